// emflow Python module: the operators M and F of a layer stack as the flow and the decoding stack
// take them (emflow::flow::layer_stack): an operator kind ("identity", "minus-identity",
// "random") or an array (d, d), (H, d, d) or (L, H, d, d), copied.
#pragma once

#include <string>
#include <vector>

#include "arrays.hpp"
#include "emflow/flow.hpp"

namespace emflow::python {

/// A host copy of `array`, checked against `place` (dtype, device) and its own shape.
template <class T>
Tensor<T> host_copy(const Placement& place, const char* name, const InArray& array) {
  const Shape shape = shape_of(array);
  const T* data = input<T>(place, name, array, shape);
  return Tensor<T>(shape, std::vector<T>(data, data + array.size()));
}

/// The source of one operator: a kind (a str) or an array.
template <class T>
flow::OperatorSource<T> source_of(const Placement& place, const char* name,
                                  const nb::handle& value) {
  flow::OperatorSource<T> source;
  source.name = name;
  if (nb::isinstance<nb::str>(value)) {
    source.kind = flow::parse_operator_kind(nb::cast<std::string>(value), name);
  } else {
    source.array = host_copy<T>(place, name, nb::cast<InArray>(value));
  }
  return source;
}

}  // namespace emflow::python

#include "emflow/tensor.hpp"

#include "check.hpp"

namespace emflow {

std::int64_t checked_element_count(const Shape& shape, const char* argument,
                                   std::int64_t max_elements) {
  const std::int64_t n = detail::checked_product("tensor", argument, shape);
  if (n > max_elements) {
    detail::fail_argument("tensor", argument, "has ", n, " elements, more than the limit of ",
                          max_elements);
  }
  return n;
}

template <class T>
Tensor<T>::Tensor(Shape shape, std::vector<T> data) : shape_(std::move(shape)) {
  const std::int64_t n = checked_element_count(shape_, "shape");
  if (n != static_cast<std::int64_t>(data.size())) {
    detail::fail_argument("tensor", "data", "has ", data.size(), " elements, expected ", n,
                          " for shape ", to_string(shape_));
  }
  data_ = std::move(data);
}

template <class T>
Tensor<T> Tensor<T>::reshaped(Shape shape) const {
  const std::int64_t n = checked_element_count(shape, "shape");
  if (n != size()) {
    detail::fail_argument("reshape", "shape", "has ", n, " elements, expected ", size(), " (from ",
                          to_string(shape_), ")");
  }
  return Tensor<T>(std::move(shape), data_);
}

template class Tensor<float>;
template class Tensor<double>;
template class Tensor<std::int64_t>;

}  // namespace emflow

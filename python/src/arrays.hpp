// emflow Python module: checks of the arrays that reach the C++ API without a copy.
//
// Every array argument is taken as it is (nanobind ndarray, from the buffer protocol or DLPack):
// the pointer handed to emflow is the caller's own memory. An array of the wrong dtype, shape,
// device or layout is refused with a ValueError naming the argument (the Python layer makes the
// copy instead when asked with copy=True).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "emflow/error.hpp"
#include "emflow/precision.hpp"
#include "emflow/tensor.hpp"
#include "emflow/types.hpp"

// emflow's 16-bit storage types as DLPack dtypes (torch.bfloat16, torch.float16 and NumPy's
// float16 arrive so), so that input<bfloat16> and the rest check them as the others.
namespace nanobind::detail {
template <>
struct dtype_traits<emflow::bfloat16> {
  static constexpr dlpack::dtype value{static_cast<std::uint8_t>(dlpack::dtype_code::Bfloat), 16,
                                       1};
  static constexpr auto name = const_name("bfloat16");
};
template <>
struct dtype_traits<emflow::float16> {
  static constexpr dlpack::dtype value{static_cast<std::uint8_t>(dlpack::dtype_code::Float), 16, 1};
  static constexpr auto name = const_name("float16");
};
}  // namespace nanobind::detail

namespace emflow::python {

namespace nb = nanobind;

/// An input array: any dtype, shape and device, read only.
using InArray = nb::ndarray<nb::ro>;
/// An output array: written in place.
using OutArray = nb::ndarray<>;

/// "float32", "float64", "int64", ... (the NumPy name).
std::string dtype_name(const nb::dlpack::dtype& dtype);
/// "(2, 3, 4)"
std::string shape_string(const InArray& array);
std::string shape_string(const OutArray& array);
/// The array's shape as emflow::Shape.
Shape shape_of(const InArray& array);

/// Throws ErrorCode::invalid_argument "<operation>: argument '<name>' ..." for the problem.
[[noreturn]] void refuse(const char* operation, const char* name, const std::string& problem);

/// True for a dense row-major array (extents of 1 may carry any stride; an empty array is dense).
bool row_major(std::size_t ndim, const std::int64_t* shape, const std::int64_t* strides);

/// The requirements one call puts on all of its arrays.
struct Placement {
  const char* operation = "attend";
  nb::dlpack::dtype dtype{};  ///< the element type of 'x'
  std::int32_t device_type = nb::device::cpu::value;
  std::int32_t device_id = 0;
  const char* like = "x";  ///< the argument whose dtype and device the others must share
  bool copy = true;        ///< whether the call takes copy=True (the messages suggest it)
  /// Said of a dtype refused instead of "the dtype of '<like>'" (the float32 statistics of a
  /// 16-bit call), when not null.
  const char* dtype_note = nullptr;
};

/// Checks dtype, device, layout and shape of an input; returns its data.
template <class T>
const T* input(const Placement& place, const char* name, const InArray& array,
               const Shape& expected);
/// The same for an optional input (null when absent).
template <class T>
const T* optional_input(const Placement& place, const char* name,
                        const std::optional<InArray>& array, const Shape& expected);
/// The same for an output (null when absent).
template <class T>
T* optional_output(const Placement& place, const char* name, const std::optional<OutArray>& array,
                   const Shape& expected);

/// Per-cloud key lengths: int64, dense, `batch` entries, on the call's device (null when absent).
const std::int64_t* key_lengths(const Placement& place, const std::optional<InArray>& array,
                                std::int64_t batch);

/// A host array of float32, float64 or int64 as a NumPy array that owns a copy of `tensor`.
template <class T>
nb::object to_numpy(Tensor<T>&& tensor);
template <class T>
nb::object to_numpy(std::vector<T>&& values, const Shape& shape);

/// A host float64 array (nanobind converts other float arrays to it: the reference functions
/// copy their arguments anyway).
using DoubleArray = nb::ndarray<const double, nb::c_contig, nb::device::cpu>;
/// A copy of `array` as Tensor<double>; an absent tensor for nullopt.
Tensor<double> to_tensor(const std::optional<DoubleArray>& array);

}  // namespace emflow::python

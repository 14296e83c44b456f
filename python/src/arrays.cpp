// emflow Python module: checks of the arrays that reach the C++ API without a copy.
#include "arrays.hpp"

#include <cstring>

namespace emflow::python {

std::string dtype_name(const nb::dlpack::dtype& dtype) {
  const char* kind = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(dtype.code)) {
    case nb::dlpack::dtype_code::Int:
      kind = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      kind = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      kind = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      kind = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      break;
  }
  return kind + std::to_string(dtype.bits);
}

namespace {
template <class A>
std::string shape_text(const A& array) {
  std::string text = "(";
  for (std::size_t i = 0; i < array.ndim(); ++i) {
    if (i) text += ", ";
    text += std::to_string(array.shape(i));
  }
  if (array.ndim() == 1) text += ",";
  return text + ")";
}

const char* device_name(std::int32_t type) {
  switch (type) {
    case nb::device::cpu::value:
      return "cpu";
    case nb::device::cuda::value:
      return "cuda";
    case nb::device::cuda_host::value:
      return "cuda_host";
    case nb::device::cuda_managed::value:
      return "cuda_managed";
    default:
      return "another device";
  }
}

template <class T, class A>
void check(const Placement& place, const char* name, const A& array, const Shape& expected) {
  if (array.dtype() != nb::dtype<T>()) {
    std::string want = dtype_name(nb::dtype<T>());
    if (place.dtype_note != nullptr) {
      want += std::string(" (") + place.dtype_note + ")";
    } else if (!std::is_same_v<T, std::int64_t>) {
      want += std::string(" (the dtype of '") + place.like + "')";
    }
    refuse(place.operation, name,
           "has dtype " + dtype_name(array.dtype()) + ", expected " + want +
               (place.copy ? "; pass copy=True to convert" : ""));
  }
  if (array.device_type() != place.device_type ||
      (place.device_type == nb::device::cuda::value && array.device_id() != place.device_id)) {
    refuse(place.operation, name,
           std::string("is on ") + device_name(array.device_type()) + ":" +
               std::to_string(array.device_id()) + ", expected the device of '" + place.like +
               "' (" + device_name(place.device_type) + ":" + std::to_string(place.device_id) +
               ")");
  }
  bool same = array.ndim() == expected.size();
  for (std::size_t i = 0; same && i < array.ndim(); ++i)
    same = static_cast<std::int64_t>(array.shape(i)) == expected[i];
  if (!same) {
    refuse(place.operation, name,
           "has shape " + shape_text(array) + ", expected " + to_string(expected));
  }
  std::vector<std::int64_t> shape(array.ndim()), strides(array.ndim());
  for (std::size_t i = 0; i < array.ndim(); ++i) {
    shape[i] = static_cast<std::int64_t>(array.shape(i));
    strides[i] = array.stride(i);
  }
  if (!row_major(array.ndim(), shape.data(), strides.data())) {
    std::string text = "(";
    for (std::size_t i = 0; i < strides.size(); ++i) {
      text += (i ? ", " : "") + std::to_string(strides[i]);
    }
    refuse(place.operation, name,
           "of shape " + shape_text(array) + " is not C-contiguous (strides " + text + ")" +
               " in elements)" + (place.copy ? "; pass copy=True to copy it" : ""));
  }
}
}  // namespace

std::string shape_string(const InArray& array) { return shape_text(array); }
std::string shape_string(const OutArray& array) { return shape_text(array); }

Shape shape_of(const InArray& array) {
  Shape shape(array.ndim());
  for (std::size_t i = 0; i < array.ndim(); ++i)
    shape[i] = static_cast<std::int64_t>(array.shape(i));
  return shape;
}

void refuse(const char* operation, const char* name, const std::string& problem) {
  throw Error(ErrorCode::invalid_argument,
              std::string(operation) + ": argument '" + name + "' " + problem);
}

bool row_major(std::size_t ndim, const std::int64_t* shape, const std::int64_t* strides) {
  // An empty array has no element to misplace, whatever strides it reports.
  for (std::size_t k = 0; k < ndim; ++k) {
    if (shape[k] == 0) return true;
  }
  std::int64_t expected = 1;
  for (std::size_t k = ndim; k-- > 0;) {
    if (shape[k] != 1 && strides[k] != expected) return false;
    expected *= shape[k];
  }
  return true;
}

template <class T>
const T* input(const Placement& place, const char* name, const InArray& array,
               const Shape& expected) {
  check<T>(place, name, array, expected);
  return static_cast<const T*>(array.data());
}

template <class T>
const T* optional_input(const Placement& place, const char* name,
                        const std::optional<InArray>& array, const Shape& expected) {
  return array ? input<T>(place, name, *array, expected) : nullptr;
}

template <class T>
T* optional_output(const Placement& place, const char* name, const std::optional<OutArray>& array,
                   const Shape& expected) {
  if (!array) return nullptr;
  check<T>(place, name, *array, expected);
  return static_cast<T*>(array->data());
}

const std::int64_t* key_lengths(const Placement& place, const std::optional<InArray>& array,
                                std::int64_t batch) {
  return optional_input<std::int64_t>(place, "key_lengths", array, Shape{batch});
}

namespace {
template <class T>
nb::object owned_numpy(std::vector<T>&& values, const Shape& shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  std::vector<std::size_t> extents(shape.begin(), shape.end());
  return nb::cast(nb::ndarray<nb::numpy, T>(owned->data(), extents.size(), extents.data(), owner));
}
}  // namespace

template <class T>
nb::object to_numpy(Tensor<T>&& tensor) {
  const Shape shape = tensor.shape();
  return owned_numpy(std::move(tensor.values()), shape);
}

template <class T>
nb::object to_numpy(std::vector<T>&& values, const Shape& shape) {
  return owned_numpy(std::move(values), shape);
}

Tensor<double> to_tensor(const std::optional<DoubleArray>& array) {
  if (!array) return {};
  Shape shape(array->ndim());
  for (std::size_t i = 0; i < array->ndim(); ++i)
    shape[i] = static_cast<std::int64_t>(array->shape(i));
  const double* data = array->data();
  return Tensor<double>(shape, std::vector<double>(data, data + array->size()));
}

template const float* input<float>(const Placement&, const char*, const InArray&, const Shape&);
template const double* input<double>(const Placement&, const char*, const InArray&, const Shape&);
template const std::int64_t* input<std::int64_t>(const Placement&, const char*, const InArray&,
                                                 const Shape&);
template const float* optional_input<float>(const Placement&, const char*,
                                            const std::optional<InArray>&, const Shape&);
template const double* optional_input<double>(const Placement&, const char*,
                                              const std::optional<InArray>&, const Shape&);
template const std::int64_t* optional_input<std::int64_t>(const Placement&, const char*,
                                                          const std::optional<InArray>&,
                                                          const Shape&);
template float* optional_output<float>(const Placement&, const char*,
                                       const std::optional<OutArray>&, const Shape&);
template double* optional_output<double>(const Placement&, const char*,
                                         const std::optional<OutArray>&, const Shape&);
#define EMFLOW_ARRAYS_16BIT(T)                                                                  \
  template const T* input<T>(const Placement&, const char*, const InArray&, const Shape&);      \
  template const T* optional_input<T>(const Placement&, const char*,                            \
                                      const std::optional<InArray>&, const Shape&);             \
  template T* optional_output<T>(const Placement&, const char*, const std::optional<OutArray>&, \
                                 const Shape&);
EMFLOW_ARRAYS_16BIT(bfloat16)
EMFLOW_ARRAYS_16BIT(float16)
#undef EMFLOW_ARRAYS_16BIT
template nb::object to_numpy<float>(Tensor<float>&&);
template nb::object to_numpy<double>(Tensor<double>&&);
template nb::object to_numpy<std::int64_t>(Tensor<std::int64_t>&&);
template nb::object to_numpy<double>(std::vector<double>&&, const Shape&);
template nb::object to_numpy<std::int64_t>(std::vector<std::int64_t>&&, const Shape&);

}  // namespace emflow::python

#include "emflow/finite.hpp"

#include <cmath>

#include "check.hpp"

namespace emflow {

template <class T>
std::int64_t find_non_finite(const T* data, std::int64_t count) noexcept {
  for (std::int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(data[i])) return i;
  }
  return -1;
}

std::string multi_index(const Shape& shape, std::int64_t index) {
  const std::int64_t count = detail::checked_product("multi_index", "shape", shape);
  if (index < 0 || index >= count) {
    detail::fail_argument("multi_index", "index", "must be in [0, ", count, ") for shape ",
                          to_string(shape), ", got ", index);
  }
  // Peel the axes off from the last (fastest varying) to the first.
  Shape position(shape.size(), 0);
  for (std::size_t axis = shape.size(); axis-- > 0;) {
    position[axis] = index % shape[axis];
    index /= shape[axis];
  }
  std::string text = "[";
  for (std::size_t axis = 0; axis < position.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(position[axis]);
  }
  return text + "]";
}

template <class T>
void require_finite(const Tensor<T>& array, const std::string& what) {
  const std::int64_t first = find_non_finite(array.data(), array.size());
  if (first < 0) return;
  detail::fail(ErrorCode::invalid_argument, what, ": element ", multi_index(array.shape(), first),
               " is ", array[first],
               "; every value must be finite (NaN and infinity refused by --check-finite)");
}

template std::int64_t find_non_finite<float>(const float*, std::int64_t) noexcept;
template std::int64_t find_non_finite<double>(const double*, std::int64_t) noexcept;
template void require_finite<float>(const Tensor<float>&, const std::string&);
template void require_finite<double>(const Tensor<double>&, const std::string&);

}  // namespace emflow

// emflow: a small owning host array with a dense row-major shape.
//
// Used by the file readers, the CLI and the reference functions. The GPU and fast CPU entry
// points take raw pointers (see attention.hpp) so callers keep their own memory.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/types.hpp"

namespace emflow {

/// Product of the extents of `shape`. Throws emflow::Error (naming `argument`) when an extent is
/// negative or the product overflows int64 or exceeds `max_elements`.
std::int64_t checked_element_count(const Shape& shape, const char* argument = "shape",
                                   std::int64_t max_elements = INT64_MAX);

template <class T>
class Tensor {
 public:
  Tensor() = default;
  /// Zero-filled tensor of `shape` (extents may be 0; none may be negative).
  explicit Tensor(Shape shape)
      : shape_(std::move(shape)),
        data_(static_cast<std::size_t>(checked_element_count(shape_, "shape"))) {}
  Tensor(Shape shape, std::vector<T> data);

  const Shape& shape() const noexcept { return shape_; }
  std::int64_t rank() const noexcept { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t extent(std::int64_t axis) const { return shape_.at(static_cast<std::size_t>(axis)); }
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(data_.size()); }

  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }
  std::vector<T>& values() noexcept { return data_; }
  const std::vector<T>& values() const noexcept { return data_; }

  T& operator[](std::int64_t i) { return data_[static_cast<std::size_t>(i)]; }
  const T& operator[](std::int64_t i) const { return data_[static_cast<std::size_t>(i)]; }

  /// Same elements, new shape of equal element count (throws otherwise).
  Tensor reshaped(Shape shape) const;

 private:
  Shape shape_;
  std::vector<T> data_;
};

/// Element-wise conversion (e.g. float -> double for the reference).
template <class To, class From>
Tensor<To> convert(const Tensor<From>& from) {
  std::vector<To> out(from.values().begin(), from.values().end());
  return Tensor<To>(from.shape(), std::move(out));
}

extern template class Tensor<float>;
extern template class Tensor<double>;
extern template class Tensor<std::int64_t>;

}  // namespace emflow

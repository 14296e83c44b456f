// Argument checks shared by the reference operations (src/reference/*.cpp): each names the
// operation and the argument, and states the expected and the actual shape or value.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/check.hpp"
#include "emflow/tensor.hpp"
#include "emflow/types.hpp"

namespace emflow::reference::detail {

using emflow::detail::fail_argument;

/// A cloud (N, d) or a batch of clouds (B, N, d); `batched` remembers which, so results keep the
/// caller's rank.
struct CloudShape {
  std::int64_t batch = 1, tokens = 0, dim = 0;
  bool batched = false;

  /// (N, d) or (B, N, d) with trailing extents `tail`, e.g. {N, N} for scores.
  Shape with_tail(std::initializer_list<std::int64_t> tail) const {
    Shape shape;
    if (batched) shape.push_back(batch);
    shape.insert(shape.end(), tail.begin(), tail.end());
    return shape;
  }
};

/// Reads the shape of a cloud-like argument: rank 2 or 3, every extent >= 1.
inline CloudShape cloud_shape(const char* op, const char* argument, const Tensor<double>& cloud) {
  if (cloud.rank() != 2 && cloud.rank() != 3) {
    fail_argument(op, argument, "has shape ", to_string(cloud.shape()),
                  ", expected (N, d) or (B, N, d)");
  }
  for (std::int64_t extent : cloud.shape()) {
    if (extent < 1) {
      fail_argument(op, argument, "has shape ", to_string(cloud.shape()),
                    ", expected every extent >= 1");
    }
  }
  CloudShape s;
  s.batched = cloud.rank() == 3;
  s.batch = s.batched ? cloud.extent(0) : 1;
  s.tokens = cloud.extent(cloud.rank() - 2);
  s.dim = cloud.extent(cloud.rank() - 1);
  return s;
}

inline void expect_shape(const char* op, const char* argument, const Tensor<double>& tensor,
                         const Shape& expected) {
  if (tensor.shape() != expected) {
    fail_argument(op, argument, "has shape ", to_string(tensor.shape()), ", expected ",
                  to_string(expected));
  }
}

/// An optional tensor: absent, or exactly `expected`.
inline void expect_optional_shape(const char* op, const char* argument,
                                  const Tensor<double>& tensor, const Shape& expected) {
  const bool is_absent = tensor.rank() == 0 && tensor.size() == 0;
  if (!is_absent) expect_shape(op, argument, tensor, expected);
}

inline void expect_finite_beta(const char* op, double beta) {
  if (!std::isfinite(beta)) fail_argument(op, "beta", "must be finite, got ", beta);
}

inline void expect_valid_mask(const char* op, const Mask& mask) {
  if (mask.kind == MaskKind::window && mask.window < 1) {
    fail_argument(op, "mask", "window width must be >= 1, got ", mask.window);
  }
}

/// Empty, or one length in [0, limit] per cloud (`batch` entries).
inline void expect_lengths(const char* op, const char* argument,
                           const std::vector<std::int64_t>& lengths, std::int64_t batch,
                           std::int64_t limit) {
  if (lengths.empty()) return;
  if (static_cast<std::int64_t>(lengths.size()) != batch) {
    fail_argument(op, argument, "has ", lengths.size(), " entries, expected ", batch,
                  " (one per cloud)");
  }
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0 || lengths[b] > limit) {
      fail_argument(op, argument, "entry ", b, " must be in [0, ", limit, "], got ", lengths[b]);
    }
  }
}

/// Empty (no key lengths), or one length in [0, N] per cloud.
inline void expect_key_lengths(const char* op, const std::vector<std::int64_t>& key_lengths,
                               const CloudShape& cloud) {
  expect_lengths(op, "key_lengths", key_lengths, cloud.batch, cloud.tokens);
}

/// Positions first .. first + count stay within +-2^60, as emflow::attend requires, so every
/// difference of two positions that a mask forms fits in int64.
inline void expect_positions(const char* op, const char* argument, std::int64_t first,
                             std::int64_t count) {
  constexpr std::int64_t limit = std::int64_t{1} << 60;
  if (first < -limit || first > limit || count > limit || first + count > limit) {
    fail_argument(op, argument, "must keep its positions within +-2^60 (", limit, "), got ", first,
                  " for ", count, " rows");
  }
}

/// The key length of cloud b: L_b, or N when no lengths are given.
inline std::int64_t key_length(const std::vector<std::int64_t>& key_lengths, std::int64_t b,
                               std::int64_t tokens) {
  return key_lengths.empty() ? tokens : key_lengths[static_cast<std::size_t>(b)];
}

/// Key j is visible to query i of a cloud with key length L (Mask::visible_keys: the mask allows
/// it, and neither the key nor the query is padding).
inline bool visible(const Mask& mask, std::int64_t length, std::int64_t i, std::int64_t j) {
  return mask.visible_keys(i, length).contains(j);
}

}  // namespace emflow::reference::detail

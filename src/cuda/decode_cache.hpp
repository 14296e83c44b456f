// The device form of BasicDecodeCache<float> in the dense form (include/emflow/decode.hpp,
// Device::cuda): the keys and per head the contents C_h = X F_h^T in device buffers of a fixed
// capacity, on the device that was current when the cache was made (every call makes it current
// again, and restores the caller's). append() copies the new tokens to the device on the cache's
// stream and projects only them; attend() copies the queries in and runs the cache's plan
// (cuda::AttentionPlan, src/cuda/decode_strategy.hpp: the queries projected, the fused kernel per
// head with its keys split into blocks, flash-decoding, so that few queries against many keys
// fill the device, the splits and the heads merged), and copies the outputs back, synchronising
// the stream before it returns. Everything a call needs is allocated when the cache is made:
// neither call allocates device memory. Defined in src/cuda/decode_cache.cpp; without CUDA the
// constructor throws ErrorCode::unsupported (src/decode/cuda_unavailable.cpp).
#pragma once

#include <cstdint>
#include <memory>

#include "core/queries.hpp"
#include "emflow/attention.hpp"

namespace emflow::detail::decode {

class DeviceCache {
 public:
  /// Copies the operators to the device and allocates `capacity` tokens of keys and contents and
  /// the plan's workspace. Throws ErrorCode::unsupported where route() refuses the cache on
  /// Device::cuda (no device, dim > 256).
  DeviceCache(const LayerOperators<float>& layer, std::int64_t dim, double beta,
              std::int64_t capacity);
  ~DeviceCache();
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  /// Tokens [first, first + count) of the cache from host rows (count x dim, validated, within
  /// the capacity).
  void append(const float* tokens, std::int64_t first, std::int64_t count);
  /// The update (count x dim), lse and entropy (heads x count, or null) of host queries.
  void attend(const float* queries, std::int64_t count, const QueryRule& rule,
              const AttentionOutput<float>& output);

 private:
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace emflow::detail::decode

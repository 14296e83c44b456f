// The device decode cache's computation (decode_cache.cpp), a strategy of cuda::AttentionPlan
// (plan_strategy.hpp) made through detail::PlanAccess (plan_access.hpp): a block of queries
// against the cache's keys (capacity, dim) and per-head contents C_h = X F_h^T (heads, capacity,
// dim), which the cache projects once per token as it appends them. A run projects the queries
// (beta log2(e) (Q M_h + u_h), decode_kernels.cu), runs the fused kernel once per head (heads = 1,
// its content rows at head h's block) with the key splits choose_key_splits gives one head, so
// that few queries still fill the device (flash-decoding), merges each head's splits into its
// slot of a partial state (heads, Nq, dim) in split order, and finish_partial sums the heads and
// adds the offset. route() decides for Operation::decode (float, dense, dim <= 256).
//
// Workspace (each region aligned to 256 bytes), laid out once for the cache's capacity and the
// most queries a run takes: projected queries (heads, Q, dim), split rows (S, dim) and split lse
// and entropy (S) for the largest S = splits x queries of any run, state rows (heads, Q, dim),
// state lse and entropy (heads, Q).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/queries.hpp"
#include "plan_strategy.hpp"

namespace emflow::detail {

/// A decode cache's shape: `dim`, `heads`, its `capacity` in tokens, and the most `queries` one
/// run takes.
struct DecodeShape {
  std::int64_t dim = 0, heads = 0, capacity = 0, queries = 0;
};

/// One run of a decode plan: device arrays throughout.
struct DecodeCall {
  const float* queries = nullptr;    ///< (count, dim)
  std::int64_t count = 0;            ///< 1 <= count <= DecodeShape::queries
  QueryRule rule;                    ///< mask, key_length (1 ..= capacity), query_origin
  const float* keys = nullptr;       ///< (capacity, dim): the cache's tokens
  const float* contents = nullptr;   ///< (heads, capacity, dim): C_h = X F_h^T
  const float* relevance = nullptr;  ///< M: (heads, dim, dim)
  const float* key_bias = nullptr;   ///< u: (heads, dim) or null
  const float* offset = nullptr;     ///< c: (dim) or null
  double beta = 1.0;
  float* update = nullptr;   ///< (count, dim)
  float* lse = nullptr;      ///< (heads, count)
  float* entropy = nullptr;  ///< (heads, count)
};

class DecodeStrategy final : public PlanStrategy<float> {
 public:
  DecodeStrategy(const DecodeShape& shape, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return total_; }
  void bind(int device, bool prepare, const char* operation) override;
  /// Not a decode call: refused (ErrorCode::internal); a decode plan runs through run_decode.
  void run(const PlanCall<float>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;
  /// One run on `stream`, its shapes checked against the plan (ErrorCode::invalid_argument).
  void run_decode(const DecodeCall& call, unsigned char* workspace, cudaStream_t stream,
                  const char* operation) const;
  const DecodeShape& shape() const noexcept { return shape_; }

 private:
  DecodeShape shape_;
  std::size_t projected_ = 0, split_rows_ = 0, split_lse_ = 0, split_entropy_ = 0;
  std::size_t state_rows_ = 0, state_lse_ = 0, state_entropy_ = 0, total_ = 0;
};

}  // namespace emflow::detail

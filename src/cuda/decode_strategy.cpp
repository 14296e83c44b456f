// The device decode cache's query blocks against its keys (decode_strategy.hpp).
#include "decode_strategy.hpp"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/check.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/decode_kernels.hpp"
#include "products_strategy.hpp"

namespace emflow::detail {

DecodeStrategy::DecodeStrategy(const DecodeShape& shape, const char* operation) : shape_(shape) {
  const std::int64_t d = shape.dim, H = shape.heads, Q = shape.queries;
  // The split scratch of the largest run: splits x queries rows, most at the full capacity (the
  // splits grow with the keys) and over every query count up to Q.
  std::int64_t split_rows = 0;
  for (std::int64_t count = 1; count <= Q; ++count) {
    const KeySplits splits = choose_key_splits(1, 1, count, shape.capacity, true);
    if (splits.splits > 1 && splits.splits * count > split_rows) split_rows = splits.splits * count;
  }
  WorkspaceCursor at(operation);
  projected_ = at.take(H * Q * d, sizeof(float), "projected queries");
  split_rows_ = at.take(split_rows * d, sizeof(float), "split rows");
  split_lse_ = at.take(split_rows, sizeof(float), "split lse");
  split_entropy_ = at.take(split_rows, sizeof(float), "split entropy");
  state_rows_ = at.take(H * Q * d, sizeof(float), "state rows");
  state_lse_ = at.take(H * Q, sizeof(float), "state lse");
  state_entropy_ = at.take(H * Q, sizeof(float), "state entropy");
  total_ = at.total();
}

void DecodeStrategy::bind(int device, bool prepare, const char* operation) {
  const int d = static_cast<int>(shape_.dim);
  expect_shared_memory(operation, "the fused kernel", fused_shared_bytes(d), device,
                       shared_memory_limit(device, operation), "use device 'cpu'");
  if (prepare) prepare_fused_attention(d, operation);
}

void DecodeStrategy::run(const PlanCall<float>&, unsigned char*, cudaStream_t,
                         const char* operation) const {
  fail(ErrorCode::internal, operation, ": a decode cache's plan runs its own calls");
}

void DecodeStrategy::run_decode(const DecodeCall& call, unsigned char* base, cudaStream_t s,
                                const char* operation) const {
  if (call.count < 1 || call.count > shape_.queries) {
    fail_argument(operation, "count", "must be in [1, ", shape_.queries,
                  "] (the plan's queries per run), got ", call.count);
  }
  const std::int64_t N = call.rule.key_length;
  if (N < 1 || N > shape_.capacity) {
    fail_argument(operation, "keys", "must be in [1, ", shape_.capacity,
                  "] (the plan's capacity), got ", N);
  }
  const KeySplits splits = choose_key_splits(1, 1, call.count, N, true);
  const int Nq = static_cast<int>(call.count), d = static_cast<int>(shape_.dim);
  const int H = static_cast<int>(shape_.heads);
  const std::size_t rows = static_cast<std::size_t>(Nq) * d;
  float* const projected = reinterpret_cast<float*>(base + projected_);
  float* const split_rows = reinterpret_cast<float*>(base + split_rows_);
  float* const split_lse = reinterpret_cast<float*>(base + split_lse_);
  float* const split_entropy = reinterpret_cast<float*>(base + split_entropy_);
  float* const state_rows = reinterpret_cast<float*>(base + state_rows_);
  float* const state_lse = reinterpret_cast<float*>(base + state_lse_);
  float* const state_entropy = reinterpret_cast<float*>(base + state_entropy_);
  // The fused kernel's queries: beta log2(e) (Q M_h + u_h), (heads, Nq, dim).
  launch_project_rows(call.queries, Nq, d, call.relevance, false, call.key_bias,
                      static_cast<float>(call.beta * 1.4426950408889634), H, rows, projected, s,
                      operation);
  KernelMask mask;
  mask.rule = call.rule.mask;
  mask.key_position = 0;
  mask.query_position = call.rule.query_origin;
  for (int h = 0; h < H; ++h) {
    FusedAttentionArgs args;
    args.query = projected + h * rows;
    args.cloud = call.keys;
    args.content = call.contents + static_cast<std::size_t>(h) * shape_.capacity * d;
    args.batch = 1;
    args.heads = 1;
    args.tokens = static_cast<int>(N);
    args.queries = Nq;
    args.dim = d;
    args.split_keys = splits.keys;
    args.splits = splits.splits;
    args.partial_state = true;
    args.mask = mask;
    args.out.batch_stride = rows;
    args.out.head_stride = rows;
    float* const head_rows = state_rows + h * rows;
    float* const head_lse = state_lse + static_cast<std::size_t>(h) * Nq;
    float* const head_entropy = state_entropy + static_cast<std::size_t>(h) * Nq;
    if (splits.splits == 1) {
      args.out.rows = head_rows;
      args.out.lse = head_lse;
      args.out.entropy = head_entropy;
      launch_fused_attention(args, s, operation);
      continue;
    }
    // The splits of one head reuse one scratch: the heads run one after another on the stream.
    args.out.rows = split_rows;
    args.out.lse = split_lse;
    args.out.entropy = split_entropy;
    args.out.split_rows = rows;
    args.out.split_stats = static_cast<std::size_t>(Nq);
    launch_fused_attention(args, s, operation);
    SplitMerge merge;
    merge.rows = split_rows;
    merge.lse = split_lse;
    merge.entropy = split_entropy;
    merge.splits = splits.splits;
    merge.batch = 1;
    merge.heads = 1;
    merge.queries = Nq;
    merge.dim = d;
    merge.heads_out = head_rows;
    merge.lse_out = head_lse;
    merge.entropy_out = head_entropy;
    launch_merge_splits(merge, s, operation);
  }
  launch_finish_partial<float>(state_rows, state_lse, state_entropy, call.offset, call.update,
                               call.lse, call.entropy, 1, H, Nq, d, s, operation);
}

}  // namespace emflow::detail

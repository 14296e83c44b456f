// The float32 and float64 product paths' construction (workspace layout, key splits) and their
// binding to a device; the launches themselves are in products_enqueue.cpp.
#include "products_strategy.hpp"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "core/check.hpp"
#include "cublas_loader.hpp"
#include "cuda_support.hpp"
#include "kernels/attention_kernels.hpp"

namespace emflow::detail {

namespace {

// The kernel's limit is the capability function's (route() decides on kCudaFusedMaxDim).
static_assert(kFusedMaxDim == kCudaFusedMaxDim, "the fused kernel's width is route()'s rule");

// cuBLAS's recommended scratch on Hopper.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

// Key splits: a fused grid of fewer blocks than kSplitBelowBlocks is split until it holds about
// kSplitTargetBlocks (two waves of two blocks per SM on a 132-SM H200), each split at least
// kSplitMinKeys keys long so that a block's fixed costs (its query tile, its writes) stay small
// beside its key tiles.
constexpr std::int64_t kSplitBelowBlocks = 128;
constexpr std::int64_t kSplitTargetBlocks = 512;
constexpr std::int64_t kSplitMinKeys = 4 * kFusedBlockKeys;

}  // namespace

KeySplits choose_key_splits(std::int64_t batch, std::int64_t heads, std::int64_t queries,
                            std::int64_t tokens, bool cross, int requested) {
  const std::int64_t tiles = (tokens + kFusedBlockKeys - 1) / kFusedBlockKeys;
  const std::int64_t blocks =
      (queries + kFusedBlockQueries - 1) / kFusedBlockQueries * batch * heads;
  std::int64_t splits = 1;
  if (requested > 0) {
    // The grid is blocks x splits: at most 2^31 - 1 (route() keeps blocks itself within it).
    const std::int64_t most = INT_MAX / blocks;
    splits = requested < tiles ? requested : tiles;
    if (splits > most) splits = most;
  } else if (cross && blocks < kSplitBelowBlocks) {
    // Self-attention is never split: its grid is as large as its keys are long.
    const std::int64_t wanted = (kSplitTargetBlocks + blocks - 1) / blocks;
    const std::int64_t most = tokens / kSplitMinKeys;
    splits = wanted < most ? wanted : most;
    if (splits < 2) splits = 1;
  }
  // Whole tiles per split, and no empty split.
  const std::int64_t tiles_per_split = (tiles + splits - 1) / splits;
  KeySplits result;
  result.keys = static_cast<int>(tiles_per_split * kFusedBlockKeys);
  result.splits = static_cast<int>((tiles + tiles_per_split - 1) / tiles_per_split);
  if (result.splits == 1) result.keys = static_cast<int>(tokens);
  return result;
}

template <class T>
ProductsStrategy<T>::ProductsStrategy(const Problem& p, Kernel kernel, int key_splits,
                                      const char* operation)
    : batch_(p.batch),
      tokens_(p.tokens),
      queries_(p.query_tokens),
      dim_(p.dim),
      heads_(p.heads),
      partial_(p.operation == Operation::partial),
      fused_(kernel == Kernel::cuda_fused) {
  if (fused_ && !std::is_same_v<T, float>) {
    fail(ErrorCode::internal, operation, ": the fused kernel was routed for float64 storage");
  }
  if (fused_) {
    splits_ = choose_key_splits(batch_, heads_, queries_, tokens_, p.cross, key_splits);
  } else {
    splits_.keys = static_cast<int>(tokens_);
  }
  // B * N * d and B * Nq * d fit in int64 (check_shapes); times H may not.
  const std::int64_t B = batch_, N = tokens_, Nq = queries_, d = dim_, H = heads_;
  const std::int64_t queries = checked_multiply(operation, "relevance", B * Nq * d, H);
  const std::int64_t keys = checked_multiply(operation, "content", B * N * d, H);
  WorkspaceCursor at(operation);
  relevance_ = at.take(queries, sizeof(T), "relevance");
  content_ = at.take(keys, sizeof(T), "content");
  if (!fused_ && !p.weights) {
    const std::int64_t scores =
        checked_multiply(operation, "scores", checked_multiply(operation, "scores", B * H, Nq), N);
    scores_ = at.take(scores, sizeof(T), "scores");
  }
  if (fused_ && splits_.splits > 1) {
    const std::int64_t stats = checked_multiply(operation, "split lse", B * H, Nq * splits_.splits);
    split_rows_ = at.take(checked_multiply(operation, "split rows", queries, splits_.splits),
                          sizeof(T), "split rows");
    split_lse_ = at.take(stats, sizeof(T), "split lse");
    split_entropy_ = at.take(stats, sizeof(T), "split entropy");
  } else if (fused_ && H > 1 && !partial_) {
    heads_out_ = at.take(queries, sizeof(T), "partial");
  }
  cublas_region_ = at.take(static_cast<std::int64_t>(kCublasWorkspaceBytes), 1, "cublas");
  total_ = at.total();
}

template <class T>
void ProductsStrategy<T>::bind(int device, bool prepare, const char* operation) {
  if (fused_) {
    const std::size_t needed = fused_shared_bytes(static_cast<int>(dim_));
    expect_shared_memory(operation, "the fused kernel", needed, device,
                         shared_memory_limit(device, operation), "use Algorithm::unfused");
    if (prepare) prepare_fused_attention(static_cast<int>(dim_), operation);
  }
  if (prepare) cublas_ = &cublas_api(operation);
  device_ = device;
}

template class ProductsStrategy<float>;
template class ProductsStrategy<double>;

}  // namespace emflow::detail

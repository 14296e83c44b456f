// The plan's construction (checks, algorithm, workspace layout, device queries) and the check
// that an enqueue matches it; the launches themselves are in attend_enqueue.cpp.
#include "attend_plan.hpp"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/attention_kernels.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "cublas_loader.hpp"
#include "cuda_support.hpp"

namespace emflow::detail {

namespace {

using cuda::Algorithm;

// cuBLAS's recommended scratch on Hopper.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

// Key splits: a fused grid of fewer blocks than kSplitBelowBlocks is split until it holds about
// kSplitTargetBlocks (two waves of two blocks per SM on a 132-SM H200), each split at least
// kSplitMinKeys keys long so that a block's fixed costs (its query tile, its writes) stay small
// beside its key tiles.
constexpr std::int64_t kSplitBelowBlocks = 128;
constexpr std::int64_t kSplitTargetBlocks = 512;
constexpr std::int64_t kSplitMinKeys = 4 * kFusedBlockKeys;

// Reserves `elements` of `element_bytes` at the next aligned offset; checked against overflow.
std::size_t reserve(std::size_t* cursor, std::int64_t elements, std::size_t element_bytes,
                    const char* operation, const char* region) {
  const std::size_t offset =
      (*cursor + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  const std::int64_t bytes =
      checked_multiply(operation, region, elements, static_cast<std::int64_t>(element_bytes));
  if (static_cast<std::size_t>(bytes) > SIZE_MAX - offset) {
    fail_argument(operation, region, "workspace size overflows size_t");
  }
  *cursor = offset + static_cast<std::size_t>(bytes);
  return offset;
}

// The kernels and cuBLAS index with int: refuse shapes whose products do not fit.
void check_int_limits(std::int64_t batch, std::int64_t tokens, std::int64_t queries,
                      std::int64_t heads, const char* operation) {
  const std::int64_t longest = tokens > queries ? tokens : queries;
  const std::int64_t rows = batch * longest * heads;  // fits in int64: check_shapes
  const std::int64_t query_blocks = (queries + 63) / 64;
  // Tile loops form m0 + 64 and n0 + 64 in int: keep tokens clear of INT_MAX. The key splits
  // multiply the grid by at most kSplitTargetBlocks.
  if (rows > INT_MAX || query_blocks * batch * heads * kSplitTargetBlocks > INT_MAX ||
      longest > INT_MAX - 256) {
    fail(ErrorCode::unsupported, operation, ": batch * heads * tokens = ", rows,
         " exceeds the CUDA backend's limit of ", INT_MAX, " rows");
  }
}

template <class T>
Algorithm choose_algorithm(const AttentionInput<T>& input, bool weights, Algorithm requested,
                           const char* operation) {
  constexpr bool is_float = std::is_same_v<T, float>;
  const bool fits = input.dim <= kFusedMaxDim;
  switch (requested) {
    case Algorithm::automatic:
      return is_float && !weights && fits ? Algorithm::fused : Algorithm::unfused;
    case Algorithm::fused:
      if (!is_float) {
        fail(ErrorCode::unsupported, operation,
             ": the fused algorithm computes in float only; use Algorithm::unfused for double");
      }
      if (weights) {
        fail(ErrorCode::unsupported, operation,
             ": the fused algorithm never forms the N x N weights; use Algorithm::unfused (or "
             "automatic) when 'weights' is requested");
      }
      if (!fits) {
        fail(ErrorCode::unsupported, operation,
             ": the fused algorithm handles dim <= ", kFusedMaxDim, ", got ", input.dim,
             "; use Algorithm::unfused");
      }
      return Algorithm::fused;
    case Algorithm::unfused:
      return Algorithm::unfused;
  }
  fail(ErrorCode::invalid_argument, operation, ": argument 'algorithm' is not an Algorithm");
}

template <class T>
WorkspaceLayout lay_out(std::int64_t B, std::int64_t N, std::int64_t Nq, std::int64_t d,
                        std::int64_t H, Algorithm algorithm, bool weights, bool partial,
                        const KeySplits& splits, const char* operation) {
  // B * N * d and B * Nq * d fit in int64 (check_shapes); times H may not.
  const std::int64_t queries = checked_multiply(operation, "relevance", B * Nq * d, H);
  const std::int64_t keys = checked_multiply(operation, "content", B * N * d, H);
  WorkspaceLayout layout;
  std::size_t cursor = 0;
  layout.relevance = reserve(&cursor, queries, sizeof(T), operation, "relevance");
  layout.content = reserve(&cursor, keys, sizeof(T), operation, "content");
  if (algorithm == Algorithm::unfused && !weights) {
    const std::int64_t scores =
        checked_multiply(operation, "scores", checked_multiply(operation, "scores", B * H, Nq), N);
    layout.scores = reserve(&cursor, scores, sizeof(T), operation, "scores");
  }
  if (algorithm == Algorithm::fused && splits.splits > 1) {
    const std::int64_t stats = checked_multiply(operation, "split lse", B * H, Nq * splits.splits);
    layout.split_rows =
        reserve(&cursor, checked_multiply(operation, "split rows", queries, splits.splits),
                sizeof(T), operation, "split rows");
    layout.split_lse = reserve(&cursor, stats, sizeof(T), operation, "split lse");
    layout.split_entropy = reserve(&cursor, stats, sizeof(T), operation, "split entropy");
  } else if (algorithm == Algorithm::fused && H > 1 && !partial) {
    layout.partial = reserve(&cursor, queries, sizeof(T), operation, "partial");
  }
  layout.cublas =
      reserve(&cursor, static_cast<std::int64_t>(kCublasWorkspaceBytes), 1, operation, "cublas");
  layout.total = cursor;
  return layout;
}

const char* presence(bool present) { return present ? "given" : "null"; }

}  // namespace

KeySplits choose_key_splits(std::int64_t batch, std::int64_t heads, std::int64_t queries,
                            std::int64_t tokens, bool cross, int requested) {
  const std::int64_t tiles = (tokens + kFusedBlockKeys - 1) / kFusedBlockKeys;
  std::int64_t splits = 1;
  if (requested > 0) {
    splits = requested < tiles ? requested : tiles;
  } else if (cross) {
    // Self-attention is never split: its grid is as large as its keys are long.
    const std::int64_t blocks =
        (queries + kFusedBlockQueries - 1) / kFusedBlockQueries * batch * heads;
    if (blocks < kSplitBelowBlocks) {
      const std::int64_t wanted = (kSplitTargetBlocks + blocks - 1) / blocks;
      const std::int64_t most = tokens / kSplitMinKeys;
      splits = wanted < most ? wanted : most;
      if (splits < 2) splits = 1;
    }
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
AttentionPlan<T>::AttentionPlan(const AttentionInput<T>& shapes, const AttentionOutput<T>& outputs,
                                Algorithm algorithm, const char* operation, bool query_device,
                                int key_splits)
    : operation_(operation),
      lse_(outputs.lse != nullptr),
      entropy_(outputs.entropy != nullptr),
      weights_(outputs.weights != nullptr) {
  check_shapes(shapes, outputs, operation);
  algorithm_ = choose_algorithm(shapes, outputs.weights != nullptr, algorithm, operation);
  set_up(shapes, algorithm, query_device, key_splits);
}

template <class T>
AttentionPlan<T>::AttentionPlan(const AttentionInput<T>& shapes, const PartialOutput<T>& outputs,
                                Algorithm algorithm, const char* operation, bool query_device,
                                int key_splits)
    : operation_(operation), partial_(true), lse_(true), entropy_(true) {
  (void)outputs;  // every array of a partial state is written
  check_shapes(shapes, AttentionOutput<T>{}, operation);
  algorithm_ = choose_algorithm(shapes, false, algorithm, operation);
  set_up(shapes, algorithm, query_device, key_splits);
}

template <class T>
void AttentionPlan<T>::set_up(const AttentionInput<T>& shapes, Algorithm, bool query_device,
                              int key_splits) {
  const char* const operation = operation_.c_str();
  batch_ = shapes.batch;
  tokens_ = shapes.tokens;
  queries_ = shapes.queries != nullptr ? shapes.query_tokens : shapes.tokens;
  dim_ = shapes.dim;
  heads_ = shapes.layer.heads;
  mask_ = shapes.mask;
  check_int_limits(batch_, tokens_, queries_, heads_, operation);
  if (algorithm_ == Algorithm::fused) {
    splits_ =
        choose_key_splits(batch_, heads_, queries_, tokens_, shapes.queries != nullptr, key_splits);
  } else {
    splits_.keys = static_cast<int>(tokens_);
  }
  layout_ = lay_out<T>(batch_, tokens_, queries_, dim_, heads_, algorithm_, weights_, partial_,
                       splits_, operation);
  if (!query_device) return;

  // Refuses a pending error: the queries below read the last error on failure, so one already
  // pending is the caller's.
  const int device = current_device(operation);
  if (algorithm_ == Algorithm::fused) {
    int shared_limit = 0;
    check_cuda(
        cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        operation, "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    const std::size_t needed = fused_shared_bytes(static_cast<int>(dim_));
    if (needed > static_cast<std::size_t>(shared_limit)) {
      fail(ErrorCode::unsupported, operation, ": the fused algorithm needs ", needed,
           " bytes of shared memory per block at dim ", dim_, "; this device allows ", shared_limit,
           "; use Algorithm::unfused");
    }
    prepare_fused_attention(static_cast<int>(dim_), device, operation);
  }
  cublas_ = &cublas_api(operation);
  device_ = device;
}

template <class T>
bool AttentionPlan<T>::matches(const AttentionInput<T>& input,
                               const AttentionOutput<T>& output) const noexcept {
  const bool same_mask = input.mask.kind == mask_.kind &&
                         (mask_.kind != MaskKind::window || input.mask.window == mask_.window);
  const std::int64_t queries = input.queries != nullptr ? input.query_tokens : input.tokens;
  return !partial_ && input.batch == batch_ && input.tokens == tokens_ && queries == queries_ &&
         input.dim == dim_ && input.layer.heads == heads_ && same_mask &&
         output.update != nullptr && (output.lse != nullptr) == lse_ &&
         (output.entropy != nullptr) == entropy_ && (output.weights != nullptr) == weights_;
}

template <class T>
void AttentionPlan<T>::check_matches(const AttentionInput<T>& input, const Targets& output) const {
  const char* const operation = operation_.c_str();
  if (device_ < 0) {
    fail(ErrorCode::invalid_argument, operation,
         ": this plan was made with query_device = false, for sizing only; make it with "
         "query_device = true to enqueue it");
  }
  if (partial_ != (output.heads != nullptr)) {
    fail_argument(operation, "output",
                  partial_ ? "must be a PartialOutput: the plan was made for a partial state"
                           : "must be an AttentionOutput: the plan was made for the update");
  }
  const std::int64_t queries = input.queries != nullptr ? input.query_tokens : input.tokens;
  const std::int64_t planned[] = {batch_, tokens_, queries_, dim_, heads_};
  const std::int64_t given[] = {input.batch, input.tokens, queries, input.dim, input.layer.heads};
  const char* const names[] = {"batch", "tokens", "query_tokens", "dim", "heads"};
  for (int k = 0; k < 5; ++k) {
    if (given[k] != planned[k]) {
      fail_argument(operation, names[k], "is ", given[k], ", but the plan was made for ",
                    planned[k]);
    }
  }
  if (input.mask.kind != mask_.kind ||
      (mask_.kind == MaskKind::window && input.mask.window != mask_.window)) {
    fail_argument(operation, "mask", "is ", to_string(input.mask), ", but the plan was made for ",
                  to_string(mask_));
  }
  if (partial_) {
    expect_not_null(operation, "heads", output.heads);
    expect_not_null(operation, "lse", output.lse);
    expect_not_null(operation, "entropy", output.entropy);
    return;
  }
  expect_not_null(operation, "update", output.update);
  const bool planned_outputs[] = {lse_, entropy_, weights_};
  const bool given_outputs[] = {output.lse != nullptr, output.entropy != nullptr,
                                output.weights != nullptr};
  const char* const outputs[] = {"lse", "entropy", "weights"};
  for (int k = 0; k < 3; ++k) {
    if (given_outputs[k] != planned_outputs[k]) {
      fail_argument(operation, outputs[k], "is ", presence(given_outputs[k]),
                    ", but the plan was made with it ", presence(planned_outputs[k]));
    }
  }
}

template class AttentionPlan<float>;
template class AttentionPlan<double>;

}  // namespace emflow::detail

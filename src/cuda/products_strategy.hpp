// A plan of the CUDA attention for one configuration (shapes, mask, outputs, algorithm): made
// once, with every check and device query, and enqueued many times, each enqueue only launching.
// emflow::cuda::attend_async (cuda.hpp) is a plan made and enqueued in one call, after checking
// the caller's pointers.
//
// A plan computes either the update (AttentionOutput) or the partial state over its keys
// (PartialOutput, partial.hpp). Nq below is query_tokens with queries, else tokens.
//
// Workspace (each region aligned to 256 bytes, in this order):
//   relevance  (heads, batch * Nq, dim)     Q_h = scale (Y M_h + 1 u_h^T) for the queries Y (X
//              for self-attention); scale = beta for the unfused path and beta log2(e) for the
//              fused one (its softmax is in base 2)
//   content    (heads, batch * tokens, dim)  C_h = X F_h^T
//   scores     (batch, heads, Nq, tokens)   unfused only, when `weights` is not requested
//   partial    (heads, batch, Nq, dim)      fused update without key splits, when heads > 1
//              (per-head updates, summed in head order by sum_heads_kernel: deterministic)
//   split rows (splits, batch, heads, Nq, dim), split lse and split entropy (splits, batch,
//              heads, Nq): fused with key splits (the partial state of each split, merged in
//              split order by merge_splits_kernel: deterministic)
//   cublas     cuBLAS's own scratch (cublasSetWorkspace)
//
// Key splits (flash-decoding): a cross-attention whose fused grid would be small (few query
// blocks: decoding) splits the keys into blocks of a multiple of 64 keys, processed by blocks of
// their own. The choice depends on the shapes alone (not on the device), so the workspace size
// needs no device and results are the same on every device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "emflow/attention.hpp"
#include "emflow/cuda.hpp"
#include "emflow/partial.hpp"

namespace emflow::detail {

struct CublasApi;
struct KernelMask;

/// Byte offsets of the workspace regions (see above) and the total size.
struct WorkspaceLayout {
  std::size_t relevance = 0, content = 0, scores = 0, partial = 0;
  std::size_t split_rows = 0, split_lse = 0, split_entropy = 0, cublas = 0;
  std::size_t total = 0;
};

/// The key splits of the fused kernel: `splits` blocks of `keys` keys (the last may be shorter).
struct KeySplits {
  int splits = 1;
  int keys = 0;
};

/// The automatic choice (see above) for these shapes; `requested` > 0 asks for that many splits
/// instead (clamped to one per 64-key tile), 1 for none.
KeySplits choose_key_splits(std::int64_t batch, std::int64_t heads, std::int64_t queries,
                            std::int64_t tokens, bool cross, int requested = 0);

/// Alignment of the workspace and of each region in it (cudaMalloc's).
constexpr std::size_t kWorkspaceAlignment = 256;

template <class T>
class AttentionPlan {
 public:
  /// Validates shapes, mask, beta and which outputs are requested (null or not), chooses the
  /// algorithm, lays out the workspace, and, when `query_device` is true, checks that a device
  /// is usable and queries it once (current device, opt-in shared-memory limit for the fused
  /// kernel), raises the fused kernel's dynamic shared-memory attribute once (not per launch)
  /// and loads cuBLAS. Reads no array. Throws emflow::Error as attend_async does.
  /// `key_splits`: 0 chooses (see above), n > 0 asks for n splits of the fused kernel's keys.
  AttentionPlan(const AttentionInput<T>& shapes, const AttentionOutput<T>& outputs,
                cuda::Algorithm algorithm, const char* operation, bool query_device = true,
                int key_splits = 0);
  /// A plan of the partial state (partial.hpp): every array of `outputs` is written.
  AttentionPlan(const AttentionInput<T>& shapes, const PartialOutput<T>& outputs,
                cuda::Algorithm algorithm, const char* operation, bool query_device = true,
                int key_splits = 0);

  std::size_t workspace_bytes() const noexcept { return layout_.total; }

  /// True when enqueue would accept this call's shapes, mask and outputs: for callers that keep
  /// one plan per configuration and pick the one a call needs.
  bool matches(const AttentionInput<T>& input, const AttentionOutput<T>& output) const noexcept;
  cuda::Algorithm algorithm() const noexcept { return algorithm_; }
  /// The fused kernel's key splits (1: none, and always 1 for the unfused algorithm).
  int key_splits() const noexcept { return splits_.splits; }
  /// The device that was current when the plan was made (-1 for a sizing-only plan).
  int device() const noexcept { return device_; }

  /// Enqueues on `stream`, on the device that was current when the plan was made. Checks only
  /// that the call matches the plan (the same batch, tokens, dim, heads, mask, the same outputs
  /// present, a non-null update; integer compares, no CUDA API query), then launches. Pointers
  /// are trusted device pointers; `beta` and the pointers may differ from call to call.
  /// `workspace` holds workspace_bytes(), 256-byte aligned. Never synchronises, allocates
  /// nothing. A plan made with query_device = false (for sizing) is refused.
  void enqueue(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
               cudaStream_t stream) const;
  /// The same for a plan of the partial state.
  void enqueue(const AttentionInput<T>& input, const PartialOutput<T>& output, void* workspace,
               cudaStream_t stream) const;

 private:
  // What a launch writes: the update (with optional lse, entropy, weights) or a partial state.
  struct Targets {
    T* update = nullptr;
    T* heads = nullptr;
    T* lse = nullptr;
    T* entropy = nullptr;
    T* weights = nullptr;
  };
  void set_up(const AttentionInput<T>& shapes, cuda::Algorithm algorithm, bool query_device,
              int key_splits);
  void check_matches(const AttentionInput<T>& input, const Targets& targets) const;
  void launch(const AttentionInput<T>& input, const Targets& targets, void* workspace,
              cudaStream_t stream) const;
  void launch_fused(const AttentionInput<T>& input, const Targets& targets, const T* relevance,
                    const T* content, unsigned char* workspace, const KernelMask& mask,
                    cudaStream_t stream) const;

  std::string operation_;
  std::int64_t batch_ = 0, tokens_ = 0, queries_ = 0, dim_ = 0, heads_ = 0;
  Mask mask_;
  bool partial_ = false;
  bool lse_ = false, entropy_ = false, weights_ = false;
  KeySplits splits_;
  cuda::Algorithm algorithm_ = cuda::Algorithm::unfused;
  WorkspaceLayout layout_;
  int device_ = -1;                    // -1: made without querying the device
  const CublasApi* cublas_ = nullptr;  // loaded with the device query
};

extern template class AttentionPlan<float>;
extern template class AttentionPlan<double>;

}  // namespace emflow::detail

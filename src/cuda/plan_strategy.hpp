// The strategies of cuda::AttentionPlan (emflow/cuda.hpp, plan.cpp): each one way of computing
// a planned problem, chosen by the plan from emflow::route's answer (capability.hpp) and made from
// the Problem alone, so that its workspace layout needs no device:
//
//   ProductsStrategy  (products_strategy.hpp)  float, double: cuBLAS projections, then the fused
//                     kernel (with or without key splits) or the unfused chain; update or partial
//   TcDenseStrategy   (tc_dense.hpp)           bfloat16, float16, float TF32: the dense form on
//                     the tensor cores
//   TcFactoredStrategy (tc_factored.hpp)       the factored form on the tensor cores
//   ExpandedStrategy  (expanded.hpp)           float, double: the factored form expanded to dense
//                     operators by cuBLAS in the workspace, then a dense strategy on them
//   DecodeStrategy    (decode_strategy.hpp)    float: the device decode cache's query blocks
//                     against its keys, split and merged (flash-decoding)
//   SdpaStrategy      (sdpa_strategy.hpp)      float, bfloat16, float16: the SDPA-shaped
//                     operator's forward pass on the caller's projected queries, keys and values
//   SdpaBackwardStrategy (sdpa_strategy.hpp)   float, bfloat16, float16: its backward pass
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/sdpa.hpp"

namespace emflow::detail {

/// The arrays of one run, which the plan has matched against the Problem it was made for: the
/// input, the factored layer (the factored form) and where the run writes (an update or a
/// partial state); or, for the SDPA-shaped operator, its input and output (the forward pass) or
/// its saved forward, upstream gradients and gradients (the backward pass).
template <class T>
struct PlanCall {
  const AttentionInput<T>* input = nullptr;
  const FactoredLayer<T>* layer = nullptr;
  const AttentionOutput<T>* output = nullptr;
  const PartialOutput<T>* partial = nullptr;
  const SdpaInput<T>* sdpa = nullptr;
  const SdpaOutput<T>* sdpa_output = nullptr;
  const SdpaSaved<T>* saved = nullptr;
  const UpstreamGradients<T>* upstream = nullptr;
  const SdpaGradientOutput<T>* gradients = nullptr;
};

/// What an SDPA backward plan is made with beyond its Problem (Operation::sdpa_backward): which
/// upstream gradients are given, whether dscale is asked for, and how dQ is formed
/// (cuda::SdpaBackwardOptions::deterministic). Its runs must give the same arrays.
struct SdpaBackwardForm {
  bool update = false;   ///< upstream.update (dO)
  bool lse = false;      ///< upstream.lse
  bool entropy = false;  ///< upstream.entropy (dH)
  bool scale = false;    ///< gradients.scale (dscale)
  bool deterministic = true;
};

template <class T>
class PlanStrategy {
 public:
  virtual ~PlanStrategy() = default;
  /// Bytes of workspace a run needs (256-byte aligned regions).
  virtual std::size_t workspace_bytes() const noexcept = 0;
  /// The fused kernel's key splits; 1 for the other kernels.
  virtual int key_splits() const noexcept { return 1; }
  /// Checks every kernel this strategy launches against `device`'s opt-in shared memory per block
  /// (ErrorCode::unsupported naming both sizes), and with `prepare` readies `device`, the current
  /// device, for its runs: the kernels' shared-memory attributes, cuBLAS loaded. Once per plan.
  virtual void bind(int device, bool prepare, const char* operation) = 0;
  /// Enqueues one run on `stream` with the plan's device current. Never synchronises, allocates
  /// nothing; `workspace` holds workspace_bytes(), aligned.
  virtual void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
                   const char* operation) const = 0;
};

/// Alignment of the workspace and of each region in it (cudaMalloc's).
constexpr std::size_t kWorkspaceAlignment = 256;

/// A workspace laid out region by region, each aligned to kWorkspaceAlignment; sizes are checked
/// against overflow (ErrorCode::invalid_argument naming the region).
class WorkspaceCursor {
 public:
  explicit WorkspaceCursor(const char* operation) : operation_(operation) {}
  /// Reserves `elements` of `element_bytes` (none for 0) and returns the region's offset.
  std::size_t take(std::int64_t elements, std::size_t element_bytes, const char* region);
  /// Reserves `count` elements of V and returns their address in the workspace at `base`, or null
  /// for none (count 0) and while sizing (a null `base`).
  template <class V>
  V* take_array(unsigned char* base, std::size_t count, const char* region) {
    if (count == 0) return nullptr;
    const std::size_t offset = take(static_cast<std::int64_t>(count), sizeof(V), region);
    return base != nullptr ? reinterpret_cast<V*>(base + offset) : nullptr;
  }
  std::size_t total() const noexcept { return cursor_; }
  /// total() rounded up to a whole kWorkspaceAlignment, so that workspaces laid end to end stay
  /// aligned (the SDPA calls' sizes).
  std::size_t aligned_total() const noexcept {
    return (cursor_ + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  }

 private:
  const char* operation_;
  std::size_t cursor_ = 0;
};

/// The opt-in dynamic shared memory per block of `device`
/// (cudaDevAttrMaxSharedMemoryPerBlockOptin).
int shared_memory_limit(int device, const char* operation);

/// Refuses (ErrorCode::unsupported) a kernel whose block needs more dynamic shared memory than
/// `device` allows, naming the kernel, both sizes and `alternative`.
void expect_shared_memory(const char* operation, const char* kernel, std::size_t needed, int device,
                          int limit, const char* alternative);

}  // namespace emflow::detail

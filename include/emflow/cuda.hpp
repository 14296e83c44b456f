// emflow::cuda: the stream-ordered GPU form of the EMF contextual update (attention.hpp), of its
// factored form (factored.hpp) and of the partial state over a block of keys (partial.hpp).
//
// The caller owns every byte of device memory: inputs, outputs and a workspace. As in CUTLASS, a
// plan is made once for a problem (its shapes, which optional inputs and outputs are given, the
// options): it checks that the problem can run (can_implement), chooses how, lays out and sizes
// the workspace (workspace_size) and prepares the device. run() then enqueues it on the caller's
// stream as often as wanted, with other arrays and another beta each time: it only checks that
// the call matches the plan, allocates nothing, never synchronises the device, and returns before
// the GPU has finished.
//
//   using namespace emflow;
//   cuda::DeviceBuffer<float> cloud(B * N * d), relevance(H * d * d), content(H * d * d),
//       update(B * N * d);
//   ...copy inputs with DeviceBuffer::copy_from_host or cudaMemcpyAsync...
//   const cuda::AttentionPlan<float> plan(input, output);     // once, outside the hot loop
//   cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_size());
//   for (int step = 0; step < steps; ++step) {
//     input.beta = betas[step];
//     plan.run(input, output, workspace.data(), workspace.bytes(), stream);
//   }
//
// attend_async(input, output, workspace, bytes, stream) is a plan made and run in one call (it
// also checks that every pointer is device memory of the current device and that no output
// overlaps an input, another output or the workspace), attend_workspace_size the plan's size
// without making it (no device needed); likewise for the factored form and the partial state.
// The functions here exist when emflow is built with CUDA (EMFLOW_WITH_CUDA is then defined for
// every target that links emflow). This header does not include cuda_runtime.h: a stream is
// passed as the runtime's own handle type, `cudaStream_t`, which is `CUstream_st*`.
//
// What runs is the answer of emflow::route (capability.hpp) for Device::cuda, the one place that
// decides; AttentionPlan::route() reports it (emflow::to_string gives "cuda cuda_fused fp32"):
//   cuda_fused    float, dim <= 256, no weights. cuBLAS projects the queries Q_h = Y M_h + u_h and
//                 the contents C_h = X F_h^T, then one kernel streams key tiles through shared
//                 memory with an online softmax; memory is O(B H N d), never N x N.
//                 Deterministic: heads and key splits are summed in a fixed order.
//   cuda_unfused  float or double. cuBLAS strided-batched products R = X M, C = X F^T, S = R X^T,
//                 Delta = sum_h P_h C_h and a masked row-softmax kernel; stores the N x N scores
//                 per cloud and head (in `weights` when requested, else in the workspace).
//   cuda_tensor_cores  bfloat16 and float16 storage (dense or factored), and float with
//                 Precision::tf32 (kernels/tc_attention.cu, mma.sync): per head, the projections
//                 in float32 rounded once to the storage type (float32 kept for TF32), the key
//                 bias terms u_h^T x_j in float32, the fused attention on the tensor cores (float32
//                 accumulation, lse and entropy in float32; one launch for every head and cloud,
//                 key splits as the fused kernel's), then the heads' outputs (times U_h for the
//                 factored form) plus the offset summed in float32 in head order and rounded once
//                 (docs/MATH.md §7). dim (dense) or rank (factored) <= 256; never the weights.
//                 Deterministic, as the fused kernel.
//   expanded      the factored form in float with fp32 products, in double, or in TF32 where
//                 the tensor cores do not apply: cuBLAS forms M_h = A_h^T B_h and F_h = U_h V_h
//                 in the storage type into the workspace (2 H d^2 r multiply-adds, against the
//                 attention's 4 B H N^2 d), and the dense rule above runs on them.
//   Algorithm::automatic takes the first that computes the problem; fused and unfused ask for
//   that product path (refused where it cannot run). Every mask, key and query lengths,
//   positions and cross-attention run on every path. The kernels index in 32 bits: batch x heads
//   x tokens x dim beyond 2^31 - 1 is refused.
//
// Cross-attention (queries given) projects the queries by M and the keys by F. When the fused
// (or tensor-core) grid of a cross-attention would be small (few queries: decoding), the keys
// are split into blocks of a multiple of 64 keys processed by thread blocks of their own, each
// writing its partial state (partial.hpp) to the workspace, and a merge kernel combines them in
// a fixed order (flash-decoding): one query against 128k keys then occupies the whole device. The
// choice depends on the shapes only (PlanOptions::key_splits overrides it), so the workspace
// size needs no device.
//
// The device: a plan belongs to the device current when it is made. Making it reads that device's
// opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) and refuses a kernel
// whose tile does not fit (ErrorCode::unsupported, naming both sizes: TF32 at dim 256 needs 195
// KiB), and allows each kernel it launches its dynamic shared memory there (cudaFuncSetAttribute,
// once per plan; after cudaDeviceReset make plans again, as every allocation). run() makes the
// plan's device current for the call and restores the caller's after; a stream of another device
// is refused by name.
//
// cuBLAS: emflow does not link it; the first call that needs it loads the toolkit's cuBLAS
// (libcublas.so.<major version of the toolkit emflow was built with>), so a process that never
// uses the GPU never maps it. A load failure is ErrorCode::unsupported naming the library and the
// loader's reason. Each host thread keeps one cuBLAS handle per device, created on the first call
// that needs it on that device (cublasCreate allocates and synchronises, once). When the thread
// exits the handle goes to a process-wide pool for the next thread rather than being destroyed
// (at process exit the CUDA context may already be gone). Every run binds it to the caller's
// stream (cublasSetStream) and then points cuBLAS's own workspace into the caller's workspace
// (cublasSetWorkspace), so calls on different streams never share scratch memory and nothing is
// allocated per call.
//
// Errors: emflow::Error.
//   ErrorCode::invalid_argument: invalid shapes; a precision that does not suit the storage
//     type; null or host-only pointers; outputs that overlap an input, another output or the
//     workspace; a workspace that is too small or misaligned; a run that does not match its plan
//     (naming what differs); a stream of another device.
//   ErrorCode::unsupported: no usable device, cuBLAS cannot be loaded, or a problem that no path
//     computes (route()'s reason, e.g. weights on the tensor cores, dim 300 on the fused kernel).
//   ErrorCode::device / out_of_memory: a failing CUDA or cuBLAS call; the message names the call.
//     A CUDA error already pending when a plan is made or run (the caller's earlier work) is
//     reported as such and left recorded for the caller.
// Errors of kernels that have already been enqueued surface at the caller's next synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/sdpa.hpp"

struct CUstream_st;

namespace emflow::cuda {

/// The CUDA runtime's stream handle (cudaStream_t). nullptr is the legacy default stream.
using Stream = CUstream_st*;

/// True when a CUDA device can be used; otherwise `reason` (if given) says why.
bool device_available(std::string* reason = nullptr) noexcept;

/// Which GPU algorithm computes the update (see the header comment; capability.hpp).
using Algorithm = emflow::Algorithm;

/// How a stream-ordered call or a plan runs: the options every call of this header takes.
struct PlanOptions {
  /// automatic (the default), or one of the two float32 / float64 product paths (fused,
  /// unfused), refused where it cannot run. The tensor cores take automatic and fused.
  Algorithm algorithm = Algorithm::automatic;
  /// The products' precision, as ExecutionOptions::precision (attention.hpp): fp32 (the default)
  /// computes as the storage type does (float32 products for float, double for double, float32
  /// accumulation for the 16-bit types); bf16 and fp16 name their 16-bit storage type; tf32
  /// permits TF32 products for float, which run on the tensor cores where those compute what is
  /// asked (no weights, dim or rank <= 256, not Algorithm::unfused, not a partial state) and in
  /// float32 elsewhere, which meets the TF32 accuracy rule (docs/MATH.md §7). Another pair is
  /// ErrorCode::invalid_argument.
  Precision precision = Precision::fp32;
  /// The key splits of the fused and the tensor-core kernels (see the header comment): 0 chooses
  /// from the shapes, n > 0 asks for n (at most one per 64-key tile), 1 for none. The other
  /// kernels ignore it.
  int key_splits = 0;
};

/// How sdpa_backward_async forms dQ.
struct SdpaBackwardOptions {
  /// true (the default): a kernel of its own over each query tile (seven products a tile pair:
  /// S and dP are formed again), the same bits run to run. false: each key tile adds its share
  /// to dQ by atomicAdd on float32 (five products, FlashAttention-2's form): the sums land in an
  /// order that varies, so dQ may differ in its last bits from run to run (dK, dV and dscale do
  /// not).
  bool deterministic = true;
};

namespace detail {
template <class T>
struct PlanState;
struct PlanAccess;
}  // namespace detail

/// A computation made once and enqueued many times (the header comment): the contextual update of
/// a dense layer, of a factored layer, the partial state over a block of keys, or the forward or
/// backward pass of the SDPA-shaped operator (sdpa.hpp), for storage type T (float, double,
/// bfloat16 or float16; the partial state is float or double; the SDPA operator float, bfloat16 or
/// float16).
///
/// A plan is made from the shapes of `input` (batch, tokens, query_tokens, dim, heads; rank for
/// the factored form; for the SDPA operator batch, query_heads, kv_heads, query_tokens, tokens,
/// rank and value_rank), its mask and which of its optional arrays are given (queries, key_bias),
/// and which outputs are asked for: the arrays themselves may be null or device pointers, they
/// are not read. beta (the SDPA operator's scale) is checked but not kept: each run passes its
/// own.
template <class T>
class AttentionPlan {
 public:
  /// The update of a dense layer (emflow::attend). Checks the shapes (invalid_argument), asks
  /// emflow::route where the problem runs on Device::cuda (unsupported with its reason when
  /// nowhere: no device, weights on the tensor cores, ...), chooses the strategy, lays out the
  /// workspace and prepares the current device, which becomes the plan's (shared-memory limits,
  /// kernel attributes, cuBLAS loaded). Throws emflow::Error; a CUDA error already pending is
  /// reported as such.
  AttentionPlan(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                const PlanOptions& options = {});
  /// The update of a factored layer (emflow::attend_factored): input.layer must be empty.
  AttentionPlan(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                const AttentionOutput<T>& output, const PlanOptions& options = {});
  /// The partial state of the queries over the keys of `input` (emflow::attend_partial): every
  /// array of a PartialOutput is written.
  AttentionPlan(const AttentionInput<T>& input, const PartialOutput<T>& output,
                const PlanOptions& options = {});
  /// The forward pass of the SDPA-shaped operator (emflow::sdpa_attend): the kernels of
  /// sdpa_attend_async (float with Precision::fp32 on the float32 kernel, else the tensor cores
  /// with key splits by the same rule or options.key_splits, value_rank equal to rank there); lse
  /// and entropy written where asked for.
  AttentionPlan(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                const PlanOptions& options = {});
  /// The backward pass of the SDPA-shaped operator (emflow::sdpa_backward): the kernels of
  /// sdpa_backward_async (float32 for float, the tensor cores for 16-bit storage; rank and
  /// value_rank <= 128), made from the shapes of `input`, which upstream gradients are given
  /// (update, lse, entropy) and whether dscale is asked for (gradients.scale).
  AttentionPlan(const SdpaInput<T>& input, const UpstreamGradients<T>& upstream,
                const SdpaGradientOutput<T>& gradients, const SdpaBackwardOptions& options = {});
  ~AttentionPlan();
  AttentionPlan(AttentionPlan&& other) noexcept;
  AttentionPlan& operator=(AttentionPlan&& other) noexcept;
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  /// Whether a plan of this problem can be made here, and how it would run: the Route of the
  /// constructor's checks and of the current device's limits (a supported route on this machine,
  /// or the reason, with device_missing set when there is no device). Never throws; reads no
  /// array; prepares nothing.
  static Route can_implement(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                             const PlanOptions& options = {}) noexcept;
  static Route can_implement(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                             const AttentionOutput<T>& output,
                             const PlanOptions& options = {}) noexcept;
  static Route can_implement(const AttentionInput<T>& input, const PartialOutput<T>& output,
                             const PlanOptions& options = {}) noexcept;
  static Route can_implement(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                             const PlanOptions& options = {}) noexcept;
  static Route can_implement(const SdpaInput<T>& input, const UpstreamGradients<T>& upstream,
                             const SdpaGradientOutput<T>& gradients,
                             const SdpaBackwardOptions& options = {}) noexcept;

  /// The workspace_size() a plan of this problem has, without a device (the strategy depends on
  /// the shapes and options only). Throws as the constructor does, except for a missing device.
  static std::size_t get_workspace_size(const AttentionInput<T>& input,
                                        const AttentionOutput<T>& output,
                                        const PlanOptions& options = {});
  static std::size_t get_workspace_size(const AttentionInput<T>& input,
                                        const FactoredLayer<T>& layer,
                                        const AttentionOutput<T>& output,
                                        const PlanOptions& options = {});
  static std::size_t get_workspace_size(const AttentionInput<T>& input,
                                        const PartialOutput<T>& output,
                                        const PlanOptions& options = {});
  static std::size_t get_workspace_size(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                                        const PlanOptions& options = {});
  static std::size_t get_workspace_size(const SdpaInput<T>& input,
                                        const UpstreamGradients<T>& upstream,
                                        const SdpaGradientOutput<T>& gradients,
                                        const SdpaBackwardOptions& options = {});

  /// Bytes of device workspace each run needs (256-byte aligned, as cudaMalloc gives; 0 for an
  /// SDPA plan in float32 that asks for lse and has no key splits).
  std::size_t workspace_size() const noexcept;
  /// Where and how the plan runs (route()'s answer: its kernel, precision, expansion).
  const Route& route() const noexcept;
  /// The device the plan was made on, which run() makes current.
  int device() const noexcept;
  /// The key splits of the fused or tensor-core kernel (1: none, and always 1 on the others).
  int key_splits() const noexcept;

  /// True when run() would accept this call's shapes, mask, optional inputs and outputs (the
  /// checks of run() that read no pointer's target): for callers that keep several plans and
  /// pick the one a call needs.
  bool matches(const AttentionInput<T>& input, const AttentionOutput<T>& output) const noexcept;
  bool matches(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
               const AttentionOutput<T>& output) const noexcept;
  bool matches(const AttentionInput<T>& input, const PartialOutput<T>& output) const noexcept;
  bool matches(const SdpaInput<T>& input, const SdpaOutput<T>& output) const noexcept;
  bool matches(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
               const UpstreamGradients<T>& upstream,
               const SdpaGradientOutput<T>& gradients) const noexcept;

  /// Enqueues the plan on `stream`, with the arrays of `input` and `output` (device pointers; the
  /// key and query lengths `batch` int64 entries on the device that the caller guarantees are in
  /// [0, tokens] and [0, query_tokens]: their values are not read here, that would need a
  /// synchronisation, and the kernels clamp them). Checks, with integer compares only, that the
  /// call is the plan's (the form; batch, tokens, query_tokens, dim, heads, rank and the mask; the
  /// same optional inputs and outputs given; the required arrays not null; a finite beta) and
  /// that `workspace` holds workspace_size() bytes and is 256-byte aligned (null only where that
  /// is 0); it does
  /// not check where the pointers point (attend_async does). Then makes the plan's device current
  /// (restoring the caller's on return), refuses a stream of another device or a CUDA error
  /// already pending, and enqueues. The workspace must not be used by other work until this run's
  /// work on `stream` is complete; a plan may be run from several threads at once, on distinct
  /// workspaces.
  void run(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
           std::size_t workspace_bytes, Stream stream) const;
  void run(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
           const AttentionOutput<T>& output, void* workspace, std::size_t workspace_bytes,
           Stream stream) const;
  void run(const AttentionInput<T>& input, const PartialOutput<T>& output, void* workspace,
           std::size_t workspace_bytes, Stream stream) const;
  /// The SDPA form: the same checks on its own shapes (batch, query_heads, kv_heads,
  /// query_tokens, tokens, rank, value_rank, the mask; lse and entropy asked for as planned; a
  /// finite scale) and its arrays (queries, keys, values and output not null).
  void run(const SdpaInput<T>& input, const SdpaOutput<T>& output, void* workspace,
           std::size_t workspace_bytes, Stream stream) const;
  /// The SDPA backward: the same checks, the upstream gradients and dscale given as planned; the
  /// saved arrays a given upstream gradient needs (lse always, O with dO, H with dH) and dQ, dK,
  /// dV not null.
  void run(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
           const UpstreamGradients<T>& upstream, const SdpaGradientOutput<T>& gradients,
           void* workspace, std::size_t workspace_bytes, Stream stream) const;

 private:
  friend struct detail::PlanAccess;
  explicit AttentionPlan(std::unique_ptr<detail::PlanState<T>> state) noexcept;
  std::unique_ptr<detail::PlanState<T>> state_;
};

extern template class AttentionPlan<float>;
extern template class AttentionPlan<double>;
extern template class AttentionPlan<bfloat16>;
extern template class AttentionPlan<float16>;

/// Bytes of device workspace attend_async needs for these shapes, outputs and options:
/// AttentionPlan<T>::get_workspace_size. Reads only the shapes, `mask`, and which pointers are
/// non-null (no memory is touched, no device is needed). Throws emflow::Error for invalid shapes
/// or a problem that cannot run (as attend_async, except for a missing device).
template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  const PlanOptions& options = {});

/// Enqueues the contextual update on `stream`: a plan made and run in one call
/// (AttentionPlan<T>(input, output, options).run(...)), after checking that every pointer is
/// device memory of the current device (or null where optional) and that no output overlaps an
/// input, another output or the workspace. `workspace` holds at least
/// attend_workspace_size(input, output, options) bytes, 256-byte aligned. Outputs are written
/// only by the enqueued work.
template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream, const PlanOptions& options = {});

/// Bytes of device workspace attend_factored_async needs (as attend_workspace_size).
template <class T>
std::size_t attend_factored_workspace_size(const AttentionInput<T>& input,
                                           const FactoredLayer<T>& layer,
                                           const AttentionOutput<T>& output,
                                           const PlanOptions& options = {});

/// Enqueues emflow::attend_factored (factored.hpp) on `stream`, as attend_async does the dense
/// form: bfloat16 and float16 on the tensor cores, float on them with Precision::tf32 (rank <=
/// 256, no weights), float with fp32 and double expanded to dense operators (the header
/// comment). Device pointers throughout; input.layer must be empty.
template <class T>
void attend_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream,
                           const PlanOptions& options = {});

/// Bytes of device workspace attend_partial_async needs (as attend_workspace_size).
template <class T>
std::size_t attend_partial_workspace_size(const AttentionInput<T>& input,
                                          const PlanOptions& options = {});

/// Enqueues the partial state of `input`'s queries over `input`'s keys (emflow::attend_partial,
/// partial.hpp) on `stream`, float or double: device pointers throughout, the workspace and the
/// key and query lengths as for attend_async. Precision::tf32 computes float32 products here.
template <class T>
void attend_partial_async(const AttentionInput<T>& input, const PartialOutput<T>& output,
                          void* workspace, std::size_t workspace_bytes, Stream stream,
                          const PlanOptions& options = {});

/// Enqueues into = merge(into, part) on `stream` (device arrays of `shape`; `part` must not
/// overlap `into`). Needs no workspace.
template <class T>
void merge_partial_async(const PartialShape& shape, const PartialInput<T>& part,
                         const PartialOutput<T>& into, Stream stream);

/// Enqueues the update (and lse / entropy where not null) of a merged state on `stream`, as
/// emflow::finish_partial does; `offset` is a device array of dim entries or null.
template <class T>
void finish_partial_async(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                          const AttentionOutput<T>& output, Stream stream);

/// Bytes of device workspace sdpa_attend_async needs for these shapes and outputs (reads no
/// array, needs no device). Throws emflow::Error for invalid shapes or a problem the GPU does
/// not compute (route()'s reason): AttentionPlan<T>::get_workspace_size.
template <class T>
std::size_t sdpa_workspace_size(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                                const PlanOptions& options = {});

/// Enqueues emflow::sdpa_attend (sdpa.hpp) on `stream`: a plan made and run in one call
/// (AttentionPlan<T>(input, output, options).run(...)), after the pointer checks of attend_async;
/// the blocking form's kernels on the caller's device arrays as they are: for T bfloat16, float16,
/// or float with Precision::tf32 the tensor-core kernel (key splits by the same rule or
/// options.key_splits; value_rank equal to rank <= 256), the output rounded to T once on the
/// device; for float with Precision::fp32 the float32 kernel (float products, no key splits; rank
/// and value_rank <= 128; its workspace is lse's rows when lse is not asked for, else none). Device
/// pointers throughout: queries, keys, values, output (T), lse and entropy (float32, optional), and
/// the key and query lengths and query positions (`batch` int64 entries each, optional, trusted as
/// attend_async's). `workspace`: sdpa_workspace_size(input, output, options) bytes, 256-byte
/// aligned (may be null when that is 0: float output with lse asked for and no key splits). Checks
/// as attend_async (device memory of the current device, no output overlapping an input, another
/// output or the workspace); no synchronisation. Unlike the blocking form it reads no value on
/// the host: a non-finite input reaches the output as the kernel carries it (the blocking form
/// sends such input to the reference).
template <class T>
void sdpa_attend_async(const SdpaInput<T>& input, const SdpaOutput<T>& output, void* workspace,
                       std::size_t workspace_bytes, Stream stream, const PlanOptions& options = {});

/// Bytes of device workspace sdpa_backward_async needs (reads no array, needs no device):
/// AttentionPlan<T>::get_workspace_size.
template <class T>
std::size_t sdpa_backward_workspace_size(const SdpaInput<T>& input,
                                         const UpstreamGradients<T>& upstream,
                                         const SdpaGradientOutput<T>& gradients,
                                         const SdpaBackwardOptions& options = {});

/// Enqueues emflow::sdpa_backward (sdpa.hpp) on `stream` (the blocking form runs this on device
/// copies), a plan made and run in one call after the pointer checks: the row terms formed on the
/// device, then the backward kernels (kernels/ sdpa_backward.cu: float32 for float, the tensor
/// cores for 16-bit storage), the gradients rounded to T once; T float, bfloat16 or float16; rank
/// and value_rank <= 128. Device pointers throughout: the input as sdpa_attend_async's; saved O
/// (T), lse and H (float32; O with dO, H with dH); upstream dO (T), dlse and dH (float32), each
/// optional; gradients dQ, dK, dV (T, required) and dscale (a device double, optional).
/// `workspace`: sdpa_backward_workspace_size(input, upstream, gradients, options) bytes, 256-byte
/// aligned. Checks and non-finite values as sdpa_attend_async. `options`: deterministic (the
/// default) or dQ by atomics.
template <class T>
void sdpa_backward_async(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                         const UpstreamGradients<T>& upstream,
                         const SdpaGradientOutput<T>& gradients, void* workspace,
                         std::size_t workspace_bytes, Stream stream,
                         const SdpaBackwardOptions& options = {});

#define EMFLOW_CUDA_SDPA_EXTERN(T)                                                              \
  extern template std::size_t sdpa_workspace_size<T>(const SdpaInput<T>&, const SdpaOutput<T>&, \
                                                     const PlanOptions&);                       \
  extern template void sdpa_attend_async<T>(const SdpaInput<T>&, const SdpaOutput<T>&, void*,   \
                                            std::size_t, Stream, const PlanOptions&);           \
  extern template std::size_t sdpa_backward_workspace_size<T>(                                  \
      const SdpaInput<T>&, const UpstreamGradients<T>&, const SdpaGradientOutput<T>&,           \
      const SdpaBackwardOptions&);                                                              \
  extern template void sdpa_backward_async<T>(                                                  \
      const SdpaInput<T>&, const SdpaSaved<T>&, const UpstreamGradients<T>&,                    \
      const SdpaGradientOutput<T>&, void*, std::size_t, Stream, const SdpaBackwardOptions&);
EMFLOW_CUDA_SDPA_EXTERN(float)
EMFLOW_CUDA_SDPA_EXTERN(bfloat16)
EMFLOW_CUDA_SDPA_EXTERN(float16)
#undef EMFLOW_CUDA_SDPA_EXTERN

#define EMFLOW_CUDA_EXTERN(T)                                                                      \
  extern template std::size_t attend_workspace_size<T>(                                            \
      const AttentionInput<T>&, const AttentionOutput<T>&, const PlanOptions&);                    \
  extern template void attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, void*, \
                                       std::size_t, Stream, const PlanOptions&);                   \
  extern template std::size_t attend_factored_workspace_size<T>(                                   \
      const AttentionInput<T>&, const FactoredLayer<T>&, const AttentionOutput<T>&,                \
      const PlanOptions&);                                                                         \
  extern template void attend_factored_async<T>(const AttentionInput<T>&, const FactoredLayer<T>&, \
                                                const AttentionOutput<T>&, void*, std::size_t,     \
                                                Stream, const PlanOptions&);
EMFLOW_CUDA_EXTERN(float)
EMFLOW_CUDA_EXTERN(double)
EMFLOW_CUDA_EXTERN(bfloat16)
EMFLOW_CUDA_EXTERN(float16)
#undef EMFLOW_CUDA_EXTERN

#define EMFLOW_CUDA_PARTIAL_EXTERN(T)                                                             \
  extern template std::size_t attend_partial_workspace_size<T>(const AttentionInput<T>&,          \
                                                               const PlanOptions&);               \
  extern template void attend_partial_async<T>(const AttentionInput<T>&, const PartialOutput<T>&, \
                                               void*, std::size_t, Stream, const PlanOptions&);   \
  extern template void merge_partial_async<T>(const PartialShape&, const PartialInput<T>&,        \
                                              const PartialOutput<T>&, Stream);                   \
  extern template void finish_partial_async<T>(const PartialShape&, const PartialInput<T>&,       \
                                               const T*, const AttentionOutput<T>&, Stream);
EMFLOW_CUDA_PARTIAL_EXTERN(float)
EMFLOW_CUDA_PARTIAL_EXTERN(double)
#undef EMFLOW_CUDA_PARTIAL_EXTERN

// The positional forms of earlier versions: the same calls with PlanOptions{algorithm, precision}.
// The positional argument's type is deduced (and must be Algorithm, or Precision), so that a
// braced PlanOptions such as {Algorithm::fused} always takes the forms above.
template <class T, class A, std::enable_if_t<std::is_same_v<A, Algorithm>, int> = 0>
[[deprecated("pass cuda::PlanOptions{algorithm, precision}")]] std::size_t attend_workspace_size(
    const AttentionInput<T>& input, const AttentionOutput<T>& output, A algorithm,
    Precision precision = Precision::fp32) {
  return attend_workspace_size(input, output, PlanOptions{algorithm, precision});
}
template <class T, class A, std::enable_if_t<std::is_same_v<A, Algorithm>, int> = 0>
[[deprecated("pass cuda::PlanOptions{algorithm, precision}")]] void attend_async(
    const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
    std::size_t workspace_bytes, Stream stream, A algorithm,
    Precision precision = Precision::fp32) {
  attend_async(input, output, workspace, workspace_bytes, stream,
               PlanOptions{algorithm, precision});
}
template <class T, class P, std::enable_if_t<std::is_same_v<P, Precision>, int> = 0>
[[deprecated("pass cuda::PlanOptions{Algorithm::automatic, precision}")]] std::size_t
attend_factored_workspace_size(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                               const AttentionOutput<T>& output, P precision) {
  return attend_factored_workspace_size(input, layer, output,
                                        PlanOptions{Algorithm::automatic, precision});
}
template <class T, class P, std::enable_if_t<std::is_same_v<P, Precision>, int> = 0>
[[deprecated("pass cuda::PlanOptions{Algorithm::automatic, precision}")]] void
attend_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                      const AttentionOutput<T>& output, void* workspace,
                      std::size_t workspace_bytes, Stream stream, P precision) {
  attend_factored_async(input, layer, output, workspace, workspace_bytes, stream,
                        PlanOptions{Algorithm::automatic, precision});
}
template <class T, class A, std::enable_if_t<std::is_same_v<A, Algorithm>, int> = 0>
[[deprecated("pass cuda::PlanOptions{algorithm}")]] std::size_t attend_partial_workspace_size(
    const AttentionInput<T>& input, A algorithm) {
  return attend_partial_workspace_size(input, PlanOptions{algorithm});
}
template <class T, class A, std::enable_if_t<std::is_same_v<A, Algorithm>, int> = 0>
[[deprecated("pass cuda::PlanOptions{algorithm}")]] void attend_partial_async(
    const AttentionInput<T>& input, const PartialOutput<T>& output, void* workspace,
    std::size_t workspace_bytes, Stream stream, A algorithm) {
  attend_partial_async(input, output, workspace, workspace_bytes, stream, PlanOptions{algorithm});
}

namespace detail {
/// cudaMalloc of `bytes` (nullptr for 0); throws ErrorCode::out_of_memory or device.
void* device_allocate(std::size_t bytes);
/// cudaFree; never throws (a failure here cannot be acted upon).
void device_free(void* pointer) noexcept;
/// cudaMemcpyAsync on `stream`, host to device / device to host; throws on failure.
void copy_host_to_device(void* device, const void* host, std::size_t bytes, Stream stream);
void copy_device_to_host(void* host, const void* device, std::size_t bytes, Stream stream);
/// Throws ErrorCode::invalid_argument when a copy of `count` elements exceeds `size`.
void check_copy_count(std::size_t count, std::size_t size);
}  // namespace detail

/// Owning device array of `size` elements of T (uninitialised), freed on destruction.
/// Allocation is cudaMalloc: do it outside hot loops.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t size)
      : data_(static_cast<T*>(detail::device_allocate(size * sizeof(T)))), size_(size) {}
  ~DeviceBuffer() { detail::device_free(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      detail::device_free(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }

  /// Copies `count` <= size() elements from host memory, ordered on `stream`. `host` must stay
  /// valid and unchanged until the copy has completed on `stream` (synchronise it, or wait for
  /// an event recorded after the copy): CUDA does not promise that a copy from pageable memory
  /// has read its source when the call returns.
  void copy_from_host(const T* host, std::size_t count, Stream stream) {
    detail::check_copy_count(count, size_);
    detail::copy_host_to_device(data_, host, count * sizeof(T), stream);
  }
  /// Copies `count` <= size() elements to host memory, ordered on `stream`; the values are there
  /// once `stream` has been synchronised.
  void copy_to_host(T* host, std::size_t count, Stream stream) const {
    detail::check_copy_count(count, size_);
    detail::copy_device_to_host(host, data_, count * sizeof(T), stream);
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace emflow::cuda

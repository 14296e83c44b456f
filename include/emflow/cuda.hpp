// emflow::cuda: the stream-ordered GPU form of the EMF contextual update (attention.hpp).
//
// The caller owns every byte of device memory: inputs, outputs and a workspace whose size
// attend_workspace_size() returns. attend_async() only enqueues work on the caller's stream:
// it allocates nothing, never synchronises the device, and returns before the GPU has finished.
//
//   using namespace emflow;
//   cuda::DeviceBuffer<float> cloud(B * N * d), relevance(H * d * d), content(H * d * d),
//       update(B * N * d);
//   ...copy inputs with DeviceBuffer::copy_from_host or cudaMemcpyAsync...
//   const std::size_t bytes = cuda::attend_workspace_size(input, output);
//   cuda::DeviceBuffer<unsigned char> workspace(bytes);      // once, outside the hot loop
//   cuda::attend_async(input, output, workspace.data(), bytes, stream);
//
// The functions here exist when emflow is built with CUDA (EMFLOW_WITH_CUDA is then defined for
// every target that links emflow). This header does not include cuda_runtime.h: a stream is
// passed as the runtime's own handle type, `cudaStream_t`, which is `CUstream_st*`.
//
// Algorithms:
//   fused    float only, dim <= 256, no weights. One kernel streams key tiles through shared
//            memory with an online softmax; memory is O(B H N d), never N x N. Deterministic.
//   unfused  float or double. cuBLAS strided-batched products R = X M, C = X F^T, S = R X^T,
//            Delta = sum_h P_h C_h and a masked row-softmax kernel; stores the N x N scores per
//            cloud and head (in `weights` when requested, else in the workspace).
//   automatic: fused for float when no weights are requested and dim <= 256, else unfused.
//
// bfloat16 and float16 (precision.hpp): the tensor-core path (src/cuda/tc_dense.cpp), taken by
// automatic and fused; unfused is refused (ErrorCode::unsupported). Per head, R_h = Q M_h and
// C_h = X F_h^T are computed in float32 from the stored values and rounded once to T, the key
// bias terms u_h^T x_j stay in float32, the fused attention of R_h against the keys X with values
// C_h runs on mma.sync (float32 accumulation, lse and entropy in float32), and the heads'
// outputs plus the offset are summed in float32 and rounded once to T (docs/MATH.md §7). Needs
// dim <= 256; every mask, key and query lengths and cross-attention as for float. Refuses
// weights (ErrorCode::unsupported, naming the output), which it never forms.
// float with Precision::tf32: the same path on float storage, the products on TF32 operands
// (mma.sync m16n8k8), where it computes what is asked; see attend_workspace_size.
//
// Cross-attention (queries given) projects the queries by M and the keys by F. When the fused
// grid of a cross-attention would be small (few queries: decoding), the keys are split into
// blocks of a multiple of 64 keys processed by thread blocks of their own, each writing its
// partial state (partial.hpp) to the workspace, and a merge kernel combines them in a fixed
// order (flash-decoding): one query against 128k keys then occupies the whole device. The
// choice depends on the shapes only, and attend_workspace_size accounts for it.
//
// cuBLAS: emflow does not link it; the first call that needs it loads the toolkit's cuBLAS
// (libcublas.so.<major version of the toolkit emflow was built with>), so a process that never
// uses the GPU never maps it. A load failure is ErrorCode::unsupported naming the library and the
// loader's reason. Each host thread keeps one cuBLAS handle per device, created on the first call
// that needs it on that device (cublasCreate allocates and synchronises, once). When the thread
// exits the handle goes to a process-wide pool for the next thread rather than being destroyed
// (at process exit the CUDA context may already be gone). Every call binds it to the caller's
// stream (cublasSetStream) and then points cuBLAS's own workspace into the caller's workspace
// (cublasSetWorkspace), so calls on different streams never share scratch memory and nothing is
// allocated per call.
//
// Each attend_async call checks its arguments and pointers, then plans the computation
// (algorithm, workspace layout, device limits, and the fused kernel's shared-memory attribute,
// set once per process and device) and enqueues the plan.
//
// Errors: emflow::Error.
//   ErrorCode::invalid_argument: invalid shapes; null or host-only pointers; outputs that overlap
//     an input, another output or the workspace; a workspace that is too small or misaligned.
//   ErrorCode::unsupported: no usable device, cuBLAS cannot be loaded, or a configuration the
//     chosen algorithm cannot run (e.g. fused with weights).
//   ErrorCode::device / out_of_memory: a failing CUDA or cuBLAS call; the message names the call.
//     A CUDA error already pending when attend_async is called (the caller's earlier work) is
//     reported as such and left recorded for the caller.
// Errors of kernels that have already been enqueued surface at the caller's next synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"

struct CUstream_st;

namespace emflow::cuda {

/// The CUDA runtime's stream handle (cudaStream_t). nullptr is the legacy default stream.
using Stream = CUstream_st*;

/// True when a CUDA device can be used; otherwise `reason` (if given) says why.
bool device_available(std::string* reason = nullptr) noexcept;

/// Which GPU algorithm computes the update (see the header comment; capability.hpp).
using Algorithm = emflow::Algorithm;

/// Bytes of device workspace attend_async needs for these shapes, outputs, algorithm and
/// precision. Reads only the shapes, `mask`, and which output pointers are non-null (no memory is
/// touched, no device is needed). Throws emflow::Error for invalid shapes or an algorithm that
/// cannot run this configuration.
///
/// `precision` (precision.hpp): for float, fp32 (float32 products: the fused or unfused path) or
/// tf32, which permits TF32 products: the dense form then runs on the tensor cores
/// (src/cuda/tc_dense.cpp, the projections R_h and C_h in float32, their products on TF32
/// operands) where that path computes what is asked (no weights, dim <= 256, Algorithm automatic
/// or fused), and elsewhere in float32, which meets the TF32 accuracy bound (docs/MATH.md §7).
/// For double: fp32 only. For bfloat16 and float16: their own precision, or fp32 (the same:
/// 16-bit operands, float32 accumulation). Other pairs are ErrorCode::invalid_argument.
template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  Algorithm algorithm = Algorithm::automatic,
                                  Precision precision = storage_precision<T>());

/// Enqueues the contextual update on `stream`. Every pointer in `input` and `output` is a device
/// pointer (or null where optional), including `input.key_lengths`: `batch` int64 entries on the
/// device that the caller guarantees are in [0, tokens]. Their values are not checked here (that
/// would need a synchronisation); the kernels clamp each to [0, tokens]. The blocking form
/// emflow::attend(..., {Device::cuda}) checks them on the host.
/// `workspace` must be at least attend_workspace_size(input, output, algorithm, precision) bytes,
/// aligned to 256 bytes (cudaMalloc's alignment), and must not be used by other work until this
/// call's work on `stream` is complete. Outputs are written only by the enqueued work.
template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream,
                  Algorithm algorithm = Algorithm::automatic,
                  Precision precision = storage_precision<T>());

#define EMFLOW_CUDA_ATTEND_EXTERN(T)                                                               \
  extern template std::size_t attend_workspace_size<T>(                                            \
      const AttentionInput<T>&, const AttentionOutput<T>&, Algorithm, Precision);                  \
  extern template void attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, void*, \
                                       std::size_t, Stream, Algorithm, Precision);
EMFLOW_CUDA_ATTEND_EXTERN(float)
EMFLOW_CUDA_ATTEND_EXTERN(double)
EMFLOW_CUDA_ATTEND_EXTERN(bfloat16)
EMFLOW_CUDA_ATTEND_EXTERN(float16)
#undef EMFLOW_CUDA_ATTEND_EXTERN

/// Bytes of device workspace attend_factored_async needs for these shapes, this layer and these
/// outputs (reads no memory, needs no device). Throws emflow::Error as attend_factored_async's
/// checks do.
template <class T>
std::size_t attend_factored_workspace_size(const AttentionInput<T>& input,
                                           const FactoredLayer<T>& layer,
                                           const AttentionOutput<T>& output,
                                           Precision precision = storage_precision<T>());

/// Enqueues emflow::attend_factored (factored.hpp) for bfloat16, float16 or float on `stream`, on
/// the tensor cores (kernels/tc_attention.cu): per head, the projections A_h x_i, B_h x_j and
/// V_h x_j in float32 stored in T and the key bias terms u_h^T x_j in float32, the fused
/// attention in rank r with
/// lse and entropy (per head, in float32), then the sum over heads of U_h times the head output
/// plus the offset in float32, rounded once to T. Device pointers throughout, key lengths as for
/// attend_async. Needs rank <= 256. Refuses (ErrorCode::unsupported) weights, which this path
/// does not compute.
/// `precision`: bf16 (or fp32, float32 accumulation) for bfloat16, fp16 (or fp32) for float16;
/// for float it must be tf32 (docs/MATH.md §7: the attention's products take operands rounded to
/// TF32, the projections and the output sum stay float32), and fp32 is ErrorCode::unsupported
/// (float32 products: emflow::attend_factored on Device::cuda, or attend_async on dense
/// operators). Another pair is ErrorCode::invalid_argument.
/// `workspace` as for attend_async, at least attend_factored_workspace_size bytes.
template <class T>
void attend_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream,
                           Precision precision = storage_precision<T>());

#define EMFLOW_CUDA_FACTORED_EXTERN(T)                                                             \
  extern template std::size_t attend_factored_workspace_size<T>(                                   \
      const AttentionInput<T>&, const FactoredLayer<T>&, const AttentionOutput<T>&, Precision);    \
  extern template void attend_factored_async<T>(const AttentionInput<T>&, const FactoredLayer<T>&, \
                                                const AttentionOutput<T>&, void*, std::size_t,     \
                                                Stream, Precision);
EMFLOW_CUDA_FACTORED_EXTERN(bfloat16)
EMFLOW_CUDA_FACTORED_EXTERN(float16)
EMFLOW_CUDA_FACTORED_EXTERN(float)
#undef EMFLOW_CUDA_FACTORED_EXTERN

/// Bytes of device workspace attend_partial_async needs (as attend_workspace_size).
template <class T>
std::size_t attend_partial_workspace_size(const AttentionInput<T>& input,
                                          Algorithm algorithm = Algorithm::automatic);

/// Enqueues the partial state of `input`'s queries over `input`'s keys (emflow::attend_partial,
/// partial.hpp) on `stream`: device pointers throughout, the workspace and the key and query
/// lengths as for attend_async.
template <class T>
void attend_partial_async(const AttentionInput<T>& input, const PartialOutput<T>& output,
                          void* workspace, std::size_t workspace_bytes, Stream stream,
                          Algorithm algorithm = Algorithm::automatic);

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

#define EMFLOW_CUDA_PARTIAL_EXTERN(T)                                                             \
  extern template std::size_t attend_partial_workspace_size<T>(const AttentionInput<T>&,          \
                                                               Algorithm);                        \
  extern template void attend_partial_async<T>(const AttentionInput<T>&, const PartialOutput<T>&, \
                                               void*, std::size_t, Stream, Algorithm);            \
  extern template void merge_partial_async<T>(const PartialShape&, const PartialInput<T>&,        \
                                              const PartialOutput<T>&, Stream);                   \
  extern template void finish_partial_async<T>(const PartialShape&, const PartialInput<T>&,       \
                                               const T*, const AttentionOutput<T>&, Stream);
EMFLOW_CUDA_PARTIAL_EXTERN(float)
EMFLOW_CUDA_PARTIAL_EXTERN(double)
#undef EMFLOW_CUDA_PARTIAL_EXTERN

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

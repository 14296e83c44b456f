// Host side of the CUDA backend: the error path, the per-thread cuBLAS handles, the workspace
// plan, the stream-ordered attend_async (cuda.hpp) and the blocking detail::cuda_attend behind
// emflow::attend(..., {Device::cuda}).
//
// Workspace (each region aligned to 256 bytes, in this order):
//   relevance  (heads, batch * tokens, dim)  Q_h = scale (X M_h + 1 u_h^T); scale = beta for the
//              unfused path and beta log2(e) for the fused one (its softmax is in base 2)
//   content    (heads, batch * tokens, dim)  C_h = X F_h^T
//   scores     (batch, heads, tokens, tokens) unfused only, when `weights` is not requested
//   partial    (heads, batch, tokens, dim)   fused only, when heads > 1 (per-head updates,
//              summed in head order by sum_heads_kernel so the result is deterministic)
//   cublas     cuBLAS's own scratch (cublasSetWorkspace)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_kernels.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

void check_cuda(cudaError_t status, const char* operation, const char* call) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // a failed call also records itself as the last error: clear it
  fail(status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::device,
       operation, ": ", call, " failed: ", cudaGetErrorString(status), " (",
       cudaGetErrorName(status), ")");
}

void check_cublas(cublasStatus_t status, const char* operation, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail(status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::out_of_memory : ErrorCode::device,
       operation, ": ", call, " failed: ", cublasGetStatusString(status), " (",
       cublasGetStatusName(status), ")");
}

void check_launch(const char* operation, const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  fail(status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::device,
       operation, ": launch of ", kernel, " failed: ", cudaGetErrorString(status), " (",
       cudaGetErrorName(status), ")");
}

OwnedStream::OwnedStream(const char* operation) {
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), operation,
             "cudaStreamCreateWithFlags");
}

OwnedStream::~OwnedStream() {
  // Work still queued completes before the stream's resources are released.
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void check_no_pending_error(const char* operation) {
  // Peek, not get: the error belongs to the caller's earlier work, so it stays recorded for them.
  const cudaError_t status = cudaPeekAtLastError();
  if (status == cudaSuccess) return;
  fail(ErrorCode::device, operation,
       ": a CUDA error was already pending before this call (left by ",
       "earlier work, not by emflow): ", cudaGetErrorString(status), " (", cudaGetErrorName(status),
       "); consume it with cudaGetLastError() before calling emflow");
}

namespace {

// cuBLAS handles: one per (host thread, device) while the thread uses it. A handle is created
// once (cublasCreate allocates and synchronises) and, when its thread exits, goes back to a
// process-wide pool for the next thread instead of being destroyed: a thread_local destructor
// may run at process exit after the CUDA runtime has torn the context down, where cublasDestroy
// is unsafe. Pooled handles are released with the process, so the number of handles is bounded
// by the number of threads that used cuBLAS at the same time.
class CublasPool {
 public:
  static CublasPool& instance() {
    static CublasPool* const pool = new CublasPool;  // never destroyed: see above
    return *pool;
  }
  cublasHandle_t take(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[device];
    if (free.empty()) return nullptr;
    cublasHandle_t handle = free.back();
    free.pop_back();
    return handle;
  }
  void give_back(int device, cublasHandle_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[device].push_back(handle);
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<cublasHandle_t>> free_;
};

struct ThreadHandles {
  std::vector<cublasHandle_t> by_device;
  ~ThreadHandles() {
    try {
      for (std::size_t device = 0; device < by_device.size(); ++device) {
        if (by_device[device] != nullptr) {
          CublasPool::instance().give_back(static_cast<int>(device), by_device[device]);
        }
      }
    } catch (...) {
      // Out of memory while pooling: the handle is then simply not reused.
    }
  }
};

}  // namespace

cublasHandle_t cublas_for_stream(cudaStream_t stream, void* workspace, std::size_t bytes,
                                 const char* operation) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), operation, "cudaGetDevice");
  thread_local ThreadHandles cache;
  const auto slot = static_cast<std::size_t>(device);
  if (cache.by_device.size() <= slot) cache.by_device.resize(slot + 1, nullptr);
  if (cache.by_device[slot] == nullptr) {
    cublasHandle_t handle = CublasPool::instance().take(device);
    if (handle == nullptr) {
      check_cublas(cublasCreate(&handle), operation, "cublasCreate");
      // Full fp32 products: no TF32 (the accuracy contract is fp32 relative error < 1e-5).
      const cublasStatus_t status = cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);
      if (status != CUBLAS_STATUS_SUCCESS) {
        cublasDestroy(handle);
        check_cublas(status, operation, "cublasSetMathMode");
      }
    }
    cache.by_device[slot] = handle;
  }
  cublasHandle_t handle = cache.by_device[slot];
  // cublasSetStream resets the workspace to cuBLAS's default pool, so the workspace comes after.
  check_cublas(cublasSetStream(handle, stream), operation, "cublasSetStream");
  check_cublas(cublasSetWorkspace(handle, workspace, bytes), operation, "cublasSetWorkspace");
  return handle;
}

namespace {

using cuda::Algorithm;

constexpr std::size_t kAlignment = 256;
// cuBLAS's recommended scratch on Hopper.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;
constexpr double kLog2e = 1.4426950408889634074;

struct Plan {
  Algorithm algorithm = Algorithm::unfused;
  std::size_t relevance = 0, content = 0, scores = 0, partial = 0, cublas = 0;
  bool has_scores = false, has_partial = false;
  std::size_t total = 0;
};

// Reserves `elements` of `element_bytes` at the next aligned offset; checked against overflow.
std::size_t reserve(std::size_t* cursor, std::int64_t elements, std::size_t element_bytes,
                    const char* operation, const char* region) {
  const std::size_t offset = (*cursor + kAlignment - 1) / kAlignment * kAlignment;
  const std::int64_t bytes =
      checked_multiply(operation, region, elements, static_cast<std::int64_t>(element_bytes));
  if (static_cast<std::size_t>(bytes) > SIZE_MAX - offset) {
    fail_argument(operation, region, "workspace size overflows size_t");
  }
  *cursor = offset + static_cast<std::size_t>(bytes);
  return offset;
}

// The kernels and cuBLAS index with int: refuse shapes whose products do not fit.
void check_int_limits(std::int64_t batch, std::int64_t tokens, std::int64_t heads,
                      const char* operation) {
  // attend_workspace_size may be asked before validate() has seen these: multiply with checks.
  const std::int64_t rows = checked_multiply(
      operation, "tokens", checked_multiply(operation, "tokens", batch, tokens), heads);
  const std::int64_t query_blocks = (tokens + 63) / 64;
  // Tile loops form m0 + 64 and n0 + 64 in int: keep tokens clear of INT_MAX.
  if (rows > INT_MAX || query_blocks * batch * heads > INT_MAX || tokens > INT_MAX - 256) {
    fail(ErrorCode::unsupported, operation, ": batch * heads * tokens = ", rows,
         " exceeds the CUDA backend's limit of ", INT_MAX, " rows");
  }
}

template <class T>
Algorithm choose_algorithm(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                           Algorithm requested, const char* operation) {
  constexpr bool is_float = std::is_same_v<T, float>;
  const bool fits = input.dim <= kFusedMaxDim;
  switch (requested) {
    case Algorithm::automatic:
      return is_float && output.weights == nullptr && fits ? Algorithm::fused : Algorithm::unfused;
    case Algorithm::fused:
      if (!is_float) {
        fail(ErrorCode::unsupported, operation,
             ": the fused algorithm computes in float only; use Algorithm::unfused for double");
      }
      if (output.weights != nullptr) {
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
Plan make_plan(const AttentionInput<T>& input, const AttentionOutput<T>& output,
               Algorithm requested, const char* operation) {
  expect_positive(operation, "batch", input.batch);
  expect_positive(operation, "tokens", input.tokens);
  expect_positive(operation, "dim", input.dim);
  expect_positive(operation, "heads", input.layer.heads);
  Plan plan;
  plan.algorithm = choose_algorithm(input, output, requested, operation);
  const std::int64_t B = input.batch, N = input.tokens, d = input.dim, H = input.layer.heads;
  check_int_limits(B, N, H, operation);
  const std::int64_t per_head = checked_multiply(operation, "cloud", B * N, d);
  const std::int64_t projected = checked_multiply(operation, "relevance", per_head, H);
  std::size_t cursor = 0;
  plan.relevance = reserve(&cursor, projected, sizeof(T), operation, "relevance");
  plan.content = reserve(&cursor, projected, sizeof(T), operation, "content");
  if (plan.algorithm == Algorithm::unfused && output.weights == nullptr) {
    const std::int64_t scores =
        checked_multiply(operation, "scores", checked_multiply(operation, "scores", B * H, N), N);
    plan.scores = reserve(&cursor, scores, sizeof(T), operation, "scores");
    plan.has_scores = true;
  }
  if (plan.algorithm == Algorithm::fused && H > 1) {
    plan.partial = reserve(&cursor, projected, sizeof(T), operation, "partial");
    plan.has_partial = true;
  }
  plan.cublas =
      reserve(&cursor, static_cast<std::int64_t>(kCublasWorkspaceBytes), 1, operation, "cublas");
  plan.total = cursor;
  return plan;
}

// A pointer the kernels will dereference must be reachable from the current device.
void expect_device_pointer(const char* operation, const char* argument, const void* pointer,
                           int device) {
  if (pointer == nullptr) return;
  cudaPointerAttributes attributes{};
  check_cuda(cudaPointerGetAttributes(&attributes, pointer), operation, "cudaPointerGetAttributes");
  if (attributes.type == cudaMemoryTypeUnregistered) {
    fail_argument(operation, argument,
                  "must be device memory (cudaMalloc, managed or registered host memory), got an "
                  "ordinary host pointer");
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device) {
    fail_argument(operation, argument, "is memory of device ", attributes.device,
                  ", but the current device is ", device);
  }
}

cublasStatus_t gemm(cublasHandle_t handle, cublasOperation_t a_op, cublasOperation_t b_op, int m,
                    int n, int k, const float* alpha, const float* a, int lda, long long a_stride,
                    const float* b, int ldb, long long b_stride, const float* beta, float* c,
                    int ldc, long long c_stride, int count) {
  return cublasSgemmStridedBatched(handle, a_op, b_op, m, n, k, alpha, a, lda, a_stride, b, ldb,
                                   b_stride, beta, c, ldc, c_stride, count);
}

cublasStatus_t gemm(cublasHandle_t handle, cublasOperation_t a_op, cublasOperation_t b_op, int m,
                    int n, int k, const double* alpha, const double* a, int lda, long long a_stride,
                    const double* b, int ldb, long long b_stride, const double* beta, double* c,
                    int ldc, long long c_stride, int count) {
  return cublasDgemmStridedBatched(handle, a_op, b_op, m, n, k, alpha, a, lda, a_stride, b, ldb,
                                   b_stride, beta, c, ldc, c_stride, count);
}

}  // namespace

template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output) {
  const char* const operation = "attend";
  // The stream is declared first so it outlives every buffer: on an error path the buffers are
  // freed (cudaFree waits for the device) before the stream is destroyed.
  const OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const std::size_t cloud_size = B * N * d, operator_size = H * d * d, rows = B * H * N;

  cuda::DeviceBuffer<T> cloud(cloud_size), relevance(operator_size), content(operator_size);
  cuda::DeviceBuffer<T> bias(input.layer.key_bias ? H * d : 0);
  cuda::DeviceBuffer<T> offset(input.layer.offset ? d : 0);
  cuda::DeviceBuffer<std::int64_t> lengths(input.key_lengths ? B : 0);
  cuda::DeviceBuffer<T> update(cloud_size);
  cuda::DeviceBuffer<T> lse(output.lse ? rows : 0), entropy(output.entropy ? rows : 0);
  cuda::DeviceBuffer<T> weights(output.weights ? rows * N : 0);

  cloud.copy_from_host(input.cloud, cloud_size, s);
  relevance.copy_from_host(input.layer.relevance, operator_size, s);
  content.copy_from_host(input.layer.content, operator_size, s);
  if (input.layer.key_bias) bias.copy_from_host(input.layer.key_bias, H * d, s);
  if (input.layer.offset) offset.copy_from_host(input.layer.offset, d, s);
  if (input.key_lengths) lengths.copy_from_host(input.key_lengths, B, s);

  AttentionInput<T> on_device = input;
  on_device.cloud = cloud.data();
  on_device.layer.relevance = relevance.data();
  on_device.layer.content = content.data();
  on_device.layer.key_bias = input.layer.key_bias ? bias.data() : nullptr;
  on_device.layer.offset = input.layer.offset ? offset.data() : nullptr;
  on_device.key_lengths = input.key_lengths ? lengths.data() : nullptr;
  AttentionOutput<T> to_device;
  to_device.update = update.data();
  to_device.lse = output.lse ? lse.data() : nullptr;
  to_device.entropy = output.entropy ? entropy.data() : nullptr;
  to_device.weights = output.weights ? weights.data() : nullptr;

  const std::size_t bytes = cuda::attend_workspace_size(on_device, to_device);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(on_device, to_device, workspace.data(), bytes, s);

  update.copy_to_host(output.update, cloud_size, s);
  if (output.lse) lse.copy_to_host(output.lse, rows, s);
  if (output.entropy) entropy.copy_to_host(output.entropy, rows, s);
  if (output.weights) weights.copy_to_host(output.weights, rows * N, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template void cuda_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&);
template void cuda_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&);

}  // namespace emflow::detail

namespace emflow::cuda {

bool device_available(std::string* reason) noexcept {
  try {
    std::string why;
    const bool available = emflow::detail::cuda_device_available(&why);
    if (reason != nullptr) *reason = why;
    return available;
  } catch (...) {
    return false;
  }
}

namespace detail {

void* device_allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    emflow::detail::fail(
        status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::device,
        "DeviceBuffer: cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(status), " (",
        cudaGetErrorName(status), ")");
  }
  return pointer;
}

void device_free(void* pointer) noexcept {
  if (pointer != nullptr) cudaFree(pointer);
}

void copy_host_to_device(void* device, const void* host, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  emflow::detail::check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream),
                             "DeviceBuffer", "cudaMemcpyAsync (host to device)");
}

void copy_device_to_host(void* host, const void* device, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  emflow::detail::check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
                             "DeviceBuffer", "cudaMemcpyAsync (device to host)");
}

void check_copy_count(std::size_t count, std::size_t size) {
  if (count > size) {
    emflow::detail::fail_argument("DeviceBuffer", "count", "must be <= the buffer's size ", size,
                                  ", got ", count);
  }
}

}  // namespace detail

template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  Algorithm algorithm) {
  return emflow::detail::make_plan(input, output, algorithm, "attend_workspace_size").total;
}

template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream, Algorithm algorithm) {
  using namespace emflow::detail;
  const char* const operation = "attend_async";
  // validate() reads key length values, which live on the device here: check shapes and
  // pointers only; the kernels clamp the lengths. Overlaps are checked below, with the workspace.
  AttentionInput<T> shapes = input;
  shapes.key_lengths = nullptr;
  check_arguments(shapes, output, operation);
  const Plan plan = make_plan(input, output, algorithm, operation);

  std::string reason;
  if (!cuda_device_available(&reason)) {
    fail(ErrorCode::unsupported, operation, ": no usable CUDA device: ", reason);
  }
  int device = 0;
  check_cuda(cudaGetDevice(&device), operation, "cudaGetDevice");
  expect_device_pointer(operation, "cloud", input.cloud, device);
  expect_device_pointer(operation, "relevance", input.layer.relevance, device);
  expect_device_pointer(operation, "content", input.layer.content, device);
  expect_device_pointer(operation, "key_bias", input.layer.key_bias, device);
  expect_device_pointer(operation, "offset", input.layer.offset, device);
  expect_device_pointer(operation, "key_lengths", input.key_lengths, device);
  expect_device_pointer(operation, "update", output.update, device);
  expect_device_pointer(operation, "lse", output.lse, device);
  expect_device_pointer(operation, "entropy", output.entropy, device);
  expect_device_pointer(operation, "weights", output.weights, device);
  if (workspace == nullptr) fail_argument(operation, "workspace", "must not be null");
  expect_device_pointer(operation, "workspace", workspace, device);
  if (workspace_bytes < plan.total) {
    fail_argument(operation, "workspace_bytes", "must be >= ", plan.total,
                  " (attend_workspace_size), got ", workspace_bytes);
  }
  if (reinterpret_cast<std::uintptr_t>(workspace) % kAlignment != 0) {
    fail_argument(operation, "workspace", "must be aligned to ", kAlignment, " bytes, got address ",
                  workspace);
  }
  check_no_overlap(input, output, operation, workspace, plan.total);
  // Launch failures are read back with cudaGetLastError: an error already pending would be
  // taken for ours, so it is reported as what it is before anything is enqueued.
  check_no_pending_error(operation);
  if (plan.algorithm == Algorithm::fused) {
    int shared_limit = 0;
    check_cuda(
        cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        operation, "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    const std::size_t needed = fused_shared_bytes(static_cast<int>(input.dim));
    if (needed > static_cast<std::size_t>(shared_limit)) {
      fail(ErrorCode::unsupported, operation, ": the fused algorithm needs ", needed,
           " bytes of shared memory per block at dim ", input.dim, "; this device allows ",
           shared_limit, "; use Algorithm::unfused");
    }
  }

  const int B = static_cast<int>(input.batch), N = static_cast<int>(input.tokens);
  const int d = static_cast<int>(input.dim), H = static_cast<int>(input.layer.heads);
  const long long rows = static_cast<long long>(B) * N;  // rows of one head's projections
  const long long head_stride = rows * d;
  auto* const base = static_cast<unsigned char*>(workspace);
  T* const relevance = reinterpret_cast<T*>(base + plan.relevance);
  T* const content = reinterpret_cast<T*>(base + plan.content);

  KernelMask mask;
  mask.kind = input.mask.kind == MaskKind::none ? 0 : (input.mask.kind == MaskKind::causal ? 1 : 2);
  mask.window =
      mask.kind == 2
          ? static_cast<int>(input.mask.window < input.tokens ? input.mask.window : input.tokens)
          : 0;
  mask.key_lengths = input.key_lengths;

  cublasHandle_t handle =
      cublas_for_stream(stream, base + plan.cublas, kCublasWorkspaceBytes, operation);

  // Q_h = scale (X M_h + 1 u_h^T): in column-major terms Q_h^T = M_h^T X^T, one product per head
  // over all clouds at once (X is shared: stride 0).
  const T scale =
      static_cast<T>(plan.algorithm == Algorithm::fused ? input.beta * kLog2e : input.beta);
  const T one = 1, zero = 0;
  T bias_coefficient = zero;
  if (input.layer.key_bias != nullptr) {
    launch_broadcast_bias<T>(relevance, input.layer.key_bias, one, H, rows, d, stream, operation);
    bias_coefficient = scale;
  }
  check_cublas(gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, static_cast<int>(rows), d, &scale,
                    input.layer.relevance, d, static_cast<long long>(d) * d, input.cloud, d, 0,
                    &bias_coefficient, relevance, d, head_stride, H),
               operation, "cublasGemmStridedBatched (relevance R = X M)");
  // C_h = X F_h^T: C_h^T = F_h X^T with F_h read transposed.
  check_cublas(gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, d, static_cast<int>(rows), d, &one,
                    input.layer.content, d, static_cast<long long>(d) * d, input.cloud, d, 0, &zero,
                    content, d, head_stride, H),
               operation, "cublasGemmStridedBatched (content C = X F^T)");

  if constexpr (std::is_same_v<T, float>) {
    if (plan.algorithm == Algorithm::fused) {
      FusedAttentionArgs args;
      args.query = relevance;
      args.cloud = input.cloud;
      args.content = content;
      args.offset = H == 1 ? input.layer.offset : nullptr;
      args.out = H == 1 ? output.update : reinterpret_cast<float*>(base + plan.partial);
      args.lse = output.lse;
      args.entropy = output.entropy;
      args.batch = B;
      args.heads = H;
      args.tokens = N;
      args.dim = d;
      args.mask = mask;
      launch_fused_attention(args, stream, operation);
      if (H > 1) {
        launch_sum_heads(args.out, input.layer.offset, output.update, B, H, N, d, mask, stream,
                         operation);
      }
      return;
    }
  }

  // Unfused. Padding content must be 0, not merely weighted by 0 (it may hold NaN); the fused
  // kernel never loads it.
  launch_zero_padding<T>(content, H, B, N, d, mask, stream, operation);
  // S_{b,h} = Q_{h,b} X_b^T (S^T = X Q^T in column-major terms), in place of the
  // weights when they are requested.
  T* const scores =
      output.weights != nullptr ? output.weights : reinterpret_cast<T*>(base + plan.scores);
  const long long square = static_cast<long long>(N) * N;
  const long long cloud_stride = static_cast<long long>(N) * d;
  for (int h = 0; h < H; ++h) {
    check_cublas(gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, N, d, &one, input.cloud, d, cloud_stride,
                      relevance + h * head_stride, d, cloud_stride, &zero, scores + h * square, N,
                      square * H, B),
                 operation, "cublasGemmStridedBatched (scores S = R X^T)");
  }
  launch_row_softmax<T>(scores, output.lse, output.entropy, B, H, N, mask, stream, operation);
  // Delta_b = sum_h P_{b,h} C_{h,b} (Delta^T = C^T P^T), heads accumulated in order.
  for (int h = 0; h < H; ++h) {
    check_cublas(gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, N, N, &one, content + h * head_stride, d,
                      cloud_stride, scores + h * square, N, square * H, h == 0 ? &zero : &one,
                      output.update, d, cloud_stride, B),
                 operation, "cublasGemmStridedBatched (update P C)");
  }
  if (input.layer.offset != nullptr) {
    launch_add_offset<T>(output.update, input.layer.offset, B, N, d, mask, stream, operation);
  }
}

template std::size_t attend_workspace_size<float>(const AttentionInput<float>&,
                                                  const AttentionOutput<float>&, Algorithm);
template std::size_t attend_workspace_size<double>(const AttentionInput<double>&,
                                                   const AttentionOutput<double>&, Algorithm);
template void attend_async<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                  void*, std::size_t, Stream, Algorithm);
template void attend_async<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                   void*, std::size_t, Stream, Algorithm);

}  // namespace emflow::cuda

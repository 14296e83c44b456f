// The launches of a plan (attend_plan.hpp): the cuBLAS projections, then either the fused kernel
// or the unfused chain of scores, row softmax and update products. Everything is enqueued on the
// caller's stream; nothing is allocated or synchronised.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "attend_plan.hpp"
#include "attention_kernels.hpp"
#include "cublas_handles.hpp"
#include "cublas_loader.hpp"

namespace emflow::detail {

namespace {

constexpr double kLog2e = 1.4426950408889634074;

// One column-major strided-batched product in T, named `what` in errors.
template <class T>
void gemm(const CublasApi& api, cublasHandle_t handle, cublasOperation_t a_op,
          cublasOperation_t b_op, int m, int n, int k, const T* alpha, const T* a, int lda,
          long long a_stride, const T* b, int ldb, long long b_stride, const T* beta, T* c, int ldc,
          long long c_stride, int count, const char* operation, const char* what) {
  const auto function = [&] {
    if constexpr (std::is_same_v<T, float>) {
      return api.sgemm_strided_batched;
    } else {
      return api.dgemm_strided_batched;
    }
  }();
  check_cublas(api,
               function(handle, a_op, b_op, m, n, k, alpha, a, lda, a_stride, b, ldb, b_stride,
                        beta, c, ldc, c_stride, count),
               operation, what);
}

}  // namespace

template <class T>
void AttentionPlan<T>::enqueue(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                               void* workspace, cudaStream_t stream) const {
  check_matches(input, output);
  const char* const operation = operation_.c_str();
  const CublasApi& api = *cublas_;
  const int B = static_cast<int>(batch_), N = static_cast<int>(tokens_);
  const int d = static_cast<int>(dim_), H = static_cast<int>(heads_);
  const long long rows = static_cast<long long>(B) * N;  // rows of one head's projections
  const long long head_stride = rows * d;
  auto* const base = static_cast<unsigned char*>(workspace);
  T* const relevance = reinterpret_cast<T*>(base + layout_.relevance);
  T* const content = reinterpret_cast<T*>(base + layout_.content);
  const KernelMask mask{input.mask, input.key_lengths};
  cublasHandle_t handle = cublas_for_stream(api, device_, stream, base + layout_.cublas,
                                            layout_.total - layout_.cublas, operation);

  // Q_h = scale (X M_h + 1 u_h^T): in column-major terms Q_h^T = M_h^T X^T, one product per head
  // over all clouds at once (X is shared: stride 0).
  const T scale =
      static_cast<T>(algorithm_ == cuda::Algorithm::fused ? input.beta * kLog2e : input.beta);
  const T one = 1, zero = 0;
  T bias_coefficient = zero;
  if (input.layer.key_bias != nullptr) {
    launch_broadcast_bias<T>(relevance, input.layer.key_bias, one, H, rows, d, stream, operation);
    bias_coefficient = scale;
  }
  gemm<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, static_cast<int>(rows), d, &scale,
          input.layer.relevance, d, static_cast<long long>(d) * d, input.cloud, d, 0,
          &bias_coefficient, relevance, d, head_stride, H, operation,
          "cublasGemmStridedBatched (relevance R = X M)");
  // C_h = X F_h^T: C_h^T = F_h X^T with F_h read transposed.
  gemm<T>(api, handle, CUBLAS_OP_T, CUBLAS_OP_N, d, static_cast<int>(rows), d, &one,
          input.layer.content, d, static_cast<long long>(d) * d, input.cloud, d, 0, &zero, content,
          d, head_stride, H, operation, "cublasGemmStridedBatched (content C = X F^T)");

  if constexpr (std::is_same_v<T, float>) {
    if (algorithm_ == cuda::Algorithm::fused) {
      FusedAttentionArgs args;
      args.query = relevance;
      args.cloud = input.cloud;
      args.content = content;
      args.offset = H == 1 ? input.layer.offset : nullptr;
      args.out = H == 1 ? output.update : reinterpret_cast<float*>(base + layout_.partial);
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
      output.weights != nullptr ? output.weights : reinterpret_cast<T*>(base + layout_.scores);
  const long long square = static_cast<long long>(N) * N;
  const long long cloud_stride = static_cast<long long>(N) * d;
  for (int h = 0; h < H; ++h) {
    gemm<T>(api, handle, CUBLAS_OP_T, CUBLAS_OP_N, N, N, d, &one, input.cloud, d, cloud_stride,
            relevance + h * head_stride, d, cloud_stride, &zero, scores + h * square, N, square * H,
            B, operation, "cublasGemmStridedBatched (scores S = R X^T)");
  }
  launch_row_softmax<T>(scores, output.lse, output.entropy, B, H, N, mask, stream, operation);
  // Delta_b = sum_h P_{b,h} C_{h,b} (Delta^T = C^T P^T), heads accumulated in order.
  for (int h = 0; h < H; ++h) {
    gemm<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, N, N, &one, content + h * head_stride, d,
            cloud_stride, scores + h * square, N, square * H, h == 0 ? &zero : &one, output.update,
            d, cloud_stride, B, operation, "cublasGemmStridedBatched (update P C)");
  }
  // Padding queries (i >= L_b) weight every key by 0, and 0 * NaN would give them the NaN of a
  // non-finite content row: they are set to 0 (docs/MATH.md §6.6).
  launch_zero_padding<T>(output.update, 1, B, N, d, mask, stream, operation);
  if (input.layer.offset != nullptr) {
    launch_add_offset<T>(output.update, input.layer.offset, B, N, d, mask, stream, operation);
  }
}

template void AttentionPlan<float>::enqueue(const AttentionInput<float>&,
                                            const AttentionOutput<float>&, void*,
                                            cudaStream_t) const;
template void AttentionPlan<double>::enqueue(const AttentionInput<double>&,
                                             const AttentionOutput<double>&, void*,
                                             cudaStream_t) const;

}  // namespace emflow::detail

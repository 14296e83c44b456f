// The launches of the float32 and float64 product paths (products_strategy.hpp): the cuBLAS
// projections, then either the fused kernel (with or without key splits and their merge) or the
// unfused chain of scores, row softmax and update products. Everything is enqueued on the
// caller's stream; nothing is allocated or synchronised.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cublas_handles.hpp"
#include "cublas_loader.hpp"
#include "kernels/attention_kernels.hpp"
#include "products_strategy.hpp"

namespace emflow::detail {

namespace {

constexpr double kLog2e = 1.4426950408889634074;

}  // namespace

template <class T>
void ProductsStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                              const char* operation) const {
  const AttentionInput<T>& input = *call.input;
  Targets out;
  if (partial_) {
    out.heads = call.partial->heads;
    out.lse = call.partial->lse;
    out.entropy = call.partial->entropy;
  } else {
    out.update = call.output->update;
    out.lse = call.output->lse;
    out.entropy = call.output->entropy;
    out.weights = call.output->weights;
  }
  const CublasApi& api = *cublas_;
  const int B = static_cast<int>(batch_), N = static_cast<int>(tokens_);
  const int Nq = static_cast<int>(queries_);
  const int d = static_cast<int>(dim_), H = static_cast<int>(heads_);
  const long long query_rows = static_cast<long long>(B) * Nq;  // one head's query projections
  const long long key_rows = static_cast<long long>(B) * N;     // one head's contents
  const long long query_head = query_rows * d, key_head = key_rows * d;
  T* const relevance = reinterpret_cast<T*>(base + relevance_);
  T* const content = reinterpret_cast<T*>(base + content_);
  const T* const queries = input.queries != nullptr ? input.queries : input.cloud;
  // Self-attention's queries are its keys: without query lengths they have the key lengths.
  const std::int64_t* const query_lengths =
      input.query_lengths != nullptr || input.queries != nullptr ? input.query_lengths
                                                                 : input.key_lengths;
  const KernelMask mask{input.mask,         input.key_lengths,    query_lengths,
                        input.key_position, input.query_position, input.query_positions};
  cublasHandle_t handle = cublas_for_stream(api, device_, stream, base + cublas_region_,
                                            total_ - cublas_region_, operation);

  // Q_h = scale (Y M_h + 1 u_h^T): in column-major terms Q_h^T = M_h^T Y^T, one product per head
  // over all clouds at once (Y is shared: stride 0).
  const T scale = static_cast<T>(fused_ ? input.beta * kLog2e : input.beta);
  const T one = 1, zero = 0;
  T bias_coefficient = zero;
  if (input.layer.key_bias != nullptr) {
    launch_broadcast_bias<T>(relevance, input.layer.key_bias, one, H, query_rows, d, stream,
                             operation);
    bias_coefficient = scale;
  }
  gemm_strided_batched<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, static_cast<int>(query_rows), d,
                          &scale, input.layer.relevance, d, static_cast<long long>(d) * d, queries,
                          d, 0, &bias_coefficient, relevance, d, query_head, H, operation,
                          "cublasGemmStridedBatched (relevance R = X M)");
  // C_h = X F_h^T: C_h^T = F_h X^T with F_h read transposed.
  gemm_strided_batched<T>(api, handle, CUBLAS_OP_T, CUBLAS_OP_N, d, static_cast<int>(key_rows), d,
                          &one, input.layer.content, d, static_cast<long long>(d) * d, input.cloud,
                          d, 0, &zero, content, d, key_head, H, operation,
                          "cublasGemmStridedBatched (content C = X F^T)");

  if (fused_) {
    launch_fused(input, out, relevance, content, base, mask, stream, operation);
    return;
  }

  // Unfused. Padding content must be 0, not merely weighted by 0 (it may hold NaN); the fused
  // kernel never loads it.
  launch_zero_padding<T>(content, H, B, N, d, mask, stream, operation);
  // S_{b,h} = Q_{h,b} X_b^T (S^T = X Q^T in column-major terms), in place of the
  // weights when they are requested.
  T* const scores = out.weights != nullptr ? out.weights : reinterpret_cast<T*>(base + scores_);
  const long long rectangle = static_cast<long long>(Nq) * N;
  const long long cloud_stride = static_cast<long long>(N) * d;
  const long long query_stride = static_cast<long long>(Nq) * d;
  for (int h = 0; h < H; ++h) {
    gemm_strided_batched<T>(api, handle, CUBLAS_OP_T, CUBLAS_OP_N, N, Nq, d, &one, input.cloud, d,
                            cloud_stride, relevance + h * query_head, d, query_stride, &zero,
                            scores + h * rectangle, N, rectangle * H, B, operation,
                            "cublasGemmStridedBatched (scores S = R X^T)");
  }
  launch_row_softmax<T>(scores, out.lse, out.entropy, B, H, N, Nq, mask, partial_, stream,
                        operation);
  if (partial_) {
    // o_{b,h} = P_{b,h} C_{h,b} into the state's (batch, heads, Nq, dim) rows.
    for (int h = 0; h < H; ++h) {
      gemm_strided_batched<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, Nq, N, &one,
                              content + h * key_head, d, cloud_stride, scores + h * rectangle, N,
                              rectangle * H, &zero, out.heads + h * query_stride, d,
                              query_stride * H, B, operation,
                              "cublasGemmStridedBatched (per-head update P C)");
    }
    // A query without a visible key weights every key by 0, and 0 * NaN would give it the NaN
    // of a non-finite content row: it is set to 0 (docs/MATH.md §6.6).
    launch_finish_rows<T>(out.heads, nullptr, B, H, N, Nq, d, mask, stream, operation);
    return;
  }
  // Delta_b = sum_h P_{b,h} C_{h,b} (Delta^T = C^T P^T), heads accumulated in order.
  for (int h = 0; h < H; ++h) {
    gemm_strided_batched<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, Nq, N, &one,
                            content + h * key_head, d, cloud_stride, scores + h * rectangle, N,
                            rectangle * H, h == 0 ? &zero : &one, out.update, d, query_stride, B,
                            operation, "cublasGemmStridedBatched (update P C)");
  }
  // Queries without a visible key get 0 (as above), the others the offset. Self-attention without
  // lengths or offset has neither.
  const bool every_query_sees_a_key = input.queries == nullptr && input.key_lengths == nullptr &&
                                      input.query_lengths == nullptr && input.key_position == 0 &&
                                      input.query_position == kAlignToEnd &&
                                      input.query_positions == nullptr;
  if (input.layer.offset != nullptr || !every_query_sees_a_key) {
    launch_finish_rows<T>(out.update, input.layer.offset, B, 1, N, Nq, d, mask, stream, operation);
  }
}

template <class T>
void ProductsStrategy<T>::launch_fused(const AttentionInput<T>& input, const Targets& out,
                                       const T* relevance, const T* content, unsigned char* base,
                                       const KernelMask& mask, cudaStream_t stream,
                                       const char* operation) const {
  if constexpr (std::is_same_v<T, float>) {
    const int B = static_cast<int>(batch_), Nq = static_cast<int>(queries_);
    const int d = static_cast<int>(dim_), H = static_cast<int>(heads_);
    const std::size_t head_rows = static_cast<std::size_t>(Nq) * d;  // one (cloud, head)
    FusedAttentionArgs args;
    args.query = relevance;
    args.cloud = input.cloud;
    args.content = content;
    args.batch = B;
    args.heads = H;
    args.tokens = static_cast<int>(tokens_);
    args.queries = Nq;
    args.dim = d;
    args.split_keys = splits_.keys;
    args.splits = splits_.splits;
    args.partial_state = partial_ || splits_.splits > 1;
    args.mask = mask;
    if (splits_.splits > 1) {
      // Each split writes its partial state (batch, heads, Nq, ...) to its own slice.
      args.out.rows = reinterpret_cast<float*>(base + split_rows_);
      args.out.lse = reinterpret_cast<float*>(base + split_lse_);
      args.out.entropy = reinterpret_cast<float*>(base + split_entropy_);
      args.out.batch_stride = head_rows * H;
      args.out.head_stride = head_rows;
      args.out.split_rows = head_rows * H * B;
      args.out.split_stats = static_cast<std::size_t>(Nq) * H * B;
      launch_fused_attention(args, stream, operation);
      SplitMerge merge;
      merge.rows = args.out.rows;
      merge.lse = args.out.lse;
      merge.entropy = args.out.entropy;
      merge.splits = splits_.splits;
      merge.batch = B;
      merge.heads = H;
      merge.queries = Nq;
      merge.dim = d;
      merge.offset = partial_ ? nullptr : input.layer.offset;
      merge.update = out.update;
      merge.heads_out = out.heads;
      merge.lse_out = out.lse;
      merge.entropy_out = out.entropy;
      launch_merge_splits(merge, stream, operation);
      return;
    }
    args.out.lse = out.lse;
    args.out.entropy = out.entropy;
    if (partial_) {
      args.out.rows = out.heads;
      args.out.batch_stride = head_rows * H;
      args.out.head_stride = head_rows;
      launch_fused_attention(args, stream, operation);
      return;
    }
    args.offset = H == 1 ? input.layer.offset : nullptr;
    args.out.rows = H == 1 ? out.update : reinterpret_cast<float*>(base + heads_out_);
    args.out.batch_stride = head_rows;
    args.out.head_stride = head_rows * B;
    launch_fused_attention(args, stream, operation);
    if (H > 1) {
      launch_sum_heads(args.out.rows, input.layer.offset, out.update, B, H, args.tokens, Nq, d,
                       mask, stream, operation);
    }
  } else {
    (void)input, (void)out, (void)relevance, (void)content, (void)base, (void)mask, (void)stream;
    (void)operation;
  }
}

// The header declares the class's instantiation extern: its members defined here are
// instantiated here explicitly, the private one that run calls included.
#define EMFLOW_INSTANTIATE_LAUNCH(T)                                                       \
  template void ProductsStrategy<T>::run(const PlanCall<T>&, unsigned char*, cudaStream_t, \
                                         const char*) const;                               \
  template void ProductsStrategy<T>::launch_fused(                                         \
      const AttentionInput<T>&, const Targets&, const T*, const T*, unsigned char*,        \
      const KernelMask&, cudaStream_t, const char*) const;
EMFLOW_INSTANTIATE_LAUNCH(float)
EMFLOW_INSTANTIATE_LAUNCH(double)
#undef EMFLOW_INSTANTIATE_LAUNCH

}  // namespace emflow::detail

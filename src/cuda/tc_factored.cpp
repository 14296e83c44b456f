// cuda::attend_factored_async for bfloat16, float16 and float with TF32 products (emflow/cuda.hpp):
// the factored layer (emflow/factored.hpp) on the tensor-core attention (tc_attention.cu).
//
//   1. project: per head, Q_h = A_h Y^T, K_h = B_h X^T, V_h = V_h X^T, accumulated in float32 and
//      stored in T (rounded for the 16-bit types; the TF32 kernel rounds its operands itself),
//      and the key bias terms u_h^T x_j in float32 (the kernel adds them to <q, k> before the
//      scale, as s_ij = beta (<A x_i, B x_j> + u^T x_j) asks);
//   2. the tensor-core attention in rank r with scale beta log2(e), lse and entropy;
//   3. combine: update_i = sum_h U_h o_h,i + c in float32 over heads in order, rounded once to T,
//      for a query that sees a key (lse > -inf); 0 for a padding query. lse and entropy, per
//      head, are transposed from the kernel's (heads, batch, queries) to the public (batch,
//      heads, queries).
//
// The projections and the combine are tc_projection.cu's, shared with the dense form (tc_dense.cpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "attend_plan.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/queries.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "emflow/precision.hpp"
#include "kernels/tc_attention.hpp"
#include "kernels/tc_projection.hpp"

namespace emflow::detail {

namespace {

/// Where each array lives in the workspace (byte offsets, each aligned).
struct FactoredLayout {
  std::size_t query = 0, key = 0, value = 0, bias = 0, heads_out = 0, lse = 0, entropy = 0;
  std::size_t total = 0;
};

template <class T>
FactoredLayout factored_layout(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                               const AttentionOutput<T>& output) {
  const auto H = static_cast<std::size_t>(layer.heads), r = static_cast<std::size_t>(layer.rank);
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto Nq = static_cast<std::size_t>(query_count(input));
  FactoredLayout l;
  std::size_t at = 0;
  auto take = [&at](std::size_t bytes) {
    const std::size_t here = at;
    at += tc_aligned_bytes(bytes);
    return here;
  };
  l.query = take(H * B * Nq * r * sizeof(T));
  l.key = take(H * B * N * r * sizeof(T));
  l.value = take(H * B * N * r * sizeof(T));
  l.bias = take(layer.key_bias != nullptr ? H * B * N * sizeof(float) : 0);
  l.heads_out = take(H * B * Nq * r * sizeof(float));
  l.lse = take(H * B * Nq * sizeof(float));
  l.entropy = take(output.entropy != nullptr ? H * B * Nq * sizeof(float) : 0);
  l.total = at;
  return l;
}

/// The kernel's type for storage type T and `precision` (cuda.hpp says which pairs run).
template <class T>
TcType tc_type(Precision precision, const char* operation) {
  if constexpr (std::is_same_v<T, float>) {
    if (precision == Precision::tf32) return TcType::tf32;
    if (precision == Precision::fp32) {
      fail(ErrorCode::unsupported, operation,
           ": precision fp32 for float input is not implemented on the tensor cores (use "
           "precision tf32 here, or emflow::attend_factored on device 'cuda' or 'cpu' for "
           "float32 products)");
    }
    fail_argument(operation, "precision", to_string(precision), " needs ",
                  precision == Precision::bf16 ? "bfloat16" : "float16", " input, got float");
  } else {
    constexpr bool bf16 = std::is_same_v<T, bfloat16>;
    if (precision == storage_precision<T>() || precision == Precision::fp32) {
      return bf16 ? TcType::bf16 : TcType::f16;
    }
    if (precision == Precision::tf32) {
      fail_argument(operation, "precision", "tf32 needs float input, got ",
                    bf16 ? "bfloat16" : "float16");
    }
    fail_argument(operation, "precision", to_string(precision), " needs ",
                  bf16 ? "float16" : "bfloat16", " input, got ", bf16 ? "bfloat16" : "float16");
  }
}

/// The checks that read no device memory: the factored layer's own (with the lengths, which live
/// on the device, left out), the precision, what this path computes, and the kernels' int limits.
template <class T>
void check_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, Precision precision,
                          const char* operation, const void* workspace = nullptr,
                          std::size_t workspace_bytes = 0) {
  check_factored(input, layer, output, operation, workspace, workspace_bytes, Lengths::device);
  (void)tc_type<T>(precision, operation);
  check_tc_outputs(output, operation);
  if (layer.rank > kTcMaxDim) {
    fail(ErrorCode::unsupported, operation, ": rank ", layer.rank,
         " exceeds the tensor-core attention's limit of ", kTcMaxDim);
  }
  const std::int64_t longest = std::max(input.tokens, query_count(input));
  // Sizes fit in int64 (check_shapes); the kernels index rows and tiles in int.
  if (input.batch * layer.heads * longest * layer.rank > INT_MAX || longest > INT_MAX - 256 ||
      input.dim > INT_MAX) {
    fail(ErrorCode::unsupported, operation,
         ": batch * heads * tokens * rank = ", input.batch * layer.heads * longest * layer.rank,
         " exceeds the CUDA backend's limit of ", INT_MAX);
  }
}

}  // namespace

}  // namespace emflow::detail

namespace emflow::cuda {

template <class T>
std::size_t attend_factored_workspace_size(const AttentionInput<T>& input,
                                           const FactoredLayer<T>& layer,
                                           const AttentionOutput<T>& output, Precision precision) {
  emflow::detail::check_factored_async(input, layer, output, precision,
                                       "attend_factored_workspace_size");
  return emflow::detail::factored_layout(input, layer, output).total;
}

template <class T>
void attend_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream, Precision precision) {
  using namespace emflow::detail;
  const char* const operation = "attend_factored_async";
  const FactoredLayout l = factored_layout(input, layer, output);
  check_factored_async(input, layer, output, precision, operation, workspace, l.total);
  const int device = current_device(operation);
  const char* const names[] = {
      "cloud",        "queries",    "key_lengths", "query_lengths", "query_positions",
      "query_factor", "key_factor", "content_up",  "content_down",  "key_bias",
      "offset",       "update",     "lse",         "entropy"};
  const void* const arrays[] = {input.cloud,         input.queries,         input.key_lengths,
                                input.query_lengths, input.query_positions, layer.query_factor,
                                layer.key_factor,    layer.content_up,      layer.content_down,
                                layer.key_bias,      layer.offset,          output.update,
                                output.lse,          output.entropy};
  for (std::size_t k = 0; k < sizeof arrays / sizeof arrays[0]; ++k) {
    expect_device_pointer(operation, names[k], arrays[k], device);
  }
  expect_workspace(operation, workspace, workspace_bytes, l.total, device);

  const int B = static_cast<int>(input.batch), N = static_cast<int>(input.tokens);
  const int Nq = static_cast<int>(query_count(input)), d = static_cast<int>(input.dim);
  const int H = static_cast<int>(layer.heads), r = static_cast<int>(layer.rank);
  auto* const base = static_cast<unsigned char*>(workspace);
  T* const q = reinterpret_cast<T*>(base + l.query);
  T* const k = reinterpret_cast<T*>(base + l.key);
  T* const v = reinterpret_cast<T*>(base + l.value);
  float* const bias = layer.key_bias != nullptr ? reinterpret_cast<float*>(base + l.bias) : nullptr;
  float* const heads_out = reinterpret_cast<float*>(base + l.heads_out);
  float* const lse = reinterpret_cast<float*>(base + l.lse);
  float* const entropy =
      output.entropy != nullptr ? reinterpret_cast<float*>(base + l.entropy) : nullptr;
  const T* const queries = input.queries != nullptr ? input.queries : input.cloud;

  launch_tc_project(layer.query_factor, TcWeights::rows, queries, q, H, B * Nq, d, r, stream,
                    operation);
  launch_tc_project(layer.key_factor, TcWeights::rows, input.cloud, k, H, B * N, d, r, stream,
                    operation);
  launch_tc_project(layer.content_down, TcWeights::rows, input.cloud, v, H, B * N, d, r, stream,
                    operation);
  if (bias != nullptr) {
    launch_tc_project(layer.key_bias, TcWeights::rows, input.cloud, bias, H, B * N, d, 1, stream,
                      operation);
  }

  TcAttentionArgs args;
  args.type = tc_type<T>(precision, operation);
  args.query = q;
  args.key = k;
  args.value = v;
  args.key_bias = bias;
  args.scale = static_cast<float>(input.beta * 1.4426950408889634);
  args.out = heads_out;
  args.lse = lse;
  args.entropy = entropy;
  args.batch = B;
  args.heads = H;
  args.tokens = N;
  args.queries = Nq;
  args.dim = r;
  args.mask = tc_kernel_mask(input);
  launch_tc_attention(args, stream, operation);

  launch_tc_combine(tc_combine_args(heads_out, lse, entropy, output, H, B, Nq, d, r),
                    layer.content_up, layer.offset, output.update, stream, operation);
}

#define EMFLOW_INSTANTIATE(T)                                                                   \
  template std::size_t attend_factored_workspace_size<T>(                                       \
      const AttentionInput<T>&, const FactoredLayer<T>&, const AttentionOutput<T>&, Precision); \
  template void attend_factored_async<T>(const AttentionInput<T>&, const FactoredLayer<T>&,     \
                                         const AttentionOutput<T>&, void*, std::size_t, Stream, \
                                         Precision);
EMFLOW_INSTANTIATE(bfloat16)
EMFLOW_INSTANTIATE(float16)
EMFLOW_INSTANTIATE(float)
#undef EMFLOW_INSTANTIATE

}  // namespace emflow::cuda

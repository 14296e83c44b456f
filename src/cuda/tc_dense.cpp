// cuda::attend_workspace_size and cuda::attend_async for bfloat16 and float16, and for float with
// precision tf32 (emflow/cuda.hpp): the dense EMF form (emflow/attention.hpp) on the tensor-core
// attention (tc_attention.cu).
//
// s_ij = beta (x_i^T M_h x_j + u_h^T x_j) = beta (<M_h^T x_i, x_j> + u_h^T x_j), so per head h:
//   1. project (tc_projection.cu): the queries' relevance gradients R_h = Q M_h (row i is
//      (M_h^T q_i)^T, Q = X for self-attention) and the contents C_h = X F_h^T (row j is
//      (F_h x_j)^T), accumulated in float32 and rounded once to T (the kernel's inputs are
//      16-bit; float storage keeps them in float32 and the kernel rounds its operands to TF32),
//      and the key bias terms u_h^T x_j in float32 (the kernel adds them to <r_i, x_j>
//      before the scale);
//   2. the tensor-core attention in dim d with queries R_h, keys X itself and values C_h, scale
//      beta log2(e), lse and entropy;
//   3. combine: update_i = sum_h o_h,i + c in float32 over heads in order, rounded once to T,
//      for a query that sees a key; 0 for a padding query (the factored path's combine with the
//      identity for its output projection). lse and entropy are transposed to (batch, heads,
//      queries).
// The keys are the same cloud for every head: one attention launch per head reads X in place
// (a head stride of 0 for the keys in the kernel would make it one launch), so the workspace
// holds R, C, the bias terms and the float32 head outputs, lse and entropy, never H copies of X.
// Algorithm::automatic and fused take this path; unfused (cuBLAS, float and double) is refused.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "attend_plan.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/queries.hpp"
#include "cuda_support.hpp"
#include "emflow/precision.hpp"
#include "kernels/tc_attention.hpp"
#include "tc_dense.hpp"
#include "kernels/tc_projection.hpp"

namespace emflow::detail {

namespace {

/// Where each array lives in the workspace (byte offsets, each aligned).
struct DenseLayout {
  std::size_t query = 0, value = 0, bias = 0, heads_out = 0, lse = 0, entropy = 0, total = 0;
};

template <class T>
DenseLayout dense_layout(const AttentionInput<T>& input, const AttentionOutput<T>& output) {
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto Nq = static_cast<std::size_t>(query_count(input));
  const auto d = static_cast<std::size_t>(input.dim);
  DenseLayout l;
  std::size_t at = 0;
  auto take = [&at](std::size_t bytes) {
    const std::size_t here = at;
    at += tc_aligned_bytes(bytes);
    return here;
  };
  l.query = take(H * B * Nq * d * sizeof(T));
  l.value = take(H * B * N * d * sizeof(T));
  l.bias = take(input.layer.key_bias != nullptr ? H * B * N * sizeof(float) : 0);
  l.heads_out = take(H * B * Nq * d * sizeof(float));
  l.lse = take(H * B * Nq * sizeof(float));
  l.entropy = take(output.entropy != nullptr ? H * B * Nq * sizeof(float) : 0);
  l.total = at;
  return l;
}

/// The checks that read no device memory: validate()'s (with the lengths, which live on the
/// device, left out), the algorithm, what this path computes, and the kernels' limits.
template <class T>
void check_dense_async(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                       cuda::Algorithm algorithm, const char* operation) {
  check_arguments(input, output, operation, Lengths::device);
  switch (algorithm) {
    case cuda::Algorithm::automatic:
    case cuda::Algorithm::fused:
      break;
    case cuda::Algorithm::unfused:
      fail(ErrorCode::unsupported, operation,
           ": Algorithm::unfused computes float32 and double products only; bfloat16 and "
           "float16 input runs on the tensor cores (Algorithm::automatic or fused)");
    default:
      fail(ErrorCode::invalid_argument, operation, ": argument 'algorithm' is not an Algorithm");
  }
  check_tc_outputs(output, operation);
  if (input.dim > kTcMaxDim) {
    fail(ErrorCode::unsupported, operation, ": dim ", input.dim,
         " exceeds the tensor-core attention's limit of ", kTcMaxDim,
         " for 16-bit input (use device 'cpu')");
  }
  const std::int64_t longest = std::max(input.tokens, query_count(input));
  // Sizes fit in int64 (check_shapes); the kernels index rows and tiles in int.
  if (input.batch * input.layer.heads * longest * input.dim > INT_MAX || longest > INT_MAX - 256) {
    fail(ErrorCode::unsupported, operation,
         ": batch * heads * tokens * dim = ", input.batch * input.layer.heads * longest * input.dim,
         " exceeds the CUDA backend's limit of ", INT_MAX);
  }
}

}  // namespace

template <class T>
std::size_t tc_dense_workspace_size(const AttentionInput<T>& input,
                                    const AttentionOutput<T>& output, cuda::Algorithm algorithm,
                                    const char* operation) {
  check_dense_async(input, output, algorithm, operation);
  return dense_layout(input, output).total;
}

template <class T>
void tc_dense_attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                           void* workspace, std::size_t workspace_bytes, cuda::Stream stream,
                           cuda::Algorithm algorithm, const char* operation) {
  check_dense_async(input, output, algorithm, operation);
  const DenseLayout l = dense_layout(input, output);
  const int device = current_device(operation);
  const char* const names[] = {"cloud",           "queries",   "key_lengths", "query_lengths",
                               "query_positions", "relevance", "content",     "key_bias",
                               "offset",          "update",    "lse",         "entropy"};
  const void* const arrays[] = {
      input.cloud,           input.queries,         input.key_lengths,   input.query_lengths,
      input.query_positions, input.layer.relevance, input.layer.content, input.layer.key_bias,
      input.layer.offset,    output.update,         output.lse,          output.entropy};
  for (std::size_t k = 0; k < sizeof arrays / sizeof arrays[0]; ++k) {
    expect_device_pointer(operation, names[k], arrays[k], device);
  }
  expect_workspace(operation, workspace, workspace_bytes, l.total, device);
  check_no_overlap(input, output, operation, workspace, l.total);

  const int B = static_cast<int>(input.batch), N = static_cast<int>(input.tokens);
  const int Nq = static_cast<int>(query_count(input)), d = static_cast<int>(input.dim);
  const int H = static_cast<int>(input.layer.heads);
  auto* const base = static_cast<unsigned char*>(workspace);
  T* const r = reinterpret_cast<T*>(base + l.query);
  T* const c = reinterpret_cast<T*>(base + l.value);
  float* const bias =
      input.layer.key_bias != nullptr ? reinterpret_cast<float*>(base + l.bias) : nullptr;
  float* const heads_out = reinterpret_cast<float*>(base + l.heads_out);
  float* const lse = reinterpret_cast<float*>(base + l.lse);
  float* const entropy =
      output.entropy != nullptr ? reinterpret_cast<float*>(base + l.entropy) : nullptr;
  const T* const queries = input.queries != nullptr ? input.queries : input.cloud;

  launch_tc_project(input.layer.relevance, TcWeights::transposed, queries, r, H, B * Nq, d, d,
                    stream, operation);
  launch_tc_project(input.layer.content, TcWeights::rows, input.cloud, c, H, B * N, d, d, stream,
                    operation);
  if (bias != nullptr) {
    launch_tc_project(input.layer.key_bias, TcWeights::rows, input.cloud, bias, H, B * N, d, 1,
                      stream, operation);
  }

  const KernelMask mask = tc_kernel_mask(input);
  const std::size_t query_rows = static_cast<std::size_t>(B) * Nq;
  const std::size_t key_rows = static_cast<std::size_t>(B) * N;
  for (int h = 0; h < H; ++h) {
    TcAttentionArgs args;
    args.type = std::is_same_v<T, float>      ? TcType::tf32
                : std::is_same_v<T, bfloat16> ? TcType::bf16
                                              : TcType::f16;
    args.query = r + h * query_rows * d;
    args.key = input.cloud;
    args.value = c + h * key_rows * d;
    args.key_bias = bias != nullptr ? bias + h * key_rows : nullptr;
    args.scale = static_cast<float>(input.beta * 1.4426950408889634);
    args.out = heads_out + h * query_rows * d;
    args.lse = lse + h * query_rows;
    args.entropy = entropy != nullptr ? entropy + h * query_rows : nullptr;
    args.batch = B;
    args.heads = 1;
    args.tokens = N;
    args.queries = Nq;
    args.dim = d;
    args.mask = mask;
    launch_tc_attention(args, stream, operation);
  }

  launch_tc_combine<T>(tc_combine_args(heads_out, lse, entropy, output, H, B, Nq, d, d), nullptr,
                       input.layer.offset, output.update, stream, operation);
}

#define EMFLOW_INSTANTIATE(T)                                                                 \
  template std::size_t tc_dense_workspace_size<T>(                                            \
      const AttentionInput<T>&, const AttentionOutput<T>&, cuda::Algorithm, const char*);     \
  template void tc_dense_attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, \
                                         void*, std::size_t, cuda::Stream, cuda::Algorithm,   \
                                         const char*);
EMFLOW_INSTANTIATE(bfloat16)
EMFLOW_INSTANTIATE(float16)
EMFLOW_INSTANTIATE(float)
#undef EMFLOW_INSTANTIATE

}  // namespace emflow::detail

// The dense EMF form (emflow/attention.hpp) on the tensor-core attention (tc_attention.cu): the
// strategy of cuda::AttentionPlan for bfloat16 and float16 storage, and for float with precision
// tf32 (emflow/cuda.hpp), where route() chooses cuda_tensor_cores.
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
// The keys are the same cloud for every head: one attention launch for every head and cloud reads
// X in place (TcAttentionArgs::shared_keys), so the workspace holds R, C, the bias terms and the
// float32 head outputs, lse and entropy, never H copies of X. The heads' outputs go to
// per-head rows and the combine sums them in head order, so the result is the same run to run.
// Key splits: as the float kernel's (choose_key_splits: a cross-attention of few query blocks,
// decoding), each split's partial state in the workspace, merged in split order by the float
// path's merge (launch_merge_splits, through launch_tc_attention) before the combine.
// route() sends Algorithm::automatic and fused here; unfused (cuBLAS) never.
#include "tc_dense.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/check.hpp"
#include "emflow/precision.hpp"
#include "kernels/tc_attention.hpp"
#include "kernels/tc_projection.hpp"

namespace emflow::detail {

namespace {

// The kernel's limit is the capability function's (route() decides on kTensorCoreMaxDim).
static_assert(kTcMaxDim == kTensorCoreMaxDim, "the tensor cores' width is route()'s rule");
// The key splits' rule (choose_key_splits) is the float kernel's, for its tile geometry.
static_assert(kTcBlockQueries == kFusedBlockQueries && kTcBlockKeys == kFusedBlockKeys,
              "the tensor-core tiles are the float kernel's");

}  // namespace

template <class T>
TcDenseStrategy<T>::TcDenseStrategy(const Problem& p, int key_splits, const char* operation)
    : batch_(static_cast<int>(p.batch)),
      tokens_(static_cast<int>(p.tokens)),
      queries_(static_cast<int>(p.query_tokens)),
      dim_(static_cast<int>(p.dim)),
      heads_(static_cast<int>(p.heads)),
      key_bias_(p.key_bias) {
  // Every size fits in int64 (check_shapes) and the rows in int (route()'s index limit).
  const std::int64_t H = heads_, B = batch_, N = tokens_, Nq = queries_, d = dim_;
  WorkspaceCursor at(operation);
  query_ = at.take(H * B * Nq * d, sizeof(T), "relevance");
  value_ = at.take(H * B * N * d, sizeof(T), "content");
  bias_ = at.take(key_bias_ ? H * B * N : 0, sizeof(float), "key bias terms");
  state_.take(at, p, d, key_splits);
  total_ = at.total();
}

template <class T>
void TcDenseStrategy<T>::bind(int device, bool prepare, const char* operation) {
  expect_shared_memory(
      operation, "the tensor-core attention", tc_shared_bytes(tc_type<T>(), dim_), device,
      shared_memory_limit(device, operation),
      std::is_same_v<T, float> ? "use Precision::fp32 (the float32 kernels)" : "use device 'cpu'");
  if (prepare) prepare_tc_attention(tc_type<T>(), dim_, operation);
}

template <class T>
void TcDenseStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                             const char* operation) const {
  const AttentionInput<T>& input = *call.input;
  const AttentionOutput<T>& output = *call.output;
  const int B = batch_, N = tokens_, Nq = queries_, d = dim_, H = heads_;
  T* const r = reinterpret_cast<T*>(base + query_);
  T* const c = reinterpret_cast<T*>(base + value_);
  float* const bias = key_bias_ ? reinterpret_cast<float*>(base + bias_) : nullptr;
  const T* const queries = input.queries != nullptr ? input.queries : input.cloud;

  launch_tc_project(input.layer.relevance, TcWeights::transposed, queries, r, H, B * Nq, d, d,
                    stream, operation);
  launch_tc_project(input.layer.content, TcWeights::rows, input.cloud, c, H, B * N, d, d, stream,
                    operation);
  if (bias != nullptr) {
    launch_tc_project(input.layer.key_bias, TcWeights::rows, input.cloud, bias, H, B * N, d, 1,
                      stream, operation);
  }

  // Every head and cloud in one launch: the keys are X itself for every head (shared_keys), the
  // queries, values and bias terms per head. The heads' outputs are summed by the combine, in
  // head order (deterministic).
  launch_tc_attention(state_.args(base, input, r, input.cloud, /*shared_keys=*/true, c, bias),
                      stream, operation);
  launch_tc_combine<T>(state_.combine_args(base, output, d), nullptr, input.layer.offset,
                       output.update, stream, operation);
}

template class TcDenseStrategy<bfloat16>;
template class TcDenseStrategy<float16>;
template class TcDenseStrategy<float>;

}  // namespace emflow::detail

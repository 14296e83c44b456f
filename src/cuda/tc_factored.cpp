// The factored layer (emflow/factored.hpp) on the tensor-core attention (tc_attention.cu): the
// strategy of cuda::AttentionPlan for bfloat16 and float16 storage and for float with TF32
// products (emflow/cuda.hpp), where route() chooses cuda_tensor_cores for the factored form;
// and for float with fp32 products where the layer has rotary positions or grouped kv heads
// (route(): cuda_fused, not expanded), the same steps with step 2 on the SDPA operator's float32
// kernel (kernels/sdpa_backward.cu, heads-major, scale beta, the key bias terms added to <q, k>;
// no key splits).
//
//   1. project: per head, Q_h = A_h Y^T, and per kv head g, K_g = B_g X^T, V_g = V_g X^T (one
//      per query head without grouped heads), accumulated in float32, each query and key turned
//      by its rotary position (FactoredLayer::rotary, docs/MATH.md §2.4: the angles in double,
//      at the positions the mask gives the rows) and stored in T (rounded for the 16-bit types;
//      the TF32 kernel rounds its operands itself), and the key bias terms u_h^T x_j in float32
//      (the kernel adds them to <q, k> before the scale, as s_ij = beta (<A x_i, B x_j> + u^T
//      x_j) asks);
//   2. the tensor-core attention in rank r with scale beta log2(e), lse and entropy, query head
//      h reading kv head h / (heads / kv_heads);
//   3. combine: update_i = sum_h U_h o_h,i + c in float32 over heads in order, rounded once to T,
//      for a query that sees a key (lse > -inf); 0 for a padding query. lse and entropy, per
//      head, are transposed from the kernel's (heads, batch, queries) to the public (batch,
//      heads, queries).
//
// The projections and the combine are tc_projection.cu's, shared with the dense form
// (tc_dense.cpp). Every head and cloud is one attention launch; key splits as the dense form's
// (tc_dense.cpp): the float kernel's rule and merge.
#include "tc_factored.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/check.hpp"
#include "core/rotary.hpp"
#include "emflow/precision.hpp"
#include "kernels/sdpa_backward.hpp"
#include "kernels/tc_attention.hpp"
#include "kernels/tc_projection.hpp"

namespace emflow::detail {

template <class T>
TcFactoredStrategy<T>::TcFactoredStrategy(const Problem& p, int key_splits, const char* operation)
    : batch_(static_cast<int>(p.batch)),
      tokens_(static_cast<int>(p.tokens)),
      queries_(static_cast<int>(p.query_tokens)),
      dim_(static_cast<int>(p.dim)),
      heads_(static_cast<int>(p.heads)),
      rank_(static_cast<int>(p.rank)),
      kv_heads_(static_cast<int>(p.kv_heads != 0 ? p.kv_heads : p.heads)),
      key_bias_(p.key_bias),
      float32_(std::is_same_v<T, float> && p.precision == Precision::fp32) {
  // Every size fits in int64 (the plan's checks) and the rows in int (route()'s index limit).
  const std::int64_t H = heads_, K = kv_heads_, B = batch_, N = tokens_, Nq = queries_, r = rank_;
  WorkspaceCursor at(operation);
  query_ = at.take(H * B * Nq * r, sizeof(T), "queries");
  key_ = at.take(K * B * N * r, sizeof(T), "keys");
  value_ = at.take(K * B * N * r, sizeof(T), "values");
  bias_ = at.take(key_bias_ ? H * B * N : 0, sizeof(float), "key bias terms");
  state_.take(at, p, r, float32_ ? 1 : key_splits);  // the float32 kernel splits no keys
  total_ = at.total();
}

template <class T>
void TcFactoredStrategy<T>::bind(int device, bool prepare, const char* operation) {
  if (float32_) {
    expect_shared_memory(operation, "the float32 SDPA kernel", sdpa_backward_shared_bytes(rank_),
                         device, shared_memory_limit(device, operation), "use device 'cpu'");
    if (prepare) prepare_sdpa_forward(rank_, operation);
    return;
  }
  expect_shared_memory(
      operation, "the tensor-core attention", tc_shared_bytes(tc_type<T>(), rank_), device,
      shared_memory_limit(device, operation),
      std::is_same_v<T, float> ? "use Precision::fp32 (the expanded layer)" : "use device 'cpu'");
  if (prepare) prepare_tc_attention(tc_type<T>(), rank_, operation);
}

template <class T>
void TcFactoredStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                                const char* operation) const {
  const AttentionInput<T>& input = *call.input;
  const FactoredLayer<T>& layer = *call.layer;
  const AttentionOutput<T>& output = *call.output;
  const int B = batch_, N = tokens_, Nq = queries_, d = dim_, H = heads_, K = kv_heads_, r = rank_;
  T* const q = reinterpret_cast<T*>(base + query_);
  T* const k = reinterpret_cast<T*>(base + key_);
  T* const v = reinterpret_cast<T*>(base + value_);
  float* const bias = key_bias_ ? reinterpret_cast<float*>(base + bias_) : nullptr;
  const T* const queries = input.queries != nullptr ? input.queries : input.cloud;

  // The rotation of the queries and the keys at their positions (none for rotary.dim 0). The
  // frequencies are fixed before the kernels run: the dynamic scaling, whose frequencies depend
  // on the lengths (device memory here), needs them given (Rotary::inverse_frequencies).
  TcRotary query_turn, key_turn;
  if (layer.rotary.dim != 0) {
    check_fixed_frequencies(layer.rotary, operation,
                            "the GPU turns the keys before their lengths are read");
    const std::vector<double> frequencies = rotary_inverse_frequencies(layer.rotary, 1);
    key_turn.dim = static_cast<int>(layer.rotary.dim);
    key_turn.interleaved = layer.rotary.pairing == RotaryPairing::interleaved;
    key_turn.mask = tc_kernel_mask(input);
    key_turn.tokens = N;
    key_turn.query_tokens = Nq;
    std::copy(frequencies.begin(), frequencies.end(), key_turn.inverse_frequencies);
    query_turn = key_turn;
    key_turn.cloud_rows = N;
    query_turn.queries = true;
    query_turn.cloud_rows = Nq;
  }
  launch_tc_project(layer.query_factor, TcWeights::rows, queries, q, H, B * Nq, d, r, stream,
                    operation, query_turn);
  launch_tc_project(layer.key_factor, TcWeights::rows, input.cloud, k, K, B * N, d, r, stream,
                    operation, key_turn);
  launch_tc_project(layer.content_down, TcWeights::rows, input.cloud, v, K, B * N, d, r, stream,
                    operation);
  if (bias != nullptr) {
    launch_tc_project(layer.key_bias, TcWeights::rows, input.cloud, bias, H, B * N, d, 1, stream,
                      operation);
  }

  TcAttentionArgs args = state_.args(base, input, q, k, /*shared_keys=*/false, v, bias);
  args.kv_heads = K;
  if (float32_) {
    if constexpr (std::is_same_v<T, float>) {
      SdpaForwardArgs f;  // the state's head outputs, lse and entropy, as the kernel's
      f.query = q;
      f.key = k;
      f.value = v;
      f.key_bias = bias;
      f.output = args.out;
      f.lse = args.lse;
      f.entropy = args.entropy;
      f.scale = static_cast<float>(input.beta);
      f.heads_major = true;
      f.batch = B;
      f.heads = H;
      f.kv_heads = K;
      f.queries = Nq;
      f.tokens = N;
      f.rank = f.value_rank = r;
      f.mask = args.mask;
      launch_sdpa_forward(f, stream, operation);
    }
  } else {
    launch_tc_attention(args, stream, operation);
  }
  launch_tc_combine(state_.combine_args(base, output, d), layer.content_up, layer.offset,
                    output.update, stream, operation);
}

template class TcFactoredStrategy<bfloat16>;
template class TcFactoredStrategy<float16>;
template class TcFactoredStrategy<float>;

}  // namespace emflow::detail

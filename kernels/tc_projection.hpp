// The element-wise stages around the tensor-core attention (tc_attention.hpp) that the factored
// (tc_factored.cpp) and the dense (tc_dense.cpp) 16-bit paths share: the per-head projections of
// the clouds before it, in float32 and rounded once to the storage type, and the float32 sum
// over heads after it. Each launcher enqueues on `stream`, checks the launch and never
// synchronises; pointers are device pointers. T is bfloat16, float16, or float (TF32: the
// attention rounds its operands, the projections stay float32).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention_kernels.hpp"
#include "emflow/attention.hpp"

namespace emflow::detail {

/// How a projection reads its weights w(h, c, k) of `heads` maps R^dim -> R^rank.
enum class TcWeights {
  rows,       ///< weights[(h * rank + c) * dim + k]: out = W x (A, B, V, F, u)
  transposed  ///< weights[(h * dim + k) * rank + c]: out = W^T x (R = X M: r_i = M^T x_i)
};

/// Rotary pairs a projection can turn: rank <= kTcMaxDim (tc_attention.hpp), so 128.
constexpr int kTcMaxRotaryPairs = 128;

/// The rotation of a projection's rows by their rotary positions (docs/MATH.md §2.4), applied to
/// the float32 sums before they are rounded: pair t of the first `dim` coordinates, (t, t + dim
/// / 2) or (2t, 2t + 1), turned by the angle position * inverse_frequencies[t] (its cosine and
/// sine in double), (a, b) -> (a cos - b sin, b cos + a sin), as the host's RotaryCall does. Row
/// `row` of the projection is token n = row % cloud_rows of cloud b = row / cloud_rows, at the
/// position the mask gives it: mask.key_position + n for keys, the cloud's first query position
/// (cloud_view: query_positions[b], query_position, or aligned to the cloud's last key) + n for
/// queries.
struct TcRotary {
  int dim = 0;  ///< rotated coordinates; 0: no rotation
  bool interleaved = false;
  bool queries = false;              ///< the rows are queries (else keys)
  int cloud_rows = 1;                ///< rows of one cloud: the tokens, or the queries
  int tokens = 1, query_tokens = 1;  ///< the call's N and Nq, as the mask's view reads them
  KernelMask mask;
  double inverse_frequencies[kTcMaxRotaryPairs] = {};
};

/// out[(h * rows + row) * rank + c] = sum_k w(h, c, k) x[row * dim + k], accumulated in float32
/// from the stored values, turned by `rotary` (rotary.dim 0: not), and rounded once to Out (T,
/// or float for the key bias terms).
template <class T, class Out>
void launch_tc_project(const T* weights, TcWeights layout, const T* x, Out* out, int heads,
                       int rows, int dim, int rank, cudaStream_t stream, const char* operation,
                       const TcRotary& rotary = TcRotary{});

/// The sum over heads after the attention.
struct TcCombineArgs {
  const float* heads_out = nullptr;  ///< (heads, batch, queries, rank)
  const float* lse = nullptr;        ///< (heads, batch, queries)
  float* lse_out = nullptr;          ///< (batch, heads, queries) or null
  const float* entropy = nullptr;    ///< (heads, batch, queries) or null
  float* entropy_out = nullptr;      ///< (batch, heads, queries) or null
  int heads = 1, batch = 1, queries = 1, dim = 1, rank = 1;
};

/// update[b, i, a] = sum_h (U_h o_h,bi)[a] + offset[a] in float32 over the heads in order,
/// rounded once to T, for a query that sees a key (head 0's lse > -inf), else 0; `up` is U
/// (heads, dim, rank), or null for the identity (rank == dim: the dense form's heads output
/// their contents directly); `offset` may be null. lse and entropy are transposed from the
/// kernel's (heads, batch, queries) to the public (batch, heads, queries) where the outputs are
/// set (the statistics are per head: attention.hpp).
template <class T>
void launch_tc_combine(const TcCombineArgs& args, const T* up, const T* offset, T* update,
                       cudaStream_t stream, const char* operation);

/// The sum over heads of `heads` head outputs (H, batch, queries, rank) with their lse and
/// entropy (entropy may be null), into `output`'s lse and entropy where those are set.
template <class T>
TcCombineArgs tc_combine_args(const float* heads_out, const float* lse, const float* entropy,
                              const AttentionOutput<T>& output, int heads, int batch, int queries,
                              int dim, int rank) {
  TcCombineArgs args;
  args.heads_out = heads_out;
  args.lse = lse;
  args.lse_out = output.lse;
  args.entropy = entropy;
  args.entropy_out = output.entropy;
  args.heads = heads;
  args.batch = batch;
  args.queries = queries;
  args.dim = dim;
  args.rank = rank;
  return args;
}

/// The kernels' mask of `input`. Self-attention's queries are its keys: without query lengths
/// they have the key lengths.
template <class T>
KernelMask tc_kernel_mask(const AttentionInput<T>& input) {
  const std::int64_t* const query_lengths =
      input.query_lengths != nullptr || input.queries != nullptr ? input.query_lengths
                                                                 : input.key_lengths;
  return KernelMask{input.mask,         input.key_lengths,    query_lengths,
                    input.key_position, input.query_position, input.query_positions};
}

}  // namespace emflow::detail

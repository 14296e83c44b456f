// emflow: the EMF contextual update (docs/MATH.md §1), one call for every backend.
//
// For a batch of B clouds X_b (N x d, row-major) and a layer of H heads (M_h, F_h, u_h) plus
// one content offset c:
//
//   s_ij    = beta * (x_i^T M_h x_j + u_h^T x_j)          (-inf where masked)
//   p_ij    = softmax_j(s_ij)                             lse_i = log sum_j exp(s_ij)
//   H_i     = lse_i - sum_j p_ij s_ij                     (attention entropy, nats)
//   delta_i = sum_h sum_j p^h_ij F_h x_j + c              (0 for a query with no visible key)
//
// All arrays are dense and row-major. Pointers are host pointers for attend(); for
// emflow::cuda::attend_async (cuda.hpp) they are device pointers.
//
// Non-finite values (docs/MATH.md §6.6, the same on every device): a query that sees a key but
// one of whose visible scores is NaN or +inf, or all of whose visible scores are -inf, gets NaN
// lse_i, H_i and weights for that head and a NaN delta_i (never the zeros of a query without
// keys); a NaN or infinity in a content F_h x_j reaches delta_i of exactly the queries that see
// key j (even with weight 0), one in c every query that sees a key. Masked keys and padding
// never contribute; padding queries get 0, -inf and 0 whatever the input holds. See finite.hpp
// for what each input reaches and for the CUDA device's one exception.
//
// Precision (docs/MATH.md §7): T is float, double, emflow::bfloat16 or emflow::float16
// (precision.hpp). The 16-bit types are storage only: X, Q, M, F, u, c and the update are stored
// in T, every product accumulates in float32, and lse, entropy and weights are float32
// (Stat<T>). The reference computes, in double, the exact result of the stored (rounded) inputs.
#pragma once

#include <cstdint>
#include <type_traits>

#include "emflow/precision.hpp"
#include "emflow/types.hpp"

namespace emflow {

/// The operators of one attention layer of `heads` heads in R^dim.
template <class T>
struct LayerOperators {
  std::int64_t heads = 1;
  const T* relevance = nullptr;  ///< M: (heads, dim, dim), bilinear form q^T M_h t. Required.
  const T* content = nullptr;    ///< F: (heads, dim, dim), content operator F_h t. Required.
  const T* key_bias = nullptr;   ///< u: (heads, dim), adds u_h^T x_j to every score. Optional.
  const T* offset = nullptr;     ///< c: (dim), added to every visible query's update. Optional.
};

/// Marks AttentionInput::query_position as "aligned to the end of the real keys".
inline constexpr std::int64_t kAlignToEnd = INT64_MIN;

/// Everything the contextual update reads.
///
/// Self-attention (queries null): every token of X is a query against all of X. Cross-attention
/// (docs/MATH.md §1): queries Q (batch, query_tokens, dim) against the keys X (batch, tokens,
/// dim); outputs then have Nq = query_tokens rows per cloud. Masks act on sequence positions:
/// key j sits at key_position + j, and query i of cloud b at query_position + i, or, by default
/// (kAlignToEnd), at key_position + Lk_b - Lq_b + i: aligned bottom-right, so that the last
/// real query sits beside the last real key as in a decoder (Lk_b, Lq_b: the cloud's key and
/// query lengths, N and Nq without them). Causal: key j is visible to query i when its position
/// is <= the query's; window w: also > the query's - w. For self-attention without query
/// lengths this is query i against key j as before. Positions, with their N or Nq rows, must
/// stay within +-2^60.
template <class T>
struct AttentionInput {
  const T* cloud = nullptr;  ///< X: (batch, tokens, dim): the keys (and the queries if unset)
  std::int64_t batch = 1;    ///< B >= 1
  std::int64_t tokens = 0;   ///< N (the key count) >= 1
  std::int64_t dim = 0;      ///< d >= 1
  LayerOperators<T> layer;
  /// Inverse temperature; finite, and |beta| <= 2^64 for float input so that beta * score
  /// stays in float range for scores up to 2^64 (docs/MATH.md §6.6).
  double beta = 1.0;
  Mask mask;
  /// Optional per-cloud key lengths L_b in [0, N] (host memory, `batch` entries): only keys
  /// j < L_b are visible; queries i >= L_b are padding and get a zero update and lse = -inf.
  const std::int64_t* key_lengths = nullptr;
  /// Q: (batch, query_tokens, dim), or null for self-attention (Q = X).
  const T* queries = nullptr;
  /// Nq >= 1 with `queries`; without them 0 (meaning N) or N.
  std::int64_t query_tokens = 0;
  /// Optional per-cloud query lengths Lq_b in [0, Nq] (host memory, `batch` entries): queries
  /// i >= Lq_b are padding (zero update, lse = -inf). Null: Nq with `queries`; for
  /// self-attention the key lengths.
  const std::int64_t* query_lengths = nullptr;
  /// Sequence position of key 0 (for the mask; see above).
  std::int64_t key_position = 0;
  /// Sequence position of query 0, or kAlignToEnd (see above).
  std::int64_t query_position = kAlignToEnd;
  /// Optional per-cloud positions of query 0 (host memory, `batch` entries), overriding
  /// query_position: a block of keys of a ragged batch (partial.hpp) needs each cloud's own
  /// bottom-right origin, key_position + Lk_b - Lq_b over the whole cloud, which one value cannot
  /// give.
  const std::int64_t* query_positions = nullptr;
};

/// `input` over arrays of another element type U (for example its values widened or rounded to
/// U): the given cloud, queries and layer, and every other field of `input` (shapes, beta, mask,
/// positions, and the length arrays, which are shared, not copied).
template <class U, class T>
AttentionInput<U> with_arrays(const AttentionInput<T>& input, const U* cloud, const U* queries,
                              const LayerOperators<U>& layer) {
  AttentionInput<U> out;
  out.cloud = cloud;
  out.batch = input.batch;
  out.tokens = input.tokens;
  out.dim = input.dim;
  out.layer = layer;
  out.beta = input.beta;
  out.mask = input.mask;
  out.key_lengths = input.key_lengths;
  out.queries = queries;
  out.query_tokens = input.query_tokens;
  out.query_lengths = input.query_lengths;
  out.key_position = input.key_position;
  out.query_position = input.query_position;
  out.query_positions = input.query_positions;
  return out;
}

/// True for the 16-bit storage types (bfloat16, float16).
template <class T>
inline constexpr bool is_16bit_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The type of the statistics (lse, entropy, weights) for storage type T: double for double,
/// float for float and for the 16-bit types (docs/MATH.md §7).
template <class T>
using Stat = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// Where the contextual update writes. Only `update` is required.
template <class T>
struct AttentionOutput {
  T* update = nullptr;         ///< Delta: (batch, Nq, dim) (Nq = tokens for self-attention)
  Stat<T>* lse = nullptr;      ///< (batch, heads, Nq); -inf for a query with no visible key
  Stat<T>* entropy = nullptr;  ///< (batch, heads, Nq); 0 for a query with no visible key
  Stat<T>* weights = nullptr;  ///< (batch, heads, Nq, tokens); needs the Nq x N matrix
};

/// How an operation runs.
struct ExecutionOptions {
  Device device = Device::automatic;
  /// CPU threads (OpenMP). 0 chooses: all available, except that calls under about 4 MFLOP
  /// run on one thread, where starting a team would cost more than it saves. At most
  /// max_threads() (types.hpp, 4 per core): more is refused (invalid_argument) by every call.
  int threads = 0;
  /// The products' precision (docs/MATH.md §7). fp32 (the default) means "as the storage type
  /// computes": float32 for float, double for double, float32 accumulation for the 16-bit types.
  /// Otherwise it must name the storage type (bf16 for bfloat16, fp16 for float16), or tf32 for
  /// float input. tf32 is a permission (as PyTorch's allow_tf32): Device::cpu and
  /// Device::reference compute float products in fp32, which meets the TF32 accuracy rule, and
  /// return their fp32 result; on Device::cuda attend and attend_factored run the TF32
  /// tensor-core paths (operands rounded to TF32, float32 accumulation) where those compute what
  /// is asked (no weights, dim or rank <= 256), and float32 products elsewhere; attend_partial
  /// and the distributed ring take it too (their kernels compute float32 products). Other pairs
  /// are invalid_argument. Route::products (capability.hpp) says what a call's products run in.
  Precision precision = Precision::fp32;
};

/// Checks shapes, sizes, pointers, beta, the mask, the key lengths and that no output overlaps
/// an input or another output; throws emflow::Error (ErrorCode::invalid_argument) naming the
/// first offending argument. attend() calls it first.
template <class T>
void validate(const AttentionInput<T>& input, const AttentionOutput<T>& output,
              const char* operation = "attend");

/// Computes the contextual update on host arrays and returns when the outputs are written, on
/// the device and with the kernel that route() (capability.hpp) names for the call; a call that
/// no device computes throws ErrorCode::unsupported with route()'s reason.
/// float inputs are computed in float32 by cpu/cuda backends (accumulation in float, softmax
/// in float with a running max) and in double by Device::reference; double inputs are computed
/// in double on the CPU. Device::cuda copies to and from the GPU and synchronises its own stream.
/// float inputs holding a NaN or infinity (in the cloud, the queries or the operators) run on
/// Device::cpu in the double reference, which puts NaN where docs/MATH.md §6.6 says.
/// bfloat16 and float16 inputs: Device::cpu widens them exactly to float and computes in float32,
/// except bfloat16 self-attention without weights on a processor with AVX512-BF16, whose products
/// take bfloat16 operands with float32 accumulation (docs/MATH.md §7); Device::reference widens
/// them to double; both round the update to T. Device::cuda runs them on the tensor cores
/// (cuda::attend_async, cuda.hpp; dim <= 256, no weights); Device::automatic picks it
/// when a device exists and the call fits it, else the CPU.
/// Throws emflow::Error on invalid input or backend failure; outputs are then unspecified.
template <class T>
void attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
            const ExecutionOptions& options = {});

/// Resolves Device::automatic to Device::cuda or Device::cpu for this process (this_machine(),
/// capability.hpp: cuda when a device is usable); checks that a requested cuda device exists
/// (throws ErrorCode::unsupported with the reason otherwise). Where one call runs is route()'s
/// answer, which also weighs what the device's kernels compute.
Device resolve_device(Device requested);

extern template void validate<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                     const char*);
extern template void validate<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                      const char*);
extern template void attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                   const ExecutionOptions&);
extern template void attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                    const ExecutionOptions&);
extern template void validate<bfloat16>(const AttentionInput<bfloat16>&,
                                        const AttentionOutput<bfloat16>&, const char*);
extern template void validate<float16>(const AttentionInput<float16>&,
                                       const AttentionOutput<float16>&, const char*);
extern template void attend<bfloat16>(const AttentionInput<bfloat16>&,
                                      const AttentionOutput<bfloat16>&, const ExecutionOptions&);
extern template void attend<float16>(const AttentionInput<float16>&,
                                     const AttentionOutput<float16>&, const ExecutionOptions&);

}  // namespace emflow

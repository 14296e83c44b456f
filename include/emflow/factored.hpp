// emflow: the factored form of an attention layer (docs/MATH.md §2), which is what QKV
// attention is. Per head h, with rank r:
//
//   M_h = A_h^T B_h    A_h, B_h in R^{r x d}                (relevance)
//   F_h = U_h V_h      U_h in R^{d x r}, V_h in R^{r x d}   (content)
//
// so that query i scores key j and token j contributes
//
//   s_ij = beta (<A_h x_i, B_h x_j> + u_h^T x_j)      F_h x_j = U_h (V_h x_j)
//
// The update is the one of emflow::attend with these M_h and F_h. Computed in this form, the
// scores cost 2 N^2 r instead of 2 N^2 d and the content 2 N^2 r instead of 2 N^2 d, so with
// r << d the factored form is the fast path: queries A_h x_i and keys B_h x_j meet in R^r, and
// the weighted average of the V_h x_j is mapped back to E by U_h once per query.
//
// Rotary positions (docs/MATH.md §2.4, FactoredLayer::rotary): the projected query and key are
// rotated by their sequence positions p_i, p_j before they meet,
//
//   s_ij = beta (<R(p_i) A_h x_i, R(p_j) B_h x_j> + u_h^T x_j)
//        = beta (x_i^T A_h^T R(p_j - p_i) B_h x_j + u_h^T x_j)
//
// still a bilinear form, M_h(p_j - p_i) = A_h^T R(p_j - p_i) B_h, but one per offset: a rotary
// layer has no single M_h and is computed in the factored form only (O(r) more work per token).
// Grouped-query heads (FactoredLayer::kv_heads): B and V hold kv_heads heads, and query head h
// reads kv head h / (heads / kv_heads), as transformers' repeat_kv groups them.
// Both also hold in the partial states of a factored layer (partial.hpp) and in its decode cache
// (decode.hpp), on the host: each key rotated at its position (the cache's once, when appended),
// and only kv_heads projected keys and values held. On Device::cuda the update of such a layer
// runs on the tensor cores (bfloat16, float16, float with Precision::tf32) or, for float with
// Precision::fp32 and rank <= 128, on the SDPA operator's float32 kernel after float32
// projections; never expanded (docs/CUDA.md).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "emflow/attention.hpp"

namespace emflow {

/// Which coordinates of a head's r a rotary embedding rotates together (Rotary::pairing), with
/// rot = Rotary::dim and t < rot / 2 the frequency index.
enum class RotaryPairing {
  half_split,   ///< (t, t + rot/2): Hugging Face's rotate_half (Llama, Qwen2, Mistral, GPT-NeoX)
  interleaved,  ///< (2t, 2t + 1): GPT-J's rotate_every_two
};

/// The frequency scaling of a rotary embedding (Rotary::scaling), as the rope_type of a
/// transformers config names it (docs/MATH.md §2.4 has the formulas).
enum class RotaryScaling {
  none,         ///< "default": inv_freq_t = base^(-2t/rot)
  linear,       ///< "linear": inv_freq_t / factor
  dynamic_ntk,  ///< "dynamic": the base grows with the call's longest sequence
  llama3,       ///< "llama3": long wavelengths divided by factor, a smooth band between
};

/// A rotary position embedding of a factored layer. dim 0 (the default) means none. The rotation
/// acts on the first `dim` coordinates of every head's projected query A_h x_i and key B_h x_j
/// (the rest unrotated, as a partial rotary factor leaves them); the key bias u_h is not rotated.
///
/// Positions: key j of cloud b at key_position + j and query i at its mask position (the
/// query_origin of AttentionInput: query_position, query_positions[b] or the bottom-right
/// alignment), the positions the masks use; key_positions and query_positions replace them for
/// the rotation only (the masks keep theirs), as a model's position_ids do.
struct Rotary {
  std::int64_t dim = 0;   ///< rotated coordinates: 0 (none), or even and <= rank
  double base = 10000.0;  ///< theta > 1, finite (rope_theta)
  RotaryPairing pairing = RotaryPairing::half_split;
  RotaryScaling scaling = RotaryScaling::none;
  double factor = 1.0;            ///< linear, dynamic_ntk, llama3: >= 1
  double low_freq_factor = 1.0;   ///< llama3: > 0
  double high_freq_factor = 4.0;  ///< llama3: > low_freq_factor
  /// dynamic_ntk, llama3: the context the model was trained for (>= 1): dynamic_ntk's
  /// max_position_embeddings, llama3's original_max_position_embeddings.
  std::int64_t original_max_positions = 0;
  /// Optional: the dim / 2 inverse frequencies themselves (finite), replacing base and scaling
  /// (which must be none): a converter passes exactly the values a framework used (transformers
  /// computes inv_freq in float32). Host memory.
  const double* inverse_frequencies = nullptr;
  /// Optional rotary positions of the keys, (batch, tokens), and of the queries, (batch, Nq),
  /// within +-2^60. Host memory.
  const std::int64_t* key_positions = nullptr;
  const std::int64_t* query_positions = nullptr;
};

/// The dim / 2 inverse frequencies of `rotary` (its explicit ones, or those of base and scaling,
/// in double) for a call whose longest sequence is `sequence_length` positions (1 + the largest
/// rotary position it rotates by; only dynamic_ntk reads it). Throws emflow::Error
/// (invalid_argument) naming a bad field.
std::vector<double> rotary_inverse_frequencies(const Rotary& rotary, std::int64_t sequence_length);

/// How the relevance of one rotary head turns with the distance between query and key
/// (docs/MATH.md §2.4). With A (rank x width) the head's query factor and B (rank x width) its
/// key factor, a key t positions before its query is scored by the bilinear form
///   M(t) = A^T R(-t) B   (width x width; M(0) = A^T B, the position-free form),
/// and for each offset t of `offsets`:
///   relative_change = ||M(t) - M(0)||_F / ||M(0)||_F,   cosine = <M(t), M(0)>_F / (||M(t)||
///   ||M(0)||)
/// (both 0 where M(0) = 0). A content head keeps cosine near 1 at every offset; a positional
/// head's cosine falls within a few positions. Computed in rank x rank (Gram matrices of A and B,
/// rotated), never forming M(t). `rotary` names dim, base, pairing, scaling (its positions are not
/// read; dynamic_ntk's frequencies are those of a sequence of 1 + the largest offset).
struct RotaryDrift {
  std::vector<std::int64_t> offsets;
  std::vector<double> relative_change;
  std::vector<double> cosine;
};
/// Throws emflow::Error (invalid_argument) naming a bad argument: null factors, rank or width
/// below 1, a rotary embedding that attend_factored would refuse for `rank`, an offset below 0.
RotaryDrift rotary_drift(const double* query_factor, const double* key_factor, std::int64_t rank,
                         std::int64_t width, const Rotary& rotary,
                         const std::vector<std::int64_t>& offsets);

/// "half_split", "interleaved".
const char* to_string(RotaryPairing pairing) noexcept;
/// "default", "linear", "dynamic", "llama3": the rope_type names of transformers.
const char* to_string(RotaryScaling scaling) noexcept;
/// The scaling named by a config's rope_type ("default", "linear", "dynamic", "llama3"; "none"
/// is taken for "default"); throws emflow::Error (unsupported) naming any other name, e.g. "yarn".
RotaryScaling rotary_scaling_from_string(std::string_view name);
/// The pairing named "half_split" or "interleaved"; throws emflow::Error (invalid_argument).
RotaryPairing rotary_pairing_from_string(std::string_view name);

/// The operators of one layer in factored form. All arrays row-major, heads one after another.
/// With kv_heads = K < heads, B and V hold K heads and query head h reads kv head
/// h / (heads / K): M_h = A_h^T B_{h / (heads / K)}, F_h = U_h V_{h / (heads / K)}.
template <class T>
struct FactoredLayer {
  std::int64_t heads = 1;
  std::int64_t rank = 1;            ///< r >= 1
  const T* query_factor = nullptr;  ///< A: (heads, rank, dim). Required.
  const T* key_factor = nullptr;    ///< B: (kv_heads, rank, dim), M_h = A_h^T B_h. Required.
  const T* content_up = nullptr;    ///< U: (heads, dim, rank). Required.
  const T* content_down = nullptr;  ///< V: (kv_heads, rank, dim), F_h = U_h V_h. Required.
  const T* key_bias = nullptr;      ///< u: (heads, dim), adds u_h^T x_j to every score. Optional.
  const T* offset = nullptr;        ///< c: (dim), added to every visible query's update. Optional.
  /// The heads of B and V (grouped-query attention; 1: multi-query): 0 means heads, otherwise
  /// it must divide heads.
  std::int64_t kv_heads = 0;
  /// Rotary positions of the queries and keys (dim 0: none).
  Rotary rotary{};

  /// kv_heads, 0 resolved to heads.
  constexpr std::int64_t key_heads() const noexcept { return kv_heads == 0 ? heads : kv_heads; }
};

/// The contextual update of `layer` on the clouds of `input`, with the same meaning, outputs and
/// rules as emflow::attend (attention.hpp). The operators come from `layer` only: input.layer
/// must be left empty (null pointers).
///
/// Where it runs is route()'s answer (capability.hpp) for the call, as for every entry point.
/// Device::cpu (and automatic without a GPU) computes float inputs in float32 in the factored
/// form, at the lower cost; double inputs, and float inputs holding a non-finite value (in the
/// clouds or the factors), are expanded to dense M_h, F_h and computed by the double reference.
/// Device::reference expands to dense M_h, F_h in double and runs the reference.
/// A rotary layer is never expanded (it has no single M_h): on Device::cpu float computes in
/// the engine in rank r, rotating each projected query and key once, and double (or non-finite
/// input) in the double reference of the factored form, which rotates in double; so does
/// Device::reference. Grouped kv heads run on the same paths (the engine projects each key and
/// value once per kv head and shares it across the group; the expansion repeats B and V).
/// On Device::cuda both run on the tensor cores (bfloat16 and float16 storage, float with
/// Precision::tf32): each projected query and key is turned at its position in float32 before
/// it is rounded (the angles in double), and query head h reads kv head h / (heads / kv_heads).
/// The positions there are the ones the mask gives the rows (key_position + j, the queries'
/// first position + i): explicit Rotary::key_positions / query_positions (host memory) are
/// refused, as are the float32 and float64 paths (which expand the layer) and the dynamic
/// scaling without explicit inverse_frequencies; automatic then runs on the CPU. Device::cuda
/// without the tensor cores (below) expands to dense operators in T and runs the GPU's dense
/// kernels (fused or unfused, as attend would).
/// bfloat16 and float16 (docs/MATH.md §7): the inputs are widened exactly to float and the float
/// path above runs (Device::cpu), or to double and the reference runs (Device::reference); the
/// update is rounded to T, lse, entropy and weights are float32. Device::cuda (and automatic when
/// a device is usable, weights are not asked for and rank <= 256) runs
/// cuda::attend_factored_async (cuda.hpp) on the tensor cores, which refuses weights; without a
/// device Device::cuda is ErrorCode::unsupported. float input with ExecutionOptions::precision
/// tf32 on Device::cuda (or automatic with a device) runs the same path with TF32 products
/// where it computes what is asked (no weights, rank <= 256), float32 products elsewhere; on the
/// host devices tf32 computes fp32 (attention.hpp).
/// Throws emflow::Error (invalid_argument) naming the first offending argument.
template <class T>
void attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                     const AttentionOutput<T>& output, const ExecutionOptions& options = {});

extern template void attend_factored<float>(const AttentionInput<float>&,
                                            const FactoredLayer<float>&,
                                            const AttentionOutput<float>&, const ExecutionOptions&);
extern template void attend_factored<double>(const AttentionInput<double>&,
                                             const FactoredLayer<double>&,
                                             const AttentionOutput<double>&,
                                             const ExecutionOptions&);
extern template void attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                               const FactoredLayer<bfloat16>&,
                                               const AttentionOutput<bfloat16>&,
                                               const ExecutionOptions&);
extern template void attend_factored<float16>(const AttentionInput<float16>&,
                                              const FactoredLayer<float16>&,
                                              const AttentionOutput<float16>&,
                                              const ExecutionOptions&);

}  // namespace emflow

// emflow::model: pretrained transformers as EMF operators (docs/MODELS.md).
//
// load_checkpoint reads a model folder (config.json and model.safetensors), finds the layers by
// the naming pattern of a known layout, and turns each layer's attention into the exact EMF
// operators of docs/MATH.md §3 (M_h, F_h, u_h, c, computed in double by emflow::to_emf), keeping
// the factored Q/K/V/O weights, the layer norms and the feed-forward block beside them:
//
//   bert  post-norm: h = LN_1(x + Attn(x)),        x' = LN_2(h + FFN(h))
//         names  [bert.|roberta.]encoder.layer.N.attention.self.{query,key,value}, ...
//   gpt2  pre-norm:  h = x + Attn(LN_1(x)),        x' = h + FFN(LN_2(h)),  ln_f after the last
//         names  [transformer.]h.N.attn.c_attn (fused Q, K, V), Conv1D weights stored (in, out)
//   llama pre-norm:  h = x + Attn(RMS_1(x)),       x' = h + down(silu(gate(g)) * up(g)),
//         g = RMS_2(h); rotary positions, kv_heads grouped key/value heads, no biases, a final
//         RMSNorm and the unembedding (tied to the embedding or not) after the last layer
//         names  model.layers.N.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj (safetensors,
//         model_type "llama", "mistral" with its sliding window, "qwen2" with biases on q, k
//         and v) or blk.N.attn_q, ... (GGUF, general.architecture "llama")
//
// A llama layer's relevance depends on the offset of the two positions (docs/MATH.md §2.4): it
// has no single M_h, so its Model holds no dense operators and runs in the factored form only.
// A layout it does not recognise is an error listing what the file holds; any other model whose
// attention depends on position (rotary forms other than llama's, relative position
// embeddings) is refused with the reason.
//
// write_operators writes the converted model as an operator folder (one .npy per operator and
// manifest.json) all or nothing; read_operators reads it back; run_model runs its layers on a
// batch of token clouds through emflow::attend; generate_greedy decodes a llama model greedily
// token by token with one decode cache per layer.
//
// Errors are emflow::Error: ErrorCode::io for unreadable or malformed files (naming the file
// and the tensor), ErrorCode::unsupported for a model this conversion cannot represent,
// ErrorCode::invalid_argument for bad arguments.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"
#include "emflow/flow.hpp"
#include "emflow/mha.hpp"
#include "emflow/reference.hpp"
#include "emflow/tensor.hpp"

namespace emflow::model {

enum class Layout { bert, gpt2, llama };
/// The feed-forward activation.
enum class Activation {
  gelu,       ///< exact: x/2 (1 + erf(x / sqrt 2))  (BERT's "gelu")
  gelu_tanh,  ///< x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (GPT-2's "gelu_new")
  relu,
  silu,  ///< x / (1 + exp(-x)), gated: silu(gate x) * (up x)  (llama's "silu")
};
// A llama layer's feed-forward block is gated by its activation: act(gate x) * (up x), silu
// (SwiGLU) or, where the config's hidden_act names gelu, gelu_new or gelu_pytorch_tanh, a
// gelu-gated block (GeGLU); the formulas below write silu, the default.
const char* to_string(Layout layout) noexcept;
const char* to_string(Activation activation) noexcept;

/// One transformer layer. Weights as torch.nn.Linear stores them: (out, in).
///
/// llama: attention.query (H*d_k, d), attention.key and attention.value (K*d_k, d) with K the
/// model's kv_heads, attention.output (d, H*d_k), no biases (empty tensors) but Qwen2's
/// query_bias (H*d_k), key_bias and value_bias (K*d_k), which run_model applies by lifting the
/// cloud to d + 1 coordinates (the last one 1) for the factored layer; `operators` is empty
/// (a rotary layer has no single M_h); norm1_gain and norm2_gain are the RMSNorm gains (the
/// biases empty); ffn_gate, ffn_in and ffn_out are gate_proj, up_proj and down_proj (no biases).
struct ModelLayer {
  MultiHeadAttentionWeights attention;    ///< the factored form
  reference::Layer operators;             ///< M (H, d, d), F (H, d, d), u (H, d), c (d)
  Tensor<double> norm1_gain, norm1_bias;  ///< bert: after attention; gpt2, llama: before it
  Tensor<double> ffn_gate;                ///< llama: (I, d), the gate of silu(gate x) * (up x)
  Tensor<double> ffn_in, ffn_in_bias;     ///< (I, d), (I)
  Tensor<double> ffn_out, ffn_out_bias;   ///< (d, I), (d)
  Tensor<double> norm2_gain, norm2_bias;  ///< bert: after the FFN; gpt2, llama: before it
  /// Where each part came from: role ("query.weight", ...) -> tensor name in the checkpoint.
  std::map<std::string, std::string> sources;
};

/// A converted model.
struct Model {
  Layout layout = Layout::bert;
  std::int64_t heads = 1, dim = 0, head_dim = 0, ffn_dim = 0;
  double norm_eps = 1e-5;
  bool pre_norm = false;
  bool causal = false;
  Activation activation = Activation::gelu;
  std::vector<ModelLayer> layers;
  Tensor<double> final_gain, final_bias;       ///< gpt2: ln_f; llama: the final RMSNorm's gain
  std::string source_file;                     ///< the safetensors or GGUF file
  std::string config_file;                     ///< config.json (the GGUF file for GGUF)
  std::string model_type;                      ///< config's model_type (GGUF: its architecture)
  std::map<std::string, std::string> sources;  ///< model-wide parts (gpt2: final_norm.*)

  // llama only (empty or 0 for bert and gpt2):
  /// The key/value heads K (dividing heads): query head h reads kv head h / (heads / K).
  std::int64_t kv_heads = 0;
  /// The rotary embedding of every layer (dim, base, pairing, scaling; its pointers null: a
  /// call takes rotary_embedding()).
  Rotary rotary{};
  /// The rotary embedding's rotary.dim / 2 inverse frequencies where the source lists them per
  /// frequency (a GGUF file's rope_freqs.weight, llama3's scaling as llama.cpp stores it:
  /// base^(-2i / dim) / factor_i); rotary.scaling is then none. Empty: base and scaling give them.
  std::vector<double> rotary_frequencies;
  /// Mistral's sliding window w: query i sees keys j with i - w < j <= i; 0: causal only.
  std::int64_t sliding_window = 0;
  Tensor<double> embedding;    ///< (vocab, d): token id t is row t (the cloud entering layer 0)
  Tensor<double> unembedding;  ///< (vocab, d), or empty when tied to the embedding
  /// The vocabulary (token strings as stored, id i is element i) and its tokenizer's name
  /// (GGUF's tokenizer.ggml.model, e.g. "gpt2"), where the source has them; else empty.
  std::vector<std::string> vocabulary;
  std::string tokenizer_model;

  std::int64_t layer_count() const noexcept { return static_cast<std::int64_t>(layers.size()); }
  /// kv_heads, 0 resolved to heads.
  std::int64_t key_heads() const noexcept { return kv_heads == 0 ? heads : kv_heads; }
  /// The Rotary a layer call takes: `rotary`, reading rotary_frequencies where there are any
  /// (valid while this model lives and rotary_frequencies is unchanged; positions null).
  Rotary rotary_embedding() const noexcept {
    Rotary r = rotary;
    r.inverse_frequencies = rotary_frequencies.empty() ? nullptr : rotary_frequencies.data();
    return r;
  }
  /// The rows of the unembedding (the vocabulary size); 0 for a model without one.
  std::int64_t vocab_size() const noexcept {
    return embedding.rank() == 2 ? embedding.extent(0) : 0;
  }
  /// The unembedding matrix: its own, or the embedding when tied.
  const Tensor<double>& output_matrix() const noexcept {
    return unembedding.size() > 0 ? unembedding : embedding;
  }
};

/// What load_checkpoint may be told.
struct ConvertOptions {
  /// "" (detect from the tensor names, or "llama" from the config's model_type), "bert", "gpt2"
  /// or "llama".
  std::string layout;
  /// Tensor-name overrides: role -> pattern, "{layer}" standing for the layer index, e.g.
  /// "query.weight" -> "encoder.blocks.{layer}.q.weight". The roles of a layout are those of
  /// checkpoint_roles(layout); an unknown role is an error.
  std::map<std::string, std::string> names;
};

/// The roles of `layout`, each with its default name pattern (the prefix, e.g. "bert.", is
/// found in the file).
std::map<std::string, std::string> checkpoint_roles(Layout layout);

/// Reads `model_dir` (config.json and model.safetensors) and converts it; see the file comment.
/// A path to a regular file ending in ".gguf" is read by load_gguf (options must then be empty).
Model load_checkpoint(const std::string& model_dir, const ConvertOptions& options = {});

/// Reads a GGUF file of general.architecture "llama" (emflow::gguf::File; its tensors
/// dequantized to float32 exactly, then held in double). The config comes from the metadata:
/// llama.block_count, embedding_length, feed_forward_length, attention.head_count,
/// attention.head_count_kv (absent: head_count), attention.layer_norm_rms_epsilon,
/// rope.freq_base (absent: 10000), rope.dimension_count (absent: the head size) and
/// rope.scaling.type / rope.scaling.factor (none or linear; any other scaling is refused by
/// name), a rope_freqs.weight tensor (rotary.dim / 2 positive factors, llama3's scaling as
/// llama.cpp stores it: frequency i is base^(-2i / dim) / factor_i, times the linear scaling's
/// 1 / factor where both are given; Model::rotary_frequencies) and attention.sliding_window
/// (llama; qwen2's is refused). llama.cpp's converter
/// permutes the rows of attn_q and attn_k per head for its interleaved rotary; they are permuted
/// back, so that the model holds transformers' layout and the half-split pairing. The vocabulary is
/// kept. Errors name the file and the key or tensor (ErrorCode::io), or what is not supported
/// (ErrorCode::unsupported).
Model load_gguf(const std::string& path);

/// The element type of the files of an operator folder.
enum class StorageType {
  automatic,  ///< float64 for bert and gpt2 (their M_h, F_h are computed in double), float32
              ///< for llama (a GGUF's weights are float32 values: exact; a 135M-parameter
              ///< model in float64 is 1 GB)
  float32,    ///< rounds what is not a float32 value
  float64,
};

/// Writes `model` to the folder `ops_dir` (which must not exist, or be an earlier operator
/// folder, replaced): the files are written to a temporary folder beside it that is renamed into
/// place at the end, so a failure leaves no `ops_dir` behind (or the earlier one as it was).
/// extra_files: more files for the folder (name -> contents), e.g. a report; the manifest lists
/// them. Runs check_operators_target first. storage: the files' element type (the manifest
/// records it; read_operators reads either into double).
void write_operators(const Model& model, const std::string& ops_dir,
                     const std::map<std::string, std::string>& extra_files = {},
                     StorageType storage = StorageType::automatic);

/// The checks write_operators makes of its target, to be made before the work of a conversion:
/// `ops_dir` (trailing slashes ignored; a symbolic link to a folder stands for that folder) must
/// lie in an existing folder and either not exist or be an earlier operator folder that holds
/// nothing but the files its manifest lists (anything else would be lost when it is replaced).
/// A dangling link, a file, a folder that is not an operator folder or one with other files in
/// it are refused (ErrorCode::invalid_argument) naming the entry. Also removes the staging
/// folders that killed conversions into `ops_dir` left beside it (their process gone), putting
/// back an earlier folder that such a conversion had moved aside.
void check_operators_target(const std::string& ops_dir);

/// The files of the operator folder `ops_dir` that read_operators reads: manifest.json and every
/// file its manifest lists (paths inside `ops_dir`). Reads only the manifest (just manifest.json
/// when it cannot be read): what a command declares as its inputs, before reading the model.
std::vector<std::string> operator_files(const std::string& ops_dir);

/// Reads an operator folder written by write_operators. Every field of the manifest is checked
/// (a field of the wrong type is named with its value; norm_eps must be finite and > 0).
Model read_operators(const std::string& ops_dir);

/// A run of a model's layers.
struct RunSettings {
  bool full_layer = true;  ///< false: attention and norm only (the EMF flow, no feed-forward)
  /// true: the attention in the factored form (emflow::attend_factored with A_h = W_Q,h /
  /// sqrt(d_k), B_h = W_K,h, U_h = W_O,h, V_h = W_V,h: the same update at rank d_k); false: with
  /// the dense operators M_h, F_h (emflow::attend). A llama model (rotary) has no dense
  /// operators: it needs true (false is refused with the reason).
  bool factored = false;
  double cluster_eps = 1e-3;
  /// llama: the rotary position of every token, (B, N) row-major; empty: 0..N-1 in every
  /// cloud. The masks stay by index (causal, the window, the key lengths): positions only turn
  /// the queries and keys, as transformers' position_ids do (a chunk of a longer sequence, a
  /// left-padded prompt). Within +-2^60; host memory, so the GPU refuses them by name. Other
  /// layouts (no rotary) refuse them.
  std::vector<std::int64_t> positions;
};

/// What run_model records.
template <class T>
struct ModelTrace {
  Tensor<T> trajectory;  ///< (L + 1, B, N, d): the input clouds, then the clouds after each layer
  Tensor<T> attention;   ///< (L, B, N, d): each layer's attention sub-layer output (Delta)
  /// (L + 1) * B, record r of cloud b at r * B + b, over each cloud's real tokens; the entropy
  /// of record r is that of layer r's attention (0 for the last record).
  std::vector<flow::Observables> observables;
};

/// Runs the layers of `model` on the clouds (B, N, d), N >= 1 and d = model.dim. key_lengths:
/// empty, or one length in [1, N] per cloud: keys j >= L_b are hidden (padding), and padding rows
/// are carried through the layers but ignored. The attention runs through emflow::attend with the
/// EMF operators in T (float or double), on options.device; the norms, residuals and the
/// feed-forward block are computed per token, accumulating in double.
///
/// llama: x <- x + Attn(RMS_1(x)) through emflow::attend_factored (the causal mask or the
/// model's sliding window, the key lengths, kv_heads and the model's rotary embedding at
/// positions 0..N-1, or settings.positions; the GPU computes rotary layers on its tensor cores
/// and in float32, not in float64 nor at explicit positions), then with full_layer x <- x +
/// down(silu(gate(g)) * up(g)), g = RMS_2(x). The last record is the cloud after the last layer,
/// before the final norm (next_token_logits applies it); gpt2's last record is after ln_f, as
/// before.
template <class T>
ModelTrace<T> run_model(const Model& model, const Tensor<T>& clouds,
                        const std::vector<std::int64_t>& key_lengths, const RunSettings& settings,
                        const ExecutionOptions& options = {});

extern template ModelTrace<float> run_model<float>(const Model&, const Tensor<float>&,
                                                   const std::vector<std::int64_t>&,
                                                   const RunSettings&, const ExecutionOptions&);
extern template ModelTrace<double> run_model<double>(const Model&, const Tensor<double>&,
                                                     const std::vector<std::int64_t>&,
                                                     const RunSettings&, const ExecutionOptions&);

/// The next-token logits of each cloud: its last real token (row L_b - 1, or N - 1 without
/// key_lengths) of `clouds` (B, N, d) (the last record of run_model's trajectory) through the
/// final norm (llama: RMSNorm with the model's eps; gpt2's ln_f is already in the trajectory)
/// and the unembedding: (B, vocab), accumulated in double. Throws emflow::Error
/// (invalid_argument) for a model without an unembedding (bert, gpt2 as converted) or bad
/// shapes.
template <class T>
Tensor<T> next_token_logits(const Model& model, const Tensor<T>& clouds,
                            const std::vector<std::int64_t>& key_lengths);

extern template Tensor<float> next_token_logits<float>(const Model&, const Tensor<float>&,
                                                       const std::vector<std::int64_t>&);
extern template Tensor<double> next_token_logits<double>(const Model&, const Tensor<double>&,
                                                         const std::vector<std::int64_t>&);

/// How generate_greedy runs.
struct GenerateSettings {
  std::int64_t new_tokens = 1;  ///< K >= 1: the tokens generated per prompt
  bool keep_logits = false;     ///< record every step's logits (Generated::logits)
  int threads = 0;              ///< CPU threads of each cache's attention (0: all), >= 0
  /// The products of the feed-forward blocks and the unembedding in a float run: fp32, or bf16
  /// (their weights stored in bfloat16, the activations rounded to bfloat16 as they enter, float32
  /// sums: as a bfloat16 model computes them, reading half the bytes; the attention, the norms
  /// and the residual stream stay float32). bf16 needs T = float and a processor with
  /// AVX512-BF16 (Machine::avx512_bf16; ErrorCode::unsupported otherwise).
  Precision products = Precision::fp32;
  /// Called after each prompt's prefill and each new token with (done, total), total =
  /// B (K + 1); empty: none.
  flow::Progress progress;
};

/// What generate_greedy returns.
template <class T>
struct Generated {
  Tensor<std::int64_t> ids;  ///< (B, K): the new tokens of each prompt, in order
  /// (B, K, vocab) with keep_logits (else empty): the logits of step k, whose argmax (the first
  /// largest) is ids[b, k]
  Tensor<T> logits;
  std::vector<double> prefill_seconds;  ///< (B): each prompt through every layer
  std::vector<double> step_seconds;     ///< (B, K): each new token (logits, argmax, layers)
};

/// Greedy decoding of a llama model (emflow::model::Layout::llama; any other layout is refused by
/// name). For each prompt b of `ids` (B, N), its first L_b = lengths[b] tokens (lengths empty:
/// N for all; right padding, whose ids are not read), in order and independently:
///
///  1. the prompt through every layer with one factored decode cache per layer (decode.hpp):
///     x <- x + Attn(RMS_1(x)) where the layer's cache appends the normalised inputs RMS_1(x)
///     (their projected keys rotated once at their positions 0.., only kv_heads sets of keys
///     and values) and attends them causally (or under the model's sliding window), then
///     x <- x + down(silu(gate(g)) * up(g)), g = RMS_2(x);
///  2. K = settings.new_tokens times: the last token's final RMSNorm and unembedding
///     (next_token_logits), the argmax as the next id, its embedding row through every layer
///     against the caches (O(L (N + k) r) attention and O(L d I) feed-forward per token; the
///     prompt is never run again).
///
/// The state is held in T (float or double); the caches compute each query in double, the norms,
/// the feed-forward block and the logits accumulate in double. The result equals running the
/// whole grown sequence through run_model (factored) and next_token_logits at every step, up to
/// the rounding of the two attention paths. Throws emflow::Error (invalid_argument) naming
/// 'model' (not llama, no layers, no embedding), 'ids' (shape, or an id of a real token outside
/// [0, vocab)), 'lengths' (count, or a length outside [1, N]), 'settings.new_tokens' (< 1) or
/// 'settings.threads'; ErrorCode::out_of_memory for logits that cannot fit; the decode cache's
/// errors (e.g. the dynamic rotary scaling, unsupported).
template <class T>
Generated<T> generate_greedy(const Model& model, const Tensor<std::int64_t>& ids,
                             const std::vector<std::int64_t>& lengths,
                             const GenerateSettings& settings);

extern template Generated<float> generate_greedy<float>(const Model&, const Tensor<std::int64_t>&,
                                                        const std::vector<std::int64_t>&,
                                                        const GenerateSettings&);
extern template Generated<double> generate_greedy<double>(const Model&, const Tensor<std::int64_t>&,
                                                          const std::vector<std::int64_t>&,
                                                          const GenerateSettings&);

}  // namespace emflow::model

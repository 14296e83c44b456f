// Reading a GGUF file (llama.cpp's format) of the llama or qwen2 architecture into a
// model::Model: the config from the metadata, every tensor dequantized by emflow::gguf::File and
// checked against the shape the config implies, llama.cpp's permutation of a llama model's query
// and key rows undone (emflow/model.hpp), and a qwen2 model's q, k and v biases.
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>

#include "core/check.hpp"
#include "emflow/gguf.hpp"
#include "emflow/model.hpp"

namespace emflow::model {
namespace {

using detail::fail;

constexpr const char* kOp = "convert";

// The metadata of `file`, read with the checks of emflow::gguf::File and those of a config.
struct Metadata {
  const gguf::File& file;
  std::string arch;

  std::string key(const std::string& name) const { return arch + "." + name; }

  // A positive integer; absent: `fallback` (0: required).
  std::int64_t count(const std::string& name, std::int64_t fallback = 0) const {
    const std::string k = key(name);
    if (!file.contains(k)) {
      if (fallback > 0) return fallback;
      fail(ErrorCode::io, kOp, ": '", file.path(), "': lacks the key '", k,
           "' (a positive integer)");
    }
    const std::int64_t value = file.get_integer(k);
    if (value < 1) {
      fail(ErrorCode::io, kOp, ": '", file.path(), "': key '", k, "' is ", value,
           ", expected a positive integer");
    }
    return value;
  }

  // A finite number > `above`; absent: `fallback` (NaN: required).
  double number(const std::string& name, double fallback, double above) const {
    const std::string k = key(name);
    if (!file.contains(k)) {
      if (!std::isnan(fallback)) return fallback;
      fail(ErrorCode::io, kOp, ": '", file.path(), "': lacks the key '", k, "' (a number)");
    }
    const double value = file.get_number(k);
    if (!std::isfinite(value) || !(value > above)) {
      fail(ErrorCode::io, kOp, ": '", file.path(), "': key '", k, "' is ", value,
           ", expected a finite number > ", above);
    }
    return value;
  }
};

// The tensors of the file by role, each checked against its shape and read into double.
struct Tensors {
  const gguf::File& file;

  Tensor<double> get(std::map<std::string, std::string>* sources, const std::string& role,
                     const std::string& name, std::int64_t layer, const Shape& shape) const {
    if (!file.has_tensor(name)) {
      fail(ErrorCode::io, kOp, ": '", file.path(), "': tensor '", name, "' is missing (", role,
           layer >= 0 ? " of layer " + std::to_string(layer) : "", ")");
    }
    const gguf::TensorInfo& info = file.tensor(name);
    if (info.shape != shape) {
      fail(ErrorCode::io, kOp, ": '", file.path(), "': tensor '", name, "' (", role, ") has shape ",
           emflow::to_string(info.shape), ", expected ", emflow::to_string(shape));
    }
    const Tensor<float> values = file.read(name);
    (*sources)[role] = name;
    return Tensor<double>(values.shape(),
                          std::vector<double>(values.values().begin(), values.values().end()));
  }
};

// llama.cpp's converter stores the rows of each head of W_Q and W_K as (d_k / 2, 2), pairs of
// the interleaved rotary, where transformers has (2, d_k / 2), its half split: GGUF row
// h d_k + 2 i + j is transformers' row h d_k + j d_k / 2 + i. This puts them back.
Tensor<double> unpermute_rows(const Tensor<double>& w, std::int64_t heads) {
  const std::int64_t rows = w.extent(0), cols = w.extent(1), k = rows / heads, half = k / 2;
  Tensor<double> out(w.shape());
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < half; ++i)
      for (std::int64_t j = 0; j < 2; ++j) {
        const double* from = w.data() + (h * k + 2 * i + j) * cols;
        std::copy(from, from + cols, out.data() + (h * k + j * half + i) * cols);
      }
  return out;
}

}  // namespace

Model load_gguf(const std::string& path) {
  const gguf::File file(path);
  const std::string arch_key = "general.architecture";
  if (!file.contains(arch_key)) {
    fail(ErrorCode::io, kOp, ": '", path, "': lacks the key '", arch_key, "'");
  }
  const std::string& arch = file.get_string(arch_key);
  if (arch != "llama" && arch != "qwen2") {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': general.architecture '", arch,
         "' is not supported (emflow converts GGUF files of the llama and qwen2 architectures)");
  }
  // llama.cpp permutes the query and key rows of a llama model for its interleaved rotary, and
  // writes a qwen2 model's as they are (its rotary pairs the halves); qwen2 has q, k, v biases.
  const bool qwen2 = arch == "qwen2";
  const Metadata meta{file, arch};
  if (file.contains(meta.key("expert_count")) && file.get_integer(meta.key("expert_count")) > 0) {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': '", meta.key("expert_count"), "' is ",
         file.get_integer(meta.key("expert_count")),
         ": mixture-of-experts feed-forward blocks are not supported");
  }
  Model model;
  model.layout = Layout::llama;
  model.model_type = arch;
  model.source_file = path;
  model.config_file = path;
  const std::int64_t layers = meta.count("block_count");
  model.dim = meta.count("embedding_length");
  model.ffn_dim = meta.count("feed_forward_length");
  model.heads = meta.count("attention.head_count");
  model.kv_heads = meta.count("attention.head_count_kv", model.heads);
  if (model.dim % model.heads != 0) {
    fail(ErrorCode::io, kOp, ": '", path, "': embedding_length ", model.dim,
         " is not a multiple of the ", model.heads, " heads");
  }
  if (model.heads % model.kv_heads != 0) {
    fail(ErrorCode::io, kOp, ": '", path, "': head_count ", model.heads,
         " is not a multiple of head_count_kv ", model.kv_heads);
  }
  model.head_dim = model.dim / model.heads;
  for (const char* name : {"attention.key_length", "attention.value_length"}) {
    if (file.contains(meta.key(name)) && meta.count(name) != model.head_dim) {
      fail(ErrorCode::unsupported, kOp, ": '", path, "': '", meta.key(name), "' is ",
           meta.count(name),
           ", but emflow reads llama heads of embedding_length / head_count = ", model.head_dim);
    }
  }
  model.norm_eps = meta.number("attention.layer_norm_rms_epsilon", NAN, 0.0);
  model.pre_norm = true;
  model.causal = true;
  model.activation = Activation::silu;
  model.rotary.dim = meta.count("rope.dimension_count", model.head_dim);
  if (model.rotary.dim % 2 != 0 || model.rotary.dim > model.head_dim) {
    fail(ErrorCode::io, kOp, ": '", path, "': '", meta.key("rope.dimension_count"), "' is ",
         model.rotary.dim, ", expected an even number <= the head size ", model.head_dim);
  }
  model.rotary.base = meta.number("rope.freq_base", 10000.0, 1.0);
  model.rotary.pairing = RotaryPairing::half_split;  // after unpermute_rows
  const std::string scaling_key = meta.key("rope.scaling.type");
  const std::string scaling = file.contains(scaling_key) ? file.get_string(scaling_key) : "none";
  if (scaling == "linear") {
    model.rotary.scaling = RotaryScaling::linear;
    model.rotary.factor = meta.number("rope.scaling.factor", NAN, 0.0);
    if (model.rotary.factor < 1.0) {
      fail(ErrorCode::io, kOp, ": '", path, "': '", meta.key("rope.scaling.factor"), "' is ",
           model.rotary.factor, ", expected >= 1");
    }
  } else if (scaling != "none") {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': rotary scaling '", scaling, "' ('",
         scaling_key, "') is not supported (none or linear)");
  }
  // A sliding window (llama.cpp's standard one, as Mistral's config.sliding_window): query i sees
  // keys j with 0 <= i - j < window, Mask::sliding_window(window); 0 is none. Qwen2's is refused,
  // as in its safetensors config (whether its layers use it is not in the file).
  const std::string window_key = meta.key("attention.sliding_window");
  if (qwen2 && file.contains(window_key)) {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': '", window_key,
         "': Qwen2's sliding window is not supported");
  }
  if (file.contains(window_key)) {
    const std::int64_t window = file.get_integer(window_key);
    if (window < 0) {
      fail(ErrorCode::io, kOp, ": '", path, "': key '", window_key, "' is ", window,
           ", expected an integer >= 0");
    }
    model.sliding_window = window;
  }

  const Tensors tensors{file};
  // llama3's scaling as llama.cpp's converter stores it: one factor per frequency, frequency i
  // turning at base^(-2i / dim) / factor_i (ggml_rope_ext's freq_factors; the linear scaling,
  // where also given, multiplies in). They become the model's explicit frequencies.
  if (file.has_tensor("rope_freqs.weight")) {
    const Tensor<double> factors = tensors.get(&model.sources, "rotary.frequency_factors",
                                               "rope_freqs.weight", -1, {model.rotary.dim / 2});
    model.rotary_frequencies = rotary_inverse_frequencies(model.rotary, 1);
    for (std::int64_t i = 0; i < factors.size(); ++i) {
      const double factor = factors.data()[i];
      if (!std::isfinite(factor) || factor <= 0.0) {
        fail(ErrorCode::io, kOp, ": '", path, "': tensor 'rope_freqs.weight' holds ", factor,
             " at ", i, ", expected finite factors > 0");
      }
      model.rotary_frequencies[static_cast<std::size_t>(i)] /= factor;
    }
    model.rotary.scaling = RotaryScaling::none;
    model.rotary.factor = 1.0;
  }
  const std::int64_t d = model.dim, I = model.ffn_dim, H = model.heads, K = model.kv_heads;
  const std::int64_t k = model.head_dim;
  if (!file.has_tensor("token_embd.weight")) {
    fail(ErrorCode::io, kOp, ": '", path, "': tensor 'token_embd.weight' is missing (embedding)");
  }
  const Shape& embd = file.tensor("token_embd.weight").shape;
  const std::int64_t vocab = embd.size() == 2 ? embd[0] : 0;
  if (vocab < 1) {
    fail(ErrorCode::io, kOp, ": '", path, "': tensor 'token_embd.weight' (embedding) has shape ",
         emflow::to_string(embd), ", expected (vocab, ", d, ")");
  }
  if (file.contains(meta.key("vocab_size")) && meta.count("vocab_size") != vocab) {
    fail(ErrorCode::io, kOp, ": '", path, "': '", meta.key("vocab_size"), "' is ",
         meta.count("vocab_size"), ", but token_embd.weight has ", vocab, " rows");
  }
  // The file must hold exactly block_count layers.
  if (file.has_tensor("blk." + std::to_string(layers) + ".attn_q.weight")) {
    fail(ErrorCode::io, kOp, ": '", path, "': holds a tensor 'blk.", layers,
         ".attn_q.weight', but '", meta.key("block_count"), "' is ", layers);
  }
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    ModelLayer layer;
    MultiHeadAttentionWeights& w = layer.attention;
    w.heads = H;
    w.model_dim = d;
    w.head_dim = w.value_dim = k;
    auto get = [&](const char* role, const char* name, const Shape& shape) {
      return tensors.get(&layer.sources, role, b + name, l, shape);
    };
    w.query = get("query.weight", "attn_q.weight", {H * k, d});
    w.key = get("key.weight", "attn_k.weight", {K * k, d});
    if (!qwen2) {
      w.query = unpermute_rows(w.query, H);
      w.key = unpermute_rows(w.key, K);
    }
    w.value = get("value.weight", "attn_v.weight", {K * k, d});
    if (qwen2) {
      w.query_bias = get("query.bias", "attn_q.bias", {H * k});
      w.key_bias = get("key.bias", "attn_k.bias", {K * k});
      w.value_bias = get("value.bias", "attn_v.bias", {K * k});
    }
    w.output = get("output.weight", "attn_output.weight", {d, H * k});
    layer.norm1_gain = get("norm1.weight", "attn_norm.weight", {d});
    layer.ffn_gate = get("ffn_gate.weight", "ffn_gate.weight", {I, d});
    layer.ffn_in = get("ffn_in.weight", "ffn_up.weight", {I, d});
    layer.ffn_out = get("ffn_out.weight", "ffn_down.weight", {d, I});
    layer.norm2_gain = get("norm2.weight", "ffn_norm.weight", {d});
    for (const char* bias : {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"}) {
      if (file.has_tensor(b + bias) && !(qwen2 && std::string(bias) != "attn_output.bias")) {
        fail(ErrorCode::unsupported, kOp, ": '", path, "': tensor '", b, bias,
             "': ", qwen2 ? "an output bias is" : "attention biases are", " not supported in the ",
             arch, " architecture");
      }
    }
    model.layers.push_back(std::move(layer));
  }
  model.final_gain =
      tensors.get(&model.sources, "final_norm.weight", "output_norm.weight", -1, {d});
  model.embedding =
      tensors.get(&model.sources, "embedding.weight", "token_embd.weight", -1, {vocab, d});
  if (file.has_tensor("output.weight")) {
    model.unembedding =
        tensors.get(&model.sources, "unembedding.weight", "output.weight", -1, {vocab, d});
  } else {
    model.sources["unembedding.weight"] = "token_embd.weight (tied)";
  }
  model.vocabulary = file.tokens();  // may be shorter than the embedding (padded rows)
  if (file.contains("tokenizer.ggml.model")) {
    model.tokenizer_model = file.get_string("tokenizer.ggml.model");
  }
  return model;
}

}  // namespace emflow::model

// Reading a pretrained checkpoint (config.json and model.safetensors) into a model::Model: the
// layout found by its tensor names, every tensor checked against the shape the config implies,
// the attention converted to EMF operators by emflow::to_emf (docs/MATH.md §3).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/check.hpp"
#include "emflow/model.hpp"
#include "emflow/safetensors.hpp"

namespace emflow::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::fail;

constexpr const char* kOp = "convert";

json read_config(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    fail(ErrorCode::io, kOp, ": '", path, "': is a folder, expected the JSON file config.json");
  }
  std::ifstream in(path);
  if (!in) fail(ErrorCode::io, kOp, ": '", path, "': cannot open (a model folder has config.json)");
  try {
    json config = json::parse(in);
    if (!config.is_object()) fail(ErrorCode::io, kOp, ": '", path, "': not a JSON object");
    return config;
  } catch (const json::exception& e) {
    fail(ErrorCode::io, kOp, ": '", path, "': malformed JSON: ", e.what());
  }
}

// A config value of the wrong type is named with its key, its value and what was expected, never
// left to the JSON library's "type must be string, but is number".
[[noreturn]] void fail_config(const std::string& path, const char* key, const json& value,
                              const char* expected) {
  fail(ErrorCode::io, kOp, ": '", path, "': '", key, "' is ", value.dump(), " (", value.type_name(),
       "), expected ", expected);
}

bool present(const json& config, const char* key) {
  return config.contains(key) && !config[key].is_null();
}

std::string config_string(const json& config, const std::string& path, const char* key,
                          const std::string& fallback) {
  if (!present(config, key)) return fallback;
  if (!config[key].is_string()) fail_config(path, key, config[key], "a string");
  return config[key].get<std::string>();
}

bool config_bool(const json& config, const std::string& path, const char* key, bool fallback) {
  if (!present(config, key)) return fallback;
  if (!config[key].is_boolean()) fail_config(path, key, config[key], "true or false");
  return config[key].get<bool>();
}

// A layer norm's epsilon: finite and > 0 (a negative one makes the variance negative and every
// output NaN).
double config_eps(const json& config, const std::string& path, const char* key, double fallback) {
  if (!present(config, key)) return fallback;
  const json& value = config[key];
  if (!value.is_number() || !std::isfinite(value.get<double>()) || !(value.get<double>() > 0.0)) {
    fail_config(path, key, value, "a finite number > 0");
  }
  return value.get<double>();
}

// A model whose scores depend on the tokens' positions has no relevance form x_i^T M x_j.
void refuse_position_dependent(const json& config, const std::string& path) {
  static const char* const kRotaryKeys[] = {"rope_theta",           "rope_scaling", "rotary_dim",
                                            "rotary_emb_base",      "rotary_pct",   "rope_type",
                                            "partial_rotary_factor"};
  static const char* const kRotaryModels[] = {
      "llama",  "mistral", "mixtral", "gpt_neox", "gptj",   "qwen2",    "qwen3", "gemma",
      "gemma2", "gemma3",  "phi",     "phi3",     "falcon", "roformer", "olmo",  "stablelm"};
  const std::string reason =
      ": the attention scores then depend on the tokens' positions, not on x_i^T M_h x_j alone, "
      "so the model has no EMF relevance operator (of the rotary models only model_type 'llama' is "
      "converted, in the factored form)";
  for (const char* key : kRotaryKeys) {
    if (config.contains(key) && !config[key].is_null()) {
      fail(ErrorCode::unsupported, kOp, ": '", path,
           "': the model uses rotary position "
           "embeddings ('",
           key, "' = ", config[key].dump(), ")", reason);
    }
  }
  const std::string type = config_string(config, path, "model_type", "");
  for (const char* rotary : kRotaryModels) {
    if (type == rotary) {
      fail(ErrorCode::unsupported, kOp, ": '", path, "': model_type '", type,
           "' uses rotary position embeddings", reason);
    }
  }
  if (present(config, "position_embedding_type")) {
    const std::string kind = config_string(config, path, "position_embedding_type", "");
    if (kind != "absolute") {
      fail(ErrorCode::unsupported, kOp, ": '", path, "': position_embedding_type '", kind,
           "' (only absolute position embeddings, added before the first layer, are supported)",
           reason);
    }
  }
}

// The first of `keys` present: a positive integer (an integer-valued float such as 12.0 is not
// one, nor is "12").
std::int64_t config_int(const json& config, const std::string& path,
                        std::initializer_list<const char*> keys) {
  for (const char* key : keys) {
    if (!present(config, key)) continue;
    const json& value = config[key];
    if (!value.is_number_integer() || value.get<long long>() < 1) {
      fail_config(path, key, value, "a positive integer");
    }
    return value.get<std::int64_t>();
  }
  fail(ErrorCode::io, kOp, ": '", path, "': lacks a positive integer '", *keys.begin(), "'");
}

Activation parse_activation(const std::string& name, const std::string& path) {
  if (name == "gelu") return Activation::gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return Activation::gelu_tanh;
  if (name == "relu") return Activation::relu;
  fail(ErrorCode::unsupported, kOp, ": '", path, "': activation '", name,
       "' is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)");
}

std::string substitute(const std::string& pattern, std::int64_t layer) {
  std::string name = pattern;
  const std::string key = "{layer}";
  for (auto at = name.find(key); at != std::string::npos; at = name.find(key))
    name.replace(at, key.size(), std::to_string(layer));
  return name;
}

// The names of the file with every run of digits replaced by N: what a layout would match.
std::string found_names(const SafetensorsFile& file) {
  std::set<std::string> kinds;
  for (const std::string& name : file.names()) {
    std::string k;
    for (std::size_t i = 0; i < name.size(); ++i) {
      if (std::isdigit(static_cast<unsigned char>(name[i]))) {
        k += 'N';
        while (i + 1 < name.size() && std::isdigit(static_cast<unsigned char>(name[i + 1]))) ++i;
      } else {
        k += name[i];
      }
    }
    kinds.insert(k);
  }
  std::ostringstream out;
  int shown = 0;
  for (const std::string& k : kinds) {
    if (shown++ == 24) {
      out << ", ... (" << kinds.size() << " patterns)";
      break;
    }
    out << (shown > 1 ? ", " : "") << k;
  }
  return out.str();
}

// The tensor of `role` in layer `layer` (or -1 for none), checked against `shape`.
struct Reader {
  const SafetensorsFile& file;
  std::map<std::string, std::string> patterns;  // role -> full pattern (prefix included)

  Tensor<double> get(std::map<std::string, std::string>* sources, const std::string& role,
                     std::int64_t layer, const Shape& shape) const {
    const std::string name = substitute(patterns.at(role), layer);
    if (!file.contains(name)) {
      fail(ErrorCode::io, "read_safetensors: '", file.path(), "': tensor '", name, "' is missing (",
           role, layer >= 0 ? " of layer " + std::to_string(layer) : "", ")");
    }
    const TensorEntry& entry = file.entry(name);
    if (entry.shape != shape) {
      fail(ErrorCode::io, "read_safetensors: '", file.path(), "': tensor '", name, "' (", role,
           ") has shape ", emflow::to_string(entry.shape), ", expected ", emflow::to_string(shape));
    }
    (*sources)[role] = name;
    return file.read<double>(name);
  }
};

Tensor<double> transposed(const Tensor<double>& a) {
  const std::int64_t rows = a.extent(0), cols = a.extent(1);
  Tensor<double> t(Shape{cols, rows});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// Columns [first, first + count) of a (rows, cols) matrix, transposed: (count, rows).
Tensor<double> column_block_transposed(const Tensor<double>& a, std::int64_t first,
                                       std::int64_t count) {
  const std::int64_t rows = a.extent(0), cols = a.extent(1);
  Tensor<double> t(Shape{count, rows});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < count; ++c) t[c * rows + r] = a[r * cols + first + c];
  return t;
}

Tensor<double> slice(const Tensor<double>& v, std::int64_t first, std::int64_t count) {
  return Tensor<double>(Shape{count}, std::vector<double>(v.values().begin() + first,
                                                          v.values().begin() + first + count));
}

}  // namespace

const char* to_string(Layout layout) noexcept {
  switch (layout) {
    case Layout::gpt2:
      return "gpt2";
    case Layout::llama:
      return "llama";
    case Layout::bert:
      break;
  }
  return "bert";
}

const char* to_string(Activation activation) noexcept {
  switch (activation) {
    case Activation::gelu_tanh:
      return "gelu_tanh";
    case Activation::relu:
      return "relu";
    case Activation::silu:
      return "silu";
    case Activation::gelu:
      break;
  }
  return "gelu";
}

std::map<std::string, std::string> checkpoint_roles(Layout layout) {
  if (layout == Layout::llama) {
    const std::string l = "model.layers.{layer}.";
    return {{"query.weight", l + "self_attn.q_proj.weight"},
            {"query.bias", l + "self_attn.q_proj.bias"},
            {"key.bias", l + "self_attn.k_proj.bias"},
            {"value.bias", l + "self_attn.v_proj.bias"},
            {"key.weight", l + "self_attn.k_proj.weight"},
            {"value.weight", l + "self_attn.v_proj.weight"},
            {"output.weight", l + "self_attn.o_proj.weight"},
            {"norm1.weight", l + "input_layernorm.weight"},
            {"ffn_gate.weight", l + "mlp.gate_proj.weight"},
            {"ffn_in.weight", l + "mlp.up_proj.weight"},
            {"ffn_out.weight", l + "mlp.down_proj.weight"},
            {"norm2.weight", l + "post_attention_layernorm.weight"},
            {"final_norm.weight", "model.norm.weight"},
            {"embedding.weight", "model.embed_tokens.weight"},
            {"unembedding.weight", "lm_head.weight"}};
  }
  if (layout == Layout::bert) {
    const std::string l = "encoder.layer.{layer}.";
    return {{"query.weight", l + "attention.self.query.weight"},
            {"query.bias", l + "attention.self.query.bias"},
            {"key.weight", l + "attention.self.key.weight"},
            {"key.bias", l + "attention.self.key.bias"},
            {"value.weight", l + "attention.self.value.weight"},
            {"value.bias", l + "attention.self.value.bias"},
            {"output.weight", l + "attention.output.dense.weight"},
            {"output.bias", l + "attention.output.dense.bias"},
            {"norm1.weight", l + "attention.output.LayerNorm.weight"},
            {"norm1.bias", l + "attention.output.LayerNorm.bias"},
            {"ffn_in.weight", l + "intermediate.dense.weight"},
            {"ffn_in.bias", l + "intermediate.dense.bias"},
            {"ffn_out.weight", l + "output.dense.weight"},
            {"ffn_out.bias", l + "output.dense.bias"},
            {"norm2.weight", l + "output.LayerNorm.weight"},
            {"norm2.bias", l + "output.LayerNorm.bias"}};
  }
  const std::string l = "h.{layer}.";
  return {{"qkv.weight", l + "attn.c_attn.weight"},    {"qkv.bias", l + "attn.c_attn.bias"},
          {"output.weight", l + "attn.c_proj.weight"}, {"output.bias", l + "attn.c_proj.bias"},
          {"norm1.weight", l + "ln_1.weight"},         {"norm1.bias", l + "ln_1.bias"},
          {"ffn_in.weight", l + "mlp.c_fc.weight"},    {"ffn_in.bias", l + "mlp.c_fc.bias"},
          {"ffn_out.weight", l + "mlp.c_proj.weight"}, {"ffn_out.bias", l + "mlp.c_proj.bias"},
          {"norm2.weight", l + "ln_2.weight"},         {"norm2.bias", l + "ln_2.bias"},
          {"final_norm.weight", "ln_f.weight"},        {"final_norm.bias", "ln_f.bias"}};
}

namespace {

// A number of the config (or of its rope_scaling object `where`): finite and > `above`.
double config_number(const json& object, const std::string& path, const char* key, double fallback,
                     double above) {
  if (!present(object, key)) return fallback;
  const json& value = object[key];
  if (!value.is_number() || !std::isfinite(value.get<double>()) || !(value.get<double>() > above)) {
    fail_config(path, key, value, above == 0.0 ? "a finite number > 0" : "a finite number > 1");
  }
  return value.get<double>();
}

// The rotary embedding of a transformers llama config: rope_theta, partial_rotary_factor and
// rope_scaling (transformers 5 may write them together as rope_parameters).
Rotary llama_rotary(const json& config, const std::string& path, std::int64_t head_dim) {
  Rotary rotary;
  rotary.pairing = RotaryPairing::half_split;
  const json none = json::object();
  const json& params = present(config, "rope_parameters") && config["rope_parameters"].is_object()
                           ? config["rope_parameters"]
                           : none;
  rotary.base = config_number(present(params, "rope_theta") ? params : config, path, "rope_theta",
                              10000.0, 1.0);
  double partial = config_number(config, path, "partial_rotary_factor", 1.0, 0.0);
  if (partial > 1.0)
    fail_config(path, "partial_rotary_factor", config["partial_rotary_factor"],
                "a number in (0, 1]");
  rotary.dim = static_cast<std::int64_t>(static_cast<double>(head_dim) * partial);
  if (rotary.dim < 2 || rotary.dim % 2 != 0) {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': partial_rotary_factor ", partial, " gives ",
         rotary.dim, " rotary dimensions of the head's ", head_dim,
         " (an even number >= 2 is needed)");
  }
  const json* scaling = present(config, "rope_scaling") ? &config["rope_scaling"]
                        : !params.empty()               ? &params
                                                        : nullptr;
  if (scaling == nullptr) return rotary;
  if (!scaling->is_object()) fail_config(path, "rope_scaling", *scaling, "an object or null");
  const char* type_key = scaling->contains("rope_type") ? "rope_type" : "type";
  const std::string type = config_string(*scaling, path, type_key, "default");
  rotary.scaling = rotary_scaling_from_string(type);  // names an unknown kind (yarn, longrope)
  if (rotary.scaling == RotaryScaling::none) return rotary;
  rotary.factor = config_number(*scaling, path, "factor", NAN, 0.0);
  if (!(rotary.factor >= 1.0)) {
    fail(ErrorCode::io, kOp, ": '", path, "': rope_scaling '", type,
         "' needs a 'factor' >= 1, got ",
         present(*scaling, "factor") ? (*scaling)["factor"].dump() : std::string("none"));
  }
  if (rotary.scaling == RotaryScaling::dynamic_ntk) {
    rotary.original_max_positions = config_int(config, path, {"max_position_embeddings"});
  } else if (rotary.scaling == RotaryScaling::llama3) {
    rotary.low_freq_factor = config_number(*scaling, path, "low_freq_factor", 1.0, 0.0);
    rotary.high_freq_factor = config_number(*scaling, path, "high_freq_factor", 4.0, 0.0);
    rotary.original_max_positions =
        config_int(*scaling, path, {"original_max_position_embeddings"});
  }
  return rotary;
}

// A transformers llama checkpoint (model_type "llama"): every tensor by its Hugging Face name.
Model load_llama(Model model, const json& config, const ConvertOptions& options) {
  const std::string& path = model.config_file;
  if (!options.names.empty()) {
    fail(ErrorCode::invalid_argument, kOp,
         ": --name is not supported for the llama layout (its "
         "tensors have the Hugging Face names)");
  }
  // The gate's activation: silu (SwiGLU), or a gelu-gated block (GeGLU) where the config names
  // gelu, gelu_new or gelu_pytorch_tanh (relu too), as transformers' LlamaMLP applies it.
  const std::string act = config_string(config, path, "hidden_act", "silu");
  if (act != "silu" && act != "gelu" && act != "gelu_new" && act != "gelu_pytorch_tanh" &&
      act != "relu") {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': hidden_act '", act,
         "' is not supported for llama (silu, gelu, gelu_new, gelu_pytorch_tanh, relu)");
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (config_bool(config, path, key, false)) {
      fail(ErrorCode::unsupported, kOp, ": '", path, "': '", key,
           "' is true: biases are not supported in the llama layout");
    }
  }
  model.layout = Layout::llama;
  const std::int64_t layers = config_int(config, path, {"num_hidden_layers"});
  model.heads = config_int(config, path, {"num_attention_heads"});
  model.dim = config_int(config, path, {"hidden_size"});
  model.ffn_dim = config_int(config, path, {"intermediate_size"});
  model.kv_heads = present(config, "num_key_value_heads")
                       ? config_int(config, path, {"num_key_value_heads"})
                       : model.heads;
  if (model.heads % model.kv_heads != 0) {
    fail(ErrorCode::io, kOp, ": '", path, "': num_attention_heads ", model.heads,
         " is not a multiple of num_key_value_heads ", model.kv_heads);
  }
  if (model.dim % model.heads != 0) {
    fail(ErrorCode::io, kOp, ": '", path, "': hidden size ", model.dim,
         " is not a multiple of the ", model.heads, " heads");
  }
  model.head_dim = model.dim / model.heads;
  if (present(config, "head_dim") && config_int(config, path, {"head_dim"}) != model.head_dim) {
    fail(ErrorCode::unsupported, kOp, ": '", path, "': head_dim ", config["head_dim"].dump(),
         " differs from hidden_size / num_attention_heads = ", model.head_dim, " (not supported)");
  }
  model.norm_eps = config_eps(config, path, "rms_norm_eps", 1e-6);
  model.pre_norm = true;
  model.causal = true;
  model.activation = act == "silu" ? Activation::silu : parse_activation(act, path);
  model.rotary = llama_rotary(config, path, model.head_dim);
  if (model.model_type == "mistral" && present(config, "sliding_window")) {
    model.sliding_window = config_int(config, path, {"sliding_window"});
  }
  // Qwen2: biases on q, k and v (none on o), and a sliding window only where it is switched on.
  const bool qkv_bias = model.model_type == "qwen2";
  if (qkv_bias && config_bool(config, path, "use_sliding_window", false)) {
    fail(ErrorCode::unsupported, kOp, ": '", path,
         "': use_sliding_window is true: Qwen2's sliding window is not supported");
  }
  if (qkv_bias && present(config, "layer_types")) {
    for (const json& kind : config["layer_types"]) {
      if (kind != "full_attention") {
        fail(ErrorCode::unsupported, kOp, ": '", path, "': layer_types holds ", kind.dump(),
             ": only full_attention layers are supported");
      }
    }
  }
  const bool tied = config_bool(config, path, "tie_word_embeddings", false);

  const SafetensorsFile file(model.source_file);  // read once the config is known to be good
  Reader reader{file, checkpoint_roles(Layout::llama)};
  const std::string marker = reader.patterns.at("query.weight");
  if (file.contains(substitute(marker, layers)) || !file.contains(substitute(marker, layers - 1))) {
    std::int64_t held = 0;
    const auto names = static_cast<std::int64_t>(file.names().size());
    while (held <= names && file.contains(substitute(marker, held))) ++held;
    fail(ErrorCode::io, kOp, ": '", model.source_file, "' holds ", held, " layers ('",
         substitute(marker, 0), "' ...), but '", path, "' says ", layers);
  }
  const std::int64_t d = model.dim, I = model.ffn_dim, H = model.heads, K = model.kv_heads;
  const std::int64_t k = model.head_dim;
  for (std::int64_t l = 0; l < layers; ++l) {
    ModelLayer layer;
    MultiHeadAttentionWeights& w = layer.attention;
    w.heads = H;
    w.model_dim = d;
    w.head_dim = w.value_dim = k;
    w.query = reader.get(&layer.sources, "query.weight", l, {H * k, d});
    w.key = reader.get(&layer.sources, "key.weight", l, {K * k, d});
    w.value = reader.get(&layer.sources, "value.weight", l, {K * k, d});
    w.output = reader.get(&layer.sources, "output.weight", l, {d, H * k});
    if (qkv_bias) {
      w.query_bias = reader.get(&layer.sources, "query.bias", l, {H * k});
      w.key_bias = reader.get(&layer.sources, "key.bias", l, {K * k});
      w.value_bias = reader.get(&layer.sources, "value.bias", l, {K * k});
    }
    layer.norm1_gain = reader.get(&layer.sources, "norm1.weight", l, {d});
    layer.ffn_gate = reader.get(&layer.sources, "ffn_gate.weight", l, {I, d});
    layer.ffn_in = reader.get(&layer.sources, "ffn_in.weight", l, {I, d});
    layer.ffn_out = reader.get(&layer.sources, "ffn_out.weight", l, {d, I});
    layer.norm2_gain = reader.get(&layer.sources, "norm2.weight", l, {d});
    model.layers.push_back(std::move(layer));
  }
  model.final_gain = reader.get(&model.sources, "final_norm.weight", -1, {d});
  const std::string embed_name = reader.patterns.at("embedding.weight");
  if (!file.contains(embed_name) || file.entry(embed_name).shape.size() != 2) {
    fail(ErrorCode::io, "read_safetensors: '", file.path(), "': tensor '", embed_name,
         "' (embedding.weight) is missing or not (vocab, ", d, ")");
  }
  const std::int64_t vocab = file.entry(embed_name).shape[0];
  model.embedding = reader.get(&model.sources, "embedding.weight", -1, {vocab, d});
  const std::string head_name = reader.patterns.at("unembedding.weight");
  if (file.contains(head_name) || !tied) {
    // Untied: lm_head must be there. Tied, a stored copy is read (it equals the embedding).
    model.unembedding = reader.get(&model.sources, "unembedding.weight", -1, {vocab, d});
  } else {
    model.sources["unembedding.weight"] = embed_name + " (tied)";
  }
  return model;
}

bool is_gguf_file(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(path, error) && path.size() > 5 &&
         path.compare(path.size() - 5, 5, ".gguf") == 0;
}

}  // namespace

Model load_checkpoint(const std::string& model_dir, const ConvertOptions& options) {
  if (is_gguf_file(model_dir)) {
    if (!options.names.empty() || (!options.layout.empty() && options.layout != "llama")) {
      fail(ErrorCode::invalid_argument, kOp, ": '", model_dir,
           "' is a GGUF file: its tensors have llama.cpp's names (no --layout or --name)");
    }
    return load_gguf(model_dir);
  }
  const fs::path dir(model_dir);
  if (!fs::is_directory(dir)) {
    fail(ErrorCode::io, kOp, ": '", model_dir,
         "' is not a folder (expected a model folder with "
         "config.json and model.safetensors)");
  }
  Model model;
  model.config_file = (dir / "config.json").string();
  model.source_file = (dir / "model.safetensors").string();
  if (!fs::exists(model.source_file) && fs::exists(dir / "model.safetensors.index.json")) {
    fail(ErrorCode::unsupported, kOp, ": '", model_dir,
         "' holds a sharded checkpoint "
         "(model.safetensors.index.json); only a single model.safetensors is supported");
  }
  const json config = read_config(model.config_file);
  model.model_type = config_string(config, model.config_file, "model_type", "");
  const bool llama_like =
      model.model_type == "llama" || model.model_type == "mistral" || model.model_type == "qwen2";
  if (llama_like || options.layout == "llama") {
    if (!llama_like) {
      fail(ErrorCode::unsupported, kOp, ": '", model.config_file,
           "': --layout llama needs model_type 'llama', 'mistral' or 'qwen2', found '",
           model.model_type, "'");
    }
    return load_llama(std::move(model), config, options);
  }
  refuse_position_dependent(config, model.config_file);
  const SafetensorsFile file(model.source_file);

  // The layout: given, or found by the first layer's attention under an optional prefix.
  struct Candidate {
    Layout layout;
    const char* marker;
    std::vector<std::string> prefixes;
  };
  const Candidate candidates[] = {{Layout::bert, "query.weight", {"", "bert.", "roberta."}},
                                  {Layout::gpt2, "qkv.weight", {"", "transformer."}}};
  if (!options.layout.empty() && options.layout != "bert" && options.layout != "gpt2") {
    fail(ErrorCode::invalid_argument, kOp, ": layout '", options.layout,
         "' is not known (bert, gpt2 or llama)");
  }
  // Every role named on the command line must be one of the layout's (or of either layout's
  // when the layout is to be found): a mistyped role is an error, never silently unused.
  for (const auto& entry : options.names) {
    const std::string& role = entry.first;
    std::string known;
    bool found = false;
    for (const Candidate& c : candidates) {
      if (!options.layout.empty() && options.layout != to_string(c.layout)) continue;
      for (const auto& r : checkpoint_roles(c.layout)) {
        found = found || r.first == role;
        if (known.find(r.first) == std::string::npos)
          known += (known.empty() ? "" : ", ") + r.first;
      }
    }
    if (!found) {
      fail(ErrorCode::invalid_argument, kOp, ": '", role, "' is not a role of the ",
           options.layout.empty() ? "bert or gpt2" : options.layout, " layout (", known, ")");
    }
  }
  const Candidate* chosen = nullptr;
  std::string prefix;
  for (const Candidate& c : candidates) {
    if (!options.layout.empty() && options.layout != to_string(c.layout)) continue;
    const auto roles = checkpoint_roles(c.layout);
    for (const std::string& p : c.prefixes) {
      const auto override_marker = options.names.find(c.marker);
      const std::string probe = override_marker != options.names.end()
                                    ? substitute(override_marker->second, 0)
                                    : p + substitute(roles.at(c.marker), 0);
      if (file.contains(probe)) {
        chosen = &c;
        prefix = p;
        break;
      }
    }
    if (chosen) break;
  }
  if (!chosen) {
    fail(ErrorCode::unsupported, kOp, ": '", model.source_file, "': no known layout",
         options.layout.empty() ? "" : " ('" + options.layout + "')",
         " matches its tensor names (BERT-style "
         "[bert.|roberta.]encoder.layer.N.attention.self.query, "
         "GPT-2-style [transformer.]h.N.attn.c_attn; give --layout and --name ROLE=PATTERN for "
         "other names); found: ",
         found_names(file));
  }
  model.layout = chosen->layout;
  Reader reader{file, {}};
  for (const auto& [role, pattern] : checkpoint_roles(model.layout))
    reader.patterns[role] = prefix + pattern;
  for (const auto& [role, pattern] : options.names) {
    if (!reader.patterns.count(role)) {
      fail(ErrorCode::invalid_argument, kOp, ": '", role, "' is not a role of the ",
           to_string(model.layout), " layout found in '", model.source_file, "'");
    }
    reader.patterns[role] = pattern;
  }
  // A role of every layer needs {layer} in its pattern: without it every layer would read the
  // same tensor (and the layer count could not be found).
  for (const auto& [role, pattern] : reader.patterns) {
    const std::string standard = checkpoint_roles(model.layout).at(role);
    if (standard.find("{layer}") != std::string::npos &&
        pattern.find("{layer}") == std::string::npos) {
      fail(ErrorCode::invalid_argument, kOp, ": the pattern of '", role, "' ('", pattern,
           "') has no {layer}, but every layer has its own ", role, " (the ",
           to_string(model.layout), " layout's is '", standard, "')");
    }
  }

  const bool bert = model.layout == Layout::bert;
  const std::int64_t layers =
      config_int(config, model.config_file,
                 bert ? std::initializer_list<const char*>{"num_hidden_layers"}
                      : std::initializer_list<const char*>{"n_layer", "num_hidden_layers"});
  model.heads =
      config_int(config, model.config_file,
                 bert ? std::initializer_list<const char*>{"num_attention_heads"}
                      : std::initializer_list<const char*>{"n_head", "num_attention_heads"});
  model.dim = config_int(config, model.config_file,
                         bert ? std::initializer_list<const char*>{"hidden_size"}
                              : std::initializer_list<const char*>{"n_embd", "hidden_size"});
  if (model.dim % model.heads != 0) {
    fail(ErrorCode::io, kOp, ": '", model.config_file, "': hidden size ", model.dim,
         " is not a multiple of the ", model.heads, " heads");
  }
  model.head_dim = model.dim / model.heads;
  if (bert) {
    model.ffn_dim = config_int(config, model.config_file, {"intermediate_size"});
    model.norm_eps = config_eps(config, model.config_file, "layer_norm_eps", 1e-12);
    model.activation = parse_activation(
        config_string(config, model.config_file, "hidden_act", "gelu"), model.config_file);
  } else {
    // n_inner null or absent: GPT-2's 4 d; anything else must be a positive integer.
    model.ffn_dim = present(config, "n_inner") ? config_int(config, model.config_file, {"n_inner"})
                                               : 4 * model.dim;
    model.norm_eps = config_eps(config, model.config_file, "layer_norm_epsilon", 1e-5);
    model.activation = parse_activation(
        config_string(config, model.config_file, "activation_function", "gelu_new"),
        model.config_file);
    if (!config_bool(config, model.config_file, "scale_attn_weights", true) ||
        config_bool(config, model.config_file, "scale_attn_by_inverse_layer_idx", false)) {
      fail(ErrorCode::unsupported, kOp, ": '", model.config_file,
           "': attention scores not scaled by 1/sqrt(d_k) alone are not supported");
    }
  }
  model.pre_norm = !bert;
  model.causal = !bert;
  // The file must hold exactly the layers the config names.
  const std::string marker = reader.patterns.at(chosen->marker);
  if (file.contains(substitute(marker, layers)) || !file.contains(substitute(marker, layers - 1))) {
    std::int64_t held = 0;  // bounded: every name of the file is one tensor
    const auto names = static_cast<std::int64_t>(file.names().size());
    while (held <= names && file.contains(substitute(marker, held))) ++held;
    fail(ErrorCode::io, kOp, ": '", model.source_file, "' holds ", held, " layers ('",
         substitute(marker, 0), "' ...), but '", model.config_file, "' says ", layers);
  }

  const std::int64_t d = model.dim, I = model.ffn_dim;
  for (std::int64_t l = 0; l < layers; ++l) {
    ModelLayer layer;
    MultiHeadAttentionWeights& w = layer.attention;
    w.heads = model.heads;
    w.model_dim = d;
    w.head_dim = w.value_dim = model.head_dim;
    if (bert) {
      w.query = reader.get(&layer.sources, "query.weight", l, {d, d});
      w.query_bias = reader.get(&layer.sources, "query.bias", l, {d});
      w.key = reader.get(&layer.sources, "key.weight", l, {d, d});
      w.key_bias = reader.get(&layer.sources, "key.bias", l, {d});
      w.value = reader.get(&layer.sources, "value.weight", l, {d, d});
      w.value_bias = reader.get(&layer.sources, "value.bias", l, {d});
      w.output = reader.get(&layer.sources, "output.weight", l, {d, d});
      layer.ffn_in = reader.get(&layer.sources, "ffn_in.weight", l, {I, d});
      layer.ffn_out = reader.get(&layer.sources, "ffn_out.weight", l, {d, I});
    } else {
      // Conv1D stores (in, out): y = x W + b, so each torch.nn.Linear weight is a transpose.
      const Tensor<double> qkv = reader.get(&layer.sources, "qkv.weight", l, {d, 3 * d});
      const Tensor<double> qkv_bias = reader.get(&layer.sources, "qkv.bias", l, {3 * d});
      w.query = column_block_transposed(qkv, 0, d);
      w.key = column_block_transposed(qkv, d, d);
      w.value = column_block_transposed(qkv, 2 * d, d);
      w.query_bias = slice(qkv_bias, 0, d);
      w.key_bias = slice(qkv_bias, d, d);
      w.value_bias = slice(qkv_bias, 2 * d, d);
      w.output = transposed(reader.get(&layer.sources, "output.weight", l, {d, d}));
      layer.ffn_in = transposed(reader.get(&layer.sources, "ffn_in.weight", l, {d, I}));
      layer.ffn_out = transposed(reader.get(&layer.sources, "ffn_out.weight", l, {I, d}));
    }
    w.output_bias = reader.get(&layer.sources, "output.bias", l, {d});
    layer.ffn_in_bias = reader.get(&layer.sources, "ffn_in.bias", l, {I});
    layer.ffn_out_bias = reader.get(&layer.sources, "ffn_out.bias", l, {d});
    layer.norm1_gain = reader.get(&layer.sources, "norm1.weight", l, {d});
    layer.norm1_bias = reader.get(&layer.sources, "norm1.bias", l, {d});
    layer.norm2_gain = reader.get(&layer.sources, "norm2.weight", l, {d});
    layer.norm2_bias = reader.get(&layer.sources, "norm2.bias", l, {d});
    layer.operators = to_emf(w);
    model.layers.push_back(std::move(layer));
  }
  if (!bert) {
    model.final_gain = reader.get(&model.sources, "final_norm.weight", -1, {d});
    model.final_bias = reader.get(&model.sources, "final_norm.bias", -1, {d});
  }
  return model;
}

}  // namespace emflow::model

// The operator folder of a converted model: one float64 .npy per operator and weight, and
// manifest.json that says what the model is, where each part came from and which files the folder
// holds. Written into a temporary folder beside the target and renamed into place, so that a
// failed conversion leaves no folder behind; an earlier operator folder is replaced only when it
// holds nothing but the files its manifest lists, and the staging folders of a killed conversion
// are removed (or an old folder it had moved aside is put back) by the next one.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "core/check.hpp"
#include "emflow/io.hpp"
#include "emflow/model.hpp"

namespace emflow::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::fail;

constexpr const char* kFormat = "emflow-operators";
constexpr int kVersion = 1;

// Every file of a layer: its name in the folder and the tensor it holds. A llama layer has no
// dense operators and no biases: its factored weights, RMSNorm gains and gated feed-forward.
template <class Layer, class Visit>
void each_part(Layer& layer, Layout layout, bool qkv_biases, Visit&& visit) {
  auto& w = layer.attention;
  auto& o = layer.operators;
  if (layout == Layout::llama) {
    visit("query", w.query);
    visit("key", w.key);
    visit("value", w.value);
    visit("output", w.output);
    if (qkv_biases) {  // Qwen2
      visit("query_bias", w.query_bias);
      visit("key_bias", w.key_bias);
      visit("value_bias", w.value_bias);
    }
    visit("norm1_gain", layer.norm1_gain);
    visit("ffn_gate", layer.ffn_gate);
    visit("ffn_in", layer.ffn_in);
    visit("ffn_out", layer.ffn_out);
    visit("norm2_gain", layer.norm2_gain);
    return;
  }
  visit("M", o.relevance);
  visit("F", o.content);
  visit("u", o.key_bias);
  visit("c", o.offset);
  visit("query", w.query);
  visit("query_bias", w.query_bias);
  visit("key", w.key);
  visit("key_bias", w.key_bias);
  visit("value", w.value);
  visit("value_bias", w.value_bias);
  visit("output", w.output);
  visit("output_bias", w.output_bias);
  visit("norm1_gain", layer.norm1_gain);
  visit("norm1_bias", layer.norm1_bias);
  visit("ffn_in", layer.ffn_in);
  visit("ffn_in_bias", layer.ffn_in_bias);
  visit("ffn_out", layer.ffn_out);
  visit("ffn_out_bias", layer.ffn_out_bias);
  visit("norm2_gain", layer.norm2_gain);
  visit("norm2_bias", layer.norm2_bias);
}

std::string layer_file(std::int64_t l, const std::string& part) {
  return "layer" + std::to_string(l) + "." + part + ".npy";
}

/// The names (inside the folder) that the manifest of `dir` lists: manifest.json, every layer's
/// files, the final norm's and the extra files; only manifest.json when it cannot be read.
std::vector<std::string> listed_names(const fs::path& dir) {
  std::vector<std::string> names{"manifest.json"};
  std::ifstream in(dir / "manifest.json");
  json m;
  try {
    m = json::parse(in);
  } catch (const json::exception&) {
    return names;
  }
  if (!m.is_object()) return names;
  if (m.contains("layer_files") && m["layer_files"].is_array()) {
    for (const json& layer : m["layer_files"]) {
      if (!layer.is_object() || !layer.contains("files") || !layer["files"].is_object()) continue;
      for (const auto& file : layer["files"].items()) {
        if (file.value().is_string()) names.push_back(file.value().get<std::string>());
      }
    }
  }
  if (m.contains("final_norm") && m["final_norm"].is_boolean() && m["final_norm"].get<bool>()) {
    names.push_back("final_gain.npy");
    names.push_back("final_bias.npy");
  }
  if (m.contains("model_files") && m["model_files"].is_object()) {
    for (const auto& file : m["model_files"].items()) {
      if (file.value().is_string()) names.push_back(file.value().get<std::string>());
    }
  }
  if (m.contains("extra_files") && m["extra_files"].is_array()) {
    for (const json& file : m["extra_files"]) {
      if (file.is_string()) names.push_back(file.get<std::string>());
    }
  }
  return names;
}

bool is_operator_folder(const fs::path& dir) {
  std::ifstream in(dir / "manifest.json");
  if (!in) return false;
  try {
    const json manifest = json::parse(in);
    return manifest.is_object() && manifest.value("format", std::string()) == kFormat;
  } catch (const json::exception&) {
    return false;
  }
}

std::string random_hex() {
  std::random_device device;
  std::ostringstream out;
  out << std::hex << device() << device();
  return out.str();
}

// The model-wide files of a llama model: role -> file name.
std::map<std::string, std::string> llama_model_files(const Model& model) {
  std::map<std::string, std::string> files{{"final_gain", "final_gain.npy"},
                                           {"embedding", "embedding.npy"}};
  if (model.unembedding.size() > 0) files["unembedding"] = "unembedding.npy";
  if (!model.vocabulary.empty()) files["vocabulary"] = "vocabulary.json";
  return files;
}

json rotary_of(const Model& model) {
  const Rotary& r = model.rotary;
  json out = {{"dim", r.dim},
              {"base", r.base},
              {"pairing", to_string(r.pairing)},
              {"scaling", to_string(r.scaling)},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_positions", r.original_max_positions}};
  // Per-frequency inverse frequencies (a GGUF file's rope_freqs): JSON numbers round-trip.
  if (!model.rotary_frequencies.empty()) out["inverse_frequencies"] = model.rotary_frequencies;
  return out;
}

const char* storage_name(StorageType storage) {
  return storage == StorageType::float32 ? "float32" : "float64";
}

json manifest_of(const Model& model, const std::map<std::string, std::string>& extra_files,
                 StorageType storage) {
  json m;
  m["format"] = kFormat;
  m["version"] = kVersion;
  m["layout"] = to_string(model.layout);
  m["model_type"] = model.model_type;
  m["layers"] = model.layer_count();
  m["heads"] = model.heads;
  m["dim"] = model.dim;
  m["head_dim"] = model.head_dim;
  m["ffn_dim"] = model.ffn_dim;
  m["norm"] = model.layout == Layout::llama ? "rmsnorm" : "layernorm";
  m["norm_eps"] = model.norm_eps;
  m["pre_norm"] = model.pre_norm;
  m["causal"] = model.causal;
  m["activation"] = to_string(model.activation);
  m["final_norm"] = model.layout != Layout::llama && model.final_gain.size() > 0;
  m["dtype"] = storage_name(storage);
  if (model.layout == Layout::llama) {
    m["kv_heads"] = model.key_heads();
    m["sliding_window"] = model.sliding_window;
    m["rotary"] = rotary_of(model);
    m["vocab_size"] = model.vocab_size();
    m["tied_embeddings"] = model.unembedding.size() == 0;
    m["tokenizer_model"] = model.tokenizer_model;
    m["model_files"] = llama_model_files(model);
  }
  m["source"] = {
      {"weights", model.source_file}, {"config", model.config_file}, {"tensors", model.sources}};
  json layers = json::array();
  for (std::int64_t l = 0; l < model.layer_count(); ++l) {
    const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
    json files = json::object();
    each_part(layer, model.layout, layer.attention.query_bias.size() > 0,
              [&](const char* part, const Tensor<double>&) { files[part] = layer_file(l, part); });
    layers.push_back({{"files", files}, {"sources", layer.sources}});
  }
  m["layer_files"] = layers;
  json extra = json::array();
  for (const auto& entry : extra_files) extra.push_back(entry.first);
  m["extra_files"] = extra;
  return m;
}

/// The folder `ops_dir` names, its trailing slashes dropped ("ops/" is "ops"), absolute.
fs::path folder_path(const std::string& ops_dir) {
  std::string text = ops_dir;
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return fs::absolute(fs::path(text)).lexically_normal();
}

/// The process id in a staging name's tail "<pid>-<hex>", or 0.
long long pid_of(const std::string& tail) {
  char* end = nullptr;
  const long long pid = std::strtoll(tail.c_str(), &end, 10);
  return end != tail.c_str() && *end == '-' ? pid : 0;
}

bool process_gone(long long pid) {
  return pid > 0 && pid <= 0x7fffffffLL && pid != ::getpid() &&
         ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

/// The staging folders ".<name>.emflow-tmp-<pid>-<hex>" of conversions into `target` whose
/// process is gone are removed; their ".<name>.old.emflow-tmp-..." (the earlier folder, moved
/// aside just before the final rename) is put back when the target is missing, else removed.
void clean_stale_staging(const fs::path& target) {
  const std::string name = target.filename().string();
  const std::string staging = "." + name + ".emflow-tmp-";
  const std::string backup = "." + name + ".old.emflow-tmp-";
  std::error_code error;
  std::vector<fs::path> stale_staging, stale_backups;
  for (const fs::directory_entry& entry : fs::directory_iterator(target.parent_path(), error)) {
    const std::string file = entry.path().filename().string();
    if (file.compare(0, staging.size(), staging) == 0 &&
        process_gone(pid_of(file.substr(staging.size())))) {
      stale_staging.push_back(entry.path());
    } else if (file.compare(0, backup.size(), backup) == 0 &&
               process_gone(pid_of(file.substr(backup.size())))) {
      stale_backups.push_back(entry.path());
    }
  }
  for (const fs::path& path : stale_staging) fs::remove_all(path, error);
  for (const fs::path& path : stale_backups) {
    // The only copy of the earlier folder when the target is missing: put back, never removed.
    if (fs::exists(fs::symlink_status(target, error))) {
      fs::remove_all(path, error);
    } else {
      fs::rename(path, target, error);
    }
  }
}

/// Every check of the target before any work: a folder name in an existing folder, not a
/// dangling link, and either absent or an earlier operator folder that holds nothing but the
/// files its manifest lists. Returns the folder to write (a link to a folder is followed).
fs::path checked_target(const std::string& ops_dir) {
  fs::path target = folder_path(ops_dir);
  const std::string name = target.filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "' is not a folder name");
  }
  std::error_code error;
  if (fs::is_symlink(fs::symlink_status(target, error))) {
    if (!fs::exists(target, error)) {
      fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "' is a symbolic link to '",
           fs::read_symlink(target, error).string(),
           "', which does not exist; expected a folder to create or an earlier operator folder");
    }
    target = fs::canonical(target, error);  // the folder the link names is the one replaced
  }
  const fs::path parent = target.parent_path();
  if (!fs::is_directory(parent)) {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "': the folder '",
         parent.string(), "' does not exist");
  }
  if (!fs::exists(target, error)) return target;
  if (!(fs::is_directory(target) && is_operator_folder(target))) {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir,
         "' exists and is not an operator folder (no manifest.json of ", kFormat,
         "); refusing to replace it");
  }
  const std::vector<std::string> listed = listed_names(target);
  const std::set<std::string> known(listed.begin(), listed.end());
  for (const fs::directory_entry& entry : fs::directory_iterator(target)) {
    const std::string file = entry.path().filename().string();
    if (!known.count(file)) {
      fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "' holds '", file,
           "', which its manifest.json does not list; refusing to replace the folder and lose "
           "it (move it out, or convert into a new folder)");
    }
  }
  return target;
}

}  // namespace

void check_operators_target(const std::string& ops_dir) {
  const fs::path target = checked_target(ops_dir);
  clean_stale_staging(target);
  checked_target(ops_dir);  // a folder put back by the cleaning is checked as well
}

std::vector<std::string> operator_files(const std::string& ops_dir) {
  const fs::path dir(ops_dir);
  std::vector<std::string> files;
  for (const std::string& name : listed_names(dir)) files.push_back((dir / name).string());
  return files;
}

void write_operators(const Model& model, const std::string& ops_dir,
                     const std::map<std::string, std::string>& extra_files, StorageType storage) {
  if (storage == StorageType::automatic) {
    storage = model.layout == Layout::llama ? StorageType::float32 : StorageType::float64;
  }
  // The tensor in the folder's element type (float32 rounds what is not a float32 value).
  auto write = [&](const fs::path& path, const Tensor<double>& t) {
    if (storage == StorageType::float64) {
      write_npy(path.string(), t);
    } else {
      write_npy(path.string(),
                Tensor<float>(t.shape(), std::vector<float>(t.values().begin(), t.values().end())));
    }
  };
  std::string vocabulary;
  if (!model.vocabulary.empty()) {
    try {
      vocabulary = json(model.vocabulary).dump() + "\n";
    } catch (const json::exception& e) {
      fail(ErrorCode::invalid_argument,
           "convert: the vocabulary cannot be written as JSON (a "
           "token is not UTF-8): ",
           e.what());
    }
  }
  for (const auto& entry : extra_files) {
    const std::string& file = entry.first;
    if (file.empty() || file.find('/') != std::string::npos || file == "manifest.json" ||
        file == "." || file == "..") {
      fail(ErrorCode::invalid_argument, "convert: extra file name '", file, "' is not allowed");
    }
  }
  check_operators_target(ops_dir);
  const fs::path target = checked_target(ops_dir);
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  const bool replacing = fs::exists(target);
  const std::string tag = ".emflow-tmp-" + std::to_string(::getpid()) + "-" + random_hex();
  const fs::path staging = parent / ("." + name + tag);
  const fs::path backup = parent / ("." + name + ".old" + tag);
  std::error_code ignored;
  try {
    if (!fs::create_directory(staging)) {
      fail(ErrorCode::io, "convert: cannot create '", staging.string(), "'");
    }
    for (std::int64_t l = 0; l < model.layer_count(); ++l) {
      const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
      each_part(layer, model.layout, layer.attention.query_bias.size() > 0,
                [&](const char* part, const Tensor<double>& t) {
                  write(staging / layer_file(l, part), t);
                });
    }
    if (model.layout == Layout::llama) {
      write(staging / "final_gain.npy", model.final_gain);
      write(staging / "embedding.npy", model.embedding);
      if (model.unembedding.size() > 0) write(staging / "unembedding.npy", model.unembedding);
      if (!vocabulary.empty())
        write_file_atomic((staging / "vocabulary.json").string(), vocabulary);
    } else if (model.final_gain.size() > 0) {
      write(staging / "final_gain.npy", model.final_gain);
      write(staging / "final_bias.npy", model.final_bias);
    }
    for (const auto& [file, bytes] : extra_files) {
      write_file_atomic((staging / file).string(), bytes);
    }
    write_file_atomic((staging / "manifest.json").string(),
                      manifest_of(model, extra_files, storage).dump(2) + "\n");
    if (replacing) fs::rename(target, backup);
    try {
      fs::rename(staging, target);
    } catch (...) {
      if (replacing) fs::rename(backup, target, ignored);
      throw;
    }
    if (replacing) fs::remove_all(backup, ignored);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(staging, ignored);
    fail(ErrorCode::io, "convert: writing '", ops_dir, "' failed: ", e.what());
  } catch (...) {
    fs::remove_all(staging, ignored);
    throw;
  }
}

Model read_operators(const std::string& ops_dir) {
  const fs::path dir(ops_dir);
  const std::string manifest_path = (dir / "manifest.json").string();
  std::error_code error;
  if (fs::is_directory(manifest_path, error)) {
    fail(ErrorCode::io, "read_operators: '", manifest_path,
         "': is a folder, expected the JSON file an operator folder holds");
  }
  std::ifstream in(manifest_path);
  if (!in) {
    fail(ErrorCode::io, "read_operators: '", manifest_path,
         "': cannot open (an operator folder is written by emflow convert)");
  }
  json m;
  try {
    m = json::parse(in);
  } catch (const json::exception& e) {
    fail(ErrorCode::io, "read_operators: '", manifest_path, "': malformed JSON: ", e.what());
  }
  auto bad = [&](const std::string& what) {
    fail(ErrorCode::io, "read_operators: '", manifest_path, "': ", what);
  };
  if (!m.is_object() || m.value("format", std::string()) != kFormat) {
    bad(std::string("is not a manifest of ") + kFormat);
  }
  if (!m.contains("version") || m["version"] != kVersion) bad("has an unsupported version");
  // Each field of the wrong type or value is named with what it holds and what was expected.
  auto field = [&](const char* key, bool (json::*is)() const noexcept,
                   const char* expected) -> const json& {
    if (!m.contains(key)) bad(std::string("lacks '") + key + "' (" + expected + ")");
    const json& value = m[key];
    if (!(value.*is)()) {
      bad(std::string("'") + key + "' is " + value.dump() + " (" + value.type_name() +
          "), expected " + expected);
    }
    return value;
  };
  auto count = [&](const char* key) {
    const auto value = field(key, &json::is_number_integer, "a positive integer").get<long long>();
    if (value < 1)
      bad(std::string("'") + key + "' is " + std::to_string(value) +
          ", expected a positive integer");
    return static_cast<std::int64_t>(value);
  };
  Model model;
  try {
    const std::string layout =
        field("layout", &json::is_string, "bert, gpt2 or llama").get<std::string>();
    if (layout != "bert" && layout != "gpt2" && layout != "llama") {
      bad("has an unknown layout '" + layout + "'");
    }
    model.layout = layout == "gpt2"    ? Layout::gpt2
                   : layout == "llama" ? Layout::llama
                                       : Layout::bert;
    const bool llama = model.layout == Layout::llama;
    if (m.contains("model_type")) {
      model.model_type = field("model_type", &json::is_string, "a string").get<std::string>();
    }
    model.heads = count("heads");
    model.dim = count("dim");
    model.head_dim = count("head_dim");
    model.ffn_dim = count("ffn_dim");
    // A layer norm's epsilon: finite and > 0 (a negative one gives NaN in every output).
    model.norm_eps = field("norm_eps", &json::is_number, "a finite number > 0").get<double>();
    if (!(std::isfinite(model.norm_eps) && model.norm_eps > 0.0)) {
      bad("'norm_eps' is " + m["norm_eps"].dump() + ", expected a finite number > 0");
    }
    model.pre_norm = field("pre_norm", &json::is_boolean, "true or false").get<bool>();
    model.causal = field("causal", &json::is_boolean, "true or false").get<bool>();
    const std::string activation =
        field("activation", &json::is_string, "gelu, gelu_tanh, relu or silu").get<std::string>();
    if (!llama && activation == "silu") {  // llama's gate takes any; silu is llama's alone
      bad("has activation '" + activation + "' for the " + layout + " layout");
    }
    if (activation == "silu") {
      model.activation = Activation::silu;
    } else if (activation == "gelu") {
      model.activation = Activation::gelu;
    } else if (activation == "gelu_tanh") {
      model.activation = Activation::gelu_tanh;
    } else if (activation == "relu") {
      model.activation = Activation::relu;
    } else {
      bad("has an unknown activation '" + activation + "'");
    }
    model.source_file = m.at("source").at("weights").get<std::string>();
    model.config_file = m.at("source").at("config").get<std::string>();
    model.sources = m.at("source").at("tensors").get<std::map<std::string, std::string>>();
    const std::int64_t layers = count("layers");
    if (layers < 1 || model.heads < 1 || model.dim < 1 || model.head_dim * model.heads != model.dim)
      bad("has inconsistent sizes");
    if (llama) {
      model.kv_heads = count("kv_heads");
      if (m.contains("sliding_window")) {
        const json& w = field("sliding_window", &json::is_number_integer, "an integer >= 0");
        if (w.get<long long>() < 0) bad("'sliding_window' is " + w.dump() + ", expected >= 0");
        model.sliding_window = w.get<std::int64_t>();
      }
      if (model.heads % model.kv_heads != 0) {
        bad("'kv_heads' is " + std::to_string(model.kv_heads) + ", which does not divide the " +
            std::to_string(model.heads) + " heads");
      }
      const json& r = field("rotary", &json::is_object, "an object");
      auto number = [&](const char* key) {
        if (!r.contains(key) || !r[key].is_number()) {
          bad(std::string("'rotary.") + key + "' is " +
              (r.contains(key) ? r[key].dump() : "absent") + ", expected a number");
        }
        return r[key].get<double>();
      };
      model.rotary.dim = static_cast<std::int64_t>(number("dim"));
      model.rotary.base = number("base");
      model.rotary.factor = number("factor");
      model.rotary.low_freq_factor = number("low_freq_factor");
      model.rotary.high_freq_factor = number("high_freq_factor");
      model.rotary.original_max_positions =
          static_cast<std::int64_t>(number("original_max_positions"));
      try {
        model.rotary.pairing = rotary_pairing_from_string(r.at("pairing").get<std::string>());
        model.rotary.scaling = rotary_scaling_from_string(r.at("scaling").get<std::string>());
      } catch (const Error& e) {
        bad(std::string("'rotary': ") + e.what());
      }
      if (model.rotary.dim < 2 || model.rotary.dim % 2 != 0 || model.rotary.dim > model.head_dim) {
        bad("'rotary.dim' is " + r["dim"].dump() + ", expected an even number in 2.." +
            std::to_string(model.head_dim));
      }
      if (r.contains("inverse_frequencies")) {
        const json& f = r["inverse_frequencies"];
        const std::size_t half = static_cast<std::size_t>(model.rotary.dim / 2);
        if (!f.is_array() || f.size() != half ||
            !std::all_of(f.begin(), f.end(), [](const json& v) { return v.is_number(); })) {
          bad("'rotary.inverse_frequencies' is " + f.dump() + ", expected " + std::to_string(half) +
              " numbers (rotary.dim / 2)");
        }
        model.rotary_frequencies = f.get<std::vector<double>>();
      }
      // The rest of the fields are checked by the attention when it runs (rotary.hpp).
      try {
        rotary_inverse_frequencies(model.rotary_embedding(), 1);
      } catch (const Error& e) {
        bad(std::string("'rotary': ") + e.what());
      }
      if (m.contains("tokenizer_model")) {
        model.tokenizer_model =
            field("tokenizer_model", &json::is_string, "a string").get<std::string>();
      }
    }
    if (static_cast<std::int64_t>(m.at("layer_files").size()) != layers) {
      bad("lists a different number of layer_files than its layers");
    }
    for (std::int64_t l = 0; l < layers; ++l) {
      const json& entry = m.at("layer_files").at(static_cast<std::size_t>(l));
      ModelLayer layer;
      const bool qkv_biases = llama && entry.at("files").contains("query_bias");
      each_part(layer, model.layout, qkv_biases, [&](const char* part, Tensor<double>& t) {
        t = read_npy<double>((dir / entry.at("files").at(part).get<std::string>()).string());
      });
      layer.sources = entry.at("sources").get<std::map<std::string, std::string>>();
      MultiHeadAttentionWeights& w = layer.attention;
      w.heads = model.heads;
      w.model_dim = model.dim;
      w.head_dim = w.value_dim = model.head_dim;
      if (!llama) validate(w, "read_operators");  // llama's shapes are checked below
      model.layers.push_back(std::move(layer));
    }
    if (field("final_norm", &json::is_boolean, "true or false").get<bool>()) {
      model.final_gain = read_npy<double>((dir / "final_gain.npy").string());
      model.final_bias = read_npy<double>((dir / "final_bias.npy").string());
    }
    if (llama) {
      const json& files = field("model_files", &json::is_object, "an object");
      auto file_of = [&](const char* role) { return (dir / files.at(role).get<std::string>()); };
      model.final_gain = read_npy<double>(file_of("final_gain").string());
      model.embedding = read_npy<double>(file_of("embedding").string());
      const bool tied = field("tied_embeddings", &json::is_boolean, "true or false").get<bool>();
      if (tied == files.contains("unembedding")) {
        bad(std::string("'tied_embeddings' is ") + (tied ? "true" : "false") +
            (tied ? " but model_files lists an unembedding" : " but model_files lists none"));
      }
      if (!tied) model.unembedding = read_npy<double>(file_of("unembedding").string());
      if (files.contains("vocabulary")) {
        const fs::path path = file_of("vocabulary");
        std::ifstream vocab_in(path);
        try {
          model.vocabulary = json::parse(vocab_in).get<std::vector<std::string>>();
        } catch (const json::exception& e) {
          fail(ErrorCode::io, "read_operators: '", path.string(),
               "': not a JSON array of strings: ", e.what());
        }
      }
      const std::int64_t vocab = count("vocab_size");
      if (model.embedding.rank() != 2 || model.embedding.extent(0) != vocab) {
        fail(ErrorCode::io, "read_operators: '", ops_dir, "': embedding has shape ",
             emflow::to_string(model.embedding.shape()), ", expected (", vocab, ", ", model.dim,
             ") (vocab_size, dim)");
      }
    }
  } catch (const json::exception& e) {
    bad(std::string("malformed manifest: ") + e.what());
  }
  // Every operator must have the shape the manifest implies.
  const std::int64_t H = model.heads, d = model.dim, I = model.ffn_dim;
  auto expect = [&](const Tensor<double>& t, const Shape& shape, const std::string& what) {
    if (t.shape() != shape) {
      fail(ErrorCode::io, "read_operators: '", ops_dir, "': ", what, " has shape ",
           emflow::to_string(t.shape()), ", expected ", emflow::to_string(shape));
    }
  };
  if (model.layout == Layout::llama) {
    const std::int64_t K = model.key_heads(), k = model.head_dim, V = model.vocab_size();
    for (std::int64_t l = 0; l < model.layer_count(); ++l) {
      const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
      const std::string at = "layer " + std::to_string(l) + " ";
      expect(layer.attention.query, {H * k, d}, at + "query");
      expect(layer.attention.key, {K * k, d}, at + "key");
      expect(layer.attention.value, {K * k, d}, at + "value");
      expect(layer.attention.output, {d, H * k}, at + "output");
      if (layer.attention.query_bias.size() > 0) {
        expect(layer.attention.query_bias, {H * k}, at + "query_bias");
        expect(layer.attention.key_bias, {K * k}, at + "key_bias");
        expect(layer.attention.value_bias, {K * k}, at + "value_bias");
      }
      expect(layer.norm1_gain, {d}, at + "norm1_gain");
      expect(layer.norm2_gain, {d}, at + "norm2_gain");
      expect(layer.ffn_gate, {I, d}, at + "ffn_gate");
      expect(layer.ffn_in, {I, d}, at + "ffn_in");
      expect(layer.ffn_out, {d, I}, at + "ffn_out");
    }
    expect(model.final_gain, {d}, "final_gain");
    expect(model.embedding, {V, d}, "embedding");
    if (model.unembedding.size() > 0) expect(model.unembedding, {V, d}, "unembedding");
    return model;
  }
  for (std::int64_t l = 0; l < model.layer_count(); ++l) {
    const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
    const std::string at = "layer " + std::to_string(l) + " ";
    expect(layer.operators.relevance, {H, d, d}, at + "M");
    expect(layer.operators.content, {H, d, d}, at + "F");
    expect(layer.operators.key_bias, {H, d}, at + "u");
    expect(layer.operators.offset, {d}, at + "c");
    for (const Tensor<double>* v : {&layer.norm1_gain, &layer.norm1_bias, &layer.norm2_gain,
                                    &layer.norm2_bias, &layer.ffn_out_bias})
      expect(*v, {d}, at + "norm or bias");
    expect(layer.ffn_in, {I, d}, at + "ffn_in");
    expect(layer.ffn_in_bias, {I}, at + "ffn_in_bias");
    expect(layer.ffn_out, {d, I}, at + "ffn_out");
  }
  if (model.final_gain.size() > 0) {
    expect(model.final_gain, {d}, "final_gain");
    expect(model.final_bias, {d}, "final_bias");
  }
  return model;
}

}  // namespace emflow::model

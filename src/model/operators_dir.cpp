// The operator folder of a converted model: one float64 .npy per operator and weight, and
// manifest.json that says what the model is and where each part came from. Written into a
// temporary folder beside the target and renamed into place, so that a failed conversion leaves
// no folder behind.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
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

// Every file of a layer: its name in the folder and the tensor it holds.
template <class Layer, class Visit>
void each_part(Layer& layer, Visit&& visit) {
  auto& w = layer.attention;
  auto& o = layer.operators;
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

json manifest_of(const Model& model) {
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
  m["norm"] = "layernorm";
  m["norm_eps"] = model.norm_eps;
  m["pre_norm"] = model.pre_norm;
  m["causal"] = model.causal;
  m["activation"] = to_string(model.activation);
  m["final_norm"] = model.final_gain.size() > 0;
  m["source"] = {
      {"weights", model.source_file}, {"config", model.config_file}, {"tensors", model.sources}};
  json layers = json::array();
  for (std::int64_t l = 0; l < model.layer_count(); ++l) {
    const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
    json files = json::object();
    each_part(layer,
              [&](const char* part, const Tensor<double>&) { files[part] = layer_file(l, part); });
    layers.push_back({{"files", files}, {"sources", layer.sources}});
  }
  m["layer_files"] = layers;
  return m;
}

}  // namespace

void write_operators(const Model& model, const std::string& ops_dir,
                     const std::map<std::string, std::string>& extra_files) {
  const fs::path target = fs::absolute(fs::path(ops_dir)).lexically_normal();
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "' is not a folder name");
  }
  if (!fs::is_directory(parent)) {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir, "': the folder '",
         parent.string(), "' does not exist");
  }
  const bool replacing = fs::exists(target);
  if (replacing && !(fs::is_directory(target) && is_operator_folder(target))) {
    fail(ErrorCode::invalid_argument, "convert: --out '", ops_dir,
         "' exists and is not an operator folder (no manifest.json of ", kFormat,
         "); refusing to replace it");
  }
  const std::string tag = ".emflow-tmp-" + std::to_string(::getpid()) + "-" + random_hex();
  const fs::path staging = parent / ("." + name + tag);
  const fs::path backup = parent / ("." + name + ".old" + tag);
  std::error_code ignored;
  try {
    if (!fs::create_directory(staging)) {
      fail(ErrorCode::io, "convert: cannot create '", staging.string(), "'");
    }
    for (std::int64_t l = 0; l < model.layer_count(); ++l) {
      each_part(model.layers[static_cast<std::size_t>(l)],
                [&](const char* part, const Tensor<double>& t) {
                  write_npy((staging / layer_file(l, part)).string(), t);
                });
    }
    if (model.final_gain.size() > 0) {
      write_npy((staging / "final_gain.npy").string(), model.final_gain);
      write_npy((staging / "final_bias.npy").string(), model.final_bias);
    }
    for (const auto& [file, bytes] : extra_files) {
      if (file.empty() || file.find('/') != std::string::npos || file == "manifest.json") {
        fail(ErrorCode::invalid_argument, "convert: extra file name '", file, "' is not allowed");
      }
      write_file_atomic((staging / file).string(), bytes);
    }
    write_file_atomic((staging / "manifest.json").string(), manifest_of(model).dump(2) + "\n");
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
  if (m.value("version", 0) != kVersion) bad("has an unsupported version");
  Model model;
  try {
    const std::string layout = m.at("layout").get<std::string>();
    if (layout != "bert" && layout != "gpt2") bad("has an unknown layout '" + layout + "'");
    model.layout = layout == "gpt2" ? Layout::gpt2 : Layout::bert;
    model.model_type = m.value("model_type", std::string());
    model.heads = m.at("heads").get<std::int64_t>();
    model.dim = m.at("dim").get<std::int64_t>();
    model.head_dim = m.at("head_dim").get<std::int64_t>();
    model.ffn_dim = m.at("ffn_dim").get<std::int64_t>();
    model.norm_eps = m.at("norm_eps").get<double>();
    model.pre_norm = m.at("pre_norm").get<bool>();
    model.causal = m.at("causal").get<bool>();
    const std::string activation = m.at("activation").get<std::string>();
    if (activation == "gelu") {
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
    const std::int64_t layers = m.at("layers").get<std::int64_t>();
    if (layers < 1 || model.heads < 1 || model.dim < 1 || model.head_dim * model.heads != model.dim)
      bad("has inconsistent sizes");
    if (static_cast<std::int64_t>(m.at("layer_files").size()) != layers) {
      bad("lists a different number of layer_files than its layers");
    }
    for (std::int64_t l = 0; l < layers; ++l) {
      const json& entry = m.at("layer_files").at(static_cast<std::size_t>(l));
      ModelLayer layer;
      each_part(layer, [&](const char* part, Tensor<double>& t) {
        t = read_npy<double>((dir / entry.at("files").at(part).get<std::string>()).string());
      });
      layer.sources = entry.at("sources").get<std::map<std::string, std::string>>();
      MultiHeadAttentionWeights& w = layer.attention;
      w.heads = model.heads;
      w.model_dim = model.dim;
      w.head_dim = w.value_dim = model.head_dim;
      validate(w, "read_operators");
      model.layers.push_back(std::move(layer));
    }
    if (m.at("final_norm").get<bool>()) {
      model.final_gain = read_npy<double>((dir / "final_gain.npy").string());
      model.final_bias = read_npy<double>((dir / "final_bias.npy").string());
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

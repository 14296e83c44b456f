#include "machine.hpp"

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "emflow/capability.hpp"
#include "emflow/types.hpp"

namespace emflow::cli {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : " ") + name;
  return out.empty() ? "(none)" : out;
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// A dense self-attention of one 64-token cloud in d = 64, with lse: the call whose route says
// which path each storage type takes.
Problem sample(Dtype storage) {
  Problem p;
  p.storage = storage;
  p.precision = storage == Dtype::bfloat16  ? Precision::bf16
                : storage == Dtype::float16 ? Precision::fp16
                                            : Precision::fp32;
  p.tokens = p.query_tokens = 64;
  p.dim = 64;
  p.lse = true;
  return p;
}

const std::vector<std::pair<const char*, Dtype>>& storages() {
  static const std::vector<std::pair<const char*, Dtype>> all = {{"float64", Dtype::float64},
                                                                 {"float32", Dtype::float32},
                                                                 {"bfloat16", Dtype::bfloat16},
                                                                 {"float16", Dtype::float16}};
  return all;
}

std::string path(Dtype storage, Device device) {
  const Route r = route(sample(storage), device, "attend");
  return r.supported ? to_string(r) : "refused (" + r.reason + ")";
}

}  // namespace

std::string version_text() {
  const Machine& m = this_machine();
  std::string out = std::string("emflow ") + EMFLOW_CLI_VERSION;
  out += "\ncpu: " + (m.cpu_name.empty() ? std::string("(unknown)") : m.cpu_name);
  out += "\n  extensions found: " + joined(m.cpu_features);
  if (!m.cpu_disabled.empty()) {
    out += "\n  paths not taken (EMFLOW_CPU_DISABLE): " + joined(m.cpu_disabled);
  }
  const char* forced = std::getenv("EMFLOW_CPU_PATH");
  out += "\n  engine paths built: " + joined(m.cpu_paths);
  out += "\n  engine path taken: " + m.cpu_instruction_set + " (uses " +
         joined(m.cpu_compiled_for) + ")" +
         (forced != nullptr && *forced != '\0' ? ", as EMFLOW_CPU_PATH asks" : "");
  if (!m.cpu_missing.empty()) {
    out += "\n  MISSING here: " + m.cpu_missing +
           " (the engine is refused: its lowest path needs it; the reference still runs)";
  }
  out += "\ngpu: ";
  if (!m.cuda_built) {
    out += "not built (EMFLOW_WITH_CUDA=OFF)";
  } else {
    out += m.cuda_device ? "a CUDA device is usable" : "no usable device (" + m.cuda_reason + ")";
  }
  out += "\npaths of a dense self-attention (route: device kernel products):";
  for (const auto& [name, storage] : storages()) {
    const std::string cpu = path(storage, Device::cpu);
    const std::string automatic = path(storage, Device::automatic);
    out += "\n  " + std::string(name) + std::string(9 - std::string(name).size(), ' ') + cpu;
    if (automatic != cpu) out += "; automatic: " + automatic;
  }
  return out;
}

std::string machine_json() {
  const Machine& m = this_machine();
  std::string features, compiled, paths;
  for (const std::string& name : m.cpu_features) {
    features += (features.empty() ? "" : ", ") + quoted(name);
  }
  for (const std::string& name : m.cpu_compiled_for) {
    compiled += (compiled.empty() ? "" : ", ") + quoted(name);
  }
  for (const auto& [name, storage] : storages()) {
    paths += (paths.empty() ? "" : ", ") + quoted(name) + ": " +
             quoted(path(storage, Device::automatic));
  }
  return ", \"cpu\": " + quoted(m.cpu_name) + ", \"cpu_features\": [" + features +
         "], \"cpu_compiled_for\": [" + compiled + "], \"paths\": {" + paths + "}";
}

}  // namespace emflow::cli

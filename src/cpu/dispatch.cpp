// The CPU backend's entry points for the rest of the library, in baseline code: each calls the
// function of the instruction-set path this process takes (target.hpp, kernels.hpp). The path is
// chosen once, with the machine (capability.cpp, this_machine): the highest of the build's paths
// whose extensions the processor has, or the one EMFLOW_CPU_PATH names; it never changes within
// a process, so the layouts a path packs (padded_columns: whole vectors of its width) stay the
// ones its kernels read.
#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "emflow/capability.hpp"
#include "emflow/error.hpp"
#include "kernels.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(EMFLOW_CPU_BUILT_avx2) && \
    !defined(EMFLOW_CPU_BUILT_avx512) && !defined(EMFLOW_CPU_BUILT_avx512bf16)
#error "compile with EMFLOW_CPU_BUILT_<path> for each path the build holds (CMakeLists.txt)"
#endif

namespace emflow::detail {

namespace cpu {

#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 {
extern const Kernels kernels;
}  // namespace avx2
namespace avx512 {
extern const Kernels kernels;
}  // namespace avx512
namespace avx512bf16 {
extern const Kernels kernels;
}  // namespace avx512bf16
#else
namespace generic {
extern const Kernels kernels;
}  // namespace generic
#endif

namespace {

struct Path {
  const Kernels* kernels;
  std::vector<std::string> required;  ///< of cpu_feature_names()
};

/// The extensions of cpu_feature_names() a path's target string names (CMakeLists.txt,
/// EMFLOW_CPU_PATH_<name>_ISA, given here as EMFLOW_CPU_BUILT_<name>): all of them but avx, which
/// every processor with avx2 has and the probe does not list.
std::vector<std::string> required_by(const char* target) {
  std::vector<std::string> out;
  std::stringstream list(target);
  std::string name;
  while (std::getline(list, name, ',')) {
    if (!name.empty() && name != "avx") out.push_back(name);
  }
  return out;
}

/// The build's paths, lowest first (all of them, or the one EMFLOW_ONLY_CPU_PATH kept:
/// EMFLOW_CPU_BUILT_<name>, each the path's target string).
const std::vector<Path>& paths() {
  static const std::vector<Path> built = [] {
    std::vector<Path> out;
#if defined(__x86_64__) || defined(_M_X64)
#if defined(EMFLOW_CPU_BUILT_avx2)
    out.push_back({&avx2::kernels, required_by(EMFLOW_CPU_BUILT_avx2)});
#endif
#if defined(EMFLOW_CPU_BUILT_avx512)
    out.push_back({&avx512::kernels, required_by(EMFLOW_CPU_BUILT_avx512)});
#endif
#if defined(EMFLOW_CPU_BUILT_avx512bf16)
    out.push_back({&avx512bf16::kernels, required_by(EMFLOW_CPU_BUILT_avx512bf16)});
#endif
#else
    out.push_back({&generic::kernels, {}});
#endif
    return out;
  }();
  return built;
}

const Kernels& chosen() {
  static const Kernels* const taken = []() -> const Kernels* {
    const std::string& name = this_machine().cpu_instruction_set;
    for (const Path& path : paths()) {
      if (name == path.kernels->name) return path.kernels;
    }
    return nullptr;
  }();
  if (taken == nullptr) require_cpu_engine("the CPU engine");
  return *taken;
}

/// The bfloat16 kernels exist on the avx512bf16 path only; route() asks Machine::avx512_bf16
/// first, so this guards against a caller that did not.
[[noreturn]] void require_bf16(const char* what) {
  throw Error(ErrorCode::unsupported, std::string(what) +
                                          " needs the CPU engine's avx512bf16 path, and this "
                                          "process takes " +
                                          this_machine().cpu_instruction_set);
}

}  // namespace

// The layout of a dense layer (engine.hpp) is the taken path's: baseline code, so that the one
// type serves every path.
DenseMaps::DenseMaps(const AttentionInput<float>& in) {
  const std::int64_t H = in.layer.heads, d = in.dim;
  const std::int64_t stride = padded_columns(d);
  const float beta = static_cast<float>(in.beta);
  query_map.assign(static_cast<std::size_t>(H * d * stride), 0.0f);
  value_map.assign(query_map.size(), 0.0f);
  if (in.layer.key_bias != nullptr) query_bias.assign(static_cast<std::size_t>(H * stride), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const float* M = in.layer.relevance + h * d * d;
    const float* F = in.layer.content + h * d * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t a = 0; a < d; ++a) {
        query_map[static_cast<std::size_t>((h * d + k) * stride + a)] = beta * M[k * d + a];
        value_map[static_cast<std::size_t>((h * d + k) * stride + a)] = F[a * d + k];
      }
    }
    if (!query_bias.empty()) {
      for (std::int64_t a = 0; a < d; ++a) {
        query_bias[static_cast<std::size_t>(h * stride + a)] = beta * in.layer.key_bias[h * d + a];
      }
    }
  }
  layer.heads = H;
  layer.dim = layer.score_dim = layer.value_dim = d;
  layer.query_map = query_map.data();
  layer.query_bias = query_bias.empty() ? nullptr : query_bias.data();
  layer.value_map = value_map.data();
  layer.offset = in.layer.offset;
}

std::int64_t padded_columns(std::int64_t columns) { return chosen().padded_columns(columns); }

void pack_key_rows(const float* rows, std::int64_t dim, std::int64_t first, std::int64_t count,
                   float* panels) {
  chosen().pack_key_rows(rows, dim, first, count, panels);
}

void project_rows(const float* rows, std::int64_t count, std::int64_t dim, const float* map,
                  std::int64_t columns, float* out) {
  chosen().project_rows(rows, count, dim, map, columns, out);
}

void attend_cached(const float* queries, std::int64_t query_tokens, const QueryRule& rule,
                   const CachedOperands& keys, const EngineLayer& layer,
                   const AttentionOutput<float>& output, int threads) {
  chosen().attend_cached(queries, query_tokens, rule, keys, layer, output, threads);
}

bool sdpa_inputs_finite(const SdpaArrays& arrays) { return chosen().sdpa_inputs_finite(arrays); }

void sdpa_forward(const SdpaArrays& arrays, float* output, float* lse, float* entropy,
                  int threads) {
  chosen().sdpa_forward(arrays, output, lse, entropy, threads);
}

bool sdpa_backward_finite(const SdpaArrays& arrays, const SdpaBackwardArrays& saved) {
  return chosen().sdpa_backward_finite(arrays, saved);
}

void sdpa_backward(const SdpaArrays& arrays, const SdpaBackwardArrays& saved,
                   const SdpaGradientArrays& gradients, int threads) {
  chosen().sdpa_backward(arrays, saved, gradients, threads);
}

void sdpa_backward_bf16(const SdpaArrays& arrays, const SdpaBackwardArrays& saved,
                        const SdpaGradientArrays& gradients, int threads) {
  if (chosen().sdpa_backward_bf16 == nullptr) require_bf16("the bfloat16 backward pass");
  chosen().sdpa_backward_bf16(arrays, saved, gradients, threads);
}

bool layer_backward(const BackwardClouds& clouds, const BackwardLayer& layer,
                    const LayerUpstream& upstream, const BackwardLayerGradients& gradients,
                    int threads) {
  return chosen().layer_backward(clouds, layer, upstream, gradients, threads);
}

}  // namespace cpu

CpuPath choose_cpu_path(const std::vector<std::string>& usable, const char* forced) {
  CpuPath out;
  for (const cpu::Path& path : cpu::paths()) out.built.emplace_back(path.kernels->name);
  const auto missing = [&usable](const cpu::Path& path) {
    return cpu_missing_features(path.required, usable);
  };
  const cpu::Path* taken = nullptr;
  if (forced != nullptr && *forced != '\0') {
    std::string choices;
    for (const std::string& name : out.built) choices += (choices.empty() ? "" : ", ") + name;
    for (const cpu::Path& path : cpu::paths()) {
      if (path.kernels->name == std::string(forced)) taken = &path;
    }
    if (taken == nullptr) {
      throw Error(ErrorCode::invalid_argument,
                  "environment variable EMFLOW_CPU_PATH names '" + std::string(forced) +
                      "', expected one of this build's paths: " + choices);
    }
    if (!missing(*taken).empty()) {
      throw Error(ErrorCode::invalid_argument,
                  "environment variable EMFLOW_CPU_PATH names '" + std::string(forced) +
                      "', which needs " + missing(*taken) +
                      " that this processor lacks (or EMFLOW_CPU_DISABLE turns off)");
    }
  } else {
    for (const cpu::Path& path : cpu::paths()) {
      if (missing(path).empty()) taken = &path;
    }
  }
  const cpu::Path& described = taken != nullptr ? *taken : cpu::paths().front();
  out.name = taken != nullptr ? taken->kernels->name : "none";
  out.required = described.required;
  out.missing = taken != nullptr ? "" : missing(described);
  return out;
}

void cpu_attend(const AttentionInput<float>& input, const AttentionOutput<float>& output,
                int threads) {
  cpu::chosen().attend(input, output, threads);
}

void cpu_partial(const AttentionInput<float>& input, const PartialOutput<float>& output,
                 int threads) {
  cpu::chosen().partial(input, output, threads);
}

void cpu_attend_factored(const AttentionInput<float>& input, const FactoredLayer<float>& layer,
                         const AttentionOutput<float>& output, int threads) {
  cpu::chosen().attend_factored(input, layer, output, threads);
}

void cpu_products(const float* A, std::int64_t rows, std::int64_t depth, const float* B,
                  std::int64_t columns, float* C, int threads) {
  cpu::chosen().products(A, rows, depth, B, columns, C, threads);
}

void cpu_cached_partial(const float* queries, std::int64_t heads, std::int64_t width,
                        const float* panels, const float* values, const float* const* bias,
                        float bias_scale, std::int64_t first, std::int64_t last, float* scratch,
                        double* lse, double* entropy, double* o) {
  cpu::chosen().cached_partial(queries, heads, width, panels, values, bias, bias_scale, first, last,
                               scratch, lse, entropy, o);
}

void cpu_products_bf16(const float* A, std::int64_t rows, std::int64_t depth, const bfloat16* B,
                       std::int64_t columns, float* C, int threads) {
  if (cpu::chosen().products_bf16 == nullptr) cpu::require_bf16("the bfloat16 products");
  cpu::chosen().products_bf16(A, rows, depth, B, columns, C, threads);
}

void cpu_gated_silu(const float* gate_up, std::int64_t rows, std::int64_t inner, float* hidden) {
  cpu::chosen().gated_silu(gate_up, rows, inner, hidden);
}

void cpu_attend_bf16(const AttentionInput<float>& input, const AttentionOutput<bfloat16>& output,
                     int threads) {
  if (cpu::chosen().attend_bf16 == nullptr) cpu::require_bf16("the bfloat16 attention");
  cpu::chosen().attend_bf16(input, output, threads);
}

}  // namespace emflow::detail

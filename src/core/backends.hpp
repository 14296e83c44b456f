// The seam between the public API and the backends. Each entry point of core validates once
// (validate.hpp), asks route() (capability.hpp) where its call runs, and calls the one function
// below that the route names; each backend implements the contract of its entry point on
// validated input, and decides nothing: the rules of which kernel computes what live in
// src/core/capability.cpp alone. Tests hold every backend against reference_attend.
#pragma once

#include <string>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/sdpa.hpp"
#include "validate.hpp"

namespace emflow::detail {

/// Double accumulation, written for clarity (src/reference/): Kernel::reference.
template <class T>
void reference_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output);

/// The double reference of the factored form (src/reference/attend.cpp), written as
/// docs/MATH.md §2.3 and §2.4 read: per head the projected queries A_h q_i and keys
/// B_{h/g} x_j, each rotated by its position (FactoredLayer::rotary), the scores
/// beta (<., .> + u_h^T x_j), and the contents U_h V_{h/g} x_j; every other rule (masks, lengths,
/// non-finite values) as reference_attend's. input.layer is empty, the operators come from
/// `layer`. With `partial` set it writes the per-head partial state of partial.hpp there instead
/// (no offset, no weights; `output` unused), as reference_partial does for the dense form.
void reference_attend_factored(const AttentionInput<double>& input,
                               const FactoredLayer<double>& layer,
                               const AttentionOutput<double>& output,
                               const PartialOutput<double>* partial = nullptr);

/// reference_attend's partial state over the input's keys (partial.hpp): per head, no offset.
template <class T>
void reference_partial(const AttentionInput<T>& input, const PartialOutput<T>& output);

/// The fused multi-threaded CPU engine (src/cpu/attend.cpp), Kernel::cpu_fused, on input whose
/// values are all finite (Problem::finite).
void cpu_attend(const AttentionInput<float>& input, const AttentionOutput<float>& output,
                int threads);

/// The engine's partial state (src/cpu/attend.cpp), on finite input.
void cpu_partial(const AttentionInput<float>& input, const PartialOutput<float>& output,
                 int threads);

/// The engine in rank r for the factored form (src/cpu/factored.cpp), on finite input:
/// input.layer is empty, the operators come from `layer`.
void cpu_attend_factored(const AttentionInput<float>& input, const FactoredLayer<float>& layer,
                         const AttentionOutput<float>& output, int threads);

/// The processor as src/core/cpu_features.cpp reads it (CPUID, XCR0), in baseline code.
struct CpuProbe {
  std::string name;                   ///< the brand string, "" where unknown
  std::vector<std::string> features;  ///< found, of cpu_feature_names()
  std::vector<std::string> disabled;  ///< the names `disabled` listed
};
/// Every extension the probe looks for, in its order.
std::vector<std::string> cpu_feature_names();
/// This processor's extensions, and those whose paths `disabled` (EMFLOW_CPU_DISABLE: a
/// comma-separated list of cpu_feature_names(); another name is invalid_argument naming it)
/// asks not to take.
CpuProbe probe_cpu(const char* disabled);
/// The extensions of `probe` that its `disabled` leaves: those a path may use.
std::vector<std::string> usable_cpu_features(const CpuProbe& probe);
/// The names of `required` that `found` lacks, space-separated ("" when none).
std::string cpu_missing_features(const std::vector<std::string>& required,
                                 const std::vector<std::string>& found);
/// The instruction-set path the CPU engine takes in this process (src/cpu/dispatch.cpp).
struct CpuPath {
  std::vector<std::string> built;     ///< the paths of this build, lowest first
  std::string name;                   ///< the path taken, or "none"
  std::vector<std::string> required;  ///< the extensions it needs (the lowest path's if none)
  std::string missing;                ///< those of `required` the processor lacks ("" if any runs)
};
/// The highest path of this build whose extensions are all in `usable` (the processor's, less
/// the disabled ones), or the one `forced` names (EMFLOW_CPU_PATH; an unknown name, or a path the
/// processor cannot run, is invalid_argument naming it and the choices). Baseline code.
CpuPath choose_cpu_path(const std::vector<std::string>& usable, const char* forced);
/// Why the engine cannot run on this machine (Machine::cpu_missing is not empty).
std::string cpu_engine_mismatch(const Machine& machine);
/// Throws ErrorCode::unsupported (naming `operation` and cpu_engine_mismatch) where the engine
/// cannot run here: for the engine's entry points that are not routed (the SDPA operator, the
/// layer backward).
void require_cpu_engine(const char* operation);

/// The multiple that the columns of cpu_products' B and C are padded to (zero columns in B).
inline constexpr std::int64_t kProductColumns = 16;
/// The columns of one panel of cpu_products' B.
inline constexpr std::int64_t kProductPanel = 256;

/// Where element (k, c) of cpu_products' B (depth x columns) lies in its panels.
inline std::int64_t product_index(std::int64_t depth, std::int64_t columns, std::int64_t k,
                                  std::int64_t c) {
  const std::int64_t first = c / kProductPanel * kProductPanel;
  const std::int64_t width = columns - first < kProductPanel ? columns - first : kProductPanel;
  return first * depth + k * width + (c - first);
}

/// C[rows x columns] = A[rows x depth] B[depth x columns] in float32 (src/cpu/products.cpp):
/// the products of a model's layers around attention, where torch runs float32 GEMMs too. A and
/// C are row-major; B is held in panels of kProductPanel columns (the last one narrower), each a
/// row-major depth x width block after the one before (product_index), so that a panel is read
/// as one stream: from memory for one row (decoding), from the L2 cache for many. `columns` is
/// a multiple of kProductColumns. Every element is one chain of FMAs over k = 0..depth-1, so the
/// result does not depend on `threads` (0: every core when the product is large). Only where the
/// engine can run (Machine::cpu_missing empty).
void cpu_products(const float* A, std::int64_t rows, std::int64_t depth, const float* B,
                  std::int64_t columns, float* C, int threads);

/// Keys per panel of the float factored decode cache (cpu_cached_partial).
inline constexpr std::int64_t kCachedPanel = 16;

/// One query's partial state (partial.hpp) for `heads` heads of one kv head's group against its
/// cached keys [first, last) (src/cpu/cached_keys.cpp), in float32 as the engine computes:
/// queries (heads x width) already scaled and rotated; `panels`, the keys transposed in panels of
/// kCachedPanel keys (key j at panels[(j / P) P width + k P + j % P], the slots past the cache's
/// end finite); `values`, rows of width floats; `bias`, per head the key bias term of every key
/// (or null), scaled by bias_scale. Writes per head lse, entropy and o (the weighted value, width
/// doubles); `scratch` holds heads (ceil(last / P) - floor(first / P)) P + width floats.
/// first < last. Where the engine runs.
void cpu_cached_partial(const float* queries, std::int64_t heads, std::int64_t width,
                        const float* panels, const float* values, const float* const* bias,
                        float bias_scale, std::int64_t first, std::int64_t last, float* scratch,
                        double* lse, double* entropy, double* o);

/// Where element (k, c) of cpu_products_bf16's B (depth x columns, bfloat16) lies: the panels of
/// cpu_products, each a row of `width` pairs per pair of depth rows, (k, c) and (k + 1, c) side
/// by side (an odd depth padded with a zero row).
inline std::int64_t product_index_bf16(std::int64_t depth, std::int64_t columns, std::int64_t k,
                                       std::int64_t c) {
  const std::int64_t first = c / kProductPanel * kProductPanel;
  const std::int64_t width = columns - first < kProductPanel ? columns - first : kProductPanel;
  const std::int64_t pairs = (depth + 1) / 2;
  return first * 2 * pairs + (k / 2) * 2 * width + 2 * (c - first) + k % 2;
}

/// C = A B as cpu_products, in bfloat16 (src/cpu/products_bf16.cpp): A's elements rounded to
/// bfloat16 (to nearest even) once, B stored in bfloat16 (product_index_bf16), each pair of
/// products summed into float32 by vdpbf16ps: what a bfloat16 model's layers compute, reading
/// half the bytes of B. Every element's sum runs over the pairs in order, so the result does not
/// depend on `threads`. Only where Machine::avx512_bf16.
void cpu_products_bf16(const float* A, std::int64_t rows, std::int64_t depth, const bfloat16* B,
                       std::int64_t columns, float* C, int threads);

/// hidden[r][k] = silu(g) u for g = gate_up[r][k], u = gate_up[r][inner + k] (rows of 2 inner
/// floats; hidden rows of inner), the gated block's middle in float32 with the engine's exp
/// (relative error about 2 ulp); `inner` a multiple of kProductColumns. Where the engine runs.
void cpu_gated_silu(const float* gate_up, std::int64_t rows, std::int64_t inner, float* hidden);

/// The AVX512-BF16 CPU path (src/cpu/attend_bf16.cpp), Kernel::cpu_bf16, of bfloat16
/// self-attention of a dense layer without weights: `input` holds the stored bfloat16 values
/// widened to float, all finite; writes the update in bfloat16 and lse and entropy in float32
/// (docs/MATH.md §7).
void cpu_attend_bf16(const AttentionInput<float>& input, const AttentionOutput<bfloat16>& output,
                     int threads);

/// Blocking CUDA path on host arrays (src/cuda/attend_blocking.cpp, or a stub without CUDA): the
/// arrays copied to the device, a cuda::AttentionPlan made with the algorithm and the precision
/// of `route` (a supported route on Device::cuda) run there, the outputs copied back.
template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const Route& route);

/// Blocking CUDA path of attend_partial on host arrays, with the algorithm of `route`.
template <class T>
void cuda_attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                         const Route& route);

/// Blocking CUDA path of attend_factored on host arrays: copies to the device, runs a
/// cuda::AttentionPlan of the factored layer (the tensor cores, or for an expanded route of
/// float or double the layer expanded to dense operators on the device), copies back.
template <class T>
void cuda_attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, const Route& route);

/// The blocking CUDA paths of sdpa_attend and sdpa_backward on host arrays (src/cuda/sdpa.cpp, or
/// stubs without CUDA): the arrays copied to the device, the stream-ordered calls
/// (cuda::sdpa_attend_async, sdpa_backward_async) run on the copies, the results copied back.
/// The arguments are validated, routed to the GPU and finite. `precision`: the call's
/// (Precision::tf32 for float, whose products on the tensor cores are TF32).
template <class T>
void cuda_sdpa_attend(const SdpaInput<T>& input, const SdpaOutput<T>& output, Precision precision);
template <class T>
void cuda_sdpa_backward(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                        const UpstreamGradients<T>& upstream,
                        const SdpaGradientOutput<T>& gradients);

/// Whether a CUDA device can be used; when not, `reason` says why (no CUDA build, no device,
/// driver error). Read once per process, by this_machine().
bool cuda_device_available(std::string* reason);

}  // namespace emflow::detail

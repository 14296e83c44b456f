// emflow: which backend and kernel compute a problem, or why none can.
//
// Every entry point (attend, attend_factored, attend_partial, the decode cache, the distributed
// ring, the CUDA plan, the Python package) describes its call as a Problem, a description without
// arrays, and asks route() where it runs. The eligibility rules (the tensor cores' largest
// dimension, which outputs a kernel forms, which storage types a device holds) are written once,
// in route(); a caller that wants to know in advance whether a call will run, and how, asks the
// same question (as cuDNN's check_support or CUTLASS's can_implement):
//
//   emflow::Problem problem = emflow::describe(input, output);
//   const emflow::Route route = emflow::route(problem, emflow::Device::automatic);
//   if (!route.supported) std::cerr << route.reason << "\n";
//   else std::cout << emflow::to_string(route) << "\n";  // "cuda cuda_tensor_cores bf16"
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

namespace emflow {

/// The two ways a layer's operators are given (docs/MATH.md §1, §2).
enum class Form {
  dense,     ///< M_h, F_h (d x d each): LayerOperators
  factored,  ///< M_h = A_h^T B_h, F_h = U_h V_h of rank r: FactoredLayer
};

/// What a call computes.
enum class Operation {
  update,         ///< the contextual update (attend, attend_factored)
  partial,        ///< the partial state over a block of keys (attend_partial, partial.hpp)
  decode,         ///< queries against a decode cache's keys (decode.hpp)
  sdpa,           ///< the SDPA-shaped operator on projected queries, keys, values (sdpa.hpp)
  sdpa_backward,  ///< its gradients (sdpa_backward)
  backward,       ///< the gradients of a layer (attend_backward, attend_factored_backward)
};

/// The algorithm a caller asks of the GPU (cuda.hpp): automatic, or one of the two float32
/// product paths. Host devices ignore it.
enum class Algorithm { automatic, fused, unfused };

/// The code that computes a routed problem.
enum class Kernel {
  reference,     ///< the double-precision reference, written as the formulas read (src/reference)
  cpu_fused,     ///< the fused multi-threaded CPU engine: float32 products, online softmax
  cpu_bf16,      ///< the fused CPU engine with AVX512-BF16 products (float32 accumulation)
  cuda_fused,    ///< the fused float32 GPU kernel (online softmax, never N x N)
  cuda_unfused,  ///< cuBLAS products and a row-softmax kernel (the N x N scores stored)
  cuda_tensor_cores,  ///< the mma.sync kernel: bf16, fp16 or TF32 operands, float32 accumulation
};

/// A call described by its shapes and options, without its arrays.
struct Problem {
  Operation operation = Operation::update;
  Form form = Form::dense;
  Dtype storage = Dtype::float32;         ///< float64, float32, bfloat16 or float16
  Precision precision = Precision::fp32;  ///< as ExecutionOptions::precision
  Algorithm algorithm = Algorithm::automatic;
  std::int64_t batch = 1;
  std::int64_t tokens = 0;        ///< N, the keys
  std::int64_t query_tokens = 0;  ///< Nq; equal to tokens for self-attention
  std::int64_t dim = 0;
  std::int64_t heads = 1;
  std::int64_t rank = 0;  ///< r, the factored form only
  /// The factored form's kv heads (FactoredLayer::kv_heads, 0 resolved to heads); 0 for the
  /// dense form. Fewer than heads: grouped-query heads.
  std::int64_t kv_heads = 0;
  std::int64_t rotary_dim = 0;  ///< FactoredLayer::rotary.dim: rotated coordinates, 0 for none
  /// Explicit rotary positions (Rotary::key_positions or query_positions: host memory).
  bool rotary_positions = false;
  Mask mask;
  bool cross = false;          ///< queries of their own (AttentionInput::queries)
  bool query_lengths = false;  ///< per-cloud query lengths
  bool positions = false;      ///< key_position, query_position or query_positions set
  bool key_lengths = false;    ///< per-cloud key lengths
  bool key_bias = false;       ///< u_h
  bool offset = false;         ///< c
  bool lse = false;            ///< outputs asked for
  bool entropy = false;
  bool weights = false;
  /// Every key a query can read is finite (the cloud's tokens within the key lengths; for the
  /// factored form the factors too; for the 16-bit types every value of the cloud, the queries
  /// and the operators). The CPU's kernels
  /// route on it (non-finite input goes to the reference, which puts NaN where
  /// docs/MATH.md §6.6 says); describe() reads no array and leaves it true, and the host entry
  /// points (attend, attend_factored, attend_partial) compute it before they ask route().
  bool finite = true;

  /// Self-attention as it was before queries existed: no queries, query lengths or positions.
  /// Some kernels (cpu_bf16) keep a fast path for it alone.
  constexpr bool plain_self_attention() const noexcept {
    return !cross && !query_lengths && !positions;
  }
  /// Grouped-query heads: kv heads fewer than the heads (the factored form).
  constexpr bool grouped() const noexcept { return kv_heads != 0 && kv_heads != heads; }
  /// dim for the dense form, rank for the factored one: the width of the scores' products.
  constexpr std::int64_t score_width() const noexcept {
    return form == Form::factored ? rank : dim;
  }
};

/// The answer to a Problem on a device.
struct Route {
  bool supported = false;
  /// Why not, when !supported: names the device, the limit and the value, e.g. "attend: cuda
  /// tensor_cores: weights are not computed on the tensor cores (ask for lse and the update)".
  std::string reason;
  /// True when !supported only because the device is absent (no CUDA build or no GPU): the one
  /// refusal a test may turn into a skip.
  bool device_missing = false;
  Device device = Device::cpu;  ///< cpu, cuda or reference (never automatic)
  Kernel kernel = Kernel::reference;
  /// The factored layer is first expanded to dense M_h = A_h^T B_h, F_h = U_h V_h (in double for
  /// the reference, in the storage type on the GPU), then computed by `kernel`.
  bool expanded = false;
  /// What the arithmetic runs in: float64 or float32 (16-bit storage accumulates in float32).
  Dtype computes = Dtype::float32;
  /// The operands of the products: fp32 (float32, or float64 when computes is float64), tf32,
  /// bf16 or fp16. tf32 is a permission: a host device computes fp32 for it.
  Precision products = Precision::fp32;
};

/// What this process can use: asked once (the first call) and kept.
struct Machine {
  bool cuda_built = false;   ///< emflow was built with the CUDA backend
  bool cuda_device = false;  ///< and a device is usable
  std::string cuda_reason;   ///< why not, when !cuda_device
  bool avx512_bf16 = false;  ///< the engine takes its avx512bf16 path here (cpu_bf16)
  /// The processor: its CPUID brand string with family and model ("" where unknown) and the
  /// extensions found of avx2, fma, f16c, bmi2, avx512f, avx512dq, avx512bw, avx512vl,
  /// avx512vnni, avx512vbmi, avx512bf16, avx512fp16, amx-tile, amx-bf16, amx-int8 (each only
  /// where the operating system saves its registers).
  std::string cpu_name;
  std::vector<std::string> cpu_features;
  /// The extensions the environment variable EMFLOW_CPU_DISABLE lists (comma-separated): the
  /// paths that need them are not taken (cpu_bf16 without avx512bf16), a way to test the others.
  std::vector<std::string> cpu_disabled;
  /// The fused CPU engine (src/cpu) is built once per instruction-set path, and each process
  /// takes the highest path whose extensions the processor has (and EMFLOW_CPU_DISABLE leaves),
  /// or the one the environment variable EMFLOW_CPU_PATH names. cpu_paths: the paths of this
  /// build, lowest first ("avx2", "avx512", "avx512bf16" on x86-64; "generic" elsewhere).
  std::vector<std::string> cpu_paths;
  /// The path taken ("none" where the processor has none of them) and the extensions it uses
  /// (the lowest path's where none runs).
  std::string cpu_instruction_set;
  std::vector<std::string> cpu_compiled_for;
  /// Those of cpu_compiled_for this processor lacks, space-separated ("" when a path runs):
  /// the engine's kernels are then refused with the reason (the double reference still runs on
  /// Device::reference).
  std::string cpu_missing;
};

/// This process's machine.
const Machine& this_machine();

/// The largest dim (dense) or rank (factored) of the GPU's fused float32 kernel and of its
/// tensor-core kernel.
inline constexpr std::int64_t kCudaFusedMaxDim = 256;
inline constexpr std::int64_t kTensorCoreMaxDim = 256;
/// Largest rank and value_rank of the SDPA-shaped operator's float32 kernels on the GPU (the
/// forward pass with Precision::fp32) and of its backward pass there.
inline constexpr std::int64_t kCudaSdpaBackwardMaxRank = 128;

/// The storage type of T.
template <class T>
constexpr Dtype dtype_of() noexcept {
  if constexpr (std::is_same_v<T, double>) {
    return Dtype::float64;
  } else if constexpr (std::is_same_v<T, float>) {
    return Dtype::float32;
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return Dtype::bfloat16;
  } else {
    static_assert(std::is_same_v<T, float16>, "storage is double, float, bfloat16 or float16");
    return Dtype::float16;
  }
}

/// The Problem of an attend call: shapes, options and which optional arrays are given. Reads no
/// array: `finite` is left true (a host entry point that routes on it sets it).
template <class T>
Problem describe(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const ExecutionOptions& options = {});
/// The Problem of an attend_factored call (input.layer unused).
template <class T>
Problem describe(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                 const AttentionOutput<T>& output, const ExecutionOptions& options = {});
/// The Problem of an attend_partial call.
template <class T>
Problem describe(const AttentionInput<T>& input, const PartialOutput<T>& output,
                 const ExecutionOptions& options = {});

/// The Problem of an attend_partial call of a factored layer (input.layer unused).
template <class T>
Problem describe(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                 const PartialOutput<T>& output, const ExecutionOptions& options = {});

/// The Problem of a decode cache of `layer` in R^dim made with `options` (decode.hpp): its keys
/// and contents are what the cache holds, `tokens` its capacity (0: grows without limit).
template <class T>
Problem describe(const LayerOperators<T>& layer, std::int64_t dim, const DecodeOptions& options);
/// The same for a factored layer.
template <class T>
Problem describe(const FactoredLayer<T>& layer, std::int64_t dim, const DecodeOptions& options);

/// Where `problem` runs when `requested` is asked for on `machine`: for Device::automatic the
/// GPU when it is usable and computes the problem (the CPU otherwise); for a named device that
/// device or the reason it cannot. Never throws; reads no array. `operation` prefixes reasons.
Route route(const Problem& problem, Device requested, const Machine& machine,
            const char* operation = "attend");
/// route() on this process's machine.
Route route(const Problem& problem, Device requested = Device::automatic,
            const char* operation = "attend");

/// route(), throwing emflow::Error (ErrorCode::unsupported, the route's reason) when the problem
/// cannot run there: what the entry points call.
Route require_route(const Problem& problem, Device requested, const char* operation);

/// "reference", "cpu_fused", ..., "cuda_tensor_cores".
const char* to_string(Kernel kernel) noexcept;
const char* to_string(Form form) noexcept;
const char* to_string(Operation operation) noexcept;
const char* to_string(Algorithm algorithm) noexcept;
/// "cuda cuda_tensor_cores bf16", "cpu cpu_fused fp32 (expanded)", or "unsupported: <reason>".
std::string to_string(const Route& route);

#define EMFLOW_CAPABILITY_EXTERN(T)                                                        \
  extern template Problem describe<T>(const AttentionInput<T>&, const AttentionOutput<T>&, \
                                      const ExecutionOptions&);                            \
  extern template Problem describe<T>(const AttentionInput<T>&, const FactoredLayer<T>&,   \
                                      const AttentionOutput<T>&, const ExecutionOptions&); \
  extern template Problem describe<T>(const AttentionInput<T>&, const PartialOutput<T>&,   \
                                      const ExecutionOptions&);                            \
  extern template Problem describe<T>(const AttentionInput<T>&, const FactoredLayer<T>&,   \
                                      const PartialOutput<T>&, const ExecutionOptions&);
EMFLOW_CAPABILITY_EXTERN(float)
EMFLOW_CAPABILITY_EXTERN(double)
EMFLOW_CAPABILITY_EXTERN(bfloat16)
EMFLOW_CAPABILITY_EXTERN(float16)
#undef EMFLOW_CAPABILITY_EXTERN
extern template Problem describe<float>(const LayerOperators<float>&, std::int64_t,
                                        const DecodeOptions&);
extern template Problem describe<double>(const LayerOperators<double>&, std::int64_t,
                                         const DecodeOptions&);
extern template Problem describe<float>(const FactoredLayer<float>&, std::int64_t,
                                        const DecodeOptions&);
extern template Problem describe<double>(const FactoredLayer<double>&, std::int64_t,
                                         const DecodeOptions&);

}  // namespace emflow

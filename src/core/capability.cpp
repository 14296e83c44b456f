// The capability function (include/emflow/capability.hpp): every rule that decides which device
// and kernel compute a problem, or why none can, in one place.
//
// The rules, by device:
//   reference  every storage type, the update and the partial state; the factored form expanded
//              to dense operators in double (its partial state in the factored form, in double).
//              No decode cache (its keys live on cpu or cuda). The SDPA-shaped operator and its
//              backward, and the gradients of a layer (float or double), in double.
//   cpu        the update: float in the fused engine (dense and factored), double in the
//              reference; bfloat16 and float16 widened exactly to float and computed there, except
//              bfloat16 self-attention without weights on a processor with AVX512-BF16, whose
//              products take bf16 operands. Input with a non-finite value goes to the reference
//              (expanded for the factored form), which puts NaN exactly where docs/MATH.md §6.6
//              says. The partial state: float in the engine (the reference for non-finite
//              input), double in the reference; the factored form's, float or double, in the
//              double reference of the factored form (never expanded). The decode cache: float
//              in the engine (the factored form in double where the engine cannot run), double
//              in double. The engine runs the highest of its instruction-set paths that the
//              processor has (avx512bf16, avx512, avx2: src/cpu/dispatch.cpp); where it has
//              none (Machine::cpu_missing), every engine kernel is refused with the reason; the
//              reference kernels still run. The SDPA-shaped operator and its backward: the
//              engine in float32 (16-bit storage widened exactly), the bfloat16 backward on
//              AVX512-BF16 (cpu_bf16), double in the reference; a layer's gradients: float in
//              the engine, double in the reference (non-finite input: the reference, by the
//              entry point, as for the update).
//   cuda       dense float: the tensor cores for tf32 where they compute what is asked (no
//              weights, dim <= kTensorCoreMaxDim, not Algorithm::unfused), else fused (no
//              weights, dim <= kCudaFusedMaxDim) or unfused (cuBLAS); double: unfused; bfloat16
//              and float16: the tensor cores (no weights, dim <= kTensorCoreMaxDim). Factored:
//              16-bit, and float with tf32, on the tensor cores (rank <= kTensorCoreMaxDim, no
//              weights); otherwise expanded to dense operators in the storage type and routed as
//              the dense form. The partial state: float and double as the dense update without
//              weights; not the factored form's. The decode cache: float, dense,
//              dim <= kCudaFusedMaxDim, with a capacity.
//              The SDPA-shaped operator: float with Precision::fp32 on the float32 kernel
//              (rank, value_rank <= kCudaSdpaBackwardMaxRank), float with tf32 and 16-bit
//              storage on the tensor cores (value_rank = rank <= kTensorCoreMaxDim); its
//              backward: float32 kernels for float, the tensor cores for 16-bit storage (rank,
//              value_rank <= kCudaSdpaBackwardMaxRank), no double. No GPU path for a layer's
//              gradients (Operation::backward). Index arithmetic is 32-bit: larger problems are
//              refused.
//   automatic  cuda when a device is usable and computes the problem, else cpu; where the
//              processor has none of the engine's paths, the reference.
//
// Rotary positions and grouped kv heads (FactoredLayer::rotary, kv_heads) run on the host, for
// the update, the partial state and the decode cache: a rotary layer has no single M_h, so it is
// never expanded: the update in float in the engine in rank r (cpu), double and non-finite input
// in the double reference of the factored form (cpu, reference); grouped heads without rotation
// expand as before (B and V repeated). The factored partial state and decode cache compute in the
// factored form in double, rotating each key and query at its position (the cache each key once,
// when it is appended), and store kv_heads projected keys and values. On cuda the factored
// update with either runs on the tensor cores (16-bit storage, or float with tf32: the
// projections turned at the rows' positions in tc_factored.cpp, a kv head per group of query
// heads in the attention), or for float with fp32 on the same projections and the SDPA
// operator's float32 kernel (rank <= kCudaSdpaBackwardMaxRank); the float64 path, which expands
// the layer, the partial state, the decode cache and explicit rotary positions (host memory)
// are refused there.
#include "emflow/capability.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "backends.hpp"
#include "check.hpp"
#include "dispatch.hpp"
#include "queries.hpp"
#include "validate.hpp"

namespace emflow {

namespace {

bool is_16bit(Dtype storage) { return storage == Dtype::bfloat16 || storage == Dtype::float16; }

bool is_storage(Dtype storage) {
  return storage == Dtype::float64 || storage == Dtype::float32 || is_16bit(storage);
}

/// A route that runs.
Route runs(Device device, Kernel kernel, Dtype computes, Precision products,
           bool expanded = false) {
  Route r;
  r.supported = true;
  r.device = device;
  r.kernel = kernel;
  r.computes = computes;
  r.products = products;
  r.expanded = expanded;
  return r;
}

/// A refusal on `device`: "<operation>: <device>: <why...>".
template <class... Parts>
Route refused(Device device, const char* operation, Parts&&... parts) {
  std::ostringstream out;
  out << operation << ": " << to_string(device) << ": ";
  (out << ... << std::forward<Parts>(parts));
  Route r;
  r.device = device;
  r.reason = out.str();
  return r;
}

/// The products' precision of a 16-bit storage type on the tensor cores.
Precision tensor_core_products(const Problem& p) {
  if (p.storage == Dtype::bfloat16) return Precision::bf16;
  if (p.storage == Dtype::float16) return Precision::fp16;
  return Precision::tf32;
}

/// A rotary layer, or one with grouped kv heads.
bool rotary_or_grouped(const Problem& p) {
  return p.form == Form::factored && (p.rotary_dim != 0 || p.grouped());
}

/// What the factored layer is missing on a path that does not compute rotary positions or
/// grouped heads: "rotary positions (rotary.dim 8)", "grouped kv heads (kv_heads 2 of 8 heads)".
std::string rotary_or_grouped_names(const Problem& p) {
  std::ostringstream out;
  if (p.rotary_dim != 0) out << "rotary positions (rotary.dim " << p.rotary_dim << ")";
  if (p.rotary_dim != 0 && p.grouped()) out << " and ";
  if (p.grouped()) out << "grouped kv heads (kv_heads " << p.kv_heads << " of " << p.heads << ")";
  return out.str();
}

Route on_reference(const Problem& p, const char* op) {
  if (p.operation == Operation::backward && is_16bit(p.storage)) {
    return refused(Device::reference, op, "the gradients of a layer are float or double, got ",
                   to_string(p.storage));
  }
  if (p.operation == Operation::sdpa || p.operation == Operation::sdpa_backward ||
      p.operation == Operation::backward) {
    return runs(Device::reference, Kernel::reference, Dtype::float64, Precision::fp32);
  }
  if (p.operation == Operation::decode) {
    return refused(Device::reference, op,
                   "a decode cache lives on cpu or cuda (the reference holds no cache)");
  }
  if (p.operation == Operation::partial && is_16bit(p.storage)) {
    return refused(Device::reference, op, "partial states are float or double, got ",
                   to_string(p.storage));
  }
  if (p.operation == Operation::partial && p.form == Form::factored) {
    // The factored form in double: rotary positions and grouped heads as they are.
    return runs(Device::reference, Kernel::reference, Dtype::float64, Precision::fp32);
  }
  // A rotary layer has no single M_h: the reference computes it in the factored form.
  return runs(Device::reference, Kernel::reference, Dtype::float64, Precision::fp32,
              p.form == Form::factored && p.rotary_dim == 0);
}

Route on_cpu_kernels(const Problem& p, const Machine& machine, const char* op) {
  const bool factored = p.form == Form::factored;
  switch (p.operation) {
    case Operation::sdpa:
    case Operation::sdpa_backward:
    case Operation::backward:
      // The engine in float32 (16-bit storage widened exactly), the bfloat16 backward of the
      // SDPA operator on AVX512-BF16; double in the reference. A value the engine would read
      // that is not finite sends the call to the reference there (src/core/sdpa.cpp,
      // layer_backward.cpp), which puts NaN where docs/MATH.md says.
      if (p.storage == Dtype::float64) {
        return runs(Device::cpu, Kernel::reference, Dtype::float64, Precision::fp32);
      }
      if (p.operation == Operation::sdpa_backward && p.storage == Dtype::bfloat16 &&
          machine.avx512_bf16) {
        return runs(Device::cpu, Kernel::cpu_bf16, Dtype::float32, Precision::bf16);
      }
      if (p.operation == Operation::backward && is_16bit(p.storage)) {
        return refused(Device::cpu, op, "the gradients of a layer are float or double, got ",
                       to_string(p.storage));
      }
      return runs(Device::cpu, Kernel::cpu_fused, Dtype::float32, Precision::fp32);
    case Operation::partial:
      if (factored && (p.storage == Dtype::float32 || p.storage == Dtype::float64)) {
        // The double reference of the factored form, never expanded (a rotary layer has no
        // dense form, and grouped heads read their kv head as they are).
        return runs(Device::cpu, Kernel::reference, Dtype::float64, Precision::fp32);
      }
      if (p.storage == Dtype::float32 && p.finite) {
        return runs(Device::cpu, Kernel::cpu_fused, Dtype::float32, Precision::fp32);
      }
      if (p.storage == Dtype::float32 || p.storage == Dtype::float64) {
        return runs(Device::cpu, Kernel::reference, Dtype::float64, Precision::fp32);
      }
      return refused(Device::cpu, op, "partial states are float or double, got ",
                     to_string(p.storage));
    case Operation::decode:
      if (p.storage == Dtype::float32 && !factored) {
        return runs(Device::cpu, Kernel::cpu_fused, Dtype::float32, Precision::fp32);
      }
      if (p.storage == Dtype::float32 || p.storage == Dtype::float64) {
        return runs(Device::cpu, Kernel::reference, Dtype::float64, Precision::fp32);
      }
      return refused(Device::cpu, op, "decode caches are float or double, got ",
                     to_string(p.storage));
    case Operation::update:
      break;
  }
  if (p.storage == Dtype::float64 || !p.finite) {
    return runs(Device::cpu, Kernel::reference, Dtype::float64, Precision::fp32,
                factored && p.rotary_dim == 0);
  }
  if (p.storage == Dtype::bfloat16 && !factored && machine.avx512_bf16 &&
      p.plain_self_attention() && !p.weights) {
    return runs(Device::cpu, Kernel::cpu_bf16, Dtype::float32, Precision::bf16);
  }
  return runs(Device::cpu, Kernel::cpu_fused, Dtype::float32, Precision::fp32);
}

// The engine's kernels only where one of its paths runs on this processor.
Route on_cpu(const Problem& p, const Machine& machine, const char* op) {
  Route r = on_cpu_kernels(p, machine, op);
  if (r.supported && r.kernel != Kernel::reference && !machine.cpu_missing.empty()) {
    return refused(Device::cpu, op, detail::cpu_engine_mismatch(machine));
  }
  return r;
}

/// The 32-bit index limit of the CUDA kernels: rows of every head and cloud times the width.
std::string cuda_size_limit(const Problem& p) {
  const std::int64_t longest = p.tokens > p.query_tokens ? p.tokens : p.query_tokens;
  const std::int64_t width = p.dim > p.rank ? p.dim : p.rank;
  // Shapes were validated: each product below fits in int64 unless its factors are absurd, so
  // compare by division.
  const std::int64_t rows_limit = INT_MAX / (width > 0 ? width : 1);
  if (longest > INT_MAX - 256 || p.batch > rows_limit || p.heads > rows_limit / p.batch ||
      longest > rows_limit / (p.batch * p.heads)) {
    std::ostringstream out;
    out << p.batch << " x " << p.heads << " x " << longest << " rows of " << width
        << " values exceed the CUDA backend's 32-bit index limit of " << INT_MAX;
    return out.str();
  }
  return {};
}

/// The dense float32 / float64 rule on the GPU (fused, unfused, or TF32 tensor cores).
Route cuda_dense_products(const Problem& p, const char* op, bool expanded) {
  const bool tf32 = p.storage == Dtype::float32 && p.precision == Precision::tf32;
  if (tf32 && !p.weights && p.dim <= kTensorCoreMaxDim && p.algorithm != Algorithm::unfused &&
      p.operation == Operation::update) {
    return runs(Device::cuda, Kernel::cuda_tensor_cores, Dtype::float32, Precision::tf32, expanded);
  }
  const Dtype computes = p.storage == Dtype::float64 ? Dtype::float64 : Dtype::float32;
  const bool fused_fits = p.storage == Dtype::float32 && !p.weights && p.dim <= kCudaFusedMaxDim;
  switch (p.algorithm) {
    case Algorithm::fused:
      if (p.storage != Dtype::float32) {
        return refused(Device::cuda, op, "the fused algorithm runs float32 only, got ",
                       to_string(p.storage));
      }
      if (p.weights) {
        return refused(Device::cuda, op,
                       "the fused algorithm does not form the weights (use unfused)");
      }
      if (p.dim > kCudaFusedMaxDim) {
        return refused(Device::cuda, op, "the fused algorithm needs dim <= ", kCudaFusedMaxDim,
                       ", got ", p.dim);
      }
      return runs(Device::cuda, Kernel::cuda_fused, computes, Precision::fp32, expanded);
    case Algorithm::unfused:
      return runs(Device::cuda, Kernel::cuda_unfused, computes, Precision::fp32, expanded);
    case Algorithm::automatic:
      return runs(Device::cuda, fused_fits ? Kernel::cuda_fused : Kernel::cuda_unfused, computes,
                  Precision::fp32, expanded);
  }
  return refused(Device::cuda, op, "unknown algorithm");
}

/// The SDPA-shaped operator's forward on the GPU, on the caller's projected queries, keys and
/// values (src/cuda/sdpa_async.cpp): float with Precision::fp32 on the float32 kernel of
/// kernels/sdpa_backward.cu, float with tf32 and 16-bit storage on the tensor-core attention
/// kernel.
Route cuda_sdpa(const Problem& p, const char* op) {
  const bool tf32 = p.storage == Dtype::float32 && p.precision == Precision::tf32;
  if (p.storage == Dtype::float32 && !tf32) {
    // The float32 kernel of kernels/sdpa_backward.cu (FFMA, online softmax): float products.
    if (p.rank > kCudaSdpaBackwardMaxRank || p.dim > kCudaSdpaBackwardMaxRank) {
      return refused(Device::cuda, op, "the GPU's float32 SDPA needs rank and value_rank <= ",
                     kCudaSdpaBackwardMaxRank, ", got ", p.rank, " and ", p.dim,
                     " (Precision::tf32 runs rank <= ", kTensorCoreMaxDim,
                     " on the tensor cores; or use Device::cpu)");
    }
    return runs(Device::cuda, Kernel::cuda_fused, Dtype::float32, Precision::fp32);
  }
  if (!is_16bit(p.storage) && !tf32) {
    return refused(Device::cuda, op,
                   "the SDPA-shaped operator on the GPU computes float (Precision::fp32 or "
                   "tf32), bfloat16 or float16; got ",
                   to_string(p.storage), " with Precision::", to_string(p.precision),
                   " (use Device::cpu)");
  }
  if (p.rank != p.dim) {
    return refused(Device::cuda, op, "the GPU's SDPA needs value_rank equal to rank, got ", p.dim,
                   " and ", p.rank, " (use Device::cpu)");
  }
  if (p.rank > kTensorCoreMaxDim) {
    return refused(Device::cuda, op, "the tensor cores need rank <= ", kTensorCoreMaxDim, ", got ",
                   p.rank);
  }
  return runs(Device::cuda, Kernel::cuda_tensor_cores, Dtype::float32, tensor_core_products(p));
}

/// The SDPA-shaped operator's backward on the GPU (kernels/sdpa_backward.cu): the float32 kernels
/// for float (Precision::tf32 is a permission there), the tensor-core kernels for 16-bit storage
/// (bf16 or fp16 products, float32 accumulation).
Route cuda_sdpa_backward(const Problem& p, const char* op) {
  if (p.storage == Dtype::float64) {
    return refused(Device::cuda, op,
                   "the GPU's SDPA backward computes float32 (and 16-bit storage widened to it), "
                   "got float64 (use Device::cpu)");
  }
  if (p.rank > kCudaSdpaBackwardMaxRank || p.dim > kCudaSdpaBackwardMaxRank) {
    return refused(Device::cuda, op, "the GPU's SDPA backward needs rank and value_rank <= ",
                   kCudaSdpaBackwardMaxRank, ", got ", p.rank, " and ", p.dim,
                   " (use Device::cpu)");
  }
  if (p.storage == Dtype::float32) {
    return runs(Device::cuda, Kernel::cuda_fused, Dtype::float32, Precision::fp32);
  }
  return runs(Device::cuda, Kernel::cuda_tensor_cores, Dtype::float32, tensor_core_products(p));
}

Route on_cuda(const Problem& p, const Machine& machine, const char* op) {
  if (p.operation == Operation::backward) {
    return refused(Device::cuda, op, "the backward pass has no GPU path yet (use Device::cpu)");
  }
  if (!machine.cuda_built || !machine.cuda_device) {
    Route r = refused(Device::cuda, op, "device 'cuda' requested but unavailable: ",
                      machine.cuda_built
                          ? machine.cuda_reason
                          : std::string("emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)"));
    r.device_missing = true;
    return r;
  }
  const std::string limit = cuda_size_limit(p);
  if (!limit.empty()) return refused(Device::cuda, op, limit);
  const bool factored = p.form == Form::factored;
  // Rotary positions and grouped kv heads: the tensor-core path of the factored update alone
  // turns the projected queries and keys, and it and the SDPA-shaped operator and its backward
  // (no rotary there) read a kv head per group of query heads.
  if (rotary_or_grouped(p) && p.operation != Operation::update && p.operation != Operation::sdpa &&
      p.operation != Operation::sdpa_backward) {
    return refused(Device::cuda, op, rotary_or_grouped_names(p), " have no GPU kernel for ",
                   p.operation == Operation::decode ? "the decode cache" : "partial states",
                   ": run on the cpu or the reference");
  }
  if (rotary_or_grouped(p) && p.rotary_positions) {
    return refused(Device::cuda, op,
                   "explicit rotary positions (Rotary::key_positions, query_positions: host "
                   "memory) are not read on the GPU: give the positions through the mask's "
                   "key_position and query_position(s), or run on the cpu");
  }
  switch (p.operation) {
    case Operation::partial:
      if (factored) {
        return refused(Device::cuda, op,
                       "partial states of the factored form are computed on the host (cpu, "
                       "reference); the GPU's take the dense form");
      }
      if (is_16bit(p.storage)) {
        return refused(Device::cuda, op, "partial states are float or double, got ",
                       to_string(p.storage));
      }
      return cuda_dense_products(p, op, false);
    case Operation::decode:
      if (p.storage != Dtype::float32 || factored) {
        return refused(Device::cuda, op,
                       "the GPU decode cache holds float32 caches of the dense form, got ",
                       to_string(p.storage), factored ? " factored" : "");
      }
      if (p.dim > kCudaFusedMaxDim) {
        return refused(Device::cuda, op, "the GPU decode cache needs dim <= ", kCudaFusedMaxDim,
                       ", got ", p.dim);
      }
      if (p.tokens < 1) {
        return refused(Device::cuda, op,
                       "the GPU decode cache needs a capacity (DecodeOptions::capacity >= 1)");
      }
      return runs(Device::cuda, Kernel::cuda_fused, Dtype::float32, Precision::fp32);
    case Operation::sdpa:
      return cuda_sdpa(p, op);
    case Operation::sdpa_backward:
      return cuda_sdpa_backward(p, op);
    case Operation::backward:  // refused above
    case Operation::update:
      break;
  }
  const bool tensor_cores = is_16bit(p.storage) || (factored && p.storage == Dtype::float32 &&
                                                    p.precision == Precision::tf32 && !p.weights &&
                                                    p.rank <= kTensorCoreMaxDim);
  if (factored && !tensor_cores && rotary_or_grouped(p)) {
    // Float products: the projections of the tensor-core path in float32, then the SDPA
    // operator's float32 kernel (kernels/sdpa_backward.cu) in rank r, never expanded.
    if (p.storage == Dtype::float32 && p.precision == Precision::fp32 && !p.weights &&
        p.rank <= kCudaSdpaBackwardMaxRank && p.algorithm != Algorithm::unfused) {
      return runs(Device::cuda, Kernel::cuda_fused, Dtype::float32, Precision::fp32);
    }
    return refused(Device::cuda, op, rotary_or_grouped_names(p),
                   " run on the GPU's tensor cores (bfloat16 or float16 storage, or float with "
                   "Precision::tf32; rank <= ",
                   kTensorCoreMaxDim,
                   ", no weights) or on its float32 kernel (float with "
                   "Precision::fp32, rank <= ",
                   kCudaSdpaBackwardMaxRank,
                   ", no weights, not Algorithm::unfused): the float64 path expands the layer to "
                   "dense M_h, which a rotary layer does not have; else run on the cpu");
  }
  if (factored && !tensor_cores) return cuda_dense_products(p, op, true);
  if (!factored && !is_16bit(p.storage)) return cuda_dense_products(p, op, false);
  // The tensor cores: 16-bit storage (either form), or the factored form in TF32.
  if (p.algorithm == Algorithm::unfused) {
    return refused(Device::cuda, op,
                   "the unfused algorithm (cuBLAS) runs float32 and float64, got ",
                   to_string(p.storage));
  }
  if (p.weights) {
    return refused(Device::cuda, op,
                   "the tensor cores do not form the weights (ask for the update, lse and "
                   "entropy, or compute in float32 or on the cpu)");
  }
  if (p.score_width() > kTensorCoreMaxDim) {
    return refused(Device::cuda, op, "the tensor cores need ", factored ? "rank" : "dim",
                   " <= ", kTensorCoreMaxDim, ", got ", p.score_width());
  }
  return runs(Device::cuda, Kernel::cuda_tensor_cores, Dtype::float32, tensor_core_products(p));
}

Machine probe_machine() {
  Machine m;
#if defined(EMFLOW_WITH_CUDA)
  m.cuda_built = true;
#endif
  std::string reason;
  m.cuda_device = m.cuda_built && detail::cuda_device_available(&reason);
  m.cuda_reason = reason;
  const detail::CpuProbe cpu = detail::probe_cpu(std::getenv("EMFLOW_CPU_DISABLE"));
  m.cpu_name = cpu.name;
  m.cpu_features = cpu.features;
  m.cpu_disabled = cpu.disabled;
  const detail::CpuPath path =
      detail::choose_cpu_path(detail::usable_cpu_features(cpu), std::getenv("EMFLOW_CPU_PATH"));
  m.cpu_paths = path.built;
  m.cpu_instruction_set = path.name;
  m.cpu_compiled_for = path.required;
  m.cpu_missing = path.missing;
  m.avx512_bf16 = path.name == "avx512bf16";
  return m;
}

}  // namespace

const Machine& this_machine() {
  static const Machine machine = probe_machine();
  return machine;
}

Route route(const Problem& p, Device requested, const Machine& machine, const char* op) {
  const Device named = requested == Device::automatic ? Device::cpu : requested;
  if (!is_storage(p.storage)) {
    return refused(named, op, "storage must be float64, float32, bfloat16 or float16, got ",
                   to_string(p.storage));
  }
  const std::string mismatch = detail::precision_mismatch(p.storage, p.precision);
  if (!mismatch.empty()) return refused(named, op, "precision ", mismatch);
  if (p.form == Form::factored && p.rank < 1) {
    return refused(named, op, "the factored form needs rank >= 1, got ", p.rank);
  }
  switch (requested) {
    case Device::reference:
      return on_reference(p, op);
    case Device::cpu:
      return on_cpu(p, machine, op);
    case Device::cuda:
      return on_cuda(p, machine, op);
    case Device::automatic: {
      if (machine.cuda_device) {
        Route gpu = on_cuda(p, machine, op);
        if (gpu.supported) return gpu;
      }
      Route cpu = on_cpu(p, machine, op);
      // A processor none of the engine's paths runs on still computes: in the reference.
      if (!cpu.supported && !machine.cpu_missing.empty()) {
        Route reference = on_reference(p, op);
        if (reference.supported) return reference;
      }
      return cpu;
    }
  }
  return refused(named, op, "unknown device");
}

Route route(const Problem& problem, Device requested, const char* operation) {
  return route(problem, requested, this_machine(), operation);
}

namespace detail {

std::string cpu_engine_mismatch(const Machine& machine) {
  std::string paths;
  for (const std::string& name : machine.cpu_paths) paths += (paths.empty() ? "" : ", ") + name;
  std::string required;
  for (const std::string& name : machine.cpu_compiled_for) required += " " + name;
  return "the CPU engine's paths (" + paths + ") need at least" + required +
         ", and this processor lacks " + machine.cpu_missing +
         " (or EMFLOW_CPU_DISABLE turns it off); the double reference still runs "
         "(Device::reference)";
}

void require_cpu_engine(const char* operation) {
  const Machine& machine = this_machine();
  if (!machine.cpu_missing.empty()) {
    throw Error(ErrorCode::unsupported,
                std::string(operation) + ": cpu: " + cpu_engine_mismatch(machine));
  }
}

namespace {
thread_local Route last;
}  // namespace

const Route& last_route() noexcept { return last; }
}  // namespace detail

Route require_route(const Problem& problem, Device requested, const char* operation) {
  Route r = route(problem, requested, operation);
  detail::last = r;
  if (!r.supported) detail::fail(ErrorCode::unsupported, r.reason);
  return r;
}

namespace {

template <class T>
Problem describe_input(const AttentionInput<T>& in, const ExecutionOptions& options) {
  Problem p;
  p.storage = dtype_of<T>();
  p.precision = options.precision;
  p.batch = in.batch;
  p.tokens = in.tokens;
  p.query_tokens = detail::query_count(in);
  p.dim = in.dim;
  p.heads = in.layer.heads;
  p.mask = in.mask;
  p.cross = in.queries != nullptr;
  p.query_lengths = in.query_lengths != nullptr;
  p.positions =
      in.key_position != 0 || in.query_position != kAlignToEnd || in.query_positions != nullptr;
  p.key_lengths = in.key_lengths != nullptr;
  p.key_bias = in.layer.key_bias != nullptr;
  p.offset = in.layer.offset != nullptr;
  return p;
}

}  // namespace

template <class T>
Problem describe(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const ExecutionOptions& options) {
  Problem p = describe_input(input, options);
  p.lse = output.lse != nullptr;
  p.entropy = output.entropy != nullptr;
  p.weights = output.weights != nullptr;
  return p;
}

namespace {

// The factored layer's part of a Problem (the update's and the partial state's alike).
template <class T>
void describe_factors(const FactoredLayer<T>& layer, Problem& p) {
  p.form = Form::factored;
  p.heads = layer.heads;
  p.rank = layer.rank;
  p.kv_heads = layer.key_heads();
  p.rotary_dim = layer.rotary.dim;
  p.rotary_positions =
      layer.rotary.key_positions != nullptr || layer.rotary.query_positions != nullptr;
  p.key_bias = layer.key_bias != nullptr;
}

}  // namespace

template <class T>
Problem describe(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                 const AttentionOutput<T>& output, const ExecutionOptions& options) {
  Problem p = describe(input, output, options);
  describe_factors(layer, p);
  p.offset = layer.offset != nullptr;
  return p;
}

template <class T>
Problem describe(const AttentionInput<T>& input, const PartialOutput<T>& output,
                 const ExecutionOptions& options) {
  Problem p = describe_input(input, options);
  p.operation = Operation::partial;
  p.offset = false;  // belongs to finish_partial
  p.lse = output.lse != nullptr;
  p.entropy = output.entropy != nullptr;
  return p;
}

template <class T>
Problem describe(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                 const PartialOutput<T>& output, const ExecutionOptions& options) {
  Problem p = describe(input, output, options);
  describe_factors(layer, p);  // the offset belongs to finish_partial
  return p;
}

template <class T>
Problem describe(const LayerOperators<T>& layer, std::int64_t dim, const DecodeOptions& options) {
  Problem p;
  p.operation = Operation::decode;
  p.storage = dtype_of<T>();
  p.precision = options.precision;
  p.tokens = options.capacity;
  p.dim = dim;
  p.heads = layer.heads;
  p.key_bias = layer.key_bias != nullptr;
  p.offset = layer.offset != nullptr;
  p.lse = p.entropy = true;
  return p;
}

template <class T>
Problem describe(const FactoredLayer<T>& layer, std::int64_t dim, const DecodeOptions& options) {
  Problem p = describe(LayerOperators<T>{layer.heads}, dim, options);
  p.form = Form::factored;
  p.rank = layer.rank;
  p.kv_heads = layer.key_heads();
  p.rotary_dim = layer.rotary.dim;
  p.rotary_positions =
      layer.rotary.key_positions != nullptr || layer.rotary.query_positions != nullptr;
  p.key_bias = layer.key_bias != nullptr;
  p.offset = layer.offset != nullptr;
  return p;
}

const char* to_string(Kernel kernel) noexcept {
  switch (kernel) {
    case Kernel::reference:
      return "reference";
    case Kernel::cpu_fused:
      return "cpu_fused";
    case Kernel::cpu_bf16:
      return "cpu_bf16";
    case Kernel::cuda_fused:
      return "cuda_fused";
    case Kernel::cuda_unfused:
      return "cuda_unfused";
    case Kernel::cuda_tensor_cores:
      return "cuda_tensor_cores";
  }
  return "unknown";
}

const char* to_string(Form form) noexcept { return form == Form::factored ? "factored" : "dense"; }

const char* to_string(Operation operation) noexcept {
  switch (operation) {
    case Operation::update:
      return "update";
    case Operation::partial:
      return "partial";
    case Operation::decode:
      return "decode";
    case Operation::sdpa:
      return "sdpa";
    case Operation::sdpa_backward:
      return "sdpa_backward";
    case Operation::backward:
      return "backward";
  }
  return "unknown";
}

const char* to_string(Algorithm algorithm) noexcept {
  switch (algorithm) {
    case Algorithm::automatic:
      return "automatic";
    case Algorithm::fused:
      return "fused";
    case Algorithm::unfused:
      return "unfused";
  }
  return "unknown";
}

std::string to_string(const Route& r) {
  if (!r.supported) return "unsupported: " + r.reason;
  std::string out = std::string(to_string(r.device)) + " " + to_string(r.kernel) + " " +
                    (r.computes == Dtype::float64 ? "fp64" : to_string(r.products));
  if (r.expanded) out += " (expanded)";
  return out;
}

#define EMFLOW_CAPABILITY(T)                                                        \
  template Problem describe<T>(const AttentionInput<T>&, const AttentionOutput<T>&, \
                               const ExecutionOptions&);                            \
  template Problem describe<T>(const AttentionInput<T>&, const FactoredLayer<T>&,   \
                               const AttentionOutput<T>&, const ExecutionOptions&); \
  template Problem describe<T>(const AttentionInput<T>&, const PartialOutput<T>&,   \
                               const ExecutionOptions&);                            \
  template Problem describe<T>(const AttentionInput<T>&, const FactoredLayer<T>&,   \
                               const PartialOutput<T>&, const ExecutionOptions&);
EMFLOW_CAPABILITY(float)
EMFLOW_CAPABILITY(double)
EMFLOW_CAPABILITY(bfloat16)
EMFLOW_CAPABILITY(float16)
#undef EMFLOW_CAPABILITY
#define EMFLOW_CAPABILITY_DECODE(T)                                                           \
  template Problem describe<T>(const LayerOperators<T>&, std::int64_t, const DecodeOptions&); \
  template Problem describe<T>(const FactoredLayer<T>&, std::int64_t, const DecodeOptions&);
EMFLOW_CAPABILITY_DECODE(float)
EMFLOW_CAPABILITY_DECODE(double)
#undef EMFLOW_CAPABILITY_DECODE

}  // namespace emflow

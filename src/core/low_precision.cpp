// bfloat16 and float16 storage on the host devices (low_precision.hpp, docs/MATH.md §7).
//
// Widening is exact (precision.hpp), so Device::cpu computes the float32 result of exactly the
// stored values, and Device::reference the double one. The statistics are float32 for both
// storage types (Stat<T>), so the float path writes them in place; only the update, stored in T,
// passes through a float buffer and is rounded to nearest even once.
#include "low_precision.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "queries.hpp"

namespace emflow::detail {

namespace {

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  return "float16";
}

/// `count` stored values widened to U (float or double); empty for null.
template <class U, class T>
std::vector<U> widened(const T* values, std::int64_t count) {
  if (values == nullptr) return {};
  std::vector<U> out(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<U>(to_float(values[i]));
  return out;
}

template <class U>
const U* data_or_null(const std::vector<U>& values) {
  return values.empty() ? nullptr : values.data();
}

template <class T>
T narrowed(float value) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(value);
  } else {
    return to_float16(value);
  }
}

/// The clouds of `in` widened to U, and `in` itself with U pointers (operators left empty).
template <class U, class T>
struct WideInput {
  std::vector<U> cloud, queries;
  AttentionInput<U> input;

  explicit WideInput(const AttentionInput<T>& in) {
    const std::int64_t Nq = query_count(in);
    cloud = widened<U>(in.cloud, in.batch * in.tokens * in.dim);
    queries = widened<U>(in.queries, in.batch * Nq * in.dim);
    input = with_arrays(in, cloud.data(), data_or_null(queries), LayerOperators<U>{in.layer.heads});
  }
};

/// Outputs in U for a call whose outputs are T: the update always through a buffer, the
/// statistics in place when U is float (their type for T), else through buffers as well.
template <class U, class T>
struct WideOutput {
  std::vector<U> update, lse, entropy, weights;
  AttentionOutput<U> output;
  const AttentionOutput<T>& target;

  WideOutput(const AttentionInput<T>& in, const AttentionOutput<T>& out) : target(out) {
    const auto rows = static_cast<std::size_t>(in.batch * in.layer.heads * query_count(in));
    update.resize(static_cast<std::size_t>(in.batch * query_count(in) * in.dim));
    output.update = update.data();
    if constexpr (std::is_same_v<U, Stat<T>>) {
      output.lse = out.lse;
      output.entropy = out.entropy;
      output.weights = out.weights;
    } else {
      if (out.lse) lse.resize(rows);
      if (out.entropy) entropy.resize(rows);
      if (out.weights) weights.resize(rows * static_cast<std::size_t>(in.tokens));
      output.lse = out.lse ? lse.data() : nullptr;
      output.entropy = out.entropy ? entropy.data() : nullptr;
      output.weights = out.weights ? weights.data() : nullptr;
    }
  }

  void write_back() const {
    for (std::size_t i = 0; i < update.size(); ++i) {
      target.update[i] = narrowed<T>(static_cast<float>(update[i]));
    }
    if constexpr (!std::is_same_v<U, Stat<T>>) {
      for (std::size_t i = 0; i < lse.size(); ++i) target.lse[i] = static_cast<float>(lse[i]);
      for (std::size_t i = 0; i < entropy.size(); ++i) {
        target.entropy[i] = static_cast<float>(entropy[i]);
      }
      for (std::size_t i = 0; i < weights.size(); ++i) {
        target.weights[i] = static_cast<float>(weights[i]);
      }
    }
  }
};

bool finite(const std::vector<float>& values) {
  for (float v : values) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

template <class U, class T>
void attend_wide(const AttentionInput<T>& in, const AttentionOutput<T>& out, Device device,
                 int threads) {
  const std::int64_t H = in.layer.heads, d = in.dim;
  WideInput<U, T> wide(in);
  const std::vector<U> relevance = widened<U>(in.layer.relevance, H * d * d);
  const std::vector<U> content = widened<U>(in.layer.content, H * d * d);
  const std::vector<U> key_bias = widened<U>(in.layer.key_bias, H * d);
  const std::vector<U> offset = widened<U>(in.layer.offset, d);
  wide.input.layer = {H, relevance.data(), content.data(), data_or_null(key_bias),
                      data_or_null(offset)};
  if constexpr (std::is_same_v<T, bfloat16> && std::is_same_v<U, float>) {
    // The AVX512-BF16 products where the processor has them, for the common case; the float32
    // engine on the widened values otherwise (non-finite values keep their rules there).
    if (cpu_bf16_available() && plain_self_attention(in) && out.weights == nullptr &&
        finite(wide.cloud) && finite(relevance) && finite(content) && finite(key_bias) &&
        finite(offset)) {
      cpu_attend_bf16(wide.input, out, threads);
      return;
    }
  }
  WideOutput<U, T> sink(in, out);
  emflow::attend(wide.input, sink.output, ExecutionOptions{device, threads});
  sink.write_back();
}

template <class U, class T>
void attend_factored_wide(const AttentionInput<T>& in, const FactoredLayer<T>& f,
                          const AttentionOutput<T>& out, Device device, int threads) {
  const std::int64_t H = f.heads, r = f.rank, d = in.dim;
  WideInput<U, T> wide(in);
  wide.input.layer = {};
  const std::vector<U> A = widened<U>(f.query_factor, H * r * d);
  const std::vector<U> B = widened<U>(f.key_factor, H * r * d);
  const std::vector<U> Up = widened<U>(f.content_up, H * d * r);
  const std::vector<U> V = widened<U>(f.content_down, H * r * d);
  const std::vector<U> key_bias = widened<U>(f.key_bias, H * d);
  const std::vector<U> offset = widened<U>(f.offset, d);
  FactoredLayer<U> layer{
      H, r, A.data(), B.data(), Up.data(), V.data(), data_or_null(key_bias), data_or_null(offset)};
  WideOutput<U, T> sink(in, out);
  emflow::attend_factored(wide.input, layer, sink.output, ExecutionOptions{device, threads});
  sink.write_back();
}

}  // namespace

template <class T>
void check_precision(const ExecutionOptions& options, const char* op) {
  const Precision p = options.precision;
  if (p == Precision::fp32) return;
  if (p == Precision::tf32) {
    if (!std::is_same_v<T, float>) {
      fail_argument(op, "precision", "tf32 needs float input, got ", type_name<T>());
    }
    // A permission, as allow_tf32: the host devices' fp32 products meet the TF32 accuracy bound;
    // on 'cuda' the tensor-core paths use it where they compute what is asked.
    return;
  }
  if constexpr (is_16bit_v<T>) {
    if (p == storage_precision<T>()) return;
  }
  fail_argument(op, "precision", to_string(p), " needs ",
                p == Precision::bf16 ? "bfloat16" : "float16", " input, got ", type_name<T>());
}

const char* tensor_core_missing_output(const void* weights) {
  return weights != nullptr ? "weights" : nullptr;
}

namespace {

/// The device of a 16-bit call: cuda when requested (unsupported without a usable device); for
/// automatic, cuda when a device exists and the tensor-core path computes what is asked (no
/// weights, `size` (dim or rank) within kTcMaxDim of kernels/tc_attention.hpp), else cpu.
Device resolve_tensor_core_device(Device requested, const void* weights, std::int64_t size,
                                  const char* op) {
  std::string reason;
  if (requested == Device::cuda) {
    if (!cuda_device_available(&reason)) {
      fail(ErrorCode::unsupported, op, ": device 'cuda' requested but unavailable: ", reason);
    }
    return Device::cuda;
  }
  if (requested == Device::automatic) {
    const bool fits = tensor_core_missing_output(weights) == nullptr && size <= 256;
    return fits && cuda_device_available(&reason) ? Device::cuda : Device::cpu;
  }
  return requested;
}

}  // namespace

template <class T>
Device resolve_16bit_device(Device requested, const AttentionInput<T>& input,
                            const AttentionOutput<T>& output, const char* op) {
  return resolve_tensor_core_device(requested, output.weights, input.dim, op);
}

template <class T>
Device resolve_16bit_factored_device(Device requested, const FactoredLayer<T>& layer,
                                     const AttentionOutput<T>& output, const char* op) {
  return resolve_tensor_core_device(requested, output.weights, layer.rank, op);
}

template <class T>
void attend_16bit(const AttentionInput<T>& in, const AttentionOutput<T>& out, Device device,
                  int threads) {
  if (device == Device::reference) {
    attend_wide<double>(in, out, device, threads);
  } else {
    attend_wide<float>(in, out, Device::cpu, threads);
  }
}

template <class T>
void attend_factored_16bit(const AttentionInput<T>& in, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& out, Device device, int threads) {
  if (device == Device::reference) {
    attend_factored_wide<double>(in, layer, out, device, threads);
  } else {
    attend_factored_wide<float>(in, layer, out, Device::cpu, threads);
  }
}

template void check_precision<float>(const ExecutionOptions&, const char*);
template void check_precision<double>(const ExecutionOptions&, const char*);
template void check_precision<bfloat16>(const ExecutionOptions&, const char*);
template void check_precision<float16>(const ExecutionOptions&, const char*);
template Device resolve_16bit_device<bfloat16>(Device, const AttentionInput<bfloat16>&,
                                               const AttentionOutput<bfloat16>&, const char*);
template Device resolve_16bit_device<float16>(Device, const AttentionInput<float16>&,
                                              const AttentionOutput<float16>&, const char*);
template Device resolve_16bit_factored_device<bfloat16>(Device, const FactoredLayer<bfloat16>&,
                                                        const AttentionOutput<bfloat16>&,
                                                        const char*);
template Device resolve_16bit_factored_device<float16>(Device, const FactoredLayer<float16>&,
                                                       const AttentionOutput<float16>&,
                                                       const char*);
template void attend_16bit<bfloat16>(const AttentionInput<bfloat16>&,
                                     const AttentionOutput<bfloat16>&, Device, int);
template void attend_16bit<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                                    Device, int);
template void attend_factored_16bit<bfloat16>(const AttentionInput<bfloat16>&,
                                              const FactoredLayer<bfloat16>&,
                                              const AttentionOutput<bfloat16>&, Device, int);
template void attend_factored_16bit<float16>(const AttentionInput<float16>&,
                                             const FactoredLayer<float16>&,
                                             const AttentionOutput<float16>&, Device, int);

}  // namespace emflow::detail

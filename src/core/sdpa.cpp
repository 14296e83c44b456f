// emflow::sdpa_attend and emflow::sdpa_backward (include/emflow/sdpa.hpp): the arguments checked
// once, the route asked of capability.cpp (route(), Operation::sdpa and sdpa_backward), and the
// host paths it names: the fused CPU engine in float32 (src/cpu/sdpa.cpp, sdpa_backward.cpp),
// the 16-bit types widened exactly to float for it (but the bfloat16 backward on AVX512-BF16,
// Kernel::cpu_bf16, sdpa_backward_bf16.cpp), and the double reference (reference::sdpa_attend,
// reference::sdpa_backward) for double input, for Device::reference, where the engine has no
// path on this processor under Device::automatic, and for input with a non-finite value the
// engine would read. On Device::cuda both passes are the stream-ordered calls
// (cuda::sdpa_attend_async: the tensor-core attention kernel; sdpa_backward_async: the float32
// backward kernels) on device copies of the caller's arrays (src/cuda/sdpa.cpp); non-finite
// input goes to the reference there too.
#include "emflow/sdpa.hpp"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "cpu/sdpa.hpp"
#include "emflow/capability.hpp"
#include "emflow/reference.hpp"
#include "low_precision.hpp"
#include "memory.hpp"
#include "queries.hpp"
#include "sdpa_checks.hpp"

namespace emflow {

namespace detail {

namespace {

/// The largest |scale| a float call accepts, as for beta (docs/MATH.md §6.6).
constexpr double kMaxFloatScale = 18446744073709551616.0;

template <class T>
double widen(T value) {
  if constexpr (is_16bit_v<T>) {
    return static_cast<double>(to_float(value));
  } else {
    return static_cast<double>(value);
  }
}

/// `count` values from `data` as a tensor of `shape` in double; absent for null.
template <class T>
Tensor<double> tensor_of(const T* data, const Shape& shape) {
  if (data == nullptr) return {};
  Tensor<double> out(shape);
  for (std::int64_t e = 0; e < out.size(); ++e) out[e] = widen(data[e]);
  return out;
}

template <class T>
void store(const Tensor<double>& values, T* out) {
  if (out == nullptr) return;
  for (std::int64_t e = 0; e < values.size(); ++e) out[e] = narrow<T>(values[e]);
}

/// `count` values widened exactly to float (16-bit storage); empty for null.
template <class T>
std::vector<float> widened(const T* data, std::int64_t count) {
  if (data == nullptr) return {};
  std::vector<float> out(static_cast<std::size_t>(count));
  for (std::size_t e = 0; e < out.size(); ++e) out[e] = to_float(data[e]);
  return out;
}

template <class T>
void store_floats(const std::vector<float>& values, T* out) {
  for (std::size_t e = 0; e < values.size(); ++e) out[e] = narrow<T>(values[e]);
}

/// The shapes of a call, from validated input.
struct SdpaShape {
  std::int64_t B, Hq, Hkv, Nq, Nk, r, rv;
  template <class T>
  explicit SdpaShape(const SdpaInput<T>& in)
      : B(in.batch),
        Hq(in.query_heads),
        Hkv(in.kv_heads),
        Nq(in.query_tokens),
        Nk(in.tokens),
        r(in.rank),
        rv(in.value_rank) {}
  Shape queries() const { return {B, Hq, Nq, r}; }
  Shape keys() const { return {B, Hkv, Nk, r}; }
  Shape values() const { return {B, Hkv, Nk, rv}; }
  Shape output() const { return {B, Hq, Nq, rv}; }
  Shape statistics() const { return {B, Hq, Nq}; }
  std::int64_t count(const Shape& shape) const {
    std::int64_t n = 1;
    for (std::int64_t e : shape) n *= e;
    return n;
  }
};

/// The visibility fields of `in` as the AttentionInput of cross-attention that the one rule
/// resolver (query_rule) and the one validator (check_arguments) read. The cloud and operator
/// pointers are stand-ins for their checks (not null), never read; dim 1 keeps the size checks
/// to the ones check_sdpa has not made.
template <class T>
AttentionInput<T> as_attention(const SdpaInput<T>& in) {
  AttentionInput<T> a;
  a.cloud = in.keys;
  a.batch = in.batch;
  a.tokens = in.tokens;
  a.dim = 1;
  a.layer.heads = in.query_heads;
  a.layer.relevance = in.keys;
  a.layer.content = in.keys;
  a.beta = 0.0;
  a.mask = in.mask;
  a.key_lengths = in.key_lengths;
  a.queries = in.queries;
  a.query_tokens = in.query_tokens;
  a.query_lengths = in.query_lengths;
  a.key_position = in.key_position;
  a.query_position = in.query_position;
  a.query_positions = in.query_positions;
  return a;
}

}  // namespace

template <class T>
void check_sdpa(const SdpaInput<T>& in, T* written, const char* op, Lengths lengths) {
  expect_positive(op, "batch", in.batch);
  expect_positive(op, "query_heads", in.query_heads);
  expect_positive(op, "kv_heads", in.kv_heads);
  expect_positive(op, "query_tokens", in.query_tokens);
  expect_positive(op, "tokens", in.tokens);
  expect_positive(op, "rank", in.rank);
  expect_positive(op, "value_rank", in.value_rank);
  if (in.query_heads % in.kv_heads != 0) {
    fail_argument(op, "query_heads", "must be a multiple of kv_heads (", in.kv_heads, "), got ",
                  in.query_heads);
  }
  auto elements = [&](const char* name, std::int64_t heads, std::int64_t rows, std::int64_t width) {
    return checked_multiply(
        op, name, checked_multiply(op, name, checked_multiply(op, name, in.batch, heads), rows),
        width);
  };
  elements("queries", in.query_heads, in.query_tokens, in.rank);
  elements("keys", in.kv_heads, in.tokens, in.rank);
  elements("values", in.kv_heads, in.tokens, in.value_rank);
  elements("output", in.query_heads, in.query_tokens, in.value_rank);
  if (!std::isfinite(in.scale)) fail_argument(op, "scale", "must be finite, got ", in.scale);
  if (!std::is_same_v<T, double> && std::abs(in.scale) > kMaxFloatScale) {
    fail_argument(op, "scale", "must satisfy |scale| <= 2^64 (", kMaxFloatScale,
                  ") for float and 16-bit input, got ", in.scale);
  }
  expect_not_null(op, "queries", in.queries);
  expect_not_null(op, "keys", in.keys);
  expect_not_null(op, "values", in.values);
  AttentionOutput<T> stand_in;
  stand_in.update = written;
  check_arguments(as_attention(in), stand_in, op, lengths);
}

template <class T>
std::vector<MemoryRange> sdpa_input_ranges(const SdpaInput<T>& in) {
  const SdpaShape s(in);
  const auto B = static_cast<std::size_t>(s.B);
  return {
      {"queries", in.queries, static_cast<std::size_t>(s.count(s.queries())) * sizeof(T), false},
      {"keys", in.keys, static_cast<std::size_t>(s.count(s.keys())) * sizeof(T), false},
      {"values", in.values, static_cast<std::size_t>(s.count(s.values())) * sizeof(T), false},
      {"key_lengths", in.key_lengths, B * sizeof(std::int64_t), false},
      {"query_lengths", in.query_lengths, B * sizeof(std::int64_t), false},
      {"query_positions", in.query_positions, B * sizeof(std::int64_t), false},
  };
}

template <class T>
Problem sdpa_problem(const SdpaInput<T>& in, Operation operation, const ExecutionOptions& options) {
  Problem p;
  p.operation = operation;
  p.form = Form::factored;  // the inner part of the factored form, in rank r
  p.storage = dtype_of<T>();
  p.precision = options.precision;
  p.batch = in.batch;
  p.tokens = in.tokens;
  p.query_tokens = in.query_tokens;
  p.dim = in.value_rank;
  p.heads = in.query_heads;
  p.kv_heads = in.kv_heads;
  p.rank = in.rank;
  p.mask = in.mask;
  p.cross = true;
  p.query_lengths = in.query_lengths != nullptr;
  p.positions =
      in.key_position != 0 || in.query_position != kAlignToEnd || in.query_positions != nullptr;
  p.key_lengths = in.key_lengths != nullptr;
  return p;
}

#define EMFLOW_SDPA_CHECKS(T)                                                  \
  template void check_sdpa<T>(const SdpaInput<T>&, T*, const char*, Lengths);  \
  template std::vector<MemoryRange> sdpa_input_ranges<T>(const SdpaInput<T>&); \
  template Problem sdpa_problem<T>(const SdpaInput<T>&, Operation, const ExecutionOptions&);
EMFLOW_SDPA_CHECKS(float)
EMFLOW_SDPA_CHECKS(double)
EMFLOW_SDPA_CHECKS(bfloat16)
EMFLOW_SDPA_CHECKS(float16)
#undef EMFLOW_SDPA_CHECKS

namespace {

void expect_threads(const ExecutionOptions& options, const char* op) {
  check_threads(options.threads, op);
}

/// The rules of the clouds of validated input.
template <class T>
std::vector<QueryRule> rules_of(const SdpaInput<T>& in) {
  const AttentionInput<T> a = as_attention(in);
  std::vector<QueryRule> rules;
  for (std::int64_t b = 0; b < in.batch; ++b) rules.push_back(query_rule(a, b));
  return rules;
}

template <class T>
reference::Visibility visibility_of(const SdpaInput<T>& in) {
  reference::Visibility v;
  v.mask = in.mask;
  if (in.key_lengths) v.key_lengths.assign(in.key_lengths, in.key_lengths + in.batch);
  if (in.query_lengths) v.query_lengths.assign(in.query_lengths, in.query_lengths + in.batch);
  v.key_position = in.key_position;
  v.query_position = in.query_position;
  if (in.query_positions) {
    v.query_positions.assign(in.query_positions, in.query_positions + in.batch);
  }
  return v;
}

/// The double reference on the stored values.
template <class T>
void reference_forward(const SdpaInput<T>& in, const SdpaOutput<T>& out) {
  const SdpaShape s(in);
  const reference::SdpaAttention r =
      reference::sdpa_attend(tensor_of(in.queries, s.queries()), tensor_of(in.keys, s.keys()),
                             tensor_of(in.values, s.values()), in.scale, visibility_of(in));
  store(r.output, out.output);
  store(r.lse, out.lse);
  store(r.entropy, out.entropy);
}

/// `saved`: the forward's statistics, read as the engine reads them (sdpa.hpp), or null for
/// Device::reference, which recomputes them in double from the stored inputs.
template <class T>
void reference_backward(const SdpaInput<T>& in, const SdpaSaved<T>* saved,
                        const UpstreamGradients<T>& up, const SdpaGradientOutput<T>& out) {
  const SdpaShape s(in);
  reference::OutputGradients upstream;
  upstream.update = tensor_of(up.update, s.output());
  upstream.lse = tensor_of(up.lse, s.statistics());
  upstream.entropy = tensor_of(up.entropy, s.statistics());
  const Tensor<double> Q = tensor_of(in.queries, s.queries()), K = tensor_of(in.keys, s.keys()),
                       V = tensor_of(in.values, s.values());
  reference::SdpaGradients g;
  if (saved == nullptr) {
    g = reference::sdpa_backward(Q, K, V, in.scale, visibility_of(in), upstream);
  } else {
    // O only with dO, H only with dH, as the engine reads them.
    reference::SdpaAttention statistics;
    statistics.lse = tensor_of(saved->lse, s.statistics());
    if (up.update != nullptr) statistics.output = tensor_of(saved->output, s.output());
    if (up.entropy != nullptr) statistics.entropy = tensor_of(saved->entropy, s.statistics());
    g = reference::sdpa_backward(Q, K, V, in.scale, visibility_of(in), upstream, statistics);
  }
  store(g.queries, out.queries);
  store(g.keys, out.keys);
  store(g.values, out.values);
  if (out.scale) *out.scale = g.scale;
}

/// The float arrays of a call for the CPU engine: the caller's for float, widened copies of the
/// stored values for the 16-bit types.
template <class T>
struct FloatInput {
  std::vector<float> queries, keys, values;
  std::vector<QueryRule> rules;
  cpu::SdpaArrays arrays;

  explicit FloatInput(const SdpaInput<T>& in) : rules(rules_of(in)) {
    const SdpaShape s(in);
    if constexpr (std::is_same_v<T, float>) {
      arrays.queries = in.queries;
      arrays.keys = in.keys;
      arrays.values = in.values;
    } else {
      queries = widened(in.queries, s.count(s.queries()));
      keys = widened(in.keys, s.count(s.keys()));
      values = widened(in.values, s.count(s.values()));
      arrays.queries = queries.data();
      arrays.keys = keys.data();
      arrays.values = values.data();
    }
    arrays.batch = s.B;
    arrays.query_heads = s.Hq;
    arrays.kv_heads = s.Hkv;
    arrays.query_tokens = s.Nq;
    arrays.tokens = s.Nk;
    arrays.rank = s.r;
    arrays.value_rank = s.rv;
    arrays.scale = static_cast<float>(in.scale);
    arrays.rules = rules.data();
  }
};

template <class T>
void cpu_forward(const SdpaInput<T>& in, const SdpaOutput<T>& out, int threads) {
  const FloatInput<T> f(in);
  if (!cpu::sdpa_inputs_finite(f.arrays)) {
    reference_forward(in, out);  // NaN exactly where docs/MATH.md §6.6 puts it
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    cpu::sdpa_forward(f.arrays, out.output, out.lse, out.entropy, threads);
  } else {
    const SdpaShape s(in);
    std::vector<float> output(static_cast<std::size_t>(s.count(s.output())));
    cpu::sdpa_forward(f.arrays, output.data(), out.lse, out.entropy, threads);
    store_floats(output, out.output);
  }
}

template <class T>
void cpu_backward(const SdpaInput<T>& in, const SdpaSaved<T>& saved, const UpstreamGradients<T>& up,
                  const SdpaGradientOutput<T>& out, bool bf16_products, int threads,
                  bool on_gpu = false) {
  const SdpaShape s(in);
  const FloatInput<T> f(in);
  cpu::SdpaBackwardArrays b;
  b.lse = saved.lse;
  b.entropy = saved.entropy;
  b.lse_gradient = up.lse;
  b.entropy_gradient = up.entropy;
  std::vector<float> output, output_gradient;
  if constexpr (std::is_same_v<T, float>) {
    b.output = saved.output;
    b.output_gradient = up.update;
  } else if (up.update != nullptr) {
    output = widened(saved.output, s.count(s.output()));
    output_gradient = widened(up.update, s.count(s.output()));
    b.output = output.data();
    b.output_gradient = output_gradient.data();
  }
  if (!cpu::sdpa_inputs_finite(f.arrays) || !cpu::sdpa_backward_finite(f.arrays, b)) {
    reference_backward(in, &saved, up, out);  // NaN exactly where docs/MATH.md §8.6 puts it
    return;
  }
  if (on_gpu) {
    cuda_sdpa_backward(in, saved, up, out);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    cpu::sdpa_backward(f.arrays, b, {out.queries, out.keys, out.values, out.scale}, threads);
  } else {
    std::vector<float> dq(static_cast<std::size_t>(s.count(s.queries())));
    std::vector<float> dk(static_cast<std::size_t>(s.count(s.keys())));
    std::vector<float> dv(static_cast<std::size_t>(s.count(s.values())));
    const cpu::SdpaGradientArrays gradients{dq.data(), dk.data(), dv.data(), out.scale};
    if (std::is_same_v<T, bfloat16> && bf16_products) {
      cpu::sdpa_backward_bf16(f.arrays, b, gradients, threads);
    } else {
      cpu::sdpa_backward(f.arrays, b, gradients, threads);
    }
    store_floats(dq, out.queries);
    store_floats(dk, out.keys);
    store_floats(dv, out.values);
  }
}

}  // namespace

}  // namespace detail

template <class T>
void sdpa_attend(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                 const ExecutionOptions& options) {
  const char* op = "sdpa_attend";
  detail::reporting_out_of_memory(op, "", [&] {
    detail::expect_not_null(op, "output", output.output);
    detail::check_sdpa(input, output.output, op);
    const detail::SdpaShape s(input);
    std::vector<detail::MemoryRange> ranges = detail::sdpa_input_ranges(input);
    const auto rows = static_cast<std::size_t>(s.count(s.statistics()));
    ranges.push_back(
        {"output", output.output, rows * static_cast<std::size_t>(s.rv) * sizeof(T), true});
    ranges.push_back({"lse", output.lse, rows * sizeof(Stat<T>), true});
    ranges.push_back({"entropy", output.entropy, rows * sizeof(Stat<T>), true});
    detail::check_disjoint(ranges.data(), ranges.size(), op);
    detail::expect_threads(options, op);
    detail::check_precision<T>(options, op);
    const Route route =
        require_route(detail::sdpa_problem(input, Operation::sdpa, options), options.device, op);
    if (route.kernel == Kernel::reference || std::is_same_v<T, double>) {
      detail::reference_forward(input, output);
    } else if constexpr (!std::is_same_v<T, double>) {
      if (route.device == Device::cuda) {
        // Non-finite input as on the cpu: the reference puts NaN where §6.6 says.
        if (!detail::cpu::sdpa_inputs_finite(detail::FloatInput<T>(input).arrays)) {
          detail::reference_forward(input, output);
        } else {
          detail::cuda_sdpa_attend(input, output, options.precision);
        }
      } else {
        detail::cpu_forward(input, output, options.threads);
      }
    }
  });
}

template <class T>
void sdpa_backward(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                   const UpstreamGradients<T>& upstream, const SdpaGradientOutput<T>& gradients,
                   const ExecutionOptions& options) {
  const char* op = "sdpa_backward";
  detail::reporting_out_of_memory(op, "", [&] {
    detail::expect_not_null(op, "gradients.queries", gradients.queries);
    detail::expect_not_null(op, "gradients.keys", gradients.keys);
    detail::expect_not_null(op, "gradients.values", gradients.values);
    detail::check_sdpa(input, gradients.queries, op);
    detail::expect_not_null(op, "saved.lse", saved.lse);
    if (upstream.update != nullptr && saved.output == nullptr) {
      detail::fail_argument(op, "saved.output",
                            "must not be null when upstream.update (dO) is given: D_i = "
                            "<dO_i, O_i> reads it");
    }
    if (upstream.entropy != nullptr && saved.entropy == nullptr) {
      detail::fail_argument(op, "saved.entropy",
                            "must not be null when upstream.entropy (dH) is given: dS reads H");
    }
    const detail::SdpaShape s(input);
    std::vector<detail::MemoryRange> ranges = detail::sdpa_input_ranges(input);
    const auto rows = static_cast<std::size_t>(s.count(s.statistics()));
    const std::size_t output_bytes = rows * static_cast<std::size_t>(s.rv) * sizeof(T);
    ranges.insert(ranges.end(),
                  {{"saved.output", saved.output, output_bytes, false},
                   {"saved.lse", saved.lse, rows * sizeof(Stat<T>), false},
                   {"saved.entropy", saved.entropy, rows * sizeof(Stat<T>), false},
                   {"upstream.update", upstream.update, output_bytes, false},
                   {"upstream.lse", upstream.lse, rows * sizeof(Stat<T>), false},
                   {"upstream.entropy", upstream.entropy, rows * sizeof(Stat<T>), false},
                   {"gradients.queries", gradients.queries,
                    static_cast<std::size_t>(s.count(s.queries())) * sizeof(T), true},
                   {"gradients.keys", gradients.keys,
                    static_cast<std::size_t>(s.count(s.keys())) * sizeof(T), true},
                   {"gradients.values", gradients.values,
                    static_cast<std::size_t>(s.count(s.values())) * sizeof(T), true},
                   {"gradients.scale", gradients.scale, sizeof(double), true}});
    detail::check_disjoint(ranges.data(), ranges.size(), op);
    detail::expect_threads(options, op);
    detail::check_precision<T>(options, op);
    const Route route = require_route(
        detail::sdpa_problem(input, Operation::sdpa_backward, options), options.device, op);
    if (options.device == Device::reference) {  // the oracle: recomputed from the inputs
      detail::reference_backward<T>(input, nullptr, upstream, gradients);
    } else if (route.kernel == Kernel::reference || std::is_same_v<T, double>) {
      detail::reference_backward(input, &saved, upstream, gradients);
    } else if constexpr (!std::is_same_v<T, double>) {
      detail::cpu_backward(input, saved, upstream, gradients, route.kernel == Kernel::cpu_bf16,
                           options.threads, route.device == Device::cuda);
    }
  });
}

#define EMFLOW_SDPA(T)                                                                      \
  template void sdpa_attend<T>(const SdpaInput<T>&, const SdpaOutput<T>&,                   \
                               const ExecutionOptions&);                                    \
  template void sdpa_backward<T>(const SdpaInput<T>&, const SdpaSaved<T>&,                  \
                                 const UpstreamGradients<T>&, const SdpaGradientOutput<T>&, \
                                 const ExecutionOptions&);
EMFLOW_SDPA(float)
EMFLOW_SDPA(double)
EMFLOW_SDPA(bfloat16)
EMFLOW_SDPA(float16)
#undef EMFLOW_SDPA

}  // namespace emflow

// emflow::attend_factored: the factored form of a layer (include/emflow/factored.hpp).
//
// On the CPU in float32 it runs the fused engine (engine.hpp) in rank r: queries beta A_h x_i
// and keys B_h x_j in R^r, values V_h x_j in R^r, and the head output mapped back by U_h. The key
// bias joins the scores as one more coordinate: queries [beta A_h x_i, 1], keys
// [B_h x_j, beta u_h^T x_j], so s_ij = beta (<A_h x_i, B_h x_j> + u_h^T x_j) in one product.
// Every other path expands the layer to dense M_h = A_h^T B_h and F_h = U_h V_h.
#include "emflow/factored.hpp"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/low_precision.hpp"
#include "core/queries.hpp"
#include "engine.hpp"

namespace emflow {

namespace {

constexpr const char* kOperation = "attend_factored";

}  // namespace

namespace detail {

template <class T>
void check_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const AttentionOutput<T>& output, const char* operation, const void* workspace,
                    std::size_t workspace_bytes, Lengths lengths) {
  using detail::checked_multiply;
  using detail::expect_not_null;
  using detail::fail_argument;
  if (input.layer.relevance != nullptr || input.layer.content != nullptr ||
      input.layer.key_bias != nullptr || input.layer.offset != nullptr) {
    fail_argument(operation, "input.layer",
                  "must be empty (null pointers): the operators come from 'layer'");
  }
  detail::expect_positive(operation, "heads", layer.heads);
  detail::expect_positive(operation, "rank", layer.rank);
  expect_not_null(operation, "query_factor", layer.query_factor);
  expect_not_null(operation, "key_factor", layer.key_factor);
  expect_not_null(operation, "content_up", layer.content_up);
  expect_not_null(operation, "content_down", layer.content_down);
  if (input.dim >= 1) {
    checked_multiply(operation, "query_factor",
                     checked_multiply(operation, "query_factor", layer.heads, layer.rank),
                     input.dim);
  }
  // Everything else (sizes, cloud, beta, mask, key lengths, outputs) as for emflow::attend; the
  // dense operator pointers are stand-ins there, only checked for null and never read.
  AttentionInput<T> shape = input;
  shape.layer.heads = layer.heads;
  shape.layer.relevance = layer.query_factor;
  shape.layer.content = layer.content_down;
  detail::check_arguments(shape, output, operation, lengths);
  // No output may share memory with the factors (sizes fit: checked above).
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto Nq = static_cast<std::size_t>(detail::query_count(input));
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(layer.heads);
  const auto r = static_cast<std::size_t>(layer.rank);
  const detail::MemoryRange ranges[] = {
      {"cloud", input.cloud, B * N * d * sizeof(T), false},
      {"queries", input.queries, B * Nq * d * sizeof(T), false},
      {"query_lengths", input.query_lengths, B * sizeof(std::int64_t), false},
      {"query_positions", input.query_positions, B * sizeof(std::int64_t), false},
      {"query_factor", layer.query_factor, H * r * d * sizeof(T), false},
      {"key_factor", layer.key_factor, H * r * d * sizeof(T), false},
      {"content_up", layer.content_up, H * d * r * sizeof(T), false},
      {"content_down", layer.content_down, H * r * d * sizeof(T), false},
      {"key_bias", layer.key_bias, H * d * sizeof(T), false},
      {"offset", layer.offset, d * sizeof(T), false},
      {"key_lengths", input.key_lengths, B * sizeof(std::int64_t), false},
      {"update", output.update, B * Nq * d * sizeof(T), true},
      {"lse", output.lse, B * H * Nq * sizeof(Stat<T>), true},
      {"entropy", output.entropy, B * H * Nq * sizeof(Stat<T>), true},
      {"weights", output.weights, B * H * Nq * N * sizeof(Stat<T>), true},
      {"workspace", workspace, workspace_bytes, true},
  };
  detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
}

#define EMFLOW_CHECK_FACTORED(T)                                                       \
  template void check_factored<T>(const AttentionInput<T>&, const FactoredLayer<T>&,   \
                                  const AttentionOutput<T>&, const char*, const void*, \
                                  std::size_t, Lengths);
EMFLOW_CHECK_FACTORED(float)
EMFLOW_CHECK_FACTORED(double)
EMFLOW_CHECK_FACTORED(bfloat16)
EMFLOW_CHECK_FACTORED(float16)
#undef EMFLOW_CHECK_FACTORED

}  // namespace detail

namespace {

/// M_h = A_h^T B_h and F_h = U_h V_h in double, with the key bias and offset, as a dense layer.
template <class T>
struct DenseLayer {
  std::vector<double> relevance, content, key_bias, offset;

  DenseLayer(const FactoredLayer<T>& f, std::int64_t d) {
    const std::int64_t H = f.heads, r = f.rank;
    relevance.assign(static_cast<std::size_t>(H * d * d), 0.0);
    content.assign(relevance.size(), 0.0);
    for (std::int64_t h = 0; h < H; ++h) {
      const T* A = f.query_factor + h * r * d;
      const T* B = f.key_factor + h * r * d;
      const T* U = f.content_up + h * d * r;
      const T* V = f.content_down + h * r * d;
      double* M = relevance.data() + h * d * d;
      double* F = content.data() + h * d * d;
      for (std::int64_t a = 0; a < d; ++a) {
        for (std::int64_t b = 0; b < d; ++b) {
          double m = 0.0, c = 0.0;
          for (std::int64_t k = 0; k < r; ++k) {
            m += static_cast<double>(A[k * d + a]) * static_cast<double>(B[k * d + b]);
            c += static_cast<double>(U[a * r + k]) * static_cast<double>(V[k * d + b]);
          }
          M[a * d + b] = m;
          F[a * d + b] = c;
        }
      }
    }
    if (f.key_bias) key_bias.assign(f.key_bias, f.key_bias + H * d);
    if (f.offset) offset.assign(f.offset, f.offset + d);
  }
};

template <class To, class From>
std::vector<To> converted(const From* data, std::int64_t count) {
  if (data == nullptr) return {};
  return std::vector<To>(data, data + count);
}

/// `values` where the caller asked for this output, null where it did not.
template <class To, class From>
To* pointer(std::vector<To>& values, const From* given) {
  return given == nullptr ? nullptr : values.data();
}

/// Runs emflow::attend on the dense expansion, computing in U (double for the reference, T on
/// other devices) and writing the outputs back as T.
template <class U, class T>
void attend_dense(const AttentionInput<T>& input, const FactoredLayer<T>& factored,
                  const AttentionOutput<T>& output, const ExecutionOptions& options) {
  const DenseLayer<T> dense(factored, input.dim);
  const std::int64_t B = input.batch, N = input.tokens, d = input.dim, H = factored.heads;
  const std::int64_t Nq = detail::query_count(input);
  const std::vector<U> cloud = converted<U>(input.cloud, B * N * d);
  const std::vector<U> queries = converted<U>(input.queries, B * Nq * d);
  const std::vector<U> relevance(dense.relevance.begin(), dense.relevance.end());
  const std::vector<U> content(dense.content.begin(), dense.content.end());
  const std::vector<U> key_bias(dense.key_bias.begin(), dense.key_bias.end());
  const std::vector<U> offset(dense.offset.begin(), dense.offset.end());

  const AttentionInput<U> in = with_arrays(
      input, cloud.data(), input.queries ? queries.data() : nullptr,
      {H, relevance.data(), content.data(), key_bias.empty() ? nullptr : key_bias.data(),
       offset.empty() ? nullptr : offset.data()});
  // tf32 was checked as a permission for float input (the products here are fp32 or double);
  // the dense call may run in double, where it would not apply.
  ExecutionOptions dense_options = options;
  dense_options.precision = Precision::fp32;

  if constexpr (std::is_same_v<U, T>) {
    emflow::attend(in, output, dense_options);
  } else {
    std::vector<U> update(static_cast<std::size_t>(B * Nq * d)), lse, entropy, weights;
    if (output.lse) lse.resize(static_cast<std::size_t>(B * H * Nq));
    if (output.entropy) entropy.resize(static_cast<std::size_t>(B * H * Nq));
    if (output.weights) weights.resize(static_cast<std::size_t>(B * H * Nq * N));
    AttentionOutput<U> out{update.data(), pointer(lse, output.lse),
                           pointer(entropy, output.entropy), pointer(weights, output.weights)};
    emflow::attend(in, out, dense_options);
    std::copy(update.begin(), update.end(), output.update);
    if (output.lse) std::copy(lse.begin(), lse.end(), output.lse);
    if (output.entropy) std::copy(entropy.begin(), entropy.end(), output.entropy);
    if (output.weights) std::copy(weights.begin(), weights.end(), output.weights);
  }
}

bool factored_finite(const AttentionInput<float>& in, const FactoredLayer<float>& f) {
  using detail::cpu::all_finite;
  const std::int64_t factor = f.heads * f.rank * in.dim;
  return detail::cpu::clouds_finite(in.cloud, in.batch, in.tokens, in.dim, in.key_lengths) &&
         all_finite(f.query_factor, factor) && all_finite(f.key_factor, factor) &&
         all_finite(f.content_up, factor) && all_finite(f.content_down, factor) &&
         all_finite(f.key_bias, f.heads * in.dim) && all_finite(f.offset, in.dim);
}

/// The factored float32 path of the fused CPU engine (see the top of this file).
void attend_factored_cpu(const AttentionInput<float>& input, const FactoredLayer<float>& f,
                         const AttentionOutput<float>& output, int threads) {
  const std::int64_t H = f.heads, r = f.rank, d = input.dim;
  const bool bias = f.key_bias != nullptr;
  const std::int64_t score_dim = r + (bias ? 1 : 0);
  const std::int64_t score_stride = detail::cpu::padded_columns(score_dim);
  const std::int64_t value_stride = detail::cpu::padded_columns(r);
  const std::int64_t dim_stride = detail::cpu::padded_columns(d);
  const float beta = static_cast<float>(input.beta);
  auto at = [](std::vector<float>& v, std::int64_t i) -> float& {
    return v[static_cast<std::size_t>(i)];
  };

  std::vector<float> query_map(static_cast<std::size_t>(H * d * score_stride), 0.0f);
  std::vector<float> key_map(query_map.size(), 0.0f);
  std::vector<float> value_map(static_cast<std::size_t>(H * d * value_stride), 0.0f);
  std::vector<float> output_map(static_cast<std::size_t>(H * r * dim_stride), 0.0f);
  std::vector<float> query_bias;
  if (bias) query_bias.assign(static_cast<std::size_t>(H * score_stride), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const float* A = f.query_factor + h * r * d;
    const float* B = f.key_factor + h * r * d;
    const float* U = f.content_up + h * d * r;
    const float* V = f.content_down + h * r * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c) {
        at(query_map, (h * d + k) * score_stride + c) = beta * A[c * d + k];
        at(key_map, (h * d + k) * score_stride + c) = B[c * d + k];
        at(value_map, (h * d + k) * value_stride + c) = V[c * d + k];
        at(output_map, (h * r + c) * dim_stride + k) = U[k * r + c];
      }
      if (bias) at(key_map, (h * d + k) * score_stride + r) = beta * f.key_bias[h * d + k];
    }
    if (bias) at(query_bias, h * score_stride + r) = 1.0f;
  }

  detail::cpu::EngineLayer layer;
  layer.heads = H;
  layer.dim = d;
  layer.score_dim = score_dim;
  layer.value_dim = r;
  layer.query_map = query_map.data();
  layer.query_bias = bias ? query_bias.data() : nullptr;
  layer.key_map = key_map.data();
  layer.value_map = value_map.data();
  layer.output_map = output_map.data();
  layer.offset = f.offset;
  std::vector<detail::QueryRule> rules;
  if (detail::plain_self_attention(input)) {
    rules = detail::cpu::self_rules(input.batch, input.tokens, input.mask, input.key_lengths);
  } else {
    for (std::int64_t b = 0; b < input.batch; ++b) rules.push_back(detail::query_rule(input, b));
  }
  detail::cpu::EngineClouds clouds;
  clouds.keys = input.cloud;
  clouds.queries = detail::query_rows(input);
  clouds.batch = input.batch;
  clouds.tokens = input.tokens;
  clouds.query_tokens = detail::query_count(input);
  clouds.rules = rules.data();
  detail::cpu::EngineOutput sink;
  sink.attend = output;
  detail::cpu::fused_attend(clouds, layer, sink, threads);
}

/// attend_factored for float and double on `device` (cpu, reference or cuda).
template <class T>
void attend_factored_host(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, const ExecutionOptions& options,
                          Device device);

}  // namespace

template <class T>
void attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                     const AttentionOutput<T>& output, const ExecutionOptions& options) {
  detail::check_factored(input, layer, output, kOperation);
  if (options.threads < 0) {
    detail::fail_argument(kOperation, "threads", "must be >= 0, got ", options.threads);
  }
  if constexpr (is_16bit_v<T>) {
    const Device device =
        detail::resolve_16bit_factored_device(options.device, layer, output, kOperation);
    detail::check_precision<T>(options, kOperation);
    if (device == Device::cuda) {
      detail::cuda_attend_factored(input, layer, output);
    } else {
      detail::attend_factored_16bit(input, layer, output, device, options.threads);
    }
  } else {
    const Device device = resolve_device(options.device);
    if constexpr (std::is_same_v<T, float>) {
      // TF32 on the tensor cores (src/cuda/tc_factored.cpp); elsewhere tf32 permits fp32 products.
      if (device == Device::cuda && options.precision == Precision::tf32 &&
          detail::tensor_core_missing_output(output.weights) == nullptr && layer.rank <= 256) {
        detail::cuda_attend_factored(input, layer, output, Precision::tf32);
        return;
      }
    }
    detail::check_precision<T>(options, kOperation);
    attend_factored_host(input, layer, output, options, device);
  }
}

namespace {

template <class T>
void attend_factored_host(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, const ExecutionOptions& options,
                          Device device) {
  switch (device) {
    case Device::reference:
      attend_dense<double>(input, layer, output, options);
      return;
    case Device::cpu:
    case Device::automatic:
      if constexpr (std::is_same_v<T, float>) {
        if (factored_finite(input, layer)) {
          attend_factored_cpu(input, layer, output, options.threads);
        } else {  // NaNs exactly where the reference puts them (see clouds_finite)
          attend_dense<double>(input, layer, output, options);
        }
      } else {
        attend_dense<double>(input, layer, output, options);
      }
      return;
    case Device::cuda:  // the factored layer's plan on the device (src/cuda/expanded.cpp)
      detail::cuda_attend_factored(input, layer, output, options.precision);
      return;
  }
}

}  // namespace

template void attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                        const FactoredLayer<bfloat16>&,
                                        const AttentionOutput<bfloat16>&, const ExecutionOptions&);
template void attend_factored<float16>(const AttentionInput<float16>&,
                                       const FactoredLayer<float16>&,
                                       const AttentionOutput<float16>&, const ExecutionOptions&);
template void attend_factored<float>(const AttentionInput<float>&, const FactoredLayer<float>&,
                                     const AttentionOutput<float>&, const ExecutionOptions&);
template void attend_factored<double>(const AttentionInput<double>&, const FactoredLayer<double>&,
                                      const AttentionOutput<double>&, const ExecutionOptions&);

}  // namespace emflow

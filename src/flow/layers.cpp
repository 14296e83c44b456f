// The flow's vocabulary and its generated inputs: the names of the settings, the operators of a
// layer (generated, or from multi-head attention weights) and the seeded initial clouds.
#include <algorithm>
#include <cmath>
#include <random>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/flow.hpp"
#include "emflow/mha.hpp"
#include "internal.hpp"

namespace emflow::flow {

using emflow::detail::fail_argument;

namespace detail {

namespace {
std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream) noexcept {
  return splitmix64(splitmix64(seed) + stream);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Names

Normalization parse_normalization(const std::string& text, const char* argument) {
  if (text == "none") return Normalization::none;
  if (text == "layernorm") return Normalization::layernorm;
  if (text == "rmsnorm") return Normalization::rmsnorm;
  if (text == "sphere") return Normalization::sphere;
  fail_argument("flow", argument, "expects none, layernorm, rmsnorm or sphere, got '", text, "'");
}

Integrator parse_integrator(const std::string& text, const char* argument) {
  if (text == "euler") return Integrator::euler;
  if (text == "rk4") return Integrator::rk4;
  fail_argument("flow", argument, "expects euler or rk4, got '", text, "'");
}

InitialCloud parse_initial_cloud(const std::string& text, const char* argument) {
  if (text == "gaussian") return InitialCloud::gaussian;
  if (text == "sphere") return InitialCloud::sphere;
  if (text == "cube") return InitialCloud::cube;
  if (text == "orthonormal") return InitialCloud::orthonormal;
  fail_argument("flow", argument, "expects gaussian, sphere, cube or orthonormal, got '", text,
                "'");
}

OperatorKind parse_operator_kind(const std::string& text, const char* argument) {
  if (text == "identity") return OperatorKind::identity;
  if (text == "minus-identity") return OperatorKind::minus_identity;
  if (text == "random") return OperatorKind::random;
  fail_argument("flow", argument, "expects identity, minus-identity or random, got '", text, "'");
}

const char* to_string(Normalization value) noexcept {
  switch (value) {
    case Normalization::layernorm:
      return "layernorm";
    case Normalization::rmsnorm:
      return "rmsnorm";
    case Normalization::sphere:
      return "sphere";
    case Normalization::none:
      break;
  }
  return "none";
}

const char* to_string(Integrator value) noexcept {
  return value == Integrator::euler ? "euler" : "rk4";
}

// ---------------------------------------------------------------------------------------------
// Operators and initial clouds

template <class T>
LayerOperators<T> FlowLayer<T>::operators() const {
  LayerOperators<T> ops;
  ops.heads = heads;
  ops.relevance = relevance.data();
  ops.content = content.data();
  ops.key_bias = key_bias.empty() ? nullptr : key_bias.data();
  ops.offset = offset.empty() ? nullptr : offset.data();
  return ops;
}

template <class T>
std::vector<T> make_operator(OperatorKind kind, std::int64_t dim, std::uint64_t seed) {
  emflow::detail::expect_positive("make_operator", "dim", dim);
  const auto d = static_cast<std::size_t>(dim);
  std::vector<T> op(d * d, T(0));
  if (kind == OperatorKind::random) {
    std::mt19937_64 engine(seed);
    std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(dim)));
    for (T& v : op) v = static_cast<T>(normal(engine));
  } else {
    const T diagonal = kind == OperatorKind::identity ? T(1) : T(-1);
    for (std::size_t a = 0; a < d; ++a) op[a * d + a] = diagonal;
  }
  return op;
}

template <class T>
FlowLayer<T> make_layer(std::int64_t dim, OperatorKind relevance, OperatorKind content,
                        std::uint64_t seed) {
  FlowLayer<T> layer;
  layer.relevance = make_operator<T>(relevance, dim, detail::mix_seed(seed, 1));
  layer.content = make_operator<T>(content, dim, detail::mix_seed(seed, 2));
  return layer;
}

template <class T>
FlowLayer<T> layer_from_mha(const MultiHeadAttentionWeights& weights) {
  const reference::Layer emf = to_emf(weights);
  auto cast = [](const Tensor<double>& t) {
    return std::vector<T>(t.values().begin(), t.values().end());
  };
  FlowLayer<T> layer;
  layer.heads = emf.heads();
  layer.relevance = cast(emf.relevance);
  layer.content = cast(emf.content);
  layer.key_bias = cast(emf.key_bias);
  layer.offset = cast(emf.offset);
  return layer;
}

template <class T>
Tensor<T> initial_clouds(InitialCloud kind, std::int64_t batch, std::int64_t tokens,
                         std::int64_t dim, std::uint64_t seed) {
  const char* op = "initial_clouds";
  emflow::detail::expect_positive(op, "batch", batch);
  emflow::detail::expect_positive(op, "tokens", tokens);
  emflow::detail::expect_positive(op, "dim", dim);
  if (kind == InitialCloud::orthonormal && tokens > dim) {
    fail_argument(op, "tokens", "must be <= dim (", dim, ") for orthonormal clouds, got ", tokens);
  }
  // The clouds and one cloud of float64 scratch, refused before allocating, naming the largest
  // factor; a failed allocation is ErrorCode::out_of_memory, not a bare std::bad_alloc.
  const char* largest = batch >= tokens && batch >= dim ? "batch"
                        : tokens >= dim                 ? "tokens"
                                                        : "dim";
  const std::string size =
      emflow::detail::concat("batch ", batch, " x tokens ", tokens, " x dim ", dim, " values");
  std::int64_t values = 0;
  if (__builtin_mul_overflow(batch, tokens, &values) ||
      __builtin_mul_overflow(values, dim, &values)) {
    fail_argument(op, largest, "is too large: ", size, " overflows 64 bits");
  }
  emflow::detail::expect_fits_in_memory(
      op,
      emflow::detail::concat("argument '", largest, "' (", size, " of ", sizeof(T), " bytes, and ",
                             tokens * dim, " of scratch)"),
      // NOLINTNEXTLINE(bugprone-sizeof-expression): a double of scratch, counted in T's elements
      values + tokens * dim * static_cast<std::int64_t>(sizeof(double) / sizeof(T)), sizeof(T));
  return emflow::detail::reporting_out_of_memory(op, "", [&] {
    Tensor<T> clouds({batch, tokens, dim});
    const auto d = static_cast<std::size_t>(dim);
    std::vector<double> x(static_cast<std::size_t>(tokens) * d);
    for (std::int64_t b = 0; b < batch; ++b) {
      std::mt19937_64 engine(detail::mix_seed(seed, static_cast<std::uint64_t>(b)));
      std::normal_distribution<double> normal(0.0, 1.0);
      std::uniform_real_distribution<double> uniform(-1.0, 1.0);
      if (kind == InitialCloud::cube) {
        for (double& v : x) v = uniform(engine);
      } else {
        for (double& v : x) v = normal(engine);
      }
      for (std::int64_t i = 0; i < tokens; ++i) {
        double* row = x.data() + static_cast<std::size_t>(i) * d;
        if (kind == InitialCloud::gaussian) {
          for (std::size_t a = 0; a < d; ++a) row[a] /= std::sqrt(static_cast<double>(dim));
        } else if (kind == InitialCloud::orthonormal) {
          // Modified Gram-Schmidt, twice: one pass leaves O(eps * condition) loss of
          // orthogonality, two leave rounding.
          for (int pass = 0; pass < 2; ++pass) {
            for (std::int64_t k = 0; k < i; ++k) {
              const double* prev = x.data() + static_cast<std::size_t>(k) * d;
              double dot = 0.0;
              for (std::size_t a = 0; a < d; ++a) dot += row[a] * prev[a];
              for (std::size_t a = 0; a < d; ++a) row[a] -= dot * prev[a];
            }
          }
        }
        if (kind == InitialCloud::sphere || kind == InitialCloud::orthonormal) {
          double norm = 0.0;
          for (std::size_t a = 0; a < d; ++a) norm += row[a] * row[a];
          norm = std::sqrt(norm);
          for (std::size_t a = 0; a < d; ++a) row[a] /= norm;
        }
      }
      std::copy(x.begin(), x.end(), clouds.data() + static_cast<std::size_t>(b) * x.size());
    }
    return clouds;
  });
}

#define EMFLOW_LAYERS_INSTANTIATE(T)                                                            \
  template struct FlowLayer<T>;                                                                 \
  template std::vector<T> make_operator<T>(OperatorKind, std::int64_t, std::uint64_t);          \
  template FlowLayer<T> make_layer<T>(std::int64_t, OperatorKind, OperatorKind, std::uint64_t); \
  template FlowLayer<T> layer_from_mha<T>(const MultiHeadAttentionWeights&);                    \
  template Tensor<T> initial_clouds<T>(InitialCloud, std::int64_t, std::int64_t, std::int64_t,  \
                                       std::uint64_t);

EMFLOW_LAYERS_INSTANTIATE(float)
EMFLOW_LAYERS_INSTANTIATE(double)
#undef EMFLOW_LAYERS_INSTANTIATE

}  // namespace emflow::flow

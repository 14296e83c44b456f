// The parts of a llama layer that run_model (run.cpp) and the greedy decoder (decoder.cpp)
// share: the activations, RMSNorm, the gated feed-forward block and the factored form of a
// layer's attention, accumulating in double; and for float runs the feed-forward block and the
// unembedding as float32 products (as torch computes them). Internal to src/model.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "emflow/capability.hpp"
#include "emflow/model.hpp"
#include "emflow/precision.hpp"

namespace emflow::model::layers {

inline double activate(Activation activation, double x) {
  switch (activation) {
    case Activation::gelu:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::gelu_tanh: {
      const double k = std::sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
    }
    case Activation::silu:
      return x / (1.0 + std::exp(-x));
    case Activation::relu:
      break;
  }
  return x > 0 ? x : 0.0;
}

// llama's gated block: out_r = W_down (act(W_gate x_r) * (W_up x_r)), accumulated in double;
// act is the model's activation (silu; gelu or gelu_tanh for a gelu-gated config).
template <class T>
void gated_feed_forward(const ModelLayer& layer, Activation activation, const T* in, T* out,
                        std::int64_t rows, std::int64_t d) {
  const std::int64_t I = layer.ffn_in.extent(0);
  const double* w_gate = layer.ffn_gate.data();
  const double* w_up = layer.ffn_in.data();
  const double* w_down = layer.ffn_out.data();
#pragma omp parallel for schedule(static) if (rows * d * I > (1 << 20))
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> x(in + r * d, in + (r + 1) * d), hidden(static_cast<std::size_t>(I));
    for (std::int64_t k = 0; k < I; ++k) {
      double g = 0.0, u = 0.0;
      const double* gate_row = w_gate + k * d;
      const double* up_row = w_up + k * d;
      for (std::int64_t a = 0; a < d; ++a) {
        g += gate_row[a] * x[static_cast<std::size_t>(a)];
        u += up_row[a] * x[static_cast<std::size_t>(a)];
      }
      hidden[static_cast<std::size_t>(k)] = activate(activation, g) * u;
    }
    for (std::int64_t a = 0; a < d; ++a) {
      double s = 0.0;
      const double* row = w_down + a * I;
      for (std::int64_t k = 0; k < I; ++k) s += row[k] * hidden[static_cast<std::size_t>(k)];
      out[r * d + a] = static_cast<T>(s);
    }
  }
}

// RMSNorm of every row in place: x gain / sqrt(mean(x^2) + eps), accumulated in double.
template <class T>
void rms_norm(T* x, std::int64_t rows, std::int64_t d, const Tensor<double>& gain, double eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* row = x + r * d;
    double square = 0.0;
    for (std::int64_t a = 0; a < d; ++a) square += static_cast<double>(row[a]) * row[a];
    const double scale = 1.0 / std::sqrt(square / static_cast<double>(d) + eps);
    for (std::int64_t a = 0; a < d; ++a) {
      row[a] = static_cast<T>(gain[a] * (static_cast<double>(row[a]) * scale));
    }
  }
}

// Whether a float run takes its feed-forward block and unembedding as float32 products
// (detail::cpu_products): wherever the CPU engine can run on this processor. Elsewhere, and for
// double runs, the double loops above.
inline bool float_products() { return this_machine().cpu_missing.empty(); }

inline std::int64_t padded(std::int64_t n) {
  return (n + detail::kProductColumns - 1) / detail::kProductColumns * detail::kProductColumns;
}

// The products of a float run's weights: float32 (detail::cpu_products) or bfloat16
// (detail::cpu_products_bf16: the activations rounded to bfloat16, float32 sums), with W the
// weights' element type; where their panels put element (k, c) of a depth x columns B, and how
// many elements they hold.
inline void products(const float* a, std::int64_t rows, std::int64_t depth, const float* b,
                     std::int64_t columns, float* c, int threads) {
  detail::cpu_products(a, rows, depth, b, columns, c, threads);
}
inline void products(const float* a, std::int64_t rows, std::int64_t depth, const bfloat16* b,
                     std::int64_t columns, float* c, int threads) {
  detail::cpu_products_bf16(a, rows, depth, b, columns, c, threads);
}
template <class W>
std::int64_t panel_index(std::int64_t depth, std::int64_t columns, std::int64_t k, std::int64_t c) {
  if constexpr (std::is_same_v<W, bfloat16>) {
    return detail::product_index_bf16(depth, columns, k, c);
  } else {
    return detail::product_index(depth, columns, k, c);
  }
}
template <class W>
std::vector<W> panels(std::int64_t depth, std::int64_t columns) {
  const std::int64_t rows = std::is_same_v<W, bfloat16> ? (depth + 1) / 2 * 2 : depth;
  return std::vector<W>(static_cast<std::size_t>(rows * columns), W{});
}
template <class W>
W weight(double value) {
  if constexpr (std::is_same_v<W, bfloat16>) {
    return to_bfloat16(static_cast<float>(value));
  } else {
    return static_cast<float>(value);
  }
}

// w (rows x cols) transposed into out, the panels of a cols x stride matrix B (panel_index),
// its column k at column at + k.
template <class W>
void put_transposed(const Tensor<double>& w, std::vector<W>& out, std::int64_t stride,
                    std::int64_t at) {
  const std::int64_t rows = w.extent(0), cols = w.extent(1);
  for (std::int64_t k = 0; k < rows; ++k)
    for (std::int64_t a = 0; a < cols; ++a)
      out[static_cast<std::size_t>(panel_index<W>(cols, stride, a, at + k))] =
          weight<W>(w[k * cols + a]);
}

// A llama layer's gated feed-forward block as products of a float run (where float_products()),
// its weights in W (float, or bfloat16 where the processor has AVX512-BF16):
// [W_gate^T | W_up^T] (d x 2 I', I' = I padded to whole vectors) and W_down^T (I' x d'), zero
// in the padding, so that the block is two products and act(g) u between them, each element
// accumulated in float32 in a fixed order. silu runs on the engine's vectors
// (detail::cpu_gated_silu); a gelu-gated block's activation is computed per element in double
// and rounded to float, then multiplied by u in float.
template <class W>
class GatedFeedForwardProducts {
 public:
  GatedFeedForwardProducts(const ModelLayer& layer, Activation activation, std::int64_t d)
      : activation_(activation), d_(d), inner_(padded(layer.ffn_in.extent(0))), out_(padded(d)) {
    gate_up_ = panels<W>(d, 2 * inner_);
    put_transposed(layer.ffn_gate, gate_up_, 2 * inner_, 0);
    put_transposed(layer.ffn_in, gate_up_, 2 * inner_, inner_);
    down_ = panels<W>(inner_, out_);
    put_transposed(layer.ffn_out, down_, out_, 0);
  }

  // out (rows x d) = W_down (act(W_gate x_r) * (W_up x_r)) for the rows x_r of in (rows x d);
  // `scratch` is resized to what the call needs (one buffer for every layer of a model).
  void operator()(const float* in, float* out, std::int64_t rows, int threads,
                  std::vector<float>& scratch) const {
    const std::int64_t I = inner_;
    const bool wide = out_ != d_;
    scratch.resize(static_cast<std::size_t>(rows * (3 * I + (wide ? out_ : 0))));
    float* gate_up = scratch.data();
    float* hidden = gate_up + rows * 2 * I;
    products(in, rows, d_, gate_up_.data(), 2 * I, gate_up, threads);
    if (activation_ == Activation::silu) {
      detail::cpu_gated_silu(gate_up, rows, I, hidden);
    } else {
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * I;
        for (std::int64_t k = 0; k < I; ++k) {
          hidden[r * I + k] = static_cast<float>(activate(activation_, g[k])) * g[I + k];
        }
      }
    }
    if (!wide) {
      products(hidden, rows, I, down_.data(), out_, out, threads);
      return;
    }
    float* result = hidden + rows * I;
    products(hidden, rows, I, down_.data(), out_, result, threads);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy(result + r * out_, result + r * out_ + d_, out + r * d_);
    }
  }

 private:
  Activation activation_;
  std::int64_t d_, inner_, out_;
  std::vector<W> gate_up_, down_;
};
using GatedFeedForward32 = GatedFeedForwardProducts<float>;

// The unembedding as products of a float run (where float_products()), its weights in W:
// W^T (d x V', V' the vocabulary padded to whole vectors), the logits of a row by one product.
template <class W>
class UnembeddingProducts {
 public:
  explicit UnembeddingProducts(const Tensor<double>& w)
      : d_(w.extent(1)), vocab_(w.extent(0)), stride_(padded(w.extent(0))) {
    w_ = panels<W>(d_, stride_);
    put_transposed(w, w_, stride_, 0);
  }

  // logits (vocab) of one normed row h (d).
  void operator()(const float* h, float* logits, int threads) {
    wide_.resize(static_cast<std::size_t>(stride_));
    products(h, 1, d_, w_.data(), stride_, wide_.data(), threads);
    std::copy(wide_.begin(), wide_.begin() + vocab_, logits);
  }

 private:
  std::int64_t d_, vocab_, stride_;
  std::vector<W> w_;
  std::vector<float> wide_;
};

template <class T>
std::vector<T> cast(const Tensor<double>& t) {
  return std::vector<T>(t.values().begin(), t.values().end());
}

// The factored form of a layer's attention (emflow/factored.hpp), heads one after another.
template <class T>
struct Factors {
  std::vector<T> a, b, up, down;

  // kv_heads: the heads of W_K and W_V (0: heads).
  explicit Factors(const MultiHeadAttentionWeights& w, std::int64_t kv_heads = 0) {
    const std::int64_t H = w.heads, d = w.model_dim, k = w.head_dim, v = w.value_dim;
    const std::int64_t K = kv_heads == 0 ? H : kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(k));
    for (std::int64_t i = 0; i < H * k * d; ++i) a.push_back(static_cast<T>(w.query[i] * scale));
    for (std::int64_t i = 0; i < K * k * d; ++i) b.push_back(static_cast<T>(w.key[i]));
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t r = 0; r < d; ++r)
        for (std::int64_t c = 0; c < v; ++c)
          up.push_back(static_cast<T>(w.output[r * H * v + h * v + c]));
    }
    for (std::int64_t i = 0; i < K * v * d; ++i) down.push_back(static_cast<T>(w.value[i]));
  }
};

// The factored form of an attention with biases on q, k and v (Qwen2), in dimension d + 1: the
// cloud gains a coordinate that is 1, A_h = [W_Q,h | b_Q,h] / sqrt(d_k), B_h = [W_K,h | b_K,h],
// V_h = [W_V,h | b_V,h] and U_h = [W_O,h ; 0], so that A_h x' = (W_Q,h x + b_Q,h) / sqrt(d_k), the
// rotary positions rotate the biased queries and keys as the framework does, and the update's
// last coordinate is 0.
template <class T>
struct BiasedFactors {
  std::vector<T> a, b, up, down;

  BiasedFactors(const MultiHeadAttentionWeights& w, std::int64_t kv_heads) {
    const std::int64_t H = w.heads, d = w.model_dim, k = w.head_dim, K = kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(k));
    auto rows = [&](std::vector<T>& out, const Tensor<double>& weight, const Tensor<double>& bias,
                    std::int64_t count, double factor) {
      for (std::int64_t r = 0; r < count; ++r) {
        for (std::int64_t c = 0; c < d; ++c)
          out.push_back(static_cast<T>(weight[r * d + c] * factor));
        out.push_back(static_cast<T>(bias[r] * factor));
      }
    };
    rows(a, w.query, w.query_bias, H * k, scale);
    rows(b, w.key, w.key_bias, K * k, 1.0);
    rows(down, w.value, w.value_bias, K * k, 1.0);
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t r = 0; r < d; ++r)
        for (std::int64_t c = 0; c < k; ++c)
          up.push_back(static_cast<T>(w.output[r * H * k + h * k + c]));
      for (std::int64_t c = 0; c < k; ++c) up.push_back(T(0));
    }
  }
};

}  // namespace emflow::model::layers

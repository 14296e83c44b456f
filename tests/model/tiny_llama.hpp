// A tiny random llama (Layout::llama: grouped kv heads, rotary positions, RMSNorm, SwiGLU), for
// the tests of run_model (llama_test.cpp) and of generation (llama_generate_test.cpp). Its
// weights are float32 values, so a float32 operator folder or a GGUF F32 tensor holds them
// exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "common/testing.hpp"
#include "emflow/model.hpp"
#include "emflow/tensor.hpp"

namespace emflow::testing::tiny_llama {

using model::Layout;
using model::Model;
using model::ModelLayer;

inline constexpr std::int64_t kDim = 16, kHeads = 4, kKv = 2, kHead = 4, kFfn = 24, kLayers = 2;

// A random tensor whose values are float32 values (so a float32 folder or a GGUF F32 holds them
// exactly).
inline Tensor<double> weights(const Shape& shape, std::uint64_t seed, double scale) {
  Tensor<double> t = emflow::testing::random_tensor(shape, seed, -scale, scale);
  for (double& v : t.values()) v = static_cast<float>(v);
  return t;
}

// A llama of kLayers layers and `vocab` tokens. tied: no unembedding of its own; biases:
// Qwen2's on q, k and v; window: Mistral's (0: none).
inline Model random_llama(std::int64_t vocab, bool tied, bool biases = false,
                          std::int64_t window = 0) {
  Model m;
  m.layout = Layout::llama;
  m.model_type = "llama";
  m.heads = kHeads;
  m.kv_heads = kKv;
  m.dim = kDim;
  m.head_dim = kHead;
  m.ffn_dim = kFfn;
  m.norm_eps = 1e-5;
  m.pre_norm = true;
  m.causal = true;
  m.activation = emflow::model::Activation::silu;
  m.rotary.dim = kHead;
  m.rotary.base = 10000.0;
  m.sliding_window = window;
  std::uint64_t seed = 700;
  const double s = 1.2 / std::sqrt(static_cast<double>(kDim));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    ModelLayer layer;
    auto& w = layer.attention;
    w.heads = kHeads;
    w.model_dim = kDim;
    w.head_dim = w.value_dim = kHead;
    w.query = weights({kHeads * kHead, kDim}, seed++, 3 * s);
    w.key = weights({kKv * kHead, kDim}, seed++, 3 * s);
    w.value = weights({kKv * kHead, kDim}, seed++, s);
    w.output = weights({kDim, kHeads * kHead}, seed++, s);
    if (biases) {
      w.query_bias = weights({kHeads * kHead}, seed++, 0.5);
      w.key_bias = weights({kKv * kHead}, seed++, 0.5);
      w.value_bias = weights({kKv * kHead}, seed++, 0.5);
    }
    layer.norm1_gain = weights({kDim}, seed++, 1.5);
    layer.norm2_gain = weights({kDim}, seed++, 1.5);
    layer.ffn_gate = weights({kFfn, kDim}, seed++, s);
    layer.ffn_in = weights({kFfn, kDim}, seed++, s);
    layer.ffn_out = weights({kDim, kFfn}, seed++, s);
    m.layers.push_back(std::move(layer));
  }
  m.final_gain = weights({kDim}, seed++, 1.5);
  m.embedding = weights({vocab, kDim}, seed++, 1.0);
  if (!tied) m.unembedding = weights({vocab, kDim}, seed++, 1.0);
  return m;
}

}  // namespace emflow::testing::tiny_llama

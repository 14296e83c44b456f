// The llama layout on a tiny random model (also with Qwen2's q/k/v biases and with Mistral's
// sliding window): run_model and next_token_logits against a plain double implementation written
// out here (RMSNorm, rotary half-split queries and keys, grouped kv heads, the causal mask and
// right padding, SwiGLU, the final norm and the unembedding); the operator folder's round trip in
// float64 and float32; and the GGUF loader: llama.cpp's permutation of the query and key rows
// undone, its per-frequency rotary factors (rope_freqs.weight) read, and every bad file refused
// naming the file and the tensor or key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/files.hpp"
#include "common/testing.hpp"
#include "emflow/model.hpp"
#include "tiny_llama.hpp"

namespace {

namespace fs = std::filesystem;
using emflow::Shape;
using emflow::Tensor;
using emflow::model::Layout;
using emflow::model::Model;
using emflow::model::ModelLayer;

using emflow::testing::tiny_llama::kDim;
using emflow::testing::tiny_llama::kFfn;
using emflow::testing::tiny_llama::kHead;
using emflow::testing::tiny_llama::kHeads;
using emflow::testing::tiny_llama::kKv;
using emflow::testing::tiny_llama::kLayers;

constexpr std::int64_t kVocab = 11;

Model make_llama(bool tied, bool biases = false, std::int64_t window = 0) {
  return emflow::testing::tiny_llama::random_llama(kVocab, tied, biases, window);
}

// ---- the plain implementation, one cloud at a time, in double ----

using Rows = std::vector<std::vector<double>>;

std::vector<double> matvec(const Tensor<double>& w, const std::vector<double>& x) {
  const std::int64_t rows = w.extent(0), cols = w.extent(1);
  std::vector<double> y(static_cast<std::size_t>(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  return y;
}

std::vector<double> rms(const std::vector<double>& x, const Tensor<double>& gain, double eps) {
  double square = 0;
  for (double v : x) square += v * v;
  const double scale = 1.0 / std::sqrt(square / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (std::size_t a = 0; a < x.size(); ++a)
    y[a] = gain[static_cast<std::int64_t>(a)] * x[a] * scale;
  return y;
}

// Hugging Face's apply_rotary_pos_emb on one head's vector at position p (rotate_half).
void rotate(double* v, std::int64_t p, const Model& m) {
  const std::int64_t half = m.rotary.dim / 2;
  for (std::int64_t t = 0; t < half; ++t) {
    const double angle =
        static_cast<double>(p) *
        std::pow(m.rotary.base, -2.0 * static_cast<double>(t) / static_cast<double>(m.rotary.dim));
    const double a = v[t], b = v[t + half];
    v[t] = a * std::cos(angle) - b * std::sin(angle);
    v[t + half] = b * std::cos(angle) + a * std::sin(angle);
  }
}

// The gate's activation: silu (SwiGLU), or gelu, exact or with tanh (a gelu-gated block).
double gated(emflow::model::Activation activation, double g) {
  switch (activation) {
    case emflow::model::Activation::gelu:
      return g * 0.5 * std::erfc(-g / std::sqrt(2.0));
    case emflow::model::Activation::gelu_tanh:
      return 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
    default:
      return g / (1 + std::exp(-g));
  }
}

// The real rows (n of them) of one cloud after every layer; the input first. Token i is turned
// at position positions[i] (default: i); the masks are by index.
std::vector<Rows> plain_run(const Model& m, Rows x,
                            const std::vector<std::int64_t>& positions = {}) {
  const std::int64_t n = static_cast<std::int64_t>(x.size()), k = m.head_dim;
  const std::int64_t group = m.heads / m.kv_heads;
  std::vector<Rows> records{x};
  for (const ModelLayer& layer : m.layers) {
    Rows q(n), key(n), val(n);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::vector<double> h = rms(x[i], layer.norm1_gain, m.norm_eps);
      q[i] = matvec(layer.attention.query, h);
      key[i] = matvec(layer.attention.key, h);
      val[i] = matvec(layer.attention.value, h);
      if (layer.attention.query_bias.size() > 0) {
        for (std::size_t c = 0; c < q[i].size(); ++c) {
          q[i][c] += layer.attention.query_bias[static_cast<std::int64_t>(c)];
        }
        for (std::size_t c = 0; c < key[i].size(); ++c) {
          key[i][c] += layer.attention.key_bias[static_cast<std::int64_t>(c)];
          val[i][c] += layer.attention.value_bias[static_cast<std::int64_t>(c)];
        }
      }
      const std::int64_t p = positions.empty() ? i : positions[static_cast<std::size_t>(i)];
      for (std::int64_t hd = 0; hd < m.heads; ++hd) rotate(q[i].data() + hd * k, p, m);
      for (std::int64_t hd = 0; hd < m.kv_heads; ++hd) rotate(key[i].data() + hd * k, p, m);
    }
    Rows next = x;
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<double> heads(static_cast<std::size_t>(m.heads * k), 0.0);
      for (std::int64_t hd = 0; hd < m.heads; ++hd) {
        const std::int64_t g = hd / group;
        std::vector<double> s(static_cast<std::size_t>(i + 1));
        double top = -std::numeric_limits<double>::infinity(), sum = 0;
        // Causal, and within the window: i - w < j.
        const std::int64_t first =
            m.sliding_window > 0 ? std::max<std::int64_t>(0, i - m.sliding_window + 1) : 0;
        for (std::int64_t j = 0; j < first; ++j) s[j] = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = first; j <= i; ++j) {
          double dot = 0;
          for (std::int64_t c = 0; c < k; ++c) dot += q[i][hd * k + c] * key[j][g * k + c];
          s[j] = dot / std::sqrt(static_cast<double>(k));
          top = std::max(top, s[j]);
        }
        for (double& v : s) sum += (v = std::exp(v - top));  // exp(-inf) = 0
        for (std::int64_t j = 0; j <= i; ++j)
          for (std::int64_t c = 0; c < k; ++c) heads[hd * k + c] += s[j] / sum * val[j][g * k + c];
      }
      const std::vector<double> o = matvec(layer.attention.output, heads);
      for (std::int64_t a = 0; a < m.dim; ++a) next[i][a] += o[a];
    }
    x = next;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::vector<double> h = rms(x[i], layer.norm2_gain, m.norm_eps);
      std::vector<double> gate = matvec(layer.ffn_gate, h), up = matvec(layer.ffn_in, h);
      for (std::size_t c = 0; c < gate.size(); ++c) gate[c] = gated(m.activation, gate[c]) * up[c];
      const std::vector<double> down = matvec(layer.ffn_out, gate);
      for (std::int64_t a = 0; a < m.dim; ++a) x[i][a] += down[a];
    }
    records.push_back(x);
  }
  return records;
}

template <class T>
class LlamaModel : public ::testing::Test {};
TYPED_TEST_SUITE(LlamaModel, emflow::testing::FloatTypes);

// Explicit rotary positions (RunSettings::positions): each token turned at its own, the masks by
// index, as the plain implementation computes it; 0..N-1 given is the default, bit for bit; a
// count other than B * N and a layout without rotary are refused by name.
TYPED_TEST(LlamaModel, ExplicitPositionsTurnEachTokenAtItsOwn) {
  using T = TypeParam;
  const Model m = make_llama(false, false, 3);  // with a window, which stays by index
  const std::int64_t B = 2, N = 6;
  const std::vector<std::int64_t> lengths{6, 4};
  const std::vector<std::int64_t> positions{7, 8, 9, 12, 13, 40, 5, 6, 8, 11, 99, 99};
  const Tensor<double> x = emflow::testing::random_tensor({B, N, kDim}, 33, -1.0, 1.0);
  const Tensor<T> clouds(x.shape(), std::vector<T>(x.values().begin(), x.values().end()));
  emflow::model::RunSettings settings;
  settings.factored = true;
  const Tensor<T> plain = emflow::model::run_model(m, clouds, lengths, settings).trajectory;
  settings.positions = positions;
  const Tensor<T> turned = emflow::model::run_model(m, clouds, lengths, settings).trajectory;
  const double tol = std::is_same<T, double>::value ? 1e-13 : 2e-5;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t n = lengths[static_cast<std::size_t>(b)];
    Rows rows(n);
    for (std::int64_t i = 0; i < n; ++i)
      rows[i].assign(x.data() + (b * N + i) * kDim, x.data() + (b * N + i + 1) * kDim);
    const std::vector<Rows> expected = plain_run(
        m, rows,
        std::vector<std::int64_t>(positions.begin() + b * N, positions.begin() + (b + 1) * N));
    double scale = 0, worst = 0, moved = 0;
    for (std::int64_t r = 1; r <= kLayers; ++r)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t a = 0; a < kDim; ++a) {
          const std::int64_t at = ((r * B + b) * N + i) * kDim + a;
          scale = std::max(scale, std::abs(expected[r][i][a]));
          worst = std::max(worst, std::abs(static_cast<double>(turned[at]) - expected[r][i][a]));
          moved = std::max(moved, std::abs(static_cast<double>(turned[at] - plain[at])));
        }
    EXPECT_LT(worst, tol * scale) << "cloud " << b;
    EXPECT_GT(moved, 1e-3 * scale) << "cloud " << b << ": the positions must matter here";
  }
  std::vector<std::int64_t> counting(static_cast<std::size_t>(B * N));
  for (std::int64_t i = 0; i < B * N; ++i) counting[static_cast<std::size_t>(i)] = i % N;
  settings.positions = counting;
  EXPECT_EQ(emflow::model::run_model(m, clouds, lengths, settings).trajectory.values(),
            plain.values());

  settings.positions.pop_back();
  std::string message = emflow::testing::error_of(emflow::ErrorCode::invalid_argument, [&] {
    emflow::model::run_model(m, clouds, lengths, settings);
  });
  EXPECT_NE(message.find("'settings.positions' has 11 entries, expected B * N = 12"),
            std::string::npos)
      << message;
  Model gpt2 = m;
  gpt2.layout = Layout::gpt2;
  settings.positions = counting;
  message = emflow::testing::error_of(emflow::ErrorCode::invalid_argument, [&] {
    emflow::model::run_model(gpt2, clouds, lengths, settings);
  });
  EXPECT_NE(message.find("the gpt2 layout has no rotary embedding"), std::string::npos) << message;
}

TYPED_TEST(LlamaModel, EqualsThePlainImplementationOnAPaddedBatch) {
  using T = TypeParam;
  using emflow::model::Activation;
  struct Variant {
    bool tied, biases;
    std::int64_t window;
    Activation gate = Activation::silu;
  };
  for (const Variant v : {Variant{true, false, 0}, Variant{false, false, 0}, Variant{true, true, 0},
                          Variant{false, false, 3}, Variant{true, false, 0, Activation::gelu_tanh},
                          Variant{false, true, 0, Activation::gelu}}) {
    const bool tied = v.tied;
    Model m = make_llama(v.tied, v.biases, v.window);
    m.activation = v.gate;
    const std::int64_t B = 2, N = 6;
    const std::vector<std::int64_t> lengths{6, 4};
    const Tensor<double> x = emflow::testing::random_tensor({B, N, kDim}, 31, -1.0, 1.0);
    Tensor<T> clouds(x.shape(), std::vector<T>(x.values().begin(), x.values().end()));
    emflow::model::RunSettings settings;
    settings.factored = true;
    const auto trace = emflow::model::run_model(m, clouds, lengths, settings);
    ASSERT_EQ(trace.trajectory.shape(), (Shape{kLayers + 1, B, N, kDim}));
    const Tensor<T> last(Shape{B, N, kDim},
                         std::vector<T>(trace.trajectory.values().end() - B * N * kDim,
                                        trace.trajectory.values().end()));
    const Tensor<T> logits = emflow::model::next_token_logits(m, last, lengths);
    ASSERT_EQ(logits.shape(), (Shape{B, kVocab}));
    const double tol = std::is_same<T, double>::value ? 1e-13 : 2e-5;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t n = lengths[b];
      Rows rows(n);
      for (std::int64_t i = 0; i < n; ++i)
        rows[i].assign(clouds.data() + (b * N + i) * kDim, clouds.data() + (b * N + i + 1) * kDim);
      const std::vector<Rows> expected = plain_run(m, rows);
      double scale = 0, worst = 0;
      for (std::int64_t r = 0; r <= kLayers; ++r)
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t a = 0; a < kDim; ++a) {
            const double got = trace.trajectory[((r * B + b) * N + i) * kDim + a];
            scale = std::max(scale, std::abs(expected[r][i][a]));
            worst = std::max(worst, std::abs(got - expected[r][i][a]));
          }
      EXPECT_LT(worst, tol * scale)
          << "cloud " << b << (tied ? " tied" : " untied") << (v.biases ? ", biases" : "")
          << ", window " << v.window << ", gate " << to_string(v.gate);
      const std::vector<double> h = rms(expected[kLayers][n - 1], m.final_gain, m.norm_eps);
      const std::vector<double> want = matvec(m.output_matrix(), h);
      for (std::int64_t t = 0; t < kVocab; ++t) {
        EXPECT_NEAR(logits[b * kVocab + t], want[t], tol * 10) << "cloud " << b << " token " << t;
      }
    }
  }
}

TEST(LlamaModel, TheDenseFormIsRefusedWithTheReason) {
  const Model m = make_llama(true);
  const Tensor<double> x = emflow::testing::random_tensor({1, 3, kDim}, 5);
  const std::string message = emflow::testing::error_of(emflow::ErrorCode::invalid_argument, [&] {
    emflow::model::run_model(m, x, {}, emflow::model::RunSettings{});
  });
  EXPECT_NE(message.find("no single dense M_h"), std::string::npos) << message;
  EXPECT_NE(message.find("factored"), std::string::npos) << message;
}

TEST(LlamaModel, LogitsNeedAnUnembedding) {
  Model m = make_llama(true);
  m.embedding = Tensor<double>();
  const Tensor<double> x = emflow::testing::random_tensor({1, 3, kDim}, 5);
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::invalid_argument, [&] { emflow::model::next_token_logits(m, x, {}); });
  EXPECT_NE(message.find("has no unembedding"), std::string::npos) << message;
}

// ---- a GGUF file written here: F32 tensors, the metadata of a llama ----

struct GgufValue {
  std::uint32_t type;  // 4 uint32, 5 int32 (u's bits), 6 float32, 8 string
  std::uint32_t u = 0;
  float f = 0;
  std::string s;
};

void put_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<char*>(&v), 4); }
void put_u64(std::string& out, std::uint64_t v) { out.append(reinterpret_cast<char*>(&v), 8); }
void put_str(std::string& out, const std::string& s) {
  put_u64(out, s.size());
  out += s;
}

std::string gguf_bytes(const std::vector<std::pair<std::string, GgufValue>>& metadata,
                       const std::vector<std::pair<std::string, Tensor<double>>>& tensors) {
  std::string out = "GGUF";
  put_u32(out, 3);
  put_u64(out, tensors.size());
  put_u64(out, metadata.size());
  for (const auto& [key, value] : metadata) {
    put_str(out, key);
    put_u32(out, value.type);
    if (value.type == 4 || value.type == 5) put_u32(out, value.u);
    if (value.type == 6) out.append(reinterpret_cast<const char*>(&value.f), 4);
    if (value.type == 8) put_str(out, value.s);
  }
  std::string data;
  for (const auto& [name, t] : tensors) {
    put_str(out, name);
    put_u32(out, static_cast<std::uint32_t>(t.rank()));
    for (std::int64_t a = t.rank() - 1; a >= 0; --a) put_u64(out, t.extent(a));  // innermost first
    put_u32(out, 0);                                                             // F32
    put_u64(out, data.size());
    for (double v : t.values()) {
      const float f = static_cast<float>(v);
      data.append(reinterpret_cast<const char*>(&f), 4);
    }
    while (data.size() % 32 != 0) data += '\0';
  }
  while (out.size() % 32 != 0) out += '\0';
  return out + data;
}

// llama.cpp's permute: transformers' row h k + j k/2 + i is stored at h k + 2 i + j.
Tensor<double> permuted(const Tensor<double>& w, std::int64_t heads) {
  Tensor<double> out(w.shape());
  const std::int64_t cols = w.extent(1), k = w.extent(0) / heads, half = k / 2;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < half; ++i)
      for (std::int64_t j = 0; j < 2; ++j)
        for (std::int64_t c = 0; c < cols; ++c)
          out[(h * k + 2 * i + j) * cols + c] = w[(h * k + j * half + i) * cols + c];
  return out;
}

std::vector<std::pair<std::string, GgufValue>> llama_metadata() {
  auto u = [](std::uint32_t v) { return GgufValue{4, v, 0, ""}; };
  return {{"general.architecture", GgufValue{8, 0, 0, "llama"}},
          {"llama.block_count", u(kLayers)},
          {"llama.embedding_length", u(kDim)},
          {"llama.feed_forward_length", u(kFfn)},
          {"llama.attention.head_count", u(kHeads)},
          {"llama.attention.head_count_kv", u(kKv)},
          {"llama.rope.dimension_count", u(kHead)},
          {"llama.attention.layer_norm_rms_epsilon", GgufValue{6, 0, 1e-5f, ""}},
          {"llama.rope.freq_base", GgufValue{6, 0, 10000.0f, ""}}};
}

std::vector<std::pair<std::string, Tensor<double>>> llama_tensors(const Model& m) {
  std::vector<std::pair<std::string, Tensor<double>>> t;
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const ModelLayer& layer = m.layers[static_cast<std::size_t>(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    t.emplace_back(b + "attn_q.weight", permuted(layer.attention.query, kHeads));
    t.emplace_back(b + "attn_k.weight", permuted(layer.attention.key, kKv));
    t.emplace_back(b + "attn_v.weight", layer.attention.value);
    t.emplace_back(b + "attn_output.weight", layer.attention.output);
    t.emplace_back(b + "attn_norm.weight", layer.norm1_gain);
    t.emplace_back(b + "ffn_gate.weight", layer.ffn_gate);
    t.emplace_back(b + "ffn_up.weight", layer.ffn_in);
    t.emplace_back(b + "ffn_down.weight", layer.ffn_out);
    t.emplace_back(b + "ffn_norm.weight", layer.norm2_gain);
  }
  t.emplace_back("output_norm.weight", m.final_gain);
  t.emplace_back("token_embd.weight", m.embedding);
  if (m.unembedding.size() > 0) t.emplace_back("output.weight", m.unembedding);
  return t;
}

// run_model's trajectory of `model` on x in the factored form (a rotary layer's only form).
Tensor<double> factored_run(const Model& model, const Tensor<double>& x) {
  emflow::model::RunSettings settings;
  settings.factored = true;
  return emflow::model::run_model(model, x, {}, settings).trajectory;
}

class LlamaFiles : public emflow::testing::FileFolder {
 protected:
  LlamaFiles() : FileFolder("emflow_llama_files") {}

  std::string write(const std::string& name, const std::string& bytes) {
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }
};

void expect_same(const Tensor<double>& a, const Tensor<double>& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  for (std::int64_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << " at " << i;
}

TEST_F(LlamaFiles, AGgufFileReadsBackTheModelWithQueryAndKeyRowsUnpermuted) {
  const Model m = make_llama(false);
  const std::string file = write("m.gguf", gguf_bytes(llama_metadata(), llama_tensors(m)));
  const Model g = emflow::model::load_checkpoint(file);
  EXPECT_EQ(g.layout, Layout::llama);
  EXPECT_EQ(g.kv_heads, kKv);
  EXPECT_EQ(g.rotary.dim, kHead);
  EXPECT_EQ(g.rotary.base, 10000.0);
  EXPECT_EQ(g.rotary.pairing, emflow::RotaryPairing::half_split);
  EXPECT_EQ(g.norm_eps, static_cast<double>(1e-5f));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const ModelLayer& a = m.layers[static_cast<std::size_t>(l)];
    const ModelLayer& b = g.layers[static_cast<std::size_t>(l)];
    expect_same(a.attention.query, b.attention.query, "query");
    expect_same(a.attention.key, b.attention.key, "key");
    expect_same(a.attention.value, b.attention.value, "value");
    expect_same(a.attention.output, b.attention.output, "output");
    expect_same(a.ffn_gate, b.ffn_gate, "ffn_gate");
    expect_same(a.ffn_in, b.ffn_in, "ffn_in");
    expect_same(a.ffn_out, b.ffn_out, "ffn_out");
    expect_same(a.norm1_gain, b.norm1_gain, "norm1");
    expect_same(a.norm2_gain, b.norm2_gain, "norm2");
    EXPECT_EQ(b.sources.at("query.weight"), "blk." + std::to_string(l) + ".attn_q.weight");
  }
  expect_same(m.embedding, g.embedding, "embedding");
  expect_same(m.unembedding, g.unembedding, "unembedding");
  expect_same(m.final_gain, g.final_gain, "final norm");
}

// A GGUF file's sliding window (llama.cpp's attention.sliding_window, query i seeing keys
// i - w < j <= i) is the model's: the model read back runs as the one written, bit for bit, and
// unlike the same model without the window; a negative window is refused by name.
TEST_F(LlamaFiles, AGgufSlidingWindowIsTheModelsWindow) {
  const Model m = make_llama(false, false, 3);
  auto meta = llama_metadata();
  meta.push_back({"llama.attention.sliding_window", GgufValue{4, 3, 0, ""}});
  const Model g =
      emflow::model::load_checkpoint(write("w.gguf", gguf_bytes(meta, llama_tensors(m))));
  EXPECT_EQ(g.sliding_window, 3);
  const Tensor<double> x = emflow::testing::random_tensor({1, 6, kDim}, 5, -1.0, 1.0);
  const auto trajectory = [&](const Model& model) { return factored_run(model, x); };
  Model written = m;
  written.norm_eps = g.norm_eps;  // the file's float32 epsilon
  const Tensor<double> want = trajectory(written), got = trajectory(g);
  EXPECT_EQ(got.values(), want.values());
  Model unwindowed = g;
  unwindowed.sliding_window = 0;
  EXPECT_NE(trajectory(unwindowed).values(), want.values());

  meta.back().second = GgufValue{5, static_cast<std::uint32_t>(-2), 0, ""};  // int32 -2
  const std::string bad = write("w_bad.gguf", gguf_bytes(meta, llama_tensors(m)));
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::io, [&] { emflow::model::load_checkpoint(bad); });
  EXPECT_NE(message.find("'llama.attention.sliding_window' is -2, expected an integer >= 0"),
            std::string::npos)
      << message;
  // Qwen2's window is refused, as in its safetensors config.
  for (auto& [key, value] : meta) {
    if (key.rfind("llama.", 0) == 0) key = "qwen2." + key.substr(6);
  }
  meta[0].second.s = "qwen2";
  meta.back().second = GgufValue{4, 3, 0, ""};
  const std::string qwen2 = write("w_qwen2.gguf", gguf_bytes(meta, llama_tensors(m)));
  const std::string refused = emflow::testing::error_of(
      emflow::ErrorCode::unsupported, [&] { emflow::model::load_checkpoint(qwen2); });
  EXPECT_NE(
      refused.find("'qwen2.attention.sliding_window': Qwen2's sliding window is not supported"),
      std::string::npos)
      << refused;
}

// llama3's scaling as llama.cpp's converter stores it in a GGUF file: rope_freqs.weight, one
// factor per frequency, frequency i turning at base^(-2i / dim) / factor_i. The model read back
// holds those frequencies and runs, bit for bit, as the model written with them; with the
// factors of llama3's scaling (rounded to float32, as the file holds them) it runs as the model
// with that scaling to float32's rounding of the factors. The operator folder keeps them exactly,
// and a folder whose frequencies are not rotary.dim / 2 numbers is refused by name.
TEST_F(LlamaFiles, AGgufFilesPerFrequencyFactorsGiveTheModelsFrequencies) {
  Model llama3 = make_llama(false);
  llama3.rotary.scaling = emflow::RotaryScaling::llama3;
  llama3.rotary.factor = 8.0;
  llama3.rotary.low_freq_factor = 1.0;
  llama3.rotary.high_freq_factor = 4.0;
  llama3.rotary.original_max_positions = 16;  // kHead = 4: one frequency blended, one divided
  emflow::Rotary plain = llama3.rotary;
  plain.scaling = emflow::RotaryScaling::none;
  const std::vector<double> base = emflow::rotary_inverse_frequencies(plain, 1);
  const std::vector<double> scaled = emflow::rotary_inverse_frequencies(llama3.rotary, 1);
  Tensor<double> factors(Shape{kHead / 2});
  for (std::int64_t t = 0; t < kHead / 2; ++t) {
    factors[t] =
        static_cast<float>(base[static_cast<std::size_t>(t)] / scaled[static_cast<std::size_t>(t)]);
    EXPECT_GT(factors[t], 1.0) << t;  // both frequencies scaled: the factors matter
  }
  auto tensors = llama_tensors(llama3);
  tensors.emplace_back("rope_freqs.weight", factors);
  const Model g =
      emflow::model::load_checkpoint(write("f.gguf", gguf_bytes(llama_metadata(), tensors)));
  EXPECT_EQ(g.rotary.scaling, emflow::RotaryScaling::none);
  EXPECT_EQ(g.sources.at("rotary.frequency_factors"), "rope_freqs.weight");
  ASSERT_EQ(g.rotary_frequencies.size(), base.size());
  for (std::size_t t = 0; t < base.size(); ++t) {
    EXPECT_EQ(g.rotary_frequencies[t], base[t] / factors[static_cast<std::int64_t>(t)]) << t;
    EXPECT_NEAR(g.rotary_frequencies[t], scaled[t], 1e-7 * scaled[t]) << t;
  }
  EXPECT_EQ(g.rotary_embedding().inverse_frequencies, g.rotary_frequencies.data());
  // With the linear scaling too (rope.scaling.type), llama.cpp multiplies both in.
  auto linear = llama_metadata();
  linear.push_back({"llama.rope.scaling.type", GgufValue{8, 0, 0, "linear"}});
  linear.push_back({"llama.rope.scaling.factor", GgufValue{6, 0, 2.0f, ""}});
  const Model both = emflow::model::load_checkpoint(write("fl.gguf", gguf_bytes(linear, tensors)));
  EXPECT_EQ(both.rotary.scaling, emflow::RotaryScaling::none);
  for (std::size_t t = 0; t < base.size(); ++t) {
    EXPECT_EQ(both.rotary_frequencies[t], base[t] / 2.0 / factors[static_cast<std::int64_t>(t)]);
  }

  const Tensor<double> x = emflow::testing::random_tensor({1, 9, kDim}, 5, -1.0, 1.0);
  const auto trajectory = [&](const Model& model) { return factored_run(model, x); };
  Model written = llama3;
  written.norm_eps = g.norm_eps;  // the file's float32 epsilon
  const Tensor<double> scaled_run = trajectory(written);
  written.rotary = g.rotary;
  written.rotary_frequencies = g.rotary_frequencies;
  const Tensor<double> got = trajectory(g);
  EXPECT_EQ(got.values(), trajectory(written).values());
  double worst = 0.0, scale = 0.0;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - scaled_run[i]));
    scale = std::max(scale, std::abs(scaled_run[i]));
  }
  EXPECT_LT(worst, 1e-6 * scale);
  Model unscaled = g;
  unscaled.rotary_frequencies.clear();
  EXPECT_NE(trajectory(unscaled).values(), got.values());

  // The operator folder: the frequencies exactly, and refused when malformed.
  emflow::model::write_operators(g, path("ops"), {}, emflow::model::StorageType::float64);
  const Model back = emflow::model::read_operators(path("ops"));
  EXPECT_EQ(back.rotary_frequencies, g.rotary_frequencies);
  EXPECT_EQ(back.rotary.scaling, emflow::RotaryScaling::none);
  std::string manifest = text_of("ops/manifest.json");
  const std::size_t at = manifest.find("\"inverse_frequencies\"");
  ASSERT_NE(at, std::string::npos) << manifest;
  const std::size_t open = manifest.find('[', at), close = manifest.find(']', at);
  manifest.replace(open, close - open + 1, "[0.5]");
  put("ops/manifest.json", manifest);
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::io, [&] { emflow::model::read_operators(path("ops")); });
  EXPECT_NE(message.find("'rotary.inverse_frequencies' is [0.5], expected 2 numbers"),
            std::string::npos)
      << message;
}

// A qwen2 GGUF file: the keys under "qwen2.", the query and key rows as they are (llama.cpp
// permutes a llama model's only), and the q, k, v biases.
TEST_F(LlamaFiles, AQwen2GgufFileReadsBackTheModelWithItsBiasesAndRowsAsTheyAre) {
  const Model m = make_llama(false, true);
  auto meta = llama_metadata();
  for (auto& [key, value] : meta) {
    if (key.rfind("llama.", 0) == 0) key = "qwen2." + key.substr(6);
  }
  meta[0].second.s = "qwen2";
  std::vector<std::pair<std::string, Tensor<double>>> tensors;
  for (auto& [name, tensor] : llama_tensors(m)) {
    const std::string::size_type dot = name.find('.', 4);
    const std::int64_t l = name.rfind("blk.", 0) == 0 ? std::stoll(name.substr(4, dot - 4)) : -1;
    if (l < 0) {
      tensors.emplace_back(name, tensor);
      continue;
    }
    const emflow::MultiHeadAttentionWeights& w = m.layers[static_cast<std::size_t>(l)].attention;
    if (name.find("attn_q.weight") != std::string::npos) {
      tensors.emplace_back(name, w.query);  // not permuted
    } else if (name.find("attn_k.weight") != std::string::npos) {
      tensors.emplace_back(name, w.key);
    } else {
      tensors.emplace_back(name, tensor);
    }
  }
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const emflow::MultiHeadAttentionWeights& w = m.layers[static_cast<std::size_t>(l)].attention;
    const std::string b = "blk." + std::to_string(l) + ".";
    tensors.emplace_back(b + "attn_q.bias", w.query_bias);
    tensors.emplace_back(b + "attn_k.bias", w.key_bias);
    tensors.emplace_back(b + "attn_v.bias", w.value_bias);
  }
  const std::string file = write("q.gguf", gguf_bytes(meta, tensors));
  const Model g = emflow::model::load_checkpoint(file);
  EXPECT_EQ(g.layout, Layout::llama);
  EXPECT_EQ(g.model_type, "qwen2");
  EXPECT_EQ(g.kv_heads, kKv);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const auto& a = m.layers[static_cast<std::size_t>(l)].attention;
    const auto& b = g.layers[static_cast<std::size_t>(l)].attention;
    ASSERT_GT(a.query_bias.size(), 0);
    expect_same(a.query, b.query, "query");
    expect_same(a.key, b.key, "key");
    expect_same(a.query_bias, b.query_bias, "query bias");
    expect_same(a.key_bias, b.key_bias, "key bias");
    expect_same(a.value_bias, b.value_bias, "value bias");
  }
  // Without its biases a qwen2 file is incomplete, and says which tensor is missing.
  tensors.pop_back();
  const std::string cut = write("q_cut.gguf", gguf_bytes(meta, tensors));
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::io, [&] { emflow::model::load_checkpoint(cut); });
  EXPECT_NE(message.find("blk." + std::to_string(kLayers - 1) + ".attn_v.bias"), std::string::npos)
      << message;
}

TEST_F(LlamaFiles, TheOperatorFolderRoundTripsInFloat64AndFloat32) {
  Model m = make_llama(true, true, 3);
  m.activation = emflow::model::Activation::gelu_tanh;  // a gelu-gated block
  m.vocabulary = {"a", "b", "Ġc"};
  m.tokenizer_model = "gpt2";
  for (const auto storage :
       {emflow::model::StorageType::float64, emflow::model::StorageType::float32,
        emflow::model::StorageType::automatic}) {
    const std::string ops = path("ops");
    emflow::model::write_operators(m, ops, {}, storage);
    const std::string manifest = text_of("ops/manifest.json");
    EXPECT_NE(manifest.find(storage == emflow::model::StorageType::float64 ? "\"float64\""
                                                                           : "\"float32\""),
              std::string::npos);
    const Model back = emflow::model::read_operators(ops);
    EXPECT_EQ(back.layout, Layout::llama);
    EXPECT_EQ(back.kv_heads, kKv);
    EXPECT_EQ(back.rotary.dim, m.rotary.dim);
    EXPECT_EQ(back.rotary.base, m.rotary.base);
    EXPECT_EQ(back.sliding_window, 3);
    EXPECT_EQ(back.activation, emflow::model::Activation::gelu_tanh);
    EXPECT_EQ(back.vocabulary, m.vocabulary);
    EXPECT_EQ(back.tokenizer_model, "gpt2");
    EXPECT_EQ(back.unembedding.size(), 0);
    // The weights are float32 values: both storages hold them exactly.
    expect_same(back.embedding, m.embedding, "embedding");
    expect_same(back.final_gain, m.final_gain, "final norm");
    for (std::int64_t l = 0; l < kLayers; ++l) {
      const ModelLayer& a = m.layers[static_cast<std::size_t>(l)];
      const ModelLayer& b = back.layers[static_cast<std::size_t>(l)];
      expect_same(a.attention.key, b.attention.key, "key");
      expect_same(a.attention.query_bias, b.attention.query_bias, "query_bias");
      expect_same(a.attention.key_bias, b.attention.key_bias, "key_bias");
      expect_same(a.attention.value_bias, b.attention.value_bias, "value_bias");
      expect_same(a.ffn_gate, b.ffn_gate, "ffn_gate");
      expect_same(a.norm2_gain, b.norm2_gain, "norm2");
    }
  }
}

// Each bad file: an error naming the file and the tensor or key; through the command line, no
// output folder is left.
TEST_F(LlamaFiles, BadGgufFilesAreRefusedNamingTheFileAndTheTensor) {
  const Model m = make_llama(true);
  auto tensors = llama_tensors(m);
  struct Case {
    std::string name;
    std::vector<std::pair<std::string, GgufValue>> metadata;
    std::vector<std::pair<std::string, Tensor<double>>> tensors;
    emflow::ErrorCode code;
    std::vector<std::string> phrases;
  };
  std::vector<Case> cases;
  {
    auto t = tensors;
    t.erase(t.begin() + 15);  // blk.1.ffn_up.weight
    cases.push_back({"missing.gguf",
                     llama_metadata(),
                     t,
                     emflow::ErrorCode::io,
                     {"tensor 'blk.1.ffn_up.weight' is missing", "ffn_in.weight of layer 1"}});
  }
  {
    auto t = tensors;
    t[1].second = Tensor<double>(Shape{kKv * kHead + 1, kDim});  // blk.0.attn_k.weight
    cases.push_back({"shape.gguf",
                     llama_metadata(),
                     t,
                     emflow::ErrorCode::io,
                     {"tensor 'blk.0.attn_k.weight'", "has shape (9, 16), expected (8, 16)"}});
  }
  {
    auto meta = llama_metadata();
    meta.push_back({"llama.rope.scaling.type", GgufValue{8, 0, 0, "yarn"}});
    cases.push_back({"yarn.gguf",
                     meta,
                     tensors,
                     emflow::ErrorCode::unsupported,
                     {"rotary scaling 'yarn'", "llama.rope.scaling.type"}});
  }
  for (const std::int64_t length : {kHead / 2 + 1, kHead / 2}) {
    auto t = tensors;
    Tensor<double> factors(Shape{length});
    for (std::int64_t i = 0; i < length; ++i) factors[i] = i == 1 ? 0.0 : 2.0;
    t.emplace_back("rope_freqs.weight", factors);
    cases.push_back({length == kHead / 2 ? "freqs_zero.gguf" : "freqs_shape.gguf",
                     llama_metadata(),
                     t,
                     emflow::ErrorCode::io,
                     {length == kHead / 2 ? "tensor 'rope_freqs.weight' holds 0 at 1, expected "
                                            "finite factors > 0"
                                          : "tensor 'rope_freqs.weight' "
                                            "(rotary.frequency_factors) has shape (3,), expected "
                                            "(2,)"}});
  }
  {
    auto meta = llama_metadata();
    meta[0].second.s = "gemma";
    cases.push_back({"gemma.gguf",
                     meta,
                     tensors,
                     emflow::ErrorCode::unsupported,
                     {"general.architecture 'gemma' is not supported", "llama and qwen2"}});
  }
  {
    auto biased = tensors;
    biased.emplace_back("blk.0.attn_q.bias", Tensor<double>({kHeads * kHead}));
    cases.push_back({"llama_bias.gguf",
                     llama_metadata(),
                     biased,
                     emflow::ErrorCode::unsupported,
                     {"tensor 'blk.0.attn_q.bias'", "not supported in the llama architecture"}});
  }
  {
    auto meta = llama_metadata();
    meta.erase(meta.begin() + 1);
    cases.push_back({"blocks.gguf",
                     meta,
                     tensors,
                     emflow::ErrorCode::io,
                     {"lacks the key 'llama.block_count'"}});
  }
  for (const Case& c : cases) {
    const std::string file = write(c.name, gguf_bytes(c.metadata, c.tensors));
    const std::string message =
        emflow::testing::error_of(c.code, [&] { emflow::model::load_checkpoint(file); });
    EXPECT_NE(message.find(file), std::string::npos) << message;
    for (const std::string& phrase : c.phrases)
      EXPECT_NE(message.find(phrase), std::string::npos) << c.name << ": " << message;
  }
  // Cut anywhere in the tensor infos or the data: the reader refuses it, naming the file.
  const std::string whole = gguf_bytes(llama_metadata(), tensors);
  for (const std::size_t cut : {std::size_t{100}, whole.size() - 5}) {
    const std::string file = write("cut.gguf", whole.substr(0, cut));
    const std::string message = emflow::testing::error_of(
        emflow::ErrorCode::io, [&] { emflow::model::load_checkpoint(file); });
    EXPECT_NE(message.find(file), std::string::npos) << message;
  }
#ifdef EMFLOW_CLI_PATH
  for (const char* name : {"missing.gguf", "yarn.gguf", "cut.gguf"}) {
    const emflow::testing::CliRun run = emflow::testing::run_cli(
        "convert '" + path(name) + "' --out '" + path("ops") + "'", path("stderr.txt"));
    EXPECT_EQ(run.status, 1) << name << ": " << run.err;
    EXPECT_NE(run.err.find(name), std::string::npos) << run.err;
    EXPECT_FALSE(fs::exists(path("ops"))) << name;
  }
  std::vector<std::string> left = entries(".");
  for (const std::string& entry : left) EXPECT_EQ(entry.find("emflow-tmp"), std::string::npos);
#endif
}

// A transformers checkpoint of model_type llama: an unknown rope scaling is refused by name.
TEST_F(LlamaFiles, AnUnknownRotaryScalingInTheConfigIsRefusedByName) {
  fs::create_directory(path("hf"));
  put("hf/config.json",
      R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16,
          "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})");
  put("hf/model.safetensors", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::unsupported, [&] { emflow::model::load_checkpoint(path("hf")); });
  EXPECT_NE(message.find("yarn"), std::string::npos) << message;
}

}  // namespace

// run_model against a plain composition of the factored layer (emflow::mha_reference for the
// attention, layer norm and feed-forward written out), for both layouts, padded batches and
// both precisions; and the operator folder's round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include "common/files.hpp"
#include "common/testing.hpp"
#include "emflow/mha.hpp"
#include "emflow/model.hpp"

namespace {

namespace fs = std::filesystem;
using emflow::Shape;
using emflow::Tensor;
using emflow::model::Layout;
using emflow::model::Model;
using emflow::testing::random_tensor;

constexpr std::int64_t kDim = 12, kHeads = 3, kFfn = 20, kLayers = 2;

Model make_model(Layout layout) {
  Model m;
  m.layout = layout;
  m.heads = kHeads;
  m.dim = kDim;
  m.head_dim = kDim / kHeads;
  m.ffn_dim = kFfn;
  m.norm_eps = layout == Layout::bert ? 1e-12 : 1e-5;
  m.pre_norm = layout == Layout::gpt2;
  m.causal = layout == Layout::gpt2;
  m.activation = layout == Layout::bert ? emflow::model::Activation::gelu
                                        : emflow::model::Activation::gelu_tanh;
  std::uint64_t seed = 100;
  const double s = 1.5 / std::sqrt(static_cast<double>(kDim));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    emflow::model::ModelLayer layer;
    auto& w = layer.attention;
    w.heads = kHeads;
    w.model_dim = kDim;
    w.head_dim = w.value_dim = kDim / kHeads;
    w.query = random_tensor({kDim, kDim}, seed++, -s, s);
    w.key = random_tensor({kDim, kDim}, seed++, -s, s);
    w.value = random_tensor({kDim, kDim}, seed++, -s, s);
    w.output = random_tensor({kDim, kDim}, seed++, -s, s);
    w.query_bias = random_tensor({kDim}, seed++, -0.3, 0.3);
    w.key_bias = random_tensor({kDim}, seed++, -0.3, 0.3);
    w.value_bias = random_tensor({kDim}, seed++, -0.3, 0.3);
    w.output_bias = random_tensor({kDim}, seed++, -0.3, 0.3);
    layer.operators = emflow::to_emf(w);
    layer.norm1_gain = random_tensor({kDim}, seed++, 0.5, 1.5);
    layer.norm1_bias = random_tensor({kDim}, seed++, -0.2, 0.2);
    layer.norm2_gain = random_tensor({kDim}, seed++, 0.5, 1.5);
    layer.norm2_bias = random_tensor({kDim}, seed++, -0.2, 0.2);
    layer.ffn_in = random_tensor({kFfn, kDim}, seed++, -s, s);
    layer.ffn_in_bias = random_tensor({kFfn}, seed++, -0.3, 0.3);
    layer.ffn_out = random_tensor({kDim, kFfn}, seed++, -s, s);
    layer.ffn_out_bias = random_tensor({kDim}, seed++, -0.3, 0.3);
    m.layers.push_back(layer);
  }
  if (layout == Layout::gpt2) {
    m.final_gain = random_tensor({kDim}, seed++, 0.5, 1.5);
    m.final_bias = random_tensor({kDim}, seed++, -0.2, 0.2);
  }
  return m;
}

void layer_norm(Tensor<double>& x, const Tensor<double>& g, const Tensor<double>& b, double eps) {
  const std::int64_t d = g.size(), rows = x.size() / d;
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t a = 0; a < d; ++a) mean += x[r * d + a] / static_cast<double>(d);
    for (std::int64_t a = 0; a < d; ++a) var += std::pow(x[r * d + a] - mean, 2) / d;
    for (std::int64_t a = 0; a < d; ++a)
      x[r * d + a] = (x[r * d + a] - mean) / std::sqrt(var + eps) * g[a] + b[a];
  }
}

Tensor<double> ffn(const emflow::model::ModelLayer& layer, const Tensor<double>& x,
                   bool tanh_gelu) {
  const std::int64_t d = kDim, rows = x.size() / d;
  Tensor<double> out(x.shape());
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> h(kFfn);
    for (std::int64_t k = 0; k < kFfn; ++k) {
      double s = layer.ffn_in_bias[k];
      for (std::int64_t a = 0; a < d; ++a) s += layer.ffn_in[k * d + a] * x[r * d + a];
      h[k] = tanh_gelu ? 0.5 * s * (1 + std::tanh(std::sqrt(2 / M_PI) * (s + 0.044715 * s * s * s)))
                       : 0.5 * s * (1 + std::erf(s / std::sqrt(2.0)));
    }
    for (std::int64_t a = 0; a < d; ++a) {
      double s = layer.ffn_out_bias[a];
      for (std::int64_t k = 0; k < kFfn; ++k) s += layer.ffn_out[a * kFfn + k] * h[k];
      out[r * d + a] = s;
    }
  }
  return out;
}

// The clouds after every layer, composed from the factored form.
std::vector<Tensor<double>> expected_run(const Model& m, Tensor<double> x,
                                         const std::vector<std::int64_t>& lengths, bool full) {
  std::vector<Tensor<double>> records{x};
  const bool gpt2 = m.layout == Layout::gpt2;
  const emflow::Mask mask = m.causal ? emflow::Mask::causal() : emflow::Mask::none();
  for (std::int64_t l = 0; l < m.layer_count(); ++l) {
    const auto& layer = m.layers[l];
    Tensor<double> in = x;
    if (gpt2) layer_norm(in, layer.norm1_gain, layer.norm1_bias, m.norm_eps);
    const Tensor<double> a = emflow::mha_reference(layer.attention, in, mask, lengths);
    for (std::int64_t k = 0; k < x.size(); ++k) x[k] += a[k];
    if (!gpt2) layer_norm(x, layer.norm1_gain, layer.norm1_bias, m.norm_eps);
    if (full) {
      Tensor<double> h = x;
      if (gpt2) layer_norm(h, layer.norm2_gain, layer.norm2_bias, m.norm_eps);
      const Tensor<double> f = ffn(layer, h, gpt2);
      for (std::int64_t k = 0; k < x.size(); ++k) x[k] += f[k];
      if (!gpt2) layer_norm(x, layer.norm2_gain, layer.norm2_bias, m.norm_eps);
    }
    if (gpt2 && l == m.layer_count() - 1) layer_norm(x, m.final_gain, m.final_bias, m.norm_eps);
    records.push_back(x);
  }
  return records;
}

// Largest relative difference over the real rows of every cloud.
template <class T>
double error_on_real_rows(const T* ours, const Tensor<double>& theirs,
                          const std::vector<std::int64_t>& lengths) {
  const std::int64_t N = theirs.extent(1), d = theirs.extent(2);
  double worst = 0, scale = 0;
  for (std::int64_t b = 0; b < theirs.extent(0); ++b) {
    for (std::int64_t k = b * N * d; k < (b * N + lengths[b]) * d; ++k) {
      worst = std::max(worst, std::abs(static_cast<double>(ours[k]) - theirs[k]));
      scale = std::max(scale, std::abs(theirs[k]));
    }
  }
  return worst / scale;
}

template <class T>
class RunModel : public ::testing::Test {};
TYPED_TEST_SUITE(RunModel, emflow::testing::FloatTypes);

TYPED_TEST(RunModel, EqualsTheFactoredLayersForBothLayouts) {
  using T = TypeParam;
  const double tol = std::is_same_v<T, double> ? 1e-12 : 2e-5;
  const std::vector<std::int64_t> lengths = {7, 4, 6};
  const Tensor<double> x = random_tensor({3, 7, kDim}, 5, -1.5, 1.5);
  for (Layout layout : {Layout::bert, Layout::gpt2}) {
    const Model m = make_model(layout);
    for (int variant = 0; variant < 3; ++variant) {
      const bool full = variant != 1;
      emflow::model::RunSettings settings;
      settings.full_layer = full;
      settings.factored = variant == 2;
      emflow::ExecutionOptions cpu;
      cpu.device = emflow::Device::cpu;
      const auto trace = emflow::model::run_model(m, emflow::convert<T>(x), lengths, settings, cpu);
      const auto expected = expected_run(m, x, lengths, full);
      ASSERT_EQ(trace.trajectory.shape(), (Shape{kLayers + 1, 3, 7, kDim}));
      for (std::int64_t r = 0; r <= kLayers; ++r) {
        const double e =
            error_on_real_rows(trace.trajectory.data() + r * x.size(), expected[r], lengths);
        EXPECT_LT(e, tol) << emflow::model::to_string(layout) << " variant " << variant
                          << " record " << r;
      }
      // Padding rows get no attention update; the observables count the real tokens only.
      for (std::int64_t k = (1 * 7 + 4) * kDim; k < 2 * 7 * kDim; ++k) {
        EXPECT_EQ(trace.attention[k], T(0));
      }
      EXPECT_GT(trace.observables[0].entropy, 0.0);
    }
  }
}

TEST(RunModel, RefusesCloudsOfTheWrongSize) {
  const Model m = make_model(Layout::bert);
  using emflow::ErrorCode;
  EXPECT_TRUE(emflow::testing::throws_error(
      [&] {
        emflow::model::run_model(m, Tensor<double>(Shape{1, 3, 5}), {}, {});
      },
      ErrorCode::invalid_argument, {"clouds", "(B, N, 12)"}));
  EXPECT_TRUE(emflow::testing::throws_error(
      [&] {
        emflow::model::run_model(m, Tensor<double>(Shape{1, 3, kDim}), {4}, {});
      },
      ErrorCode::invalid_argument, {"key_lengths", "expected 1..3"}));
}

class OperatorFolder : public emflow::testing::FileFolder {
 protected:
  OperatorFolder() : FileFolder("emflow_operator_folder") {}
};

TEST_F(OperatorFolder, RoundTripsEveryPart) {
  const Model m = make_model(Layout::gpt2);
  emflow::model::write_operators(m, path("ops"), {{"notes.txt", "hello"}});
  EXPECT_EQ(entries("."), (std::vector<std::string>{"ops"}));  // no staging folder left
  const Model back = emflow::model::read_operators(path("ops"));
  EXPECT_EQ(back.layer_count(), kLayers);
  EXPECT_EQ(back.layout, Layout::gpt2);
  EXPECT_TRUE(back.pre_norm && back.causal);
  EXPECT_EQ(back.norm_eps, 1e-5);
  EXPECT_EQ(back.layers[1].operators.relevance.values(), m.layers[1].operators.relevance.values());
  EXPECT_EQ(back.layers[0].ffn_out.values(), m.layers[0].ffn_out.values());
  EXPECT_EQ(back.final_bias.values(), m.final_bias.values());
  EXPECT_EQ(text_of("ops/notes.txt"), "hello");
}

TEST_F(OperatorFolder, AFailedWriteLeavesNothing) {
  Model m = make_model(Layout::bert);
  m.layers[1].ffn_in = Tensor<double>();  // rank 0: write_npy refuses it midway
  EXPECT_THROW(emflow::model::write_operators(m, path("ops")), emflow::Error);
  EXPECT_TRUE(entries(".").empty());
  const std::string message = emflow::testing::error_of(
      emflow::ErrorCode::io, [&] { emflow::model::read_operators(path("nowhere")); });
  EXPECT_NE(message.find("manifest.json"), std::string::npos) << message;
}

}  // namespace

// The flow of token clouds against the known behaviour of docs/MATH.md §4 (published theorems)
// and against direct formulas: energy monotone on the sphere, collapse to one cluster in
// d >= 3, the shrinking hull of the rescaled tokens, integrator orders, the sphere norm, USA
// against SA, per-cloud beta, the layer stack, observables, generators and the phase sweep.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/flow.hpp"
#include "emflow/mha.hpp"
#include "emflow/reference.hpp"

namespace emflow::flow {
namespace {

using testing::continuous;
using testing::on_cpu;

template <class T>
std::vector<FlowLayer<T>> one_layer(std::int64_t d, OperatorKind m, OperatorKind f,
                                    std::uint64_t seed = 1) {
  return {make_layer<T>(d, m, f, seed)};
}

// The last recorded cloud b of a run, as doubles.
template <class T>
std::vector<double> final_cloud(const FlowResult<T>& r, std::int64_t b) {
  const auto& shape = r.trajectory.shape();
  const std::int64_t R = shape[0], B = shape[1], n = shape[2] * shape[3];
  const T* from = r.trajectory.data() + ((R - 1) * B + b) * n;
  return std::vector<double>(from, from + n);
}

double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// ---------------------------------------------------------------------------------------------
// Known behaviour on the sphere (Q = K = V = I)

TEST(FlowSphere, EnergyNeverDecreasesForIdentityValues) {
  for (double beta : {0.5, 1.0, 4.0}) {
    const auto x0 = initial_clouds<double>(InitialCloud::sphere, 2, 12, 3, 7);
    const auto r =
        run_flow(x0, {beta}, one_layer<double>(3, OperatorKind::identity, OperatorKind::identity),
                 continuous(6.0, 0.05, Integrator::rk4, true), on_cpu());
    const std::int64_t R = r.trajectory.extent(0);
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t k = 1; k < R; ++k) {
        const double before = r.observables[static_cast<std::size_t>((k - 1) * 2 + b)].energy;
        const double after = r.observables[static_cast<std::size_t>(k * 2 + b)].energy;
        ASSERT_GE(after, before - 1e-12 * before)
            << "beta " << beta << " cloud " << b << " record " << k;
      }
      // Not vacuous: the energy really grows.
      EXPECT_GT(r.observables[static_cast<std::size_t>((R - 1) * 2 + b)].energy,
                1.05 * r.observables[static_cast<std::size_t>(b)].energy);
    }
  }
}

TEST(FlowSphere, EnergyDecreasesForMinusIdentityValues) {
  const auto x0 = initial_clouds<double>(InitialCloud::sphere, 1, 12, 3, 3);
  const auto r = run_flow(
      x0, {1.0}, one_layer<double>(3, OperatorKind::identity, OperatorKind::minus_identity),
      continuous(4.0, 0.05, Integrator::rk4, true), on_cpu());
  const std::int64_t R = r.trajectory.extent(0);
  for (std::int64_t k = 1; k < R; ++k) {
    ASSERT_LE(r.observables[static_cast<std::size_t>(k)].energy,
              r.observables[static_cast<std::size_t>(k - 1)].energy * (1 + 1e-12))
        << "record " << k;
  }
  EXPECT_LT(r.observables.back().energy, 0.99 * r.observables.front().energy);
}

TEST(FlowSphere, CollapsesToOneClusterInDimensionThreeAndMore) {
  for (std::int64_t d : {3, 4}) {
    const auto x0 = initial_clouds<double>(InitialCloud::sphere, 3, 8, d, 11);
    const auto r =
        run_flow(x0, {1.0}, one_layer<double>(d, OperatorKind::identity, OperatorKind::identity),
                 continuous(30.0, 0.1, Integrator::rk4, true), on_cpu());
    const std::int64_t R = r.trajectory.extent(0);
    for (std::int64_t b = 0; b < 3; ++b) {
      const Observables& start = r.observables[static_cast<std::size_t>(b)];
      const Observables& end = r.observables[static_cast<std::size_t>((R - 1) * 3 + b)];
      EXPECT_GT(start.clusters, 1) << "d " << d << " cloud " << b;
      EXPECT_EQ(end.clusters, 1) << "d " << d << " cloud " << b;
      EXPECT_DOUBLE_EQ(end.clustered_fraction, 1.0);
      EXPECT_GT(end.min_inner, 1.0 - 1e-6);
      EXPECT_LT(end.diameter, 1e-3);
    }
  }
}

TEST(FlowSphere, NormStaysOneToOneMillionth) {
  for (Integrator integrator : {Integrator::euler, Integrator::rk4}) {
    const auto x64 = initial_clouds<double>(InitialCloud::gaussian, 2, 16, 5, 5);
    const auto r64 =
        run_flow(x64, {2.0}, one_layer<double>(5, OperatorKind::random, OperatorKind::random, 9),
                 continuous(10.0, 0.1, integrator, true), on_cpu());
    const auto x32 = initial_clouds<float>(InitialCloud::gaussian, 2, 16, 5, 5);
    const auto r32 =
        run_flow(x32, {2.0}, one_layer<float>(5, OperatorKind::random, OperatorKind::random, 9),
                 continuous(10.0, 0.1, integrator, true), on_cpu());
    auto worst = [](const auto& trajectory) {
      double w = 0.0;
      for (std::int64_t t = 0; t < trajectory.size() / 5; ++t) {
        double square = 0.0;
        for (int a = 0; a < 5; ++a) square += double(trajectory[t * 5 + a]) * trajectory[t * 5 + a];
        w = std::max(w, std::abs(std::sqrt(square) - 1.0));
      }
      return w;
    };
    EXPECT_LE(worst(r64.trajectory), 1e-12) << to_string(integrator);
    EXPECT_LE(worst(r32.trajectory), 1e-6) << to_string(integrator);
    // The tokens moved: the check is not on a frozen cloud.
    EXPECT_GT(max_difference(final_cloud(r64, 0),
                             std::vector<double>(x64.values().begin(), x64.values().begin() + 80)),
              0.1);
  }
}

// ---------------------------------------------------------------------------------------------
// V = I without normalisation: the rescaled tokens z_i = e^{-t} x_i stay in a shrinking hull.

TEST(FlowEuclidean, RescaledHullNeverGrowsForIdentityValues) {
  const std::int64_t N = 8, d = 3;
  // M symmetric positive definite: identity, and A^T A + I/2.
  std::vector<FlowLayer<double>> layers =
      one_layer<double>(d, OperatorKind::identity, OperatorKind::identity);
  FlowLayer<double> spd = layers[0];
  const auto a = make_operator<double>(OperatorKind::random, d, 4);
  for (std::int64_t i = 0; i < d; ++i)
    for (std::int64_t j = 0; j < d; ++j) {
      double s = i == j ? 0.5 : 0.0;
      for (std::int64_t k = 0; k < d; ++k) s += a[k * d + i] * a[k * d + j];
      spd.relevance[i * d + j] = s;
    }
  std::mt19937_64 engine(2);
  std::normal_distribution<double> normal;
  std::vector<double> directions(32 * d);
  for (double& v : directions) v = normal(engine);

  for (const FlowLayer<double>& layer : {layers[0], spd}) {
    const auto x0 = initial_clouds<double>(InitialCloud::gaussian, 1, N, d, 8);
    const auto r =
        run_flow(x0, {3.0}, {layer}, continuous(3.0, 0.01, Integrator::rk4, false), on_cpu());
    const std::int64_t R = r.trajectory.extent(0);
    double largest_drop = 0.0;
    for (std::int64_t u = 0; u < 32; ++u) {
      const double* dir = directions.data() + u * d;
      double previous = INFINITY;
      for (std::int64_t k = 0; k < R; ++k) {
        const double scale = std::exp(-r.times[static_cast<std::size_t>(k)]);
        double support = -std::numeric_limits<double>::infinity();  // max_i <u, z_i>
        for (std::int64_t i = 0; i < N; ++i) {
          double dot = 0.0;
          for (std::int64_t c = 0; c < d; ++c) dot += dir[c] * r.trajectory[(k * N + i) * d + c];
          support = std::max(support, scale * dot);
        }
        ASSERT_LE(support, previous + 1e-9) << "direction " << u << " record " << k;
        if (k > 0) largest_drop = std::max(largest_drop, previous - support);
        previous = k == 0 ? support : std::min(previous, support);
      }
    }
    EXPECT_GT(largest_drop, 1e-4);  // the hull does shrink
  }
}

// ---------------------------------------------------------------------------------------------
// Integrators: Euler is order 1, RK4 order 4 (against a fine RK4 solution).

double final_error(const Tensor<double>& x0, const FlowLayer<double>& layer, bool sphere,
                   Integrator integrator, double dt, const std::vector<double>& truth) {
  FlowSettings s = continuous(1.0, dt, integrator, sphere);
  s.record_every = 1 << 20;
  const auto r = run_flow(x0, {2.0}, {layer}, s, on_cpu());
  return max_difference(final_cloud(r, 0), truth);
}

TEST(FlowIntegrators, EulerIsFirstOrderAndRk4FourthOrder) {
  for (bool sphere : {false, true}) {
    const auto x0 = initial_clouds<double>(InitialCloud::sphere, 1, 6, 3, 21);
    const FlowLayer<double> layer =
        make_layer<double>(3, OperatorKind::random, OperatorKind::random, 5);
    FlowSettings fine = continuous(1.0, 1.0 / 2048, Integrator::rk4, sphere);
    fine.record_every = 1 << 20;
    const auto truth = final_cloud(run_flow(x0, {2.0}, {layer}, fine, on_cpu()), 0);
    double previous = final_error(x0, layer, sphere, Integrator::euler, 1.0 / 16, truth);
    for (double dt : {1.0 / 32, 1.0 / 64}) {
      const double e = final_error(x0, layer, sphere, Integrator::euler, dt, truth);
      const double order = std::log2(previous / e);
      EXPECT_NEAR(order, 1.0, 0.2) << "euler dt " << dt << " sphere " << sphere;
      previous = e;
    }
    previous = final_error(x0, layer, sphere, Integrator::rk4, 1.0 / 4, truth);
    for (double dt : {1.0 / 8, 1.0 / 16}) {
      const double e = final_error(x0, layer, sphere, Integrator::rk4, dt, truth);
      const double order = std::log2(previous / e);
      EXPECT_NEAR(order, 4.0, 0.5) << "rk4 dt " << dt << " sphere " << sphere;
      EXPECT_GT(e, 1e-13);  // still above rounding, so the ratio means something
      previous = e;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The update against direct formulas

// sum_h sum_j w_ij F_h x_j + c with w = softmax (SA) or exp(s) / N (USA), in double.
std::vector<double> direct_update(const std::vector<double>& x, std::int64_t N, std::int64_t d,
                                  const FlowLayer<double>& layer, double beta, bool usa) {
  std::vector<double> out(static_cast<std::size_t>(N * d), 0.0);
  for (std::int64_t h = 0; h < layer.heads; ++h) {
    const double* M = layer.relevance.data() + h * d * d;
    const double* F = layer.content.data() + h * d * d;
    for (std::int64_t i = 0; i < N; ++i) {
      std::vector<double> s(static_cast<std::size_t>(N));
      for (std::int64_t j = 0; j < N; ++j) {
        double v = 0.0;
        for (std::int64_t a = 0; a < d; ++a)
          for (std::int64_t b = 0; b < d; ++b) v += x[i * d + a] * M[a * d + b] * x[j * d + b];
        if (!layer.key_bias.empty())
          for (std::int64_t b = 0; b < d; ++b) v += layer.key_bias[h * d + b] * x[j * d + b];
        s[j] = beta * v;
      }
      double z = 0.0;
      for (double v : s) z += std::exp(v);
      for (std::int64_t j = 0; j < N; ++j) {
        const double w = std::exp(s[j]) / (usa ? static_cast<double>(N) : z);
        for (std::int64_t a = 0; a < d; ++a) {
          double fx = 0.0;
          for (std::int64_t b = 0; b < d; ++b) fx += F[a * d + b] * x[j * d + b];
          out[i * d + a] += w * fx;
        }
      }
    }
  }
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t a = 0; a < d; ++a) out[i * d + a] += layer.offset[a];
  return out;
}

// The arguments of one attention_update call.
UpdateInput<double> update_input(const double* cloud, std::int64_t batch, std::int64_t tokens,
                                 std::int64_t dim, const FlowLayer<double>& layer,
                                 std::vector<double> betas, const UpdateSettings& settings) {
  UpdateInput<double> in;
  in.cloud = cloud;
  in.batch = batch;
  in.tokens = tokens;
  in.dim = dim;
  in.layer = &layer;
  in.betas = std::move(betas);
  in.settings = settings;
  return in;
}

TEST(FlowUpdate, UnnormalizedAndNormalizedMatchTheirFormulas) {
  const std::int64_t N = 7, d = 4, H = 2;
  FlowLayer<double> layer;
  layer.heads = H;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto m = make_operator<double>(OperatorKind::random, d, 10 + h);
    const auto f = make_operator<double>(OperatorKind::random, d, 20 + h);
    layer.relevance.insert(layer.relevance.end(), m.begin(), m.end());
    layer.content.insert(layer.content.end(), f.begin(), f.end());
  }
  layer.key_bias = testing::uniform(static_cast<std::size_t>(H * d), 3);
  layer.offset = testing::uniform(static_cast<std::size_t>(d), 4);
  const auto cloud = initial_clouds<double>(InitialCloud::gaussian, 2, N, d, 6);
  const std::vector<double> betas = {1.5, 0.7};
  for (bool usa : {false, true}) {
    UpdateSettings settings;
    settings.unnormalized = usa;
    std::vector<double> update(static_cast<std::size_t>(2 * N * d), NAN);
    std::vector<double> entropy(2, NAN);
    attention_update(update_input(cloud.data(), 2, N, d, layer, betas, settings),
                     UpdateOutput<double>{update.data(), entropy.data()}, on_cpu());
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::vector<double> x(cloud.data() + b * N * d, cloud.data() + (b + 1) * N * d);
      const auto want = direct_update(x, N, d, layer, betas[b], usa);
      const std::vector<double> got(update.begin() + b * N * d, update.begin() + (b + 1) * N * d);
      EXPECT_LT(testing::relative_error(got, want), 1e-12) << "usa " << usa << " cloud " << b;
      EXPECT_GT(entropy[b], 0.0);
      EXPECT_LT(entropy[b], std::log(double(N)) + 1e-12);
    }
  }
}

TEST(FlowUpdate, TangentProjectionIsOrthogonalToTheToken) {
  const std::int64_t N = 5, d = 3;
  const auto cloud = initial_clouds<double>(InitialCloud::sphere, 1, N, d, 2);
  const auto layer = make_layer<double>(d, OperatorKind::random, OperatorKind::random, 3);
  UpdateSettings settings;
  settings.tangent = true;
  std::vector<double> update(N * d, NAN), free(N * d, NAN);
  attention_update(update_input(cloud.data(), 1, N, d, layer, {1.0}, settings),
                   UpdateOutput<double>{update.data()}, on_cpu());
  attention_update(update_input(cloud.data(), 1, N, d, layer, {1.0}, {}),
                   UpdateOutput<double>{free.data()}, on_cpu());
  for (std::int64_t i = 0; i < N; ++i) {
    double dot = 0.0, along = 0.0;
    for (std::int64_t a = 0; a < d; ++a) {
      dot += update[i * d + a] * cloud[i * d + a];
      along += free[i * d + a] * cloud[i * d + a];
    }
    EXPECT_NEAR(dot, 0.0, 1e-14);
    for (std::int64_t a = 0; a < d; ++a) {
      EXPECT_NEAR(update[i * d + a], free[i * d + a] - along * cloud[i * d + a], 1e-14);
    }
  }
}

TEST(FlowUpdate, RefusesAMissingLayerAndBetasOfAnotherLength) {
  const auto cloud = initial_clouds<double>(InitialCloud::sphere, 2, 5, 3, 2);
  const auto layer = make_layer<double>(3, OperatorKind::random, OperatorKind::random, 3);
  std::vector<double> update(2 * 5 * 3, NAN);
  UpdateInput<double> in = update_input(cloud.data(), 2, 5, 3, layer, {1.0}, {});
  EXPECT_TRUE(testing::throws_error(
      [&] { attention_update(in, UpdateOutput<double>{update.data()}, on_cpu()); },
      ErrorCode::invalid_argument, {"'betas'", "one entry per cloud (2), got 1"}));
  in.betas = {1.0, 2.0};
  in.layer = nullptr;
  EXPECT_TRUE(testing::throws_error(
      [&] { attention_update(in, UpdateOutput<double>{update.data()}, on_cpu()); },
      ErrorCode::invalid_argument, {"'layer'"}));
}

// The former positional form is kept, deprecated, for code written against it: it computes the
// same bits as the named one.
TEST(FlowUpdate, TheDeprecatedPositionalFormIsTheSameCall) {
  const auto cloud = initial_clouds<double>(InitialCloud::gaussian, 2, 6, 3, 4);
  const auto layer = make_layer<double>(3, OperatorKind::random, OperatorKind::random, 5);
  const std::vector<double> betas = {0.5, 2.0};
  std::vector<double> named(2 * 6 * 3, NAN), positional(named.size(), NAN);
  std::vector<double> named_entropy(2, NAN), positional_entropy(2, NAN);
  attention_update(update_input(cloud.data(), 2, 6, 3, layer, betas, {}),
                   UpdateOutput<double>{named.data(), named_entropy.data()}, on_cpu());
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  attention_update(cloud.data(), 2, 6, 3, layer, betas, UpdateSettings{}, positional.data(),
                   positional_entropy.data(), on_cpu());
#pragma GCC diagnostic pop
  EXPECT_EQ(named, positional);
  EXPECT_EQ(named_entropy, positional_entropy);
  EXPECT_GT(std::abs(named[0]), 1e-6);
}

TEST(FlowUpdate, MultiHeadAttentionWeightsGiveTheAttentionSublayer) {
  MultiHeadAttentionWeights w;
  w.heads = 2;
  w.model_dim = 6;
  w.head_dim = 3;
  w.value_dim = 3;
  auto tensor = [](const Shape& shape, std::uint64_t seed) {
    const auto n = static_cast<std::size_t>(checked_element_count(shape));
    return Tensor<double>(shape, testing::uniform(n, seed, -0.5, 0.5));
  };
  w.query = tensor({6, 6}, 1);
  w.key = tensor({6, 6}, 2);
  w.value = tensor({6, 6}, 3);
  w.output = tensor({6, 6}, 4);
  w.query_bias = tensor({6}, 5);
  w.value_bias = tensor({6}, 6);
  w.output_bias = tensor({6}, 7);
  const auto cloud = initial_clouds<double>(InitialCloud::gaussian, 1, 9, 6, 3);
  const FlowLayer<double> layer = layer_from_mha<double>(w);
  std::vector<double> update(9 * 6, NAN);
  attention_update(update_input(cloud.data(), 1, 9, 6, layer, {1.0}, {}),
                   UpdateOutput<double>{update.data()}, on_cpu());
  const Tensor<double> want = mha_reference(w, cloud);
  EXPECT_LT(testing::relative_error(update, want.values()), 1e-12);
}

// ---------------------------------------------------------------------------------------------
// Batches

TEST(FlowBatch, PerCloudBetaEqualsSeparateRuns) {
  const std::int64_t N = 6, d = 3;
  const auto x0 = initial_clouds<double>(InitialCloud::sphere, 3, N, d, 4);
  const auto layers = one_layer<double>(d, OperatorKind::random, OperatorKind::identity, 2);
  const std::vector<double> betas = {0.5, 3.0, 0.5};
  const FlowSettings s = continuous(2.0, 0.1, Integrator::rk4, true);
  const auto together = run_flow(x0, betas, layers, s, on_cpu());
  for (std::int64_t b = 0; b < 3; ++b) {
    Tensor<double> alone({1, N, d});
    std::copy(x0.data() + b * N * d, x0.data() + (b + 1) * N * d, alone.data());
    const auto r = run_flow(alone, {betas[b]}, layers, s, on_cpu());
    EXPECT_LT(max_difference(final_cloud(together, b), final_cloud(r, 0)), 1e-13) << b;
    EXPECT_NEAR(together.observables.back().energy, together.observables.back().energy, 0);
    const std::size_t last = together.observables.size() - 3 + b;
    EXPECT_NEAR(together.observables[last].energy, r.observables.back().energy,
                1e-12 * r.observables.back().energy);
    EXPECT_NEAR(together.observables[last].entropy, r.observables.back().entropy, 1e-12);
  }
  // Different betas lead to different clouds (the batch really sweeps temperatures).
  EXPECT_GT(max_difference(final_cloud(together, 0), final_cloud(together, 1)), 1e-3);
}

// ---------------------------------------------------------------------------------------------
// The layer stack

TEST(FlowLayers, PostAndPreNormFollowTheirFormulas) {
  const std::int64_t N = 5, d = 4;
  const auto x0 = initial_clouds<double>(InitialCloud::gaussian, 1, N, d, 12);
  std::vector<FlowLayer<double>> layers = {
      make_layer<double>(d, OperatorKind::random, OperatorKind::random, 1),
      make_layer<double>(d, OperatorKind::random, OperatorKind::random, 2)};
  layers[1].norm_gain = {1.0, 2.0, 0.5, 1.5};
  layers[1].norm_bias = {0.1, -0.2, 0.0, 0.3};
  for (Normalization norm : testing::every_normalization()) {
    for (bool pre : {false, true}) {
      const auto r = run_flow(x0, {1.3}, layers, testing::stack(2, norm, pre), on_cpu());
      ASSERT_EQ(r.trajectory.extent(0), 3);
      // Replay with the reference attention and the normalisation by hand.
      std::vector<double> x(x0.values());
      for (std::size_t l = 0; l < 2; ++l) {
        const FlowLayer<double>& layer = layers[l];
        const double* gain = layer.norm_gain.empty() ? nullptr : layer.norm_gain.data();
        const double* bias = layer.norm_bias.empty() ? nullptr : layer.norm_bias.data();
        std::vector<double> input = x;
        if (pre) normalize(norm, input.data(), N, d, gain, bias);
        reference::Layer ref;
        ref.relevance = Tensor<double>({d, d}, layer.relevance);
        ref.content = Tensor<double>({d, d}, layer.content);
        const auto delta = reference::attend(Tensor<double>({N, d}, input), ref, 1.3).update;
        for (std::int64_t e = 0; e < N * d; ++e) x[e] += delta[e];
        if (!pre) normalize(norm, x.data(), N, d, gain, bias);
        const std::vector<double> got(r.trajectory.data() + (l + 1) * N * d,
                                      r.trajectory.data() + (l + 2) * N * d);
        EXPECT_LT(max_difference(got, x), 1e-12) << to_string(norm) << " pre " << pre << " l " << l;
      }
    }
  }
}

TEST(FlowLayers, NormalizationsDoWhatTheySay) {
  std::vector<double> x = {1.0, 2.0, 3.0, 6.0, -1.0, 0.0, 0.0, 1.0};
  auto ln = x, rms = x, sphere = x;
  normalize(Normalization::layernorm, ln.data(), 2, 4);
  normalize(Normalization::rmsnorm, rms.data(), 2, 4);
  normalize(Normalization::sphere, sphere.data(), 2, 4);
  for (int r = 0; r < 2; ++r) {
    double mean = 0, var = 0, ms = 0, square = 0;
    for (int a = 0; a < 4; ++a) mean += ln[r * 4 + a] / 4;
    for (int a = 0; a < 4; ++a) var += (ln[r * 4 + a] - mean) * (ln[r * 4 + a] - mean) / 4;
    for (int a = 0; a < 4; ++a) ms += rms[r * 4 + a] * rms[r * 4 + a] / 4;
    for (int a = 0; a < 4; ++a) square += sphere[r * 4 + a] * sphere[r * 4 + a];
    EXPECT_NEAR(mean, 0.0, 1e-12);
    EXPECT_NEAR(var, 1.0, 1e-4);  // var / (var + 1e-5)
    EXPECT_NEAR(ms, 1.0, 1e-4);
    EXPECT_NEAR(square, 1.0, 1e-12);
    EXPECT_NEAR(sphere[r * 4] / sphere[r * 4 + 3], x[r * 4] / x[r * 4 + 3], 1e-12);
  }
}

// ---------------------------------------------------------------------------------------------
// Observables and generators

TEST(FlowObservables, HandMadeCloud) {
  // Tokens on the circle: two at angle 0, one at 0.01 (cosine 0.99995 > 1 - 1e-3), one at pi/2.
  const double c = std::cos(0.01), s = std::sin(0.01);
  const std::vector<double> x = {1, 0, 1, 0, c, s, 0, 1};
  const double beta = 2.0;
  const Observables o = observe(x.data(), 4, 2, beta);
  EXPECT_NEAR(o.min_inner, 0.0, 1e-15);
  EXPECT_NEAR(o.mean_inner, (1 + c + c + 0 + 0 + s) / 6, 1e-15);
  EXPECT_DOUBLE_EQ(o.clustered_fraction, 0.5);
  EXPECT_EQ(o.clusters, 2);
  EXPECT_NEAR(o.diameter, std::sqrt(2.0), 1e-15);
  double energy = 0;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      energy += std::exp(beta * (x[2 * i] * x[2 * j] + x[2 * i + 1] * x[2 * j + 1]));
  EXPECT_NEAR(o.energy, energy / (2 * beta * 16), 1e-14);
}

TEST(FlowGenerators, CloudsAreSeededAndHaveTheirShape) {
  const auto sphere = initial_clouds<double>(InitialCloud::sphere, 3, 5, 4, 9);
  const auto prefix = initial_clouds<double>(InitialCloud::sphere, 2, 5, 4, 9);
  EXPECT_EQ(std::vector<double>(sphere.values().begin(), sphere.values().begin() + 40),
            prefix.values());
  EXPECT_NE(initial_clouds<double>(InitialCloud::sphere, 1, 5, 4, 10).values(),
            std::vector<double>(sphere.values().begin(), sphere.values().begin() + 20));
  for (std::int64_t t = 0; t < 15; ++t) {
    double square = 0;
    for (int a = 0; a < 4; ++a) square += sphere[t * 4 + a] * sphere[t * 4 + a];
    EXPECT_NEAR(square, 1.0, 1e-14);
  }
  const auto cube = initial_clouds<double>(InitialCloud::cube, 2, 50, 3, 1);
  for (double v : cube.values()) {
    EXPECT_GE(v, -1.0);
    EXPECT_LE(v, 1.0);
  }
  const auto ortho = initial_clouds<double>(InitialCloud::orthonormal, 2, 4, 6, 1);
  for (std::int64_t b = 0; b < 2; ++b)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        double dot = 0;
        for (int a = 0; a < 6; ++a) dot += ortho[(b * 4 + i) * 6 + a] * ortho[(b * 4 + j) * 6 + a];
        EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-14);
      }
  const auto gaussian = initial_clouds<float>(InitialCloud::gaussian, 1, 400, 16, 1);
  double square = 0;
  for (float v : gaussian.values()) square += double(v) * v;
  EXPECT_NEAR(square / 400, 1.0, 0.1);  // entries N(0, 1/d): norms near 1
  EXPECT_THROW(initial_clouds<double>(InitialCloud::orthonormal, 1, 5, 3, 1), Error);
  EXPECT_EQ(make_operator<double>(OperatorKind::minus_identity, 2, 0),
            (std::vector<double>{-1, 0, 0, -1}));
  EXPECT_EQ(make_operator<float>(OperatorKind::random, 3, 4),
            make_operator<float>(OperatorKind::random, 3, 4));
}

TEST(FlowValidation, BadSettingsNameTheirArgument) {
  const auto x0 = initial_clouds<double>(InitialCloud::sphere, 1, 4, 3, 1);
  const auto layers = one_layer<double>(3, OperatorKind::identity, OperatorKind::identity);
  auto message = [&](FlowSettings s, const std::vector<double>& betas = {1.0}) {
    try {
      run_flow(x0, betas, layers, s, on_cpu());
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  FlowSettings s = continuous(1.0, 0.1, Integrator::rk4, false);
  s.dt = -1;
  EXPECT_NE(message(s).find("'dt'"), std::string::npos);
  s = continuous(1.0, 0.1, Integrator::rk4, false);
  s.norm = Normalization::layernorm;
  EXPECT_NE(message(s).find("'norm'"), std::string::npos);
  s = continuous(1.0, 0.1, Integrator::rk4, false);
  s.record_every = 0;
  EXPECT_NE(message(s).find("'record_every'"), std::string::npos);
  s = continuous(1.0, 0.1, Integrator::rk4, false);
  EXPECT_NE(message(s, {1.0, 2.0}).find("'betas'"), std::string::npos);
  EXPECT_NE(message(s, {0.0}).find("'beta'"), std::string::npos);
  s.layers = 3;
  s.norm = Normalization::none;
  EXPECT_EQ(message(s), "no error");
  EXPECT_THROW(parse_normalization("batchnorm", "--norm"), Error);
}

// ---------------------------------------------------------------------------------------------
// The phase sweep: the specialised CPU path against the generic path through attend.

TEST(FlowPhase, SpecialisedPathMatchesGenericPath) {
  for (std::int64_t d : {2, 3, 5}) {
    // 7 clouds at 3 betas, 21 clouds: two lane groups, the second partly empty.
    const PhaseSettings s = testing::phase_settings(9, d, 0.5, 6.0, 3, 6.0, 0.1, 7, 3);
    const PhaseDiagram fast = phase_diagram(s, on_cpu());
    PhaseSettings g = s;
    g.generic = true;
    const PhaseDiagram generic = phase_diagram(g, on_cpu());
    ASSERT_EQ(fast.clustered.size(), 61u * 3u);
    ASSERT_EQ(fast.times, generic.times);
    ASSERT_EQ(fast.betas, generic.betas);
    // A pair sitting on the threshold may count on one side only: allow one pair in one cloud.
    const double one_pair = 1.0 / (36.0 * 7.0);
    for (std::size_t e = 0; e < fast.clustered.size(); ++e) {
      ASSERT_NEAR(fast.clustered[e], generic.clustered[e], 1.01 * one_pair)
          << "d " << d << " " << e;
    }
    EXPECT_GT(fast.clustered[60 * 3], fast.clustered[0] + 0.1) << d;  // clustering happened
    for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(fast.clustered[k], fast.clustered[0]);
  }
}

}  // namespace
}  // namespace emflow::flow

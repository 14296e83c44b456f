// FlowSettings::norm_eps: a stack's layer norm uses the given eps (a model's own, 1e-12 for
// BERT), exactly as flow::normalize with that eps; bad values are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/testing.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow {
namespace {

TEST(FlowNormEps, TheLayerNormOfAStackUsesTheGivenEps) {
  // Tokens whose entries differ by about 1e-3: a variance near 1e-6, where eps 1e-5 and 1e-12
  // give very different results.
  const std::int64_t N = 4, d = 5;
  std::vector<double> values = testing::uniform(static_cast<std::size_t>(N * d), 3);
  for (double& v : values) v = 1.0 + 1e-3 * v;
  const Tensor<double> initial(Shape{1, N, d}, values);
  FlowLayer<double> layer;  // F = 0: the layer is the norm alone, X <- N(X)
  layer.relevance.assign(static_cast<std::size_t>(d * d), 0.0);
  layer.content.assign(static_cast<std::size_t>(d * d), 0.0);
  FlowSettings settings;
  settings.layers = 1;
  settings.norm = Normalization::layernorm;
  ExecutionOptions cpu;
  cpu.device = Device::cpu;
  for (double eps : {1e-12, 1e-5, 0.5}) {
    settings.norm_eps = eps;
    const auto result = run_flow(initial, {1.0}, {layer}, settings, cpu);
    std::vector<double> expected = values;
    normalize(Normalization::layernorm, expected.data(), N, d, static_cast<const double*>(nullptr),
              static_cast<const double*>(nullptr), eps);
    const std::vector<double> last(result.trajectory.data() + N * d,
                                   result.trajectory.data() + 2 * N * d);
    EXPECT_EQ(last, expected) << eps;
  }
  // With eps 1e-12 the first token gets unit variance (to eps / variance, ~1e-5); with the
  // default 1e-5, which dwarfs its variance, it stays far below.
  auto variance_after = [&](double eps) {
    settings.norm_eps = eps;
    const auto r = run_flow(initial, {1.0}, {layer}, settings, cpu);
    double square = 0;
    for (std::int64_t a = 0; a < d; ++a) square += std::pow(r.trajectory[N * d + a], 2);
    return square / static_cast<double>(d);
  };
  EXPECT_NEAR(variance_after(1e-12), 1.0, 1e-4);
  EXPECT_LT(variance_after(1e-5), 0.1);

  settings.norm_eps = 0.0;
  EXPECT_TRUE(testing::throws_error([&] { run_flow(initial, {1.0}, {layer}, settings, cpu); },
                                    ErrorCode::invalid_argument, {"norm_eps"}));
}

}  // namespace
}  // namespace emflow::flow

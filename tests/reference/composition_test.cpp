// The reference operations composed one by one (reference::attend) against the fused reference
// behind emflow::attend(Device::reference) (src/reference/attend.cpp): two independent codings
// of docs/MATH.md §1 that must agree to 1e-12 on awkward sizes, masks and key lengths.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "emflow/reference.hpp"
#include "reference/reference_helpers.hpp"

namespace emflow {
namespace {

using testing::attend_via_api;
using testing::max_abs;
using testing::random_layer;
using testing::random_tensor;
using testing::tensors_near;

struct Case {
  std::string name;
  std::int64_t batch, tokens, dim, heads;
  Mask mask;
  std::vector<std::int64_t> key_lengths;
  bool key_bias, offset;
  double beta;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

class Composition : public ::testing::TestWithParam<Case> {};

TEST_P(Composition, ComposedOperationsEqualFusedReference) {
  const Case& c = GetParam();
  const Tensor<double> X = random_tensor({c.batch, c.tokens, c.dim}, c.tokens * 131 + c.dim);
  const reference::Layer layer =
      random_layer(c.heads, c.dim, c.batch * 17 + c.heads, c.key_bias, c.offset);
  const reference::Attention composed =
      reference::attend(X, layer, c.beta, c.mask, c.key_lengths, /*with_weights=*/true);
  const reference::Attention fused =
      attend_via_api(X, layer, c.beta, c.mask, c.key_lengths, /*with_weights=*/true);

  ASSERT_GT(max_abs(composed.update), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(tensors_near(fused.update, composed.update, 1e-12));
  EXPECT_TRUE(tensors_near(fused.lse, composed.lse, 1e-12));
  EXPECT_TRUE(tensors_near(fused.entropy, composed.entropy, 1e-12));
  EXPECT_TRUE(tensors_near(fused.weights, composed.weights, 1e-12));
}

INSTANTIATE_TEST_SUITE_P(
    AwkwardSizes, Composition,
    ::testing::Values(
        Case{"one_token_d1", 1, 1, 1, 1, Mask::none(), {}, false, false, 1.0},
        Case{"pair_d2", 1, 2, 2, 1, Mask::none(), {}, true, true, 1.0},
        Case{"b2_n7_d5_h3_causal", 2, 7, 5, 3, Mask::causal(), {}, true, true, 1.0},
        Case{"b3_n11_d4_h2_window3_lengths",
             3,
             11,
             4,
             2,
             Mask::sliding_window(3),
             {11, 0, 5},
             true,
             true,
             1.0},
        Case{"n33_d16_h2", 1, 33, 16, 2, Mask::none(), {}, true, false, 1.0},
        Case{"b4_n13_d3_causal_lengths",
             4,
             13,
             3,
             1,
             Mask::causal(),
             {1, 13, 7, 2},
             false,
             true,
             1.0},
        Case{"n9_d6_h2_negative_beta", 1, 9, 6, 2, Mask::none(), {}, true, true, -1.7},
        Case{"n12_d4_sharp_beta40", 1, 12, 4, 1, Mask::none(), {}, true, false, 40.0},
        Case{"n101_d1", 1, 101, 1, 1, Mask::causal(), {}, true, true, 3.0},
        Case{"b2_n8_d7_h4_window1", 2, 8, 7, 4, Mask::sliding_window(1), {}, true, true, 1.0},
        Case{"b2_n5_d3_window_wider_than_cloud",
             2,
             5,
             3,
             2,
             Mask::sliding_window(64),
             {4, 5},
             true,
             true,
             0.7}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Optional outputs left null: the update is the same, nothing else is written.
TEST(Composition, OptionalOutputsMayBeOmitted) {
  const Tensor<double> X = random_tensor({2, 6, 3}, 21);
  const reference::Layer layer = random_layer(2, 3, 21, true, true);
  const reference::Attention composed = reference::attend(X, layer, 1.0, Mask::causal());

  Tensor<double> update({2, 6, 3}, std::vector<double>(36, std::nan("")));
  AttentionInput<double> input;
  input.cloud = X.data();
  input.batch = 2;
  input.tokens = 6;
  input.dim = 3;
  input.layer = layer.operators();
  input.mask = Mask::causal();
  AttentionOutput<double> output;
  output.update = update.data();
  attend(input, output, {Device::reference});
  EXPECT_TRUE(tensors_near(update, composed.update, 1e-12));
}

// float inputs on Device::reference are computed in double and rounded at the end.
TEST(Composition, FloatInputsOnTheReferenceAreComputedInDouble) {
  const Tensor<double> X = random_tensor({1, 9, 4}, 22);  // values exactly representable in float
  const reference::Layer layer = random_layer(2, 4, 22, true, true);
  const reference::Attention composed = reference::attend(X, layer, 1.0, Mask::none());

  const std::vector<float> cloud(X.values().begin(), X.values().end());
  const std::vector<float> M(layer.relevance.values().begin(), layer.relevance.values().end());
  const std::vector<float> F(layer.content.values().begin(), layer.content.values().end());
  const std::vector<float> u(layer.key_bias.values().begin(), layer.key_bias.values().end());
  const std::vector<float> c(layer.offset.values().begin(), layer.offset.values().end());
  std::vector<float> update(36, std::nanf(""));
  AttentionInput<float> input;
  input.cloud = cloud.data();
  input.tokens = 9;
  input.dim = 4;
  input.layer = {2, M.data(), F.data(), u.data(), c.data()};
  AttentionOutput<float> output;
  output.update = update.data();
  attend(input, output, {Device::reference});
  for (std::size_t e = 0; e < update.size(); ++e) {
    // Two double codings may differ in the last double bits, and so round to neighbouring floats.
    EXPECT_FLOAT_EQ(update[e], static_cast<float>(composed.update[static_cast<std::int64_t>(e)]))
        << "element " << e;
  }
}

}  // namespace
}  // namespace emflow

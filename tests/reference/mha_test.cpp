// Standard multi-head attention against its EMF form (docs/MATH.md §3): on random weights, with
// and without biases and masks, d_k != d, the EMF update of to_emf(w) equals the plain QKV
// computation to 1e-12 in double.
#include "emflow/mha.hpp"

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
using testing::random_tensor;
using testing::tensors_near;

enum class Biases { none, all, query_and_value_only };

MultiHeadAttentionWeights random_weights(std::int64_t H, std::int64_t d, std::int64_t dk,
                                         std::int64_t dv, Biases biases, std::uint64_t seed) {
  MultiHeadAttentionWeights w;
  w.heads = H;
  w.model_dim = d;
  w.head_dim = dk;
  w.value_dim = dv;
  w.query = random_tensor({H * dk, d}, seed * 13 + 1);
  w.key = random_tensor({H * dk, d}, seed * 13 + 2);
  w.value = random_tensor({H * dv, d}, seed * 13 + 3);
  w.output = random_tensor({d, H * dv}, seed * 13 + 4);
  if (biases != Biases::none) {
    w.query_bias = random_tensor({H * dk}, seed * 13 + 5);
    w.value_bias = random_tensor({H * dv}, seed * 13 + 6);
  }
  if (biases == Biases::all) {
    w.key_bias = random_tensor({H * dk}, seed * 13 + 7);
    w.output_bias = random_tensor({d}, seed * 13 + 8);
  }
  return w;
}

struct Case {
  std::string name;
  std::int64_t heads, model_dim, head_dim, value_dim, batch, tokens;
  Biases biases;
  Mask mask;
  std::vector<std::int64_t> key_lengths;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

class MultiHeadAsEmf : public ::testing::TestWithParam<Case> {};

TEST_P(MultiHeadAsEmf, EmfUpdateEqualsQkvAttention) {
  const Case& c = GetParam();
  const MultiHeadAttentionWeights w =
      random_weights(c.heads, c.model_dim, c.head_dim, c.value_dim, c.biases, c.tokens + 7);
  const Tensor<double> X = random_tensor({c.batch, c.tokens, c.model_dim}, c.tokens * 3 + 1);

  const Tensor<double> qkv = mha_reference(w, X, c.mask, c.key_lengths);
  ASSERT_GT(max_abs(qkv), 1e-2) << "a vacuous comparison";
  const reference::Layer layer = to_emf(w);
  EXPECT_EQ(layer.relevance.shape(), (Shape{c.heads, c.model_dim, c.model_dim}));

  const reference::Attention composed = reference::attend(X, layer, 1.0, c.mask, c.key_lengths);
  EXPECT_TRUE(tensors_near(composed.update, qkv, 1e-12));
  const reference::Attention fused = attend_via_api(X, layer, 1.0, c.mask, c.key_lengths);
  EXPECT_TRUE(tensors_near(fused.update, qkv, 1e-12));
}

INSTANTIATE_TEST_SUITE_P(
    RandomWeights, MultiHeadAsEmf,
    ::testing::Values(
        Case{"h1_d4_dk4_dv4_all_biases", 1, 4, 4, 4, 1, 5, Biases::all, Mask::none(), {}},
        Case{"h2_d6_dk3_dv2_all_biases", 2, 6, 3, 2, 2, 7, Biases::all, Mask::none(), {}},
        Case{"h3_d5_dk8_dv7_no_biases", 3, 5, 8, 7, 1, 9, Biases::none, Mask::none(), {}},
        Case{"h4_d8_dk2_dv3_query_value_biases",
             4,
             8,
             2,
             3,
             2,
             6,
             Biases::query_and_value_only,
             Mask::none(),
             {}},
        Case{"h2_d6_dk3_dv5_causal", 2, 6, 3, 5, 2, 8, Biases::all, Mask::causal(), {}},
        Case{"h3_d4_dk5_dv2_window2", 3, 4, 5, 2, 1, 10, Biases::all, Mask::sliding_window(2), {}},
        Case{"h2_d7_dk3_dv3_key_lengths", 2, 7, 3, 3, 3, 6, Biases::all, Mask::none(), {6, 2, 0}},
        Case{"h1_d3_dk1_dv1_causal_key_lengths",
             1,
             3,
             1,
             1,
             2,
             11,
             Biases::all,
             Mask::causal(),
             {4, 11}},
        Case{"h8_d16_dk2_dv2_many_heads", 8, 16, 2, 2, 1, 12, Biases::all, Mask::none(), {}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The key bias cancels in the softmax: plain attention with and without b_K agrees.
TEST(MultiHead, KeyBiasCancels) {
  MultiHeadAttentionWeights w = random_weights(2, 5, 3, 4, Biases::all, 31);
  const Tensor<double> X = random_tensor({2, 6, 5}, 32);
  const Tensor<double> with = mha_reference(w, X, Mask::causal());
  w.key_bias = Tensor<double>{};
  EXPECT_TRUE(tensors_near(mha_reference(w, X, Mask::causal()), with, 1e-12));
}

// The value and output biases become the constant c: a query that sees a key gets exactly c
// when W_V = 0, and 0 when it sees none.
TEST(MultiHead, ValueBiasesBecomeTheOffset) {
  MultiHeadAttentionWeights w = random_weights(2, 3, 2, 2, Biases::all, 33);
  w.value = Tensor<double>({4, 3});
  const reference::Layer layer = to_emf(w);
  for (double f : layer.content.values()) EXPECT_EQ(f, 0.0);
  const Tensor<double> X = random_tensor({1, 4, 3}, 34);
  const Tensor<double> out = mha_reference(w, X, Mask::none(), {3});
  for (std::int64_t i = 0; i < 4; ++i) {
    for (std::int64_t a = 0; a < 3; ++a) {
      EXPECT_NEAR(out[i * 3 + a], i < 3 ? layer.offset[a] : 0.0, 1e-14) << "query " << i;
    }
  }
}

// A (N, d) cloud is a batch of one and keeps its rank.
TEST(MultiHead, UnbatchedCloudKeepsItsRank) {
  const MultiHeadAttentionWeights w = random_weights(2, 4, 3, 3, Biases::all, 35);
  const Tensor<double> X = random_tensor({5, 4}, 36);
  const Tensor<double> out = mha_reference(w, X);
  EXPECT_EQ(out.shape(), (Shape{5, 4}));
  EXPECT_TRUE(tensors_near(mha_reference(w, X.reshaped({1, 5, 4})), out.reshaped({1, 5, 4}), 0.0));
}

}  // namespace
}  // namespace emflow

// Small cases worked on paper: 2 or 3 tokens in d = 2, with beta chosen as ln 2 or ln 3 so that
// every exp(score) is an integer and every weight a simple fraction. The operators are not
// symmetric, so a transposed M or F gives different numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "emflow/mha.hpp"
#include "emflow/reference.hpp"
#include "reference/reference_helpers.hpp"

namespace emflow {
namespace {

using reference::Layer;
using testing::tensors_near;

const double kLn2 = std::log(2.0), kLn3 = std::log(3.0), kLn5 = std::log(5.0);
const double kInf = std::numeric_limits<double>::infinity();
constexpr double kTight = 1e-14;

Tensor<double> T(Shape shape, std::vector<double> values) {
  return Tensor<double>(std::move(shape), std::move(values));
}

// Case 1. X = [e1; e2], M = I, F = 2I, beta = ln 3, no bias.
//   S = ln3 * X X^T = [[ln3, 0], [0, ln3]]
//   exp(S) rows: [3, 1] and [1, 3] -> Z = 4, P = [[3/4, 1/4], [1/4, 3/4]]
//   lse = ln 4 for both; H = ln4 - (3/4 ln3 + 1/4 * 0) = ln4 - 3/4 ln3
//   C = X F^T = 2X; Delta = P C = [[3/2, 1/2], [1/2, 3/2]]; X* = [[5/2, 1/2], [1/2, 5/2]]
TEST(HandWorked, TwoOrthogonalTokensIdentityForm) {
  const Tensor<double> X = T({2, 2}, {1, 0, 0, 1});
  const Tensor<double> M = T({2, 2}, {1, 0, 0, 1});
  const Tensor<double> F = T({2, 2}, {2, 0, 0, 2});

  const Tensor<double> R = reference::relevance_gradients(X, M);
  EXPECT_TRUE(tensors_near(R, X, kTight));
  const Tensor<double> S = reference::scores(R, X, {}, kLn3);
  EXPECT_TRUE(tensors_near(S, T({2, 2}, {kLn3, 0, 0, kLn3}), kTight));
  const reference::Softmax sm = reference::masked_softmax(S);
  EXPECT_TRUE(tensors_near(sm.weights, T({2, 2}, {0.75, 0.25, 0.25, 0.75}), kTight));
  EXPECT_TRUE(tensors_near(sm.lse, T({2}, {std::log(4.0), std::log(4.0)}), kTight));
  const double H = std::log(4.0) - 0.75 * kLn3;
  EXPECT_TRUE(tensors_near(sm.entropy, T({2}, {H, H}), kTight));
  const Tensor<double> C = reference::content(X, F);
  EXPECT_TRUE(tensors_near(C, T({2, 2}, {2, 0, 0, 2}), kTight));
  const Tensor<double> delta = reference::contextual_update(sm.weights, C);
  EXPECT_TRUE(tensors_near(delta, T({2, 2}, {1.5, 0.5, 0.5, 1.5}), kTight));
  EXPECT_TRUE(
      tensors_near(reference::residual_update(X, delta), T({2, 2}, {2.5, 0.5, 0.5, 2.5}), kTight));
}

// Case 2, used by the tests below. X = [[1, 0], [0, 1], [1, 1]], beta = ln 2,
//   M = [[0, 1], [0, 0]]: x^T M t = x_0 t_1 (query's first coordinate times key's second),
//   R = X M: row i = (0, x_i0) -> R = [[0, 1], [0, 0], [0, 1]]
//   F = [[1, 2], [0, 1]]: F x = (x_0 + 2 x_1, x_1) -> C = [[1, 0], [2, 1], [3, 1]]
// With M transposed (x_1 t_0) query 0 would see flat scores; with F transposed C would be
// [[1, 2], [0, 1], [1, 3]]: either mistake changes every number below.
const Tensor<double> kCloud = T({3, 2}, {1, 0, 0, 1, 1, 1});
const Tensor<double> kRelevance = T({2, 2}, {0, 1, 0, 0});
const Tensor<double> kContent = T({2, 2}, {1, 2, 0, 1});

Layer case2_layer() {
  Layer layer;
  layer.relevance = kRelevance;
  layer.content = kContent;
  return layer;
}

TEST(HandWorked, AsymmetricFormRelevanceAndContent) {
  EXPECT_TRUE(tensors_near(reference::relevance_gradients(kCloud, kRelevance),
                           T({3, 2}, {0, 1, 0, 0, 0, 1}), kTight));
  EXPECT_TRUE(
      tensors_near(reference::content(kCloud, kContent), T({3, 2}, {1, 0, 2, 1, 3, 1}), kTight));
}

// Case 2 unmasked. s_ij = ln2 * x_i0 * x_j1:
//   queries 0 and 2 (x_i0 = 1): s = ln2 * [0, 1, 1], exp = [1, 2, 2], Z = 5, p = [1, 2, 2] / 5
//     lse = ln 5, H = ln5 - (2/5 + 2/5) ln2 = ln5 - 4/5 ln2
//     delta = 1/5 [1, 0] + 2/5 [2, 1] + 2/5 [3, 1] = [11/5, 4/5]
//   query 1 (x_10 = 0): s = [0, 0, 0], p = 1/3 each, lse = ln 3, H = ln 3
//     delta = ([1, 0] + [2, 1] + [3, 1]) / 3 = [2, 2/3]
TEST(HandWorked, ThreeTokensUnmasked) {
  const Tensor<double> S =
      reference::scores(reference::relevance_gradients(kCloud, kRelevance), kCloud, {}, kLn2);
  EXPECT_TRUE(tensors_near(S, T({3, 3}, {0, kLn2, kLn2, 0, 0, 0, 0, kLn2, kLn2}), kTight));
  const reference::Softmax sm = reference::masked_softmax(S);
  EXPECT_TRUE(tensors_near(
      sm.weights, T({3, 3}, {0.2, 0.4, 0.4, 1.0 / 3, 1.0 / 3, 1.0 / 3, 0.2, 0.4, 0.4}), kTight));
  EXPECT_TRUE(tensors_near(sm.lse, T({3}, {kLn5, kLn3, kLn5}), kTight));
  const double H0 = kLn5 - 0.8 * kLn2;
  EXPECT_TRUE(tensors_near(sm.entropy, T({3}, {H0, kLn3, H0}), kTight));

  const reference::Attention out = reference::attend(kCloud, case2_layer(), kLn2);
  EXPECT_TRUE(tensors_near(out.update, T({3, 2}, {2.2, 0.8, 2, 2.0 / 3, 2.2, 0.8}), kTight));
  EXPECT_TRUE(tensors_near(out.lse, T({1, 1, 3}, {kLn5, kLn3, kLn5}), kTight));
}

// Case 2 with key bias u = (1, 0) and offset c = (1, -1): s_ij = ln2 (x_i0 x_j1 + x_j0).
//   x_j0 over keys = [1, 0, 1]
//   queries 0 and 2: s / ln2 = [0 + 1, 1 + 0, 1 + 1] = [1, 1, 2], exp = [2, 2, 4], Z = 8
//     p = [1/4, 1/4, 1/2], lse = ln 8, H = 3 ln2 - (1/4 + 1/4 + 1/2 * 2) ln2 = 3/2 ln2
//     delta = 1/4 [1, 0] + 1/4 [2, 1] + 1/2 [3, 1] + c = [9/4, 3/4] + [1, -1] = [13/4, -1/4]
//   query 1: s / ln2 = [1, 0, 1], exp = [2, 1, 2], Z = 5, p = [2/5, 1/5, 2/5]
//     lse = ln 5, H = ln5 - 4/5 ln2
//     delta = 2/5 [1, 0] + 1/5 [2, 1] + 2/5 [3, 1] + c = [2, 3/5] + [1, -1] = [3, -2/5]
TEST(HandWorked, KeyBiasAndOffset) {
  Layer layer = case2_layer();
  layer.key_bias = T({2}, {1, 0});
  layer.offset = T({2}, {1, -1});
  const reference::Attention out = reference::attend(kCloud, layer, kLn2, {}, {}, true);
  EXPECT_TRUE(tensors_near(
      out.weights, T({1, 1, 3, 3}, {0.25, 0.25, 0.5, 0.4, 0.2, 0.4, 0.25, 0.25, 0.5}), kTight));
  EXPECT_TRUE(tensors_near(out.lse, T({1, 1, 3}, {3 * kLn2, kLn5, 3 * kLn2}), kTight));
  EXPECT_TRUE(
      tensors_near(out.entropy, T({1, 1, 3}, {1.5 * kLn2, kLn5 - 0.8 * kLn2, 1.5 * kLn2}), kTight));
  EXPECT_TRUE(tensors_near(out.update, T({3, 2}, {3.25, -0.25, 3, -0.4, 3.25, -0.25}), kTight));
}

// Case 2, causal (j <= i):
//   query 0 sees key 0 only: p = [1], delta = C_0 = [1, 0], lse = s_00 = 0, H = 0
//   query 1 sees keys 0, 1 with s = [0, 0]: p = [1/2, 1/2], delta = [3/2, 1/2], lse = ln2, H = ln2
//   query 2 sees all keys: as unmasked, delta = [11/5, 4/5], lse = ln 5
TEST(HandWorked, Causal) {
  const reference::Attention out =
      reference::attend(kCloud, case2_layer(), kLn2, Mask::causal(), {}, true);
  EXPECT_TRUE(
      tensors_near(out.weights, T({1, 1, 3, 3}, {1, 0, 0, 0.5, 0.5, 0, 0.2, 0.4, 0.4}), kTight));
  EXPECT_TRUE(tensors_near(out.update, T({3, 2}, {1, 0, 1.5, 0.5, 2.2, 0.8}), kTight));
  EXPECT_TRUE(tensors_near(out.lse, T({1, 1, 3}, {0, kLn2, kLn5}), kTight));
  EXPECT_TRUE(tensors_near(out.entropy, T({1, 1, 3}, {0, kLn2, kLn5 - 0.8 * kLn2}), kTight));
}

// Case 2, sliding window w = 2 (i - 2 < j <= i):
//   query 0: key 0 only -> delta = [1, 0], lse = 0
//   query 1: keys 0, 1, s = [0, 0] -> delta = [3/2, 1/2], lse = ln 2
//   query 2: keys 1, 2, s = ln2 [1, 1] -> p = [1/2, 1/2], delta = ([2, 1] + [3, 1]) / 2 = [5/2, 1]
//            lse = ln2 + ln2 = 2 ln2, H = 2 ln2 - ln2 = ln2
// and w = 1 (each query sees itself): delta_i = C_i, lse_i = s_ii = [0, 0, ln2], H = 0.
TEST(HandWorked, SlidingWindow) {
  const reference::Attention w2 =
      reference::attend(kCloud, case2_layer(), kLn2, Mask::sliding_window(2));
  EXPECT_TRUE(tensors_near(w2.update, T({3, 2}, {1, 0, 1.5, 0.5, 2.5, 1}), kTight));
  EXPECT_TRUE(tensors_near(w2.lse, T({1, 1, 3}, {0, kLn2, 2 * kLn2}), kTight));
  EXPECT_TRUE(tensors_near(w2.entropy, T({1, 1, 3}, {0, kLn2, kLn2}), kTight));

  const reference::Attention w1 =
      reference::attend(kCloud, case2_layer(), kLn2, Mask::sliding_window(1));
  EXPECT_TRUE(tensors_near(w1.update, T({3, 2}, {1, 0, 2, 1, 3, 1}), kTight));
  EXPECT_TRUE(tensors_near(w1.lse, T({1, 1, 3}, {0, 0, kLn2}), kTight));
  EXPECT_TRUE(tensors_near(w1.entropy, T({1, 1, 3}, {0, 0, 0}), kTight));
}

// Case 2 as a batch of two clouds with key lengths {2, 0} and offset c = (1, -1):
//   cloud 0 (L = 2): key 2 is hidden, query 2 is padding.
//     query 0: keys 0, 1, s = ln2 [0, 1], exp = [1, 2], p = [1/3, 2/3], lse = ln3,
//              H = ln3 - 2/3 ln2, delta = 1/3 [1, 0] + 2/3 [2, 1] + c = [5/3, 2/3] + c
//     query 1: s = [0, 0], p = [1/2, 1/2], lse = ln2, delta = [3/2, 1/2] + c
//     query 2: no key: delta = 0 (no offset), lse = -inf, H = 0
//   cloud 1 (L = 0): every query is padding.
// These outputs, whichever function computed them (reference::attend or emflow::attend).
void expect_key_lengths_case(const reference::Attention& out) {
  EXPECT_TRUE(tensors_near(
      out.update, T({2, 3, 2}, {5.0 / 3 + 1, 2.0 / 3 - 1, 2.5, -0.5, 0, 0, 0, 0, 0, 0, 0, 0}),
      kTight));
  EXPECT_TRUE(
      tensors_near(out.lse, T({2, 1, 3}, {kLn3, kLn2, -kInf, -kInf, -kInf, -kInf}), kTight));
  EXPECT_TRUE(
      tensors_near(out.entropy, T({2, 1, 3}, {kLn3 - 2.0 / 3 * kLn2, kLn2, 0, 0, 0, 0}), kTight));
  EXPECT_TRUE(tensors_near(
      out.weights,
      T({2, 1, 3, 3}, {1.0 / 3, 2.0 / 3, 0, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}),
      kTight));
}

// Two copies of the cloud above in a batch.
Tensor<double> cloud_twice() {
  std::vector<double> twice = kCloud.values();
  twice.insert(twice.end(), kCloud.values().begin(), kCloud.values().end());
  return T({2, 3, 2}, twice);
}

TEST(HandWorked, KeyLengthsInABatch) {
  Layer layer = case2_layer();
  layer.offset = T({2}, {1, -1});
  expect_key_lengths_case(reference::attend(cloud_twice(), layer, kLn2, {}, {2, 0}, true));
}

// The Device::reference backend of emflow::attend on the same hand-worked case with bias and
// offset (see KeyBiasAndOffset), so the fused reference is pinned to paper numbers too.
TEST(HandWorked, FusedReferenceBackendMatchesPaper) {
  Layer layer = case2_layer();
  layer.key_bias = T({2}, {1, 0});
  layer.offset = T({2}, {1, -1});
  const reference::Attention out =
      testing::attend_via_api(kCloud.reshaped({1, 3, 2}), layer, kLn2, {}, {});
  EXPECT_TRUE(tensors_near(out.update, T({1, 3, 2}, {3.25, -0.25, 3, -0.4, 3.25, -0.25}), kTight));
  EXPECT_TRUE(tensors_near(out.lse, T({1, 1, 3}, {3 * kLn2, kLn5, 3 * kLn2}), kTight));
  EXPECT_TRUE(
      tensors_near(out.entropy, T({1, 1, 3}, {1.5 * kLn2, kLn5 - 0.8 * kLn2, 1.5 * kLn2}), kTight));
}

// The fused backend on the key-length case above (see KeyLengthsInABatch): padding queries get
// no offset, hidden keys no weight.
TEST(HandWorked, FusedReferenceBackendKeyLengths) {
  Layer layer = case2_layer();
  layer.offset = T({2}, {1, -1});
  expect_key_lengths_case(
      testing::attend_via_api(cloud_twice(), layer, kLn2, {}, {2, 0}, /*with_weights=*/true));
}

// to_emf on hand-picked weights: H = 1, d = 2, d_k = 4 (so 1/sqrt(d_k) = 1/2), d_v = 1.
//   W_Q rows: [1, 0], 0, 0, 0;  W_K rows: [0, 1], 0, 0, 0
//     M = W_Q^T W_K / 2 = [[0, 1], [0, 0]] / 2 = [[0, 1/2], [0, 0]]
//   b_Q = [2, 5, 5, 5]: u = W_K^T b_Q / 2 = (0 * ... , 1 * 2) / 2 = [0, 1]
//   W_V = [[1, 0]], W_O = [[1], [0]]: F = W_O W_V = [[1, 0], [0, 0]]
//   b_V = [3], b_O = [1/2, -1]: c = W_O b_V + b_O = [3, 0] + [1/2, -1] = [7/2, -1]
//   b_K = [7, 7, 7, 7] changes nothing (it cancels in the softmax).
TEST(HandWorked, MultiHeadAttentionToEmf) {
  // Every member in declaration order: H, d, d_k, d_v, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O.
  const MultiHeadAttentionWeights w{1,
                                    2,
                                    4,
                                    1,
                                    T({4, 2}, {1, 0, 0, 0, 0, 0, 0, 0}),
                                    T({4, 2}, {0, 1, 0, 0, 0, 0, 0, 0}),
                                    T({1, 2}, {1, 0}),
                                    T({2, 1}, {1, 0}),
                                    T({4}, {2, 5, 5, 5}),
                                    T({4}, {7, 7, 7, 7}),
                                    T({1}, {3}),
                                    T({2}, {0.5, -1})};
  const Layer layer = to_emf(w);
  EXPECT_TRUE(tensors_near(layer.relevance, T({1, 2, 2}, {0, 0.5, 0, 0}), kTight));
  EXPECT_TRUE(tensors_near(layer.content, T({1, 2, 2}, {1, 0, 0, 0}), kTight));
  EXPECT_TRUE(tensors_near(layer.key_bias, T({1, 2}, {0, 1}), kTight));
  EXPECT_TRUE(tensors_near(layer.offset, T({2}, {3.5, -1}), kTight));

  // Plain attention on X = [[1, 0], [0, 1]]: q = [x_0 + 2, 5, 5, 5], k = [x_1 + 7, 7, 7, 7],
  // v = x_0 + 3. q_i . k_j / 2 = ((x_i0 + 2)(x_j1 + 7) + 15 * 7) / 2; for query 0 (x_00 = 1) the
  // logits differ by 3 / 2 between key 1 (x_11 = 1) and key 0, so p = [1, e^1.5] / (1 + e^1.5);
  // v = [4, 3]; out_0 = (W_O o + b_O) = [(4 + 3 e^1.5) / (1 + e^1.5) + 1/2, -1].
  const Tensor<double> X = T({2, 2}, {1, 0, 0, 1});
  const double e = std::exp(1.5);
  const double o0 = (4 + 3 * e) / (1 + e);
  const Tensor<double> out = mha_reference(w, X);
  EXPECT_NEAR(out[0], o0 + 0.5, kTight);
  EXPECT_NEAR(out[1], -1.0, kTight);
}

}  // namespace
}  // namespace emflow

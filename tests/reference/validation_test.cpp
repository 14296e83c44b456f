// Every reference function refuses a bad argument with ErrorCode::invalid_argument and a
// message naming the argument with the expected and the actual shape or value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "emflow/mha.hpp"
#include "emflow/reference.hpp"
#include "reference/reference_helpers.hpp"

namespace emflow {
namespace {

using testing::random_tensor;
using testing::rejects;

const double kNan = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

const Tensor<double> kX = random_tensor({2, 3, 2}, 1);  // B = 2, N = 3, d = 2
const Tensor<double> kM = random_tensor({2, 2}, 2);

TEST(ReferenceValidation, CloudMustBeRankTwoOrThree) {
  EXPECT_TRUE(rejects([] { reference::relevance_gradients(random_tensor({4}, 3), kM); }, "cloud",
                      {"(4,)", "expected (N, d) or (B, N, d)"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::content(random_tensor({1, 2, 2, 2}, 3), kM);
      },
      "cloud", {"(1, 2, 2, 2)"}));
}

TEST(ReferenceValidation, CloudExtentsMustBePositive) {
  EXPECT_TRUE(rejects(
      [] {
        reference::relevance_gradients(Tensor<double>({0, 2}), kM);
      },
      "cloud", {"(0, 2)", ">= 1"}));
  EXPECT_TRUE(rejects([] { reference::content(Tensor<double>({2, 0, 2}), kM); }, "cloud"));
}

TEST(ReferenceValidation, OperatorMustBeDByD) {
  EXPECT_TRUE(rejects(
      [] {
        reference::relevance_gradients(kX, random_tensor({3, 3}, 4));
      },
      "relevance", {"(3, 3)", "expected (2, 2)"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::content(kX, random_tensor({2, 3}, 4));
      },
      "content", {"(2, 3)", "expected (2, 2)"}));
}

TEST(ReferenceValidation, ScoresCheckEveryArgument) {
  const Tensor<double> R = reference::relevance_gradients(kX, kM);
  EXPECT_TRUE(rejects(
      [&] {
        reference::scores(random_tensor({2, 3, 3}, 5), kX, {}, 1.0);
      },
      "relevance_gradients", {"(2, 3, 3)", "expected (2, 3, 2)"}));
  EXPECT_TRUE(rejects([&] { reference::scores(R, kX, random_tensor({3}, 5), 1.0); }, "key_bias",
                      {"(3,)", "expected (2,)"}));
  for (double beta : {kNan, kInf, -kInf}) {
    EXPECT_TRUE(rejects([&] { reference::scores(R, kX, {}, beta); }, "beta", {"finite"}));
  }
  EXPECT_TRUE(rejects([&] { reference::scores(R, kX, {}, 1.0, Mask::sliding_window(0)); }, "mask",
                      {">= 1", "got 0"}));
  EXPECT_TRUE(rejects([&] { reference::scores(R, kX, {}, 1.0, {}, {3}); }, "key_lengths",
                      {"1 entries", "expected 2"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::scores(R, kX, {}, 1.0, {}, {3, -1});
      },
      "key_lengths", {"[0, 3]", "got -1"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::scores(R, kX, {}, 1.0, {}, {4, 0});
      },
      "key_lengths", {"[0, 3]", "got 4"}));
}

TEST(ReferenceValidation, SoftmaxRefusesBadScores) {
  EXPECT_TRUE(rejects([] { reference::masked_softmax(Tensor<double>{}); }, "scores", {"rank"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::masked_softmax(Tensor<double>({1, 1, 1, 1, 1}));
      },
      "scores", {"rank 1 to 4"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::masked_softmax(Tensor<double>({3, 0}));
      },
      "scores", {"(3, 0)", "at least one key"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::masked_softmax(Tensor<double>({1, 2}, {0.0, kNan}));
      },
      "scores", {"entry 1", "nan"}));
  EXPECT_TRUE(rejects(
      [] {
        reference::masked_softmax(Tensor<double>({1, 2}, {kInf, 0.0}));
      },
      "scores", {"entry 0", "inf"}));
}

TEST(ReferenceValidation, ContextualUpdateChecksShapes) {
  const Tensor<double> C = reference::content(kX, kM);
  EXPECT_TRUE(rejects(
      [&] {
        reference::contextual_update(Tensor<double>({2, 3, 2}), C);
      },
      "weights", {"(2, 3, 2)", "expected (2, 3, 3)"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::contextual_update(Tensor<double>({3, 3}), C);
      },
      "weights", {"(3, 3)", "expected (2, 3, 3)"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::contextual_update(Tensor<double>({2, 3, 3}), C, Tensor<double>({3}));
      },
      "offset", {"(3,)", "expected (2,)"}));
}

TEST(ReferenceValidation, ResidualUpdateNeedsTheCloudShape) {
  EXPECT_TRUE(rejects(
      [] {
        reference::residual_update(kX, Tensor<double>({3, 2}));
      },
      "update", {"(3, 2)", "expected (2, 3, 2)"}));
}

TEST(ReferenceValidation, AttendChecksTheLayer) {
  reference::Layer layer;
  layer.relevance = random_tensor({3, 2, 2}, 6);
  layer.content = random_tensor({3, 2, 2}, 7);
  EXPECT_NO_THROW(reference::attend(kX, layer));

  reference::Layer bad = layer;
  bad.relevance = random_tensor({8}, 6);
  EXPECT_TRUE(rejects([&] { reference::attend(kX, bad); }, "relevance", {"(8,)"}));
  bad = layer;
  bad.relevance = random_tensor({3, 2, 3}, 6);
  EXPECT_TRUE(rejects([&] { reference::attend(kX, bad); }, "relevance",
                      {"(3, 2, 3)", "expected (3, 2, 2)"}));
  bad = layer;
  bad.content = random_tensor({2, 2, 2}, 6);
  EXPECT_TRUE(
      rejects([&] { reference::attend(kX, bad); }, "content", {"(2, 2, 2)", "expected (3, 2, 2)"}));
  bad = layer;
  bad.key_bias = random_tensor({2}, 6);
  EXPECT_TRUE(
      rejects([&] { reference::attend(kX, bad); }, "key_bias", {"(2,)", "expected (3, 2)"}));
  bad = layer;
  bad.offset = random_tensor({3, 2}, 6);
  EXPECT_TRUE(rejects([&] { reference::attend(kX, bad); }, "offset", {"(3, 2)", "expected (2,)"}));
  EXPECT_TRUE(rejects([&] { reference::attend(kX, layer, kNan); }, "beta"));
  EXPECT_TRUE(rejects([&] { reference::attend(kX, layer, 1.0, {}, {1, 4}); }, "key_lengths"));
}

MultiHeadAttentionWeights small_weights() {
  MultiHeadAttentionWeights w;
  w.heads = 2;
  w.model_dim = 2;
  w.head_dim = 3;
  w.value_dim = 1;
  w.query = random_tensor({6, 2}, 8);
  w.key = random_tensor({6, 2}, 9);
  w.value = random_tensor({2, 2}, 10);
  w.output = random_tensor({2, 2}, 11);
  return w;
}

TEST(ReferenceValidation, MultiHeadWeightsAreChecked) {
  EXPECT_NO_THROW(to_emf(small_weights()));
  MultiHeadAttentionWeights w = small_weights();
  w.heads = 0;
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "heads", {">= 1", "got 0"}));
  w = small_weights();
  w.model_dim = -2;
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "model_dim", {"got -2"}));
  w = small_weights();
  w.query = random_tensor({2, 6}, 8);
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "query", {"(2, 6)", "expected (6, 2)"}));
  w = small_weights();
  w.value = random_tensor({3, 2}, 8);
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "value", {"(3, 2)", "expected (2, 2)"}));
  w = small_weights();
  w.output = random_tensor({2, 3}, 8);
  EXPECT_TRUE(rejects([&] { mha_reference(w, kX); }, "output", {"(2, 3)", "expected (2, 2)"}));
  w = small_weights();
  w.key_bias = random_tensor({2}, 8);
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "key_bias", {"(2,)", "expected (6,)"}));
  w = small_weights();
  w.heads = std::int64_t{1} << 40;
  w.head_dim = std::int64_t{1} << 40;
  EXPECT_TRUE(rejects([&] { to_emf(w); }, "head_dim", {"overflows"}));
}

TEST(ReferenceValidation, MultiHeadCloudIsChecked) {
  const MultiHeadAttentionWeights w = small_weights();
  EXPECT_TRUE(rejects(
      [&] {
        mha_reference(w, random_tensor({3, 5}, 12));
      },
      "cloud", {"(3, 5)", "model_dim = 2"}));
  EXPECT_TRUE(rejects([&] { mha_reference(w, kX, Mask::sliding_window(-1)); }, "mask"));
  EXPECT_TRUE(rejects([&] { mha_reference(w, kX, {}, {0, 5}); }, "key_lengths", {"got 5"}));
}

}  // namespace
}  // namespace emflow

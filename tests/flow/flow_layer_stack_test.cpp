// flow::layer_stack, the layers of a run as `emflow flow` builds them: one shared layer or one
// per layer, random operators seeded per layer and head, heads from the arrays, and bad shapes
// refused naming the source. That a C++ call of it plus run_flow reproduces runs of the tool
// bit for bit is checked in flow_cli_test.cpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow {
namespace {

Tensor<float> uniform_tensor(const Shape& shape, std::uint64_t seed) {
  const std::vector<double> v =
      testing::uniform(static_cast<std::size_t>(checked_element_count(shape)), seed);
  return Tensor<float>(shape, std::vector<float>(v.begin(), v.end()));
}

TEST(FlowLayerStack, SharesOneLayerUnlessOperatorsDifferPerLayer) {
  OperatorSource<float> identity, random;
  random.kind = OperatorKind::random;
  EXPECT_EQ(layer_stack(identity, identity, 3, 5, 1).size(), 1u);
  const auto per_layer = layer_stack(random, identity, 3, 4, 1);
  ASSERT_EQ(per_layer.size(), 4u);
  EXPECT_NE(per_layer[0].relevance, per_layer[1].relevance);  // drawn afresh for every layer
  EXPECT_EQ(per_layer[0].content, per_layer[1].content);
  EXPECT_EQ(layer_stack(random, identity, 3, 4, 1)[2].relevance, per_layer[2].relevance);
  EXPECT_NE(layer_stack(random, identity, 3, 4, 2)[2].relevance, per_layer[2].relevance);
  EXPECT_EQ(layer_stack(random, identity, 3, 1, 1).size(), 1u);

  OperatorSource<float> heads;
  heads.array = uniform_tensor({2, 3, 3}, 4);
  heads.name = "M";
  const auto two = layer_stack(heads, random, 3, 1, 1);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_EQ(two[0].heads, 2);
  EXPECT_EQ(two[0].relevance, heads.array.values());
  EXPECT_EQ(two[0].content.size(), 18u);

  auto message = [](const OperatorSource<float>& m, const OperatorSource<float>& f,
                    std::int64_t layers) {
    try {
      layer_stack(m, f, 3, layers, 0);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  OperatorSource<float> three = heads;
  three.array = uniform_tensor({3, 3, 3}, 5);
  three.name = "F";
  EXPECT_EQ(message(heads, three, 1), "F has 3 heads, expected 2 (the heads of M)");
  OperatorSource<float> wrong = heads;
  wrong.array = uniform_tensor({4, 4}, 6);
  EXPECT_NE(message(wrong, identity, 1).find("M has shape (4, 4)"), std::string::npos);
  OperatorSource<float> stack = heads;
  stack.array = uniform_tensor({2, 1, 3, 3}, 7);
  EXPECT_EQ(message(stack, identity, 3),
            "M holds 2 layers, expected 3 (one per layer of the stack)");
  EXPECT_EQ(message(stack, identity, 2), "no error");
}

}  // namespace
}  // namespace emflow::flow

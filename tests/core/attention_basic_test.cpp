#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

namespace emflow {
namespace {

using testing::Buffers;
using testing::Problem;

// One token, identity operators: the only key is the query itself, p = 1, delta = F x = x.
TEST(AttentionBasic, SingleTokenUpdateIsItsContent) {
  Problem p = Problem::random(1, 1, 3, 1, 11);
  p.relevance = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  p.content = {2, 0, 0, 0, 2, 0, 0, 0, 2};
  Buffers<double> buf(p);
  attend(buf.input, buf.output, {Device::reference});
  for (int a = 0; a < 3; ++a) EXPECT_DOUBLE_EQ(buf.update[a], 2.0 * p.cloud[a]);
  EXPECT_DOUBLE_EQ(buf.lse[0],
                   p.cloud[0] * p.cloud[0] + p.cloud[1] * p.cloud[1] + p.cloud[2] * p.cloud[2]);
  EXPECT_DOUBLE_EQ(buf.entropy[0], 0.0);
}

TEST(AttentionBasic, RejectsZeroTokensNamingTheArgument) {
  Problem p = Problem::random(1, 2, 2, 1, 3);
  Buffers<double> buf(p);
  buf.input.tokens = 0;
  EXPECT_TRUE(testing::throws_error([&] { attend(buf.input, buf.output, {Device::reference}); },
                                    ErrorCode::invalid_argument, {"'tokens'"}));
}

}  // namespace
}  // namespace emflow

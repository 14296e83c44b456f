// emflow::attend refuses every invalid input before touching memory, with
// ErrorCode::invalid_argument and a message naming the argument, the expectation and the actual
// value. Each case starts from a valid problem and breaks one thing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

namespace emflow {
namespace {

using testing::Buffers;
using testing::Problem;

constexpr std::int64_t kHuge = std::int64_t{1} << 32;  // its square overflows int64

// A valid problem: 2 clouds of 3 tokens in d = 2, 2 heads, causal, with every optional output.
Problem valid_problem() {
  Problem p = Problem::random(2, 3, 2, 2, 5);
  p.key_bias = true;
  p.offset = true;
  p.mask = Mask::causal();
  p.key_lengths = {3, 2};
  return p;
}

struct Case {
  std::string name;
  std::string argument;  // what the message must name
  std::string detail;    // and a fragment of the expectation or actual value
  std::function<void(Buffers<double>&)> breaks;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

class AttendRejects : public ::testing::TestWithParam<Case> {};

TEST_P(AttendRejects, NamingTheArgument) {
  const Case& c = GetParam();
  const Problem p = valid_problem();
  Buffers<double> buf(p, /*with_weights=*/true);
  ASSERT_NO_THROW(attend(buf.input, buf.output, {Device::reference}));
  c.breaks(buf);
  try {
    attend(buf.input, buf.output, {Device::reference});
    FAIL() << "expected emflow::Error naming '" << c.argument << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << message;
    EXPECT_NE(message.find("'" + c.argument + "'"), std::string::npos) << message;
    EXPECT_NE(message.find(c.detail), std::string::npos) << message;
    EXPECT_EQ(message.rfind("attend: ", 0), 0u) << message;
  }
}

// Pointers to a tiny buffer with sizes that would overflow: validation must refuse them before
// any backend forms an index.
INSTANTIATE_TEST_SUITE_P(InvalidInput, AttendRejects,
                         ::testing::
                             Values(Case{"zero_batch", "batch", "got 0",
                                         [](auto& b) { b.input.batch = 0; }},
                                    Case{"negative_batch", "batch", "got -3",
                                         [](auto& b) { b.input.batch = -3; }},
                                    Case{"zero_tokens", "tokens", "got 0",
                                         [](auto& b) { b.input.tokens = 0; }},
                                    Case{"negative_tokens", "tokens", "got -1",
                                         [](auto& b) { b.input.tokens = -1; }},
                                    Case{"zero_dim", "dim", "got 0",
                                         [](auto& b) { b.input.dim = 0; }},
                                    Case{"negative_dim", "dim", "got -2",
                                         [](auto& b) { b.input.dim = -2; }},
                                    Case{"zero_heads", "heads", "got 0",
                                         [](auto& b) { b.input.layer.heads = 0; }},
                                    Case{"negative_heads", "heads", "got -1",
                                         [](auto& b) { b.input.layer.heads = -1; }},
                                    Case{"cloud_size_overflows", "cloud", "overflows",
                                         [](auto& b) {
                                           b.input.batch = kHuge;
                                           b.input.tokens = kHuge;
                                           b.input.key_lengths = nullptr;
                                         }},
                                    Case{"operator_size_overflows", "relevance", "overflows",
                                         [](auto& b) { b.input.dim = kHuge; }},
                                    Case{"row_count_overflows", "lse", "overflows",
                                         [](auto& b) {
                                           b.input.batch = kHuge / 2;
                                           b.input.layer.heads = kHuge / 2;
                                           b.input.tokens = 8;
                                           b.input.key_lengths = nullptr;
                                         }},
                                    Case{"weights_size_overflows", "weights", "overflows",
                                         [](auto& b) {
                                           b.input.batch = 1;
                                           b.input.tokens = kHuge;
                                           b.input.key_lengths = nullptr;
                                         }},
                                    Case{"null_cloud", "cloud", "must not be null",
                                         [](auto& b) { b.input.cloud = nullptr; }},
                                    Case{"null_relevance", "relevance", "must not be null",
                                         [](auto& b) { b.input.layer.relevance = nullptr; }},
                                    Case{"null_content", "content", "must not be null",
                                         [](auto& b) { b.input.layer.content = nullptr; }},
                                    Case{"null_update", "update", "must not be null",
                                         [](auto& b) { b.output.update = nullptr; }},
                                    Case{"nan_beta", "beta", "finite",
                                         [](auto& b) {
                                           b.input.beta = std::numeric_limits<double>::quiet_NaN();
                                         }},
                                    Case{"infinite_beta", "beta", "inf",
                                         [](auto& b) {
                                           b.input.beta = std::numeric_limits<double>::infinity();
                                         }},
                                    Case{"negative_infinite_beta", "beta", "-inf",
                                         [](auto& b) {
                                           b.input.beta = -std::numeric_limits<double>::infinity();
                                         }},
                                    Case{"window_zero", "mask", "got 0",
                                         [](auto& b) { b.input.mask = Mask::sliding_window(0); }},
                                    Case{
                                        "window_negative", "mask", "got -4",
                                        [](auto& b) { b.input.mask = Mask::sliding_window(-4); }},
                                    Case{
                                        "key_length_negative", "key_lengths", "got -1",
                                        [](auto& b) {
                                          static const std::int64_t lengths[] = {3, -1};
                                          b.input.key_lengths = lengths;
                                        }},
                                    Case{"key_length_beyond_tokens", "key_lengths", "[0, 3], got 4",
                                         [](auto& b) {
                                           static const std::int64_t lengths[] = {4, 1};
                                           b.input.key_lengths = lengths;
                                         }},
                                    // Outputs are written while inputs are read: no aliasing.
                                    Case{"update_in_place_of_cloud", "update",
                                         "shares memory with cloud",
                                         [](auto& b) { b.output.update = b.cloud.data(); }},
                                    Case{
                                        "update_over_offset", "update", "shares memory with offset",
                                        [](auto& b) {
                                          b.input.layer.offset = b.update.data() + 1;
                                        }},
                                    Case{"entropy_overlaps_lse", "entropy",
                                         "shares memory with lse",
                                         [](auto& b) { b.output.entropy = b.output.lse + 3; }},
                                    Case{"weights_over_update", "weights",
                                         "shares memory with update",
                                         [](auto& b) { b.output.update = b.weights.data() + 5; }}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

TEST(AttendValidation, AdjacentBuffersAreNotAnOverlap) {
  // One allocation holding the cloud and, right after its last element, the update.
  const Problem p = Problem::random(1, 5, 3, 1, 9);
  Buffers<double> buf(p);
  attend(buf.input, buf.output, {Device::reference});
  const std::vector<double> expected = buf.update;
  std::vector<double> joint(buf.cloud);
  joint.resize(2 * buf.cloud.size(), std::nan(""));
  AttentionInput<double> input = buf.input;
  input.cloud = joint.data();
  AttentionOutput<double> output;
  output.update = joint.data() + buf.cloud.size();
  attend(input, output, {Device::reference});
  EXPECT_EQ(std::vector<double>(joint.begin() + static_cast<std::ptrdiff_t>(buf.cloud.size()),
                                joint.end()),
            expected);
}

TEST(AttendValidation, NegativeThreadCountIsRefused) {
  const Problem p = valid_problem();  // Buffers points into p's key lengths
  Buffers<double> buf(p);
  ExecutionOptions options;
  options.device = Device::reference;
  options.threads = -2;
  EXPECT_TRUE(testing::throws_error([&] { attend(buf.input, buf.output, options); },
                                    ErrorCode::invalid_argument, {"'threads'"}));
}

// Every optional pointer may be null; key lengths at the ends of [0, N] are valid.
TEST(AttendValidation, AcceptsAbsentOptionalsAndBoundaryKeyLengths) {
  Problem p = valid_problem();
  p.key_bias = false;
  p.offset = false;
  p.key_lengths = {0, 3};
  Buffers<double> buf(p, /*with_weights=*/false, /*with_stats=*/false);
  EXPECT_NO_THROW(attend(buf.input, buf.output, {Device::reference}));
  for (std::size_t e = 0; e < 6; ++e) EXPECT_EQ(buf.update[e], 0.0);  // cloud 0: no keys
  for (double x : buf.update) EXPECT_FALSE(std::isnan(x));
  EXPECT_NO_THROW(validate(buf.input, buf.output));
}

// float inputs go through the same checks (validate is instantiated for float too).
TEST(AttendValidation, FloatInputsAreCheckedAlike) {
  const Problem p = valid_problem();
  Buffers<float> buf(p);
  buf.input.beta = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(attend(buf.input, buf.output, {Device::reference}), Error);
  Buffers<float> nulls(p);
  nulls.input.layer.content = nullptr;
  EXPECT_TRUE(testing::throws_error([&] { attend(nulls.input, nulls.output, {Device::reference}); },
                                    ErrorCode::invalid_argument, {"'content'"}));
}

// The validation happens once for every device: the cpu backend refuses the same input.
TEST(AttendValidation, CpuDeviceRefusesTheSameInput) {
  const Problem p = valid_problem();
  Buffers<double> buf(p);
  buf.input.mask = Mask::sliding_window(0);
  EXPECT_TRUE(testing::throws_error([&] { attend(buf.input, buf.output, {Device::cpu}); },
                                    ErrorCode::invalid_argument, {"'mask'"}));
}

}  // namespace
}  // namespace emflow

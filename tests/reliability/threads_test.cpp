// Thread counts: every entry point that takes one refuses a count below 0 or above
// emflow::max_threads() with an error naming 'threads', before any work (an OpenMP team of
// 100000 threads used to crash inside libgomp), and runs at max_threads() itself.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"
#include "emflow/flow.hpp"
#include "emflow/partial.hpp"
#include "emflow/sdpa.hpp"
#include "emflow/types.hpp"

namespace emflow {
namespace {

// A small causal problem: B 1, N 6, d 2, one head, M = F = I.
struct Small {
  std::vector<float> cloud{1, 0, 0, 1, 1, 1, -1, 0, 0, -1, 0.5f, 0.5f};
  std::vector<float> identity{1, 0, 0, 1};
  std::vector<float> update = std::vector<float>(12, 0.0f);
  std::vector<float> heads = std::vector<float>(12, 0.0f);
  std::vector<float> lse = std::vector<float>(6, 0.0f);
  std::vector<float> entropy = std::vector<float>(6, 0.0f);

  AttentionInput<float> input() const {
    AttentionInput<float> in;
    in.cloud = cloud.data();
    in.tokens = 6;
    in.dim = 2;
    in.layer.relevance = identity.data();
    in.layer.content = identity.data();
    in.mask = Mask::causal();
    return in;
  }
  FactoredLayer<float> factored() const {
    FactoredLayer<float> layer;
    layer.rank = 2;
    layer.query_factor = layer.key_factor = layer.content_up = layer.content_down = identity.data();
    return layer;
  }
};

// Every entry point with a thread count, called with `threads`.
std::vector<std::pair<std::string, std::function<void(int)>>> entry_points(Small& p) {
  return {
      {"attend",
       [&p](int t) {
         attend(p.input(), AttentionOutput<float>{p.update.data()}, {Device::cpu, t});
       }},
      {"attend_factored",
       [&p](int t) {
         AttentionInput<float> in = p.input();
         in.layer = {};  // the operators come from the factored layer
         attend_factored(in, p.factored(), AttentionOutput<float>{p.update.data()},
                         {Device::cpu, t});
       }},
      {"attend_partial",
       [&p](int t) {
         attend_partial(p.input(),
                        PartialOutput<float>{p.heads.data(), p.lse.data(), p.entropy.data()},
                        {Device::cpu, t});
       }},
      {"sdpa_attend",
       [&p](int t) {
         SdpaInput<float> in;
         in.queries = in.keys = in.values = p.cloud.data();
         in.query_tokens = in.tokens = 6;
         in.rank = in.value_rank = 2;
         in.mask = Mask::causal();
         sdpa_attend(in, SdpaOutput<float>{p.update.data()}, {Device::cpu, t});
       }},
      {"DecodeCache::attend",
       [&p](int t) {
         DecodeCache cache(p.input().layer, 2);
         cache.append(p.cloud.data(), 6);
         cache.attend(p.cloud.data(), 2, Mask::causal(), AttentionOutput<float>{p.update.data()},
                      kAlignToEnd, t);
       }},
      {"run_flow",
       [](int t) {
         const Tensor<double> x =
             flow::initial_clouds<double>(flow::InitialCloud::sphere, 1, 5, 3, 1);
         flow::FlowSettings settings;
         settings.time = 0.2;
         settings.dt = 0.1;
         const auto layer = flow::make_layer<double>(3, flow::OperatorKind::identity,
                                                     flow::OperatorKind::identity, 0);
         flow::run_flow(x, {1.0}, {layer}, settings, {Device::cpu, t});
       }},
      {"phase_diagram",
       [](int t) {
         const flow::PhaseSettings s{4, 2, 1.0, 2.0, 2, 0.2, 0.1, 3, 0, 1e-3};
         flow::phase_diagram(s, {Device::cpu, t});
       }},
      {"phase_diagram (generic)",
       [](int t) {
         flow::PhaseSettings s{4, 2, 1.0, 2.0, 2, 0.2, 0.1, 3, 0, 1e-3};
         s.generic = true;
         flow::phase_diagram(s, {Device::cpu, t});
       }},
      {"phase_counts",
       [](int t) {
         const flow::PhaseSettings s{4, 2, 1.0, 2.0, 2, 0.2, 0.1, 3, 0, 1e-3};
         flow::phase_counts(s, 0, 6, {Device::cpu, t});
       }},
  };
}

TEST(ThreadCounts, MaxThreadsIsFourPerCore) {
  const unsigned cores = std::thread::hardware_concurrency();
  EXPECT_EQ(max_threads(), cores == 0 ? 1024 : static_cast<int>(4 * cores));
  EXPECT_EQ(check_threads(0, "op"), 0);
  EXPECT_EQ(check_threads(max_threads(), "op"), max_threads());
  EXPECT_TRUE(testing::throws_error([] { check_threads(std::int64_t{1} << 40, "op"); },
                                    ErrorCode::invalid_argument,
                                    {"op: argument 'threads' must be at most", "1099511627776"}));
}

TEST(ThreadCounts, EveryEntryPointRefusesCountsOutsideTheLimit) {
  Small p;
  for (const auto& [name, call] : entry_points(p)) {
    for (const int threads : {100000, max_threads() + 1, -1}) {
      EXPECT_TRUE(testing::throws_error([&] { call(threads); }, ErrorCode::invalid_argument,
                                        {"argument 'threads'", std::to_string(threads)}))
          << name << " with " << threads << " threads";
    }
  }
}

TEST(ThreadCounts, EveryEntryPointRunsAtTheLimit) {
  Small p;
  for (const auto& [name, call] : entry_points(p)) {
    EXPECT_NO_THROW(call(max_threads())) << name;
  }
  // The causal update of the last query of the small problem is a weighted mean of all tokens:
  // written, not left at zero.
  attend(p.input(), AttentionOutput<float>{p.update.data()}, {Device::cpu, max_threads()});
  EXPECT_NE(p.update[10], 0.0f);
}

}  // namespace
}  // namespace emflow

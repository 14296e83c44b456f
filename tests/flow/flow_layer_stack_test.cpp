// flow::layer_stack, the layers of a run as `emflow flow` builds them: a C++ call of it plus
// run_flow reproduces runs of the tool bit for bit (generated operators seeded per layer and
// head, operator files of every rank, one shared layer or one per layer), and bad shapes are
// refused naming the source.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"

namespace emflow::flow {
namespace {

Tensor<float> uniform_tensor(Shape shape, std::uint64_t seed) {
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

#ifdef EMFLOW_CLI_PATH
class FlowLayerStackCli : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/emflow-layer-stack-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs `emflow flow <arguments> --out T.npy --metrics M.csv` on the CPU; returns the
  // trajectory and the metrics.
  template <class T>
  Tensor<T> run_cli(const std::string& arguments, std::string* metrics) {
    const std::string command = std::string("'") + EMFLOW_CLI_PATH + "' flow " + arguments +
                                " --device cpu --out '" + path("t.npy") + "' --metrics '" +
                                path("m.csv") + "' > /dev/null";
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    std::ifstream in(path("m.csv"));
    std::stringstream text;
    text << in.rdbuf();
    *metrics = text.str();
    return read_npy<T>(path("t.npy"));
  }

  std::string dir_;
};

// The last metrics row as the tool writes it, from the C++ result.
template <class T>
std::string last_row(const FlowResult<T>& r, std::int64_t batch, const std::vector<double>& betas) {
  const std::size_t e = r.observables.size() - 1;
  const Observables& o = r.observables[e];
  auto number = [](double v) {
    char text[40];
    std::snprintf(text, sizeof text, "%.9g", v);
    return std::string(text);
  };
  std::ostringstream row;
  row << r.steps.back() << ',' << number(r.times.back()) << ',' << batch - 1 << ','
      << number(betas.back()) << ',' << number(o.min_inner) << ',' << number(o.mean_inner) << ','
      << number(o.clustered_fraction) << ',' << o.clusters << ',' << number(o.energy) << ','
      << number(o.entropy) << ',' << number(o.diameter);
  return row.str();
}

template <class T>
void expect_same(const FlowResult<T>& cpp, const Tensor<T>& cli, const std::string& metrics,
                 std::int64_t batch, const std::vector<double>& betas) {
  ASSERT_EQ(cpp.trajectory.shape(), cli.shape());
  EXPECT_EQ(std::memcmp(cpp.trajectory.data(), cli.data(), cli.values().size() * sizeof(T)), 0);
  // Not vacuous: the clouds moved.
  const std::int64_t n = cli.size() / cli.extent(0);
  EXPECT_GT(testing::max_abs_difference(
                std::vector<T>(cli.data(), cli.data() + n),
                std::vector<T>(cli.data() + cli.size() - n, cli.data() + cli.size())),
            1e-3);
  const std::string want = last_row(cpp, batch, betas);
  EXPECT_NE(metrics.find(want + "\n"), std::string::npos) << want << "\n" << metrics;
}

TEST_F(FlowLayerStackCli, RandomOperatorsPerLayerReproduceTheTool) {
  std::string metrics;
  const auto cli = run_cli<float>(
      "--tokens 6 --dim 4 --init gaussian --seed 5 --batch 2 --beta 0.5,2 --layers 3 "
      "--m random --f random --norm layernorm --pre-norm",
      &metrics);
  OperatorSource<float> random;
  random.kind = OperatorKind::random;
  FlowSettings s;
  s.layers = 3;
  s.norm = Normalization::layernorm;
  s.pre_norm = true;
  const auto cpp = run_flow(initial_clouds<float>(InitialCloud::gaussian, 2, 6, 4, 5), {0.5, 2.0},
                            layer_stack(random, random, 4, 3, 5), s, testing::on_cpu());
  expect_same(cpp, cli, metrics, 2, {0.5, 2.0});
}

TEST_F(FlowLayerStackCli, OperatorFilesReproduceTheTool) {
  // M: (L, H, d, d) for a stack; F: (H, d, d) shared by its layers; float64 throughout.
  const Tensor<double> m({2, 2, 4, 4}, testing::uniform(64, 8, -0.5, 0.5));
  const Tensor<double> f({2, 4, 4}, testing::uniform(32, 9, -0.5, 0.5));
  write_npy(path("m.npy"), m);
  write_npy(path("f.npy"), f);
  std::string metrics;
  const auto cli = run_cli<double>(
      "--tokens 5 --dim 4 --init sphere --seed 3 --precision float64 "
      "--layers 2 --norm rmsnorm --unnormalized --m '" +
          path("m.npy") + "' --f '" + path("f.npy") + "'",
      &metrics);
  OperatorSource<double> relevance, content;
  relevance.array = read_npy<double>(path("m.npy"));
  content.array = read_npy<double>(path("f.npy"));
  FlowSettings s;
  s.layers = 2;
  s.norm = Normalization::rmsnorm;
  s.unnormalized = true;
  const auto cpp = run_flow(initial_clouds<double>(InitialCloud::sphere, 1, 5, 4, 3), {1.0},
                            layer_stack(relevance, content, 4, 2, 3), s, testing::on_cpu());
  expect_same(cpp, cli, metrics, 1, {1.0});
}

TEST_F(FlowLayerStackCli, ContinuousRunWithARandomRelevanceReproducesTheTool) {
  std::string metrics;
  const auto cli = run_cli<float>(
      "--tokens 8 --dim 3 --seed 7 --batch 3 --beta 1,1,3 --m random --f minus-identity "
      "--time 0.5 --dt 0.1 --record-every 2",
      &metrics);
  OperatorSource<float> relevance, content;
  relevance.kind = OperatorKind::random;
  content.kind = OperatorKind::minus_identity;
  FlowSettings s = testing::continuous(0.5, 0.1, Integrator::rk4, true);
  s.record_every = 2;
  const auto cpp =
      run_flow(initial_clouds<float>(InitialCloud::sphere, 3, 8, 3, 7), {1.0, 1.0, 3.0},
               layer_stack(relevance, content, 3, 1, 7), s, testing::on_cpu());
  expect_same(cpp, cli, metrics, 3, {1.0, 1.0, 3.0});
}
#endif

}  // namespace
}  // namespace emflow::flow

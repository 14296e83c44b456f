// emflow flow and emflow phase through the binary: output shapes, CSV headers and rows, PNG
// files, bad arguments refused with one line naming the option and no output file, and runs of
// the tool reproduced bit for bit from C++ (flow::layer_stack and run_flow).
#include <gtest/gtest.h>
#include <sys/wait.h>
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
#include "emflow/flow.hpp"
#include "emflow/io.hpp"

namespace emflow::flow {
namespace {

#ifdef EMFLOW_CLI_PATH
class FlowCli : public ::testing::Test {
 public:
  void SetUp() override {
    char pattern[] = "/tmp/emflow-flow-cli-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs `emflow <arguments>` with stdout and stderr captured; returns the exit status.
  int run(const std::string& arguments) {
    const std::string command = std::string("'") + EMFLOW_CLI_PATH + "' " + arguments + " > '" +
                                path("stdout") + "' 2> '" + path("stderr") + "'";
    const int status = std::system(command.c_str());
    stdout_ = read(path("stdout"));
    stderr_ = read(path("stderr"));
    std::remove(path("stdout").c_str());
    std::remove(path("stderr").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  static std::string read(const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  static bool exists(const std::string& file) { return access(file.c_str(), F_OK) == 0; }
  static std::vector<std::string> lines(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }
  static bool is_png(const std::string& file) {
    const std::string bytes = read(file);
    return bytes.size() > 1000 && bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
  }

  std::string dir_, stdout_, stderr_;
};

TEST_F(FlowCli, ContinuousRunWritesTrajectoryMetricsAndPicture) {
  ASSERT_EQ(run("flow --tokens 8 --dim 3 --init sphere --seed 2 --batch 2 --time 1 --dt 0.1 "
                "--integrator rk4 --norm sphere --beta 1,4 --record-every 2 --device cpu --out " +
                path("t.npy") + " --metrics " + path("m.csv") + " --plot " + path("f.png")),
            0)
      << stderr_;
  EXPECT_EQ(stderr_, "");  // no progress bar when stderr is not a terminal
  const NpyHeader header = read_npy_header(path("t.npy"));
  EXPECT_EQ(header.shape, (Shape{6, 2, 8, 3}));  // steps 0, 2, 4, 6, 8, 10
  EXPECT_EQ(header.dtype, Dtype::float32);
  const auto rows = lines(read(path("m.csv")));
  ASSERT_EQ(rows.size(), 1u + 6u * 2u);
  EXPECT_EQ(rows[0],
            "step,time,cloud,beta,min_inner,mean_inner,clustered_fraction,clusters,energy,"
            "entropy,diameter");
  EXPECT_EQ(rows[1].substr(0, 8), "0,0,0,1,");
  EXPECT_EQ(rows[2].substr(0, 8), "0,0,1,4,");
  EXPECT_EQ(rows.back().substr(0, 9), "10,1,1,4,");
  EXPECT_TRUE(is_png(path("f.png")));
  EXPECT_NE(stdout_.find("emflow flow:"), std::string::npos);
}

TEST_F(FlowCli, LayerStackInDoublePrecisionAndFromFiles) {
  ASSERT_EQ(run("flow --tokens 6 --dim 4 --init gaussian --layers 4 --norm layernorm --pre-norm "
                "--m random --f minus-identity --precision float64 --out " +
                path("t.npy") + " --metrics " + path("m.csv")),
            0)
      << stderr_;
  const auto header = read_npy_header(path("t.npy"));
  EXPECT_EQ(header.shape, (Shape{5, 1, 6, 4}));
  EXPECT_EQ(header.dtype, Dtype::float64);
  EXPECT_EQ(lines(read(path("m.csv")))[0].substr(0, 17), "step,layer,cloud,");

  // The recorded final cloud as --x, operators from files with two heads.
  const auto trajectory = read_npy<double>(path("t.npy"));
  Tensor<double> cloud({6, 4});
  std::copy(trajectory.data() + 4 * 24, trajectory.data() + 5 * 24, cloud.data());
  write_npy(path("x.npy"), cloud);
  Tensor<double> heads({2, 4, 4});
  for (int h = 0; h < 2; ++h)
    for (int a = 0; a < 4; ++a) heads[h * 16 + a * 5] = 0.5;
  write_npy(path("m.npy"), heads);
  ASSERT_EQ(
      run("flow --x " + path("x.npy") + " --batch 3 --beta 0.5,1,2 --m " + path("m.npy") + " --f " +
          path("m.npy") + " --time 0.5 --dt 0.1 --integrator euler --out " + path("t2.npy")),
      0)
      << stderr_;
  const auto header2 = read_npy_header(path("t2.npy"));
  EXPECT_EQ(header2.shape, (Shape{6, 3, 6, 4}));
  EXPECT_EQ(header2.dtype, Dtype::float64);
}

TEST_F(FlowCli, PhaseWritesTableAndPicture) {
  ASSERT_EQ(run("phase --tokens 8 --dim 2 --betas 0.5:4:3 --time 1 --dt 0.1 --clouds 5 --seed 1 "
                "--device cpu --out " +
                path("p.csv") + " --plot " + path("p.png")),
            0)
      << stderr_;
  EXPECT_EQ(stderr_, "");
  const auto rows = lines(read(path("p.csv")));
  ASSERT_EQ(rows.size(), 1u + 11u * 3u);
  EXPECT_EQ(rows[0], "time,beta,clustered_fraction");
  EXPECT_EQ(rows[1].substr(0, 6), "0,0.5,");
  EXPECT_EQ(rows[3].substr(0, 4), "0,4,");
  EXPECT_EQ(rows.back().substr(0, 4), "1,4,");
  EXPECT_TRUE(is_png(path("p.png")));
}

TEST_F(FlowCli, BadArgumentsFailWithOneLineAndNoFiles) {
  const std::string outputs =
      " --out " + path("o.npy") + " --metrics " + path("o.csv") + " --plot " + path("o.png");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"flow --tokens 1" + outputs, "--tokens"},
      {"flow --time 1 --dt -0.1" + outputs, "--dt"},
      {"flow --time 0" + outputs, "--time"},
      {"flow --norm layernorm --time 1" + outputs, "--norm"},
      {"flow --norm batchnorm --layers 2" + outputs, "--norm"},
      {"flow --pre-norm --time 1" + outputs, "--pre-norm"},
      {"flow --layers 0" + outputs, "--layers"},
      {"flow --layers 2 --dt 0.1" + outputs, "--dt"},
      {"flow --integrator leapfrog" + outputs, "--integrator"},
      {"flow --init orthonormal --tokens 5 --dim 3" + outputs, "--init"},
      {"flow --init lattice" + outputs, "--init"},
      {"flow --m " + path("missing.npy") + outputs, "--m"},
      {"flow --f nonsense" + outputs, "--f"},
      {"flow --beta 0" + outputs, "--beta"},
      {"flow --batch 2 --beta 1,2,3" + outputs, "--beta"},
      {"flow --record-every 0" + outputs, "--record-every"},
      {"flow --device gpu" + outputs, "--device"},
      {"flow --precision float16" + outputs, "--precision"},
      {"flow --x " + path("missing.npy") + outputs, "--x"},
      {"flow --x " + path("a.npy") + " --tokens 4" + outputs, "--x"},
      {"phase --betas 2:1:3 --plot " + path("o.png") + " --out " + path("o.csv"), "--betas"},
      {"phase --betas 1:2 --plot " + path("o.png"), "--betas"},
      {"phase --clouds 0 --plot " + path("o.png"), "--clouds"},
      {"phase --tokens 1 --plot " + path("o.png"), "--tokens"},
      {"phase --dt 0 --plot " + path("o.png"), "--dt"},
      {"phase --time -3 --plot " + path("o.png"), "--time"},
  };
  for (const auto& [arguments, option] : cases) {
    EXPECT_NE(run(arguments), 0) << arguments;
    const auto message = lines(stderr_);
    ASSERT_EQ(message.size(), 1u) << arguments << "\n" << stderr_;
    EXPECT_NE(message[0].find(option), std::string::npos) << arguments << "\n" << message[0];
    EXPECT_EQ(message[0].rfind("emflow", 0), 0u) << message[0];
    for (const char* name : {"o.npy", "o.csv", "o.png"}) {
      EXPECT_FALSE(exists(path(name))) << arguments << " left " << name;
    }
  }
  // An output folder that does not exist fails before any work.
  EXPECT_NE(run("flow --out " + path("no/such/dir/t.npy")), 0);
  EXPECT_NE(stderr_.find("--out"), std::string::npos) << stderr_;
}

// ---------------------------------------------------------------------------------------------
// flow::layer_stack plus run_flow reproduce `emflow flow` runs bit for bit.

// Runs `emflow flow <arguments>` on the CPU with --out and --metrics; returns the trajectory and
// the metrics.
template <class T>
Tensor<T> run_cli(FlowCli& cli, const std::string& arguments, std::string* metrics) {
  EXPECT_EQ(cli.run("flow " + arguments + " --device cpu --out " + cli.path("t.npy") +
                    " --metrics " + cli.path("m.csv")),
            0)
      << arguments;
  *metrics = FlowCli::read(cli.path("m.csv"));
  return read_npy<T>(cli.path("t.npy"));
}

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

TEST_F(FlowCli, RandomOperatorsPerLayerReproduceTheTool) {
  std::string metrics;
  const auto cli = run_cli<float>(
      *this,
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

TEST_F(FlowCli, OperatorFilesReproduceTheTool) {
  // M: (L, H, d, d) for a stack; F: (H, d, d) shared by its layers; float64 throughout.
  const Tensor<double> m({2, 2, 4, 4}, testing::uniform(64, 8, -0.5, 0.5));
  const Tensor<double> f({2, 4, 4}, testing::uniform(32, 9, -0.5, 0.5));
  write_npy(path("m.npy"), m);
  write_npy(path("f.npy"), f);
  std::string metrics;
  const auto cli = run_cli<double>(*this,
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

TEST_F(FlowCli, ContinuousRunWithARandomRelevanceReproducesTheTool) {
  std::string metrics;
  const auto cli = run_cli<float>(
      *this,
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

// emflow flow and emflow phase through the binary: output shapes, CSV headers and rows, PNG
// files, and bad arguments refused with one line naming the option and no output file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "emflow/io.hpp"

namespace {

#ifdef EMFLOW_CLI_PATH
class FlowCli : public ::testing::Test {
 protected:
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
  const emflow::NpyHeader header = emflow::read_npy_header(path("t.npy"));
  EXPECT_EQ(header.shape, (emflow::Shape{6, 2, 8, 3}));  // steps 0, 2, 4, 6, 8, 10
  EXPECT_EQ(header.dtype, emflow::Dtype::float32);
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
  const auto header = emflow::read_npy_header(path("t.npy"));
  EXPECT_EQ(header.shape, (emflow::Shape{5, 1, 6, 4}));
  EXPECT_EQ(header.dtype, emflow::Dtype::float64);
  EXPECT_EQ(lines(read(path("m.csv")))[0].substr(0, 17), "step,layer,cloud,");

  // The recorded final cloud as --x, operators from files with two heads.
  const auto trajectory = emflow::read_npy<double>(path("t.npy"));
  emflow::Tensor<double> cloud({6, 4});
  std::copy(trajectory.data() + 4 * 24, trajectory.data() + 5 * 24, cloud.data());
  emflow::write_npy(path("x.npy"), cloud);
  emflow::Tensor<double> heads({2, 4, 4});
  for (int h = 0; h < 2; ++h)
    for (int a = 0; a < 4; ++a) heads[h * 16 + a * 5] = 0.5;
  emflow::write_npy(path("m.npy"), heads);
  ASSERT_EQ(
      run("flow --x " + path("x.npy") + " --batch 3 --beta 0.5,1,2 --m " + path("m.npy") + " --f " +
          path("m.npy") + " --time 0.5 --dt 0.1 --integrator euler --out " + path("t2.npy")),
      0)
      << stderr_;
  const auto header2 = emflow::read_npy_header(path("t2.npy"));
  EXPECT_EQ(header2.shape, (emflow::Shape{6, 3, 6, 4}));
  EXPECT_EQ(header2.dtype, emflow::Dtype::float64);
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
#endif

}  // namespace

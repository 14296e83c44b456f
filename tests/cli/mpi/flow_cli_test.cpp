// `mpirun -np P emflow flow ... --distributed` against `emflow flow ...` in one process: the same
// trajectory (to rounding) and metrics (counts exactly, the rest to rounding) for continuous time
// and stacks, a --x file and generated clouds, float and double, at 1 to 4 ranks; the same bytes
// on a rerun; a failure on one rank reported once with nothing written; the options that cannot
// work across ranks refused by name. The flow has no mask and no key lengths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/io.hpp"

namespace emflow::testing {
namespace {

struct Case {
  int ranks;
  std::string name;
  std::string options;  // everything but the outputs
  bool float64;
};

std::size_t occurrences(const std::string& text, const std::string& part) {
  std::size_t count = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++count;
  }
  return count;
}

std::vector<std::vector<std::string>> csv_rows(const std::string& text) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::istringstream fields(line);
    for (std::string cell; std::getline(fields, cell, ',');) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

class DistributedFlowCli : public CliFolder {
 protected:
  DistributedFlowCli() : CliFolder("emflow-distributed-flow-cli") {}

  template <class T>
  void write_inputs(double nan_at = -1) {
    Tensor<double> x = random_tensor({3, 21, 4}, 21);
    if (nan_at >= 0) x[static_cast<std::int64_t>(nan_at)] = std::nan("");
    write_npy(path("x.npy"), convert<T>(x));
    write_npy(path("x1.npy"), convert<T>(random_tensor({17, 3}, 22)));
    write_npy(path("f.npy"), convert<T>(random_tensor({2, 4, 4}, 23, -0.5, 0.5)));
  }

  std::string with_files(const std::string& options) const {
    std::string text = options;
    for (const char* name : {"x1.npy", "x.npy", "f.npy"}) {
      const std::string key = std::string("@") + name;
      for (std::size_t at = text.find(key); at != std::string::npos; at = text.find(key)) {
        text.replace(at, key.size(), "'" + path(name) + "'");
      }
    }
    return text;
  }

  CliRun run(const Case& c, const std::string& tag, int ranks) {
    const std::string outputs = " --out '" + path("traj" + tag + ".npy") + "' --metrics '" +
                                path("metrics" + tag + ".csv") + "' --threads 1";
    return run_cli("flow " + with_files(c.options) + outputs + (ranks > 0 ? " --distributed" : ""),
                   path("stderr.txt"), ranks > 0 ? mpirun_prefix(ranks) : "");
  }

  template <class T>
  void check(const Case& c) {
    write_inputs<T>();
    const CliRun one = run(c, "1", 0);
    ASSERT_EQ(one.status, 0) << one.err;
    const CliRun many = run(c, "P", c.ranks);
    ASSERT_EQ(many.status, 0) << many.err;
    const double tolerance = sizeof(T) == 4 ? 1e-6 : 1e-12;
    const Tensor<T> x = read_npy<T>(path("traj1.npy")), y = read_npy<T>(path("trajP.npy"));
    EXPECT_EQ(x.shape(), y.shape());
    EXPECT_TRUE(close_to(y.values(), x.values(), tolerance));
    // The metrics: step, time, cloud, beta and the counts (clustered fraction, clusters) exactly;
    // the sums to rounding (the energy scales the state's by beta |<x_i, x_j>|), and to the
    // 9 digits the file holds.
    const auto a = csv_rows(text_of("metrics1.csv")), b = csv_rows(text_of("metricsP.csv"));
    ASSERT_EQ(a.size(), b.size());
    ASSERT_GT(a.size(), 2u);
    EXPECT_EQ(a[0], b[0]);
    for (std::size_t r = 1; r < a.size(); ++r) {
      ASSERT_EQ(a[r].size(), 11u);
      ASSERT_EQ(b[r].size(), 11u);
      for (const std::size_t exact : {0, 1, 2, 3, 6, 7}) EXPECT_EQ(a[r][exact], b[r][exact]) << r;
      for (const std::size_t near : {4, 5, 8, 9, 10}) {
        const double u = std::strtod(a[r][near].c_str(), nullptr);
        const double v = std::strtod(b[r][near].c_str(), nullptr);
        EXPECT_NEAR(u, v, (sizeof(T) == 4 ? 1e-5 : 1e-8) * std::max(1.0, std::abs(u)))
            << "row " << r << " column " << a[0][near];
      }
    }
    if (c.ranks != 3) return;
    const CliRun again = run(c, "Q", c.ranks);
    ASSERT_EQ(again.status, 0) << again.err;
    EXPECT_EQ(text_of("trajP.npy"), text_of("trajQ.npy"));
    EXPECT_EQ(text_of("metricsP.csv"), text_of("metricsQ.csv"));
  }
};

class DistributedFlowCliCases : public DistributedFlowCli,
                                public ::testing::WithParamInterface<Case> {};

TEST_P(DistributedFlowCliCases, SameFilesAsOneProcess) {
  in_precision(GetParam().float64, [&](auto zero) { check<decltype(zero)>(GetParam()); });
}

std::vector<Case> cases() {
  // Continuous time on the sphere from a file of three clouds, a random M and a file F of two
  // heads; a USA stack of rmsnorm layers from one cloud run at two temperatures; a pre-norm
  // layernorm stack of generated clouds in double.
  const Case sphere{0, "sphere_file",
                    "--x @x.npy --m random --f @f.npy --beta 1,2,0.5 --time 0.6 --dt 0.2 "
                    "--record-every 2",
                    false};
  const Case usa{0, "usa_rmsnorm_batch",
                 "--x @x1.npy --batch 2 --beta 0.7,1.4 --layers 3 --norm rmsnorm --unnormalized "
                 "--m random --f random",
                 false};
  const Case stack{0, "layernorm_generated",
                   "--tokens 19 --dim 5 --batch 2 --init gaussian --seed 4 --precision float64 "
                   "--layers 3 --norm layernorm --pre-norm --m random --f random --beta 1.5",
                   true};
  // Each run starts mpirun (about half a second): a few rank counts per case, the rerun once.
  std::vector<Case> out;
  for (const auto& [c, ranks] : {std::pair{sphere, 1}, {sphere, 3}, {usa, 2}, {stack, 4}}) {
    out.push_back(c);
    out.back().ranks = ranks;
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ranks, DistributedFlowCliCases, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           return "np" + std::to_string(info.param.ranks) + "_" + info.param.name;
                         });

TEST_F(DistributedFlowCli, ANonFiniteRowOnTheLastRankIsOneErrorOnEveryRank) {
  // Row 20 of cloud 2 (element [2, 20, 1]) lies in the last rank's contiguous shard.
  write_inputs<float>((2 * 21 + 20) * 4 + 1);
  const Case c{3, "nan", "--x @x.npy --time 0.2 --check-finite", false};
  const CliRun failed = run(c, "P", 3);
  EXPECT_EQ(failed.status, 1) << failed.err;
  EXPECT_EQ(occurrences(failed.err, "emflow: error: rank 2: --x '"), 1u) << failed.err;
  EXPECT_NE(failed.err.find("element [2, 20, 1] is nan"), std::string::npos) << failed.err;
  EXPECT_FALSE(std::filesystem::exists(path("trajP.npy")));
  EXPECT_FALSE(std::filesystem::exists(path("metricsP.csv")));
}

TEST_F(DistributedFlowCli, OptionsThatCannotRunAcrossRanksAreRefusedByName) {
  write_inputs<float>();
  // A failing mpirun takes seconds to end the job: one refusal here, the device (--generate and
  // --model are refused by the same agreed check before anything runs).
  const std::pair<const char*, const char*> refused[] = {
      {"--x @x.npy --time 0.2 --device cuda", "--device with --distributed must be cpu"}};
  for (const auto& [options, message] : refused) {
    const CliRun failed = run({2, "refused", options, false}, "P", 2);
    EXPECT_EQ(failed.status, 1) << failed.err;
    EXPECT_EQ(occurrences(failed.err, "emflow: error: "), 1u) << failed.err;
    EXPECT_NE(failed.err.find(message), std::string::npos) << failed.err;
    EXPECT_FALSE(std::filesystem::exists(path("trajP.npy")));
  }
}

}  // namespace
}  // namespace emflow::testing

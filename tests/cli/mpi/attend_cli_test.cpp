// `mpirun -np P emflow attend ... --distributed` against `emflow attend ...` in one process: the
// same files (to rounding) for every mask, ragged batches, float and double at 1 to 4 ranks,
// the same bits on a rerun, and a failure on one rank reported once, with no output written.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/io.hpp"

namespace emflow::testing {
namespace {

struct Case {
  int ranks;
  std::string mask;
  bool float64;
};

class DistributedAttendCli : public CliFolder {
 protected:
  DistributedAttendCli() : CliFolder("emflow-distributed-cli") {}

  template <class T>
  void write_inputs(std::int64_t nan_row = -1) {
    constexpr std::int64_t B = 3, N = 41, d = 6, H = 2;
    Tensor<double> x = random_tensor({B, N, d}, 11);
    if (nan_row >= 0) x[(2 * N + nan_row) * d + 1] = std::nan("");
    write_npy(path("x.npy"), convert<T>(x));
    write_npy(path("m.npy"), convert<T>(random_tensor({H, d, d}, 12, -0.6, 0.6)));
    write_npy(path("f.npy"), convert<T>(random_tensor({H, d, d}, 13, -0.6, 0.6)));
    write_npy(path("u.npy"), convert<T>(random_tensor({H, d}, 14)));
    write_npy(path("c.npy"), convert<T>(random_tensor({d}, 15)));
    write_npy(path("l.npy"), Tensor<std::int64_t>({B}, {N, 0, 23}));
  }

  std::string arguments(const std::string& mask, const std::string& tag) const {
    return "attend --x '" + path("x.npy") + "' --m '" + path("m.npy") + "' --f '" + path("f.npy") +
           "' --key-bias '" + path("u.npy") + "' --offset '" + path("c.npy") + "' --key-lengths '" +
           path("l.npy") + "' --beta 1.3 --mask " + mask + " --out '" +
           path("update" + tag + ".npy") + "' --lse '" + path("lse" + tag + ".npy") +
           "' --entropy '" + path("entropy" + tag + ".npy") + "'";
  }

  CliRun run(const std::string& arguments, int ranks) {
    return run_cli(arguments + (ranks > 0 ? " --distributed" : ""), path("stderr.txt"),
                   ranks > 0 ? mpirun_prefix(ranks) : "");
  }

  template <class T>
  void expect_same_files(const std::string& a, const std::string& b, double tolerance) {
    for (const char* name : {"update", "lse", "entropy"}) {
      const Tensor<T> x = read_npy<T>(path(name + a + ".npy"));
      const Tensor<T> y = read_npy<T>(path(name + b + ".npy"));
      EXPECT_EQ(x.shape(), y.shape()) << name;
      EXPECT_TRUE(close_to(y.values(), x.values(), tolerance)) << name;
    }
  }
  void expect_identical_files(const std::string& a, const std::string& b) {
    for (const char* name : {"update", "lse", "entropy"}) {
      EXPECT_EQ(text_of(name + a + ".npy"), text_of(name + b + ".npy")) << name;
    }
  }

  template <class T>
  void check(const Case& c) {
    write_inputs<T>();
    const CliRun one = run(arguments(c.mask, "1"), 0);
    ASSERT_EQ(one.status, 0) << one.err;
    const CliRun many = run(arguments(c.mask, "P"), c.ranks);
    ASSERT_EQ(many.status, 0) << many.err;
    expect_same_files<T>("1", "P", sizeof(T) == 4 ? 1e-6 : 1e-12);
    const CliRun again = run(arguments(c.mask, "Q"), c.ranks);
    ASSERT_EQ(again.status, 0) << again.err;
    expect_identical_files("P", "Q");
  }
};

class DistributedAttendCliCases : public DistributedAttendCli,
                                  public ::testing::WithParamInterface<Case> {};

TEST_P(DistributedAttendCliCases, SameFilesAsOneProcess) {
  in_precision(GetParam().float64, [&](auto zero) { check<decltype(zero)>(GetParam()); });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const int ranks : {1, 2, 3, 4}) {
    for (const char* mask : {"none", "causal", "window:5"}) {
      out.push_back({ranks, mask, false});
      out.push_back({ranks, mask, true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ranks, DistributedAttendCliCases, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           return "np" + std::to_string(info.param.ranks) + "_" +
                                  name_part(info.param.mask) +
                                  (info.param.float64 ? "_float64" : "_float32");
                         });

std::size_t occurrences(const std::string& text, const std::string& part) {
  std::size_t count = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++count;
  }
  return count;
}

TEST_F(DistributedAttendCli, ANonFiniteRowOnTheLastRankIsOneErrorOnEveryRank) {
  // Row 40 of cloud 2 is held by the last rank under the contiguous layout (mask none).
  write_inputs<float>(40);
  const CliRun failed = run(arguments("none", "P") + " --check-finite", 3);
  EXPECT_EQ(failed.status, 1) << failed.err;
  EXPECT_EQ(occurrences(failed.err, "emflow: error: rank 2: --x '"), 1u) << failed.err;
  EXPECT_NE(failed.err.find("element [2, 40, 1] is nan"), std::string::npos) << failed.err;
  EXPECT_FALSE(std::filesystem::exists(path("updateP.npy")));
}

TEST_F(DistributedAttendCli, AMissingOutputFolderIsReportedOnceAndNothingIsWritten) {
  write_inputs<double>();
  const std::string args = arguments("causal", "P");
  const CliRun failed =
      run(args.substr(0, args.find(" --out")) + " --out '" + path("missing/u.npy") + "'", 4);
  EXPECT_EQ(failed.status, 1) << failed.err;
  EXPECT_EQ(occurrences(failed.err, "emflow: error: "), 1u) << failed.err;
  EXPECT_NE(failed.err.find("rank 0: --out"), std::string::npos) << failed.err;
}

TEST_F(DistributedAttendCli, WeightsAreRefusedOnEveryRank) {
  write_inputs<double>();
  const CliRun failed = run(arguments("none", "P") + " --weights '" + path("w.npy") + "'", 2);
  EXPECT_EQ(failed.status, 1) << failed.err;
  EXPECT_EQ(occurrences(failed.err, "emflow: error: "), 1u) << failed.err;
  EXPECT_NE(failed.err.find("--weights is not available with --distributed"), std::string::npos)
      << failed.err;
}

// The options the ring cannot take are refused through the job like every other error: one
// line, from rank 0, with the rank that saw it (they were printed once per rank, unprefixed).
TEST_F(DistributedAttendCli, PrecisionAndQueriesAreRefusedOnceWithTheRank) {
  write_inputs<float>();
  const std::pair<const char*, const char*> refused[] = {
      {" --precision bf16", "rank 0: --precision bf16 is not supported with --distributed"},
      {" --queries x.npy", "rank 0: --queries is not supported with --distributed"}};
  for (const auto& [option, message] : refused) {
    const CliRun failed = run(arguments("none", "P") + option, 2);
    EXPECT_EQ(failed.status, 1) << failed.err;
    EXPECT_EQ(occurrences(failed.err, "emflow: error: "), 1u) << failed.err;
    EXPECT_NE(failed.err.find(message), std::string::npos) << failed.err;
    EXPECT_FALSE(std::filesystem::exists(path("updateP.npy")));
  }
}

}  // namespace
}  // namespace emflow::testing

// `mpirun -np P emflow phase ... --distributed` writes the file of one process byte for byte.
#include <gtest/gtest.h>

#include <string>

#include "common/cli.hpp"

namespace emflow::testing {
namespace {

class DistributedPhaseCli : public CliFolder, public ::testing::WithParamInterface<int> {
 protected:
  DistributedPhaseCli() : CliFolder("emflow-distributed-phase") {}
};

TEST_P(DistributedPhaseCli, SameCsvAsOneProcess) {
  const std::string sweep =
      "phase --betas 0.5:6:9 --clouds 37 --time 3 --dt 0.2 --tokens 10 "
      "--dim 3 --seed 4 --threads 1 --out ";
  const CliRun one = run_cli(sweep + "'" + path("one.csv") + "'", path("stderr.txt"));
  ASSERT_EQ(one.status, 0) << one.err;
#ifdef EMFLOW_MPIEXEC
  const CliRun many = run_cli(sweep + "'" + path("many.csv") + "' --distributed",
                              path("stderr.txt"), mpirun_prefix(GetParam()));
  ASSERT_EQ(many.status, 0) << many.err;
  const std::string expected = text_of("one.csv");
  EXPECT_GT(expected.size(), 1000u);
  EXPECT_EQ(text_of("many.csv"), expected);
#endif
}

INSTANTIATE_TEST_SUITE_P(Ranks, DistributedPhaseCli, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "np" + std::to_string(info.param); });

}  // namespace
}  // namespace emflow::testing

// The emflow binary under hostile input: --check-finite refuses NaN and infinity naming the
// option, the file and the first offending element; outputs too large for memory are refused
// before anything is computed; a refused run leaves no output file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/io.hpp"
#include "emflow/tensor.hpp"

namespace emflow {
namespace {

namespace fs = std::filesystem;

using testing::CliRun;

class CliLimits : public testing::CliFolder {
 protected:
  CliLimits() : CliFolder("emflow_cli_limits_", "out") {}

  template <class T>
  std::string input(const std::string& name, const Shape& shape, double scale = 0.25) {
    Tensor<T> array(shape);
    for (std::int64_t i = 0; i < array.size(); ++i) {
      array[i] = static_cast<T>(scale * std::sin(0.7 * static_cast<double>(i) + 0.1));
    }
    write_npy(path(name), array);
    return path(name);
  }
};

TEST_F(CliLimits, CheckFiniteNamesTheFileAndTheFirstBadElementOfTheCloud) {
  Tensor<float> cloud = read_npy<float>(input<float>("x.npy", {2, 7, 3}));
  cloud[1 * 21 + 5 * 3 + 2] = std::numeric_limits<float>::quiet_NaN();
  cloud[1 * 21 + 6 * 3 + 0] = std::numeric_limits<float>::infinity();  // a later one
  write_npy(path("x.npy"), cloud);
  const std::string m = input<float>("m.npy", {2, 3, 3}), f = input<float>("f.npy", {2, 3, 3});
  const std::string common = "attend --x " + path("x.npy") + " --m " + m + " --f " + f +
                             " --device cpu --out " + path("out/u.npy");

  const CliRun refused = emflow(common + " --check-finite");
  EXPECT_EQ(refused.status, 1) << refused.err;
  EXPECT_EQ(
      refused.err.rfind("emflow: error: --x '" + path("x.npy") + "': element [1, 5, 2] is ", 0), 0u)
      << refused.err;
  EXPECT_NE(refused.err.find("nan"), std::string::npos) << refused.err;
  EXPECT_TRUE(entries("out").empty());

  // Without the option the run goes ahead (the policy: the NaN reaches the queries that see it):
  // cloud 0 is untouched and stays finite.
  const CliRun accepted = emflow(common);
  ASSERT_EQ(accepted.status, 0) << accepted.err;
  const Tensor<float> update = read_npy<float>(path("out/u.npy"));
  for (std::int64_t i = 0; i < 21; ++i) EXPECT_TRUE(std::isfinite(update[i])) << i;
}

TEST_F(CliLimits, CheckFiniteCoversEveryFloatInput) {
  const std::string x = input<double>("x.npy", {5, 4});
  const std::string m = input<double>("m.npy", {4, 4}), f = input<double>("f.npy", {4, 4});
  const std::string u = input<double>("u.npy", {4}), c = input<double>("c.npy", {4});
  const std::string common = "attend --check-finite --device reference --x " + x + " --m " + m +
                             " --f " + f + " --key-bias " + u + " --offset " + c + " --out " +
                             path("out/u.npy");
  // Clean input passes the check.
  const CliRun clean = emflow(common);
  ASSERT_EQ(clean.status, 0) << clean.err;
  fs::remove(path("out/u.npy"));

  struct Case {
    std::string option, file;
    Shape shape;
    std::int64_t flat;
    std::string index;
  };
  const std::vector<Case> cases = {{"--m", m, {4, 4}, 9, "[2, 1]"},
                                   {"--f", f, {4, 4}, 15, "[3, 3]"},
                                   {"--key-bias", u, {4}, 0, "[0]"},
                                   {"--offset", c, {4}, 3, "[3]"}};
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.option);
    Tensor<double> clean_values = read_npy<double>(bad.file);
    Tensor<double> values = clean_values;
    values[bad.flat] = -std::numeric_limits<double>::infinity();
    write_npy(bad.file, values);
    const CliRun run = emflow(common);
    EXPECT_EQ(run.status, 1);
    EXPECT_NE(run.err.find(bad.option + " '" + bad.file + "': element " + bad.index + " is -inf"),
              std::string::npos)
        << run.err;
    EXPECT_TRUE(entries("out").empty());
    write_npy(bad.file, clean_values);
  }
}

TEST_F(CliLimits, FlowCheckFiniteNamesTheFileAndTheFirstBadElement) {
  Tensor<float> cloud = read_npy<float>(input<float>("x.npy", {4, 3}));
  cloud[2 * 3 + 1] = std::numeric_limits<float>::quiet_NaN();
  write_npy(path("x.npy"), cloud);
  Tensor<float> relevance = read_npy<float>(input<float>("m.npy", {2, 3, 3}));
  const std::string f = input<float>("f.npy", {2, 3, 3});
  const std::string common = "flow --layers 2 --x " + path("x.npy") + " --f " + f + " --out " +
                             path("out/t.npy") + " --check-finite --m ";

  CliRun refused = emflow(common + path("m.npy"));
  EXPECT_EQ(refused.status, 1) << refused.err;
  EXPECT_NE(refused.err.find("--x '" + path("x.npy") + "': element [2, 1] is nan"),
            std::string::npos)
      << refused.err;
  EXPECT_TRUE(entries("out").empty());

  input<float>("x.npy", {4, 3});  // clean again
  relevance[9 + 4] = std::numeric_limits<float>::infinity();
  write_npy(path("m.npy"), relevance);
  refused = emflow(common + path("m.npy"));
  EXPECT_EQ(refused.status, 1) << refused.err;
  EXPECT_NE(refused.err.find("--m '" + path("m.npy") + "': element [1, 1, 1] is inf"),
            std::string::npos)
      << refused.err;
  EXPECT_TRUE(entries("out").empty());
}

TEST_F(CliLimits, WeightsThatCannotFitInMemoryAreRefusedUpFront) {
  // 2^20 tokens make a 4 MiB cloud but 2^40 weights (4 TiB): refused, not attempted.
  const std::string x = input<float>("x.npy", {std::int64_t{1} << 20, 1});
  const std::string m = input<float>("m.npy", {1, 1}), f = input<float>("f.npy", {1, 1});
  const CliRun run = emflow("attend --device cpu --x " + x + " --m " + m + " --f " + f + " --out " +
                            path("out/u.npy") + " --weights " + path("out/w.npy"));
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--weights (B H N N values) needs 4398046511104 bytes"), std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("bytes of memory available"), std::string::npos) << run.err;
  EXPECT_TRUE(entries("out").empty());
}

TEST_F(CliLimits, StatisticsThatCannotFitInMemoryAreRefusedUpFront) {
  // 2^22 tokens and 2^20 one-dimensional heads: B H N = 2^42 lse values (16 TiB).
  const std::string x = input<float>("x.npy", {std::int64_t{1} << 22, 1});
  const std::string m = input<float>("m.npy", {std::int64_t{1} << 20, 1, 1});
  const std::string f = input<float>("f.npy", {std::int64_t{1} << 20, 1, 1});
  const CliRun run = emflow("attend --device cpu --x " + x + " --m " + m + " --f " + f + " --out " +
                            path("out/u.npy") + " --lse " + path("out/l.npy"));
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--lse/--entropy (B H N values) needs 17592186044416 bytes"),
            std::string::npos)
      << run.err;
  EXPECT_TRUE(entries("out").empty());
}

}  // namespace
}  // namespace emflow

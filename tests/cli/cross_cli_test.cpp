// `emflow attend --queries Q.npy --x X.npy ...`: the cloud is the keys, the outputs have the
// queries' rows, --query-lengths pads queries, and the numbers equal emflow::attend on the
// double reference in process; bad query files fail naming the option, with no output written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/io.hpp"

namespace emflow::testing {
namespace {

class CrossCli : public CliFolder {
 protected:
  CrossCli() : CliFolder("emflow_cross_cli") {}

  static constexpr std::int64_t B = 2, N = 11, Nq = 4, d = 3, H = 2;
  std::vector<double> cloud = uniform(B * N * d, 31), queries = uniform(B * Nq * d, 32);
  std::vector<double> relevance = uniform(H * d * d, 33, -1.5, 1.5),
                      content = uniform(H * d * d, 34);
  std::vector<std::int64_t> key_lengths{11, 6}, query_lengths{4, 2};

  void SetUp() override {
    CliFolder::SetUp();
    if (IsSkipped()) return;
    write_npy(path("x.npy"), Tensor<double>({B, N, d}, cloud));
    write_npy(path("q.npy"), Tensor<double>({B, Nq, d}, queries));
    write_npy(path("m.npy"), Tensor<double>({H, d, d}, relevance));
    write_npy(path("f.npy"), Tensor<double>({H, d, d}, content));
    write_npy(path("l.npy"), Tensor<std::int64_t>({B}, key_lengths));
    write_npy(path("lq.npy"), Tensor<std::int64_t>({B}, query_lengths));
  }

  std::string common() const {
    return "attend --x " + path("x.npy") + " --queries " + path("q.npy") + " --m " + path("m.npy") +
           " --f " + path("f.npy") + " --mask causal --key-lengths " + path("l.npy");
  }
};

TEST_F(CrossCli, OutputsHaveTheQueriesShapeAndMatchTheReference) {
  for (const char* device : {"reference", "cpu"}) {
    SCOPED_TRACE(device);
    const CliRun run =
        emflow(common() + " --query-lengths " + path("lq.npy") + " --device " + device + " --out " +
               path("delta.npy") + " --lse " + path("lse.npy") + " --weights " + path("p.npy"));
    ASSERT_EQ(run.status, 0) << run.err;
    std::vector<double> update(B * Nq * d, NAN), lse(B * H * Nq, NAN), weights(B * H * Nq * N, NAN);
    AttentionInput<double> in;
    in.cloud = cloud.data();
    in.batch = B;
    in.tokens = N;
    in.dim = d;
    in.layer = {H, relevance.data(), content.data(), nullptr, nullptr};
    in.mask = Mask::causal();
    in.key_lengths = key_lengths.data();
    in.queries = queries.data();
    in.query_tokens = Nq;
    in.query_lengths = query_lengths.data();
    attend(in, {update.data(), lse.data(), nullptr, weights.data()}, {Device::reference});
    const Tensor<double> got = read_npy<double>(path("delta.npy"));
    EXPECT_EQ(got.shape(), (Shape{B, Nq, d}));
    EXPECT_TRUE(close_to(got.values(), update, 1e-12));
    EXPECT_EQ(read_npy<double>(path("lse.npy")).shape(), (Shape{B, H, Nq}));
    EXPECT_TRUE(close_to(read_npy<double>(path("lse.npy")).values(), lse, 1e-12));
    EXPECT_EQ(read_npy<double>(path("p.npy")).shape(), (Shape{B, H, Nq, N}));
    EXPECT_TRUE(close_to(read_npy<double>(path("p.npy")).values(), weights, 1e-12));
    // Cloud 1 has two real queries: the other two are padding.
    EXPECT_EQ(got.values()[(1 * Nq + 3) * d], 0.0);
    EXPECT_NE(got.values()[(1 * Nq + 1) * d], 0.0);
  }
}

TEST_F(CrossCli, BadQueryFilesNameTheOption) {
  write_npy(path("q_bad.npy"), Tensor<double>({B, Nq, d + 1}, uniform(B * Nq * (d + 1), 1)));
  write_npy(path("lq_bad.npy"), Tensor<std::int64_t>({B}, {4, 5}));
  for (const auto& [arguments, fragment] : std::vector<std::pair<std::string, std::string>>{
           {" --queries " + path("q_bad.npy"), "--queries"},
           {" --query-lengths " + path("lq_bad.npy"), "--query-lengths"}}) {
    std::string line = common() + " --out " + path("delta.npy");
    if (fragment == "--queries") {
      line = "attend --x " + path("x.npy") + arguments + " --m " + path("m.npy") + " --f " +
             path("f.npy") + " --out " + path("delta.npy");
    } else {
      line += arguments;
    }
    const CliRun run = emflow(line);
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.err.find(fragment), std::string::npos) << run.err;
    EXPECT_FALSE(std::filesystem::exists(path("delta.npy")));
  }
}

}  // namespace
}  // namespace emflow::testing

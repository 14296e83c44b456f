// `emflow attend --precision bf16|fp16` and `emflow bench --precision`: float32 inputs rounded to
// the storage type (fp16 also read from '<f2' files), the update written as float32 (bf16) or
// float16 (fp16), the numbers equal to emflow::attend on the stored inputs in process, and bad
// combinations refused naming --precision, with no output written. --precision tf32 is a
// permission the CPU computes in fp32: the same files as fp32, and bench says so.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/io.hpp"
#include "emflow/precision.hpp"

namespace emflow::testing {
namespace {

class PrecisionCli : public CliFolder {
 protected:
  PrecisionCli() : CliFolder("emflow_precision_cli") {}

  static constexpr std::int64_t N = 9, d = 4, H = 2;
  std::vector<float> cloud, relevance, content;

  void SetUp() override {
    CliFolder::SetUp();
    if (IsSkipped()) return;
    for (double v : uniform(N * d, 41)) cloud.push_back(static_cast<float>(v));
    for (double v : uniform(H * d * d, 42)) relevance.push_back(static_cast<float>(v));
    for (double v : uniform(H * d * d, 43)) content.push_back(static_cast<float>(v));
    write_npy(path("x.npy"), Tensor<float>({N, d}, cloud));
    write_npy(path("m.npy"), Tensor<float>({H, d, d}, relevance));
    write_npy(path("f.npy"), Tensor<float>({H, d, d}, content));
    write_npy(path("x64.npy"), Tensor<double>({N, d}, std::vector<double>(N * d, 0.5)));
    for (const char* name : {"x", "m", "f"}) {
      const Tensor<float> wide = read_npy<float>(path(std::string(name) + ".npy"));
      Tensor<float16> half(wide.shape());
      for (std::int64_t i = 0; i < wide.size(); ++i) half[i] = to_float16(wide[i]);
      write_npy(path(std::string(name) + "16.npy"), half);
    }
  }

  std::string inputs(const std::string& suffix = "", const std::string& device = "cpu") const {
    return "attend --x " + path("x" + suffix + ".npy") + " --m " + path("m" + suffix + ".npy") +
           " --f " + path("f" + suffix + ".npy") + " --mask causal --device " + device;
  }

  /// emflow::attend in process on the inputs stored as S; the update widened to float.
  template <class S>
  std::vector<float> expected(std::vector<float>* lse) const {
    auto store = [](const std::vector<float>& v) {
      std::vector<S> out;
      for (float x : v) {
        if constexpr (std::is_same_v<S, bfloat16>) {
          out.push_back(to_bfloat16(x));
        } else {
          out.push_back(to_float16(x));
        }
      }
      return out;
    };
    const std::vector<S> X = store(cloud), M = store(relevance), F = store(content);
    AttentionInput<S> in;
    in.cloud = X.data();
    in.tokens = N;
    in.dim = d;
    in.layer = {H, M.data(), F.data(), nullptr, nullptr};
    in.mask = Mask::causal();
    std::vector<S> update(N * d);
    lse->assign(H * N, NAN);
    attend(in, AttentionOutput<S>{update.data(), lse->data()}, ExecutionOptions{Device::cpu, 0});
    std::vector<float> out;
    for (S v : update) out.push_back(to_float(v));
    return out;
  }
};

TEST_F(PrecisionCli, Bf16AndFp16MatchTheLibraryAndWriteTheirTypes) {
  std::vector<float> lse;
  const std::vector<float> bf16 = expected<bfloat16>(&lse);
  CliRun run =
      emflow(inputs() + " --precision bf16 --out " + path("b.npy") + " --lse " + path("lb.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(read_npy_header(path("b.npy")).dtype, Dtype::float32);
  EXPECT_EQ(read_npy<float>(path("b.npy")).values(), bf16);
  EXPECT_EQ(read_npy<float>(path("lb.npy")).values(), lse);

  const std::vector<float> fp16 = expected<float16>(&lse);
  for (const std::string suffix : {"", "16"}) {  // float32 rounded, or float16 read exactly
    SCOPED_TRACE(suffix);
    run = emflow(inputs(suffix) + " --precision fp16 --out " + path("h.npy") + " --lse " +
                 path("lh.npy"));
    ASSERT_EQ(run.status, 0) << run.err;
    EXPECT_EQ(read_npy_header(path("h.npy")).dtype, Dtype::float16);
    EXPECT_EQ(read_npy<float>(path("h.npy")).values(), fp16);
    EXPECT_EQ(read_npy_header(path("lh.npy")).dtype, Dtype::float32);
    EXPECT_EQ(read_npy<float>(path("lh.npy")).values(), lse);
  }
  // Not zeros: the 16-bit update is the float32 one to within the storage rounding.
  run = emflow(inputs() + " --out " + path("s.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  const std::vector<float> single = read_npy<float>(path("s.npy")).values();
  for (std::size_t i = 0; i < single.size(); ++i) EXPECT_NEAR(fp16[i], single[i], 1e-2) << i;
  EXPECT_GT(std::abs(single[0]), 1e-3);
}

TEST_F(PrecisionCli, BadCombinationsNameTheOptionAndWriteNothing) {
  const struct {
    std::string arguments, message;
  } cases[] = {
      {inputs() + " --precision fp8", "--precision"},
      {"attend --x " + path("x64.npy") + " --m " + path("m.npy") + " --f " + path("f.npy") +
           " --precision tf32",
       "--precision"},
      {"attend --x " + path("x64.npy") + " --m " + path("m.npy") + " --f " + path("f.npy") +
           " --precision bf16",
       "--precision"},
      {inputs("16") + " --precision bf16", "--x"},
      {inputs("16"), "--x"},
      {inputs("", "cuda") + " --precision fp16", "cuda"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.arguments);
    const CliRun run = emflow(c.arguments + " --out " + path("bad.npy"));
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.err.find(c.message), std::string::npos) << run.err;
    EXPECT_FALSE(std::filesystem::exists(path("bad.npy")));
  }
}

TEST_F(PrecisionCli, BenchTimesEachPrecisionInOneRun) {
  const CliRun run = emflow("bench --tokens 64 --dim 8 --repeats 1 --precision fp32,bf16,fp16");
  EXPECT_EQ(run.status, 0) << run.err;
  for (const char* bad : {"fp32,fp32", "tf32 --device cuda"}) {
    const CliRun refused = emflow(std::string("bench --tokens 64 --precision ") + bad);
    EXPECT_NE(refused.status, 0) << bad;
    EXPECT_NE(refused.err.find("--precision"), std::string::npos) << refused.err;
  }
}

TEST_F(PrecisionCli, Tf32ComputesFp32OnTheCpuAndSaysSo) {
  CliRun run = emflow(inputs() + " --precision tf32 --out " + path("t.npy") + " --entropy " +
                      path("th.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  run = emflow(inputs() + " --out " + path("s.npy") + " --entropy " + path("sh.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  const std::vector<float> tf32 = read_npy<float>(path("t.npy")).values();
  EXPECT_EQ(tf32, read_npy<float>(path("s.npy")).values());
  EXPECT_EQ(read_npy<float>(path("th.npy")).values(), read_npy<float>(path("sh.npy")).values());
  EXPECT_GT(std::abs(tf32[0]), 1e-3);
  // The tool's stdout into a file (run_cli discards it): sh runs the binary as $0.
  const auto output_of = [&](const std::string& arguments, const std::string& file) {
    const CliRun r = emflow(arguments, "sh -c '\"$0\" \"$@\" > " + path(file) + "'");
    EXPECT_EQ(r.status, 0) << arguments << ": " << r.err;
    std::ifstream in(path(file));
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string bench =
      output_of("bench --tokens 64 --dim 8 --repeats 1 --precision fp32,tf32", "bench.txt");
  EXPECT_NE(bench.find("\"precision\": \"tf32\""), std::string::npos) << bench;
  EXPECT_NE(bench.find("\"computes\": \"fp32\""), std::string::npos) << bench;
  for (const char* command : {"attend", "bench"}) {
    const std::string help = output_of(std::string(command) + " --help", "help.txt");
    EXPECT_NE(help.find("tf32"), std::string::npos) << help;
    EXPECT_EQ(help.find("not implemented"), std::string::npos) << help;
  }
}

}  // namespace
}  // namespace emflow::testing

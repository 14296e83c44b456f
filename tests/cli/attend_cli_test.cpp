// The emflow binary, run as a user runs it: `emflow attend` on .npy files against the in-process
// double reference, and every bad input answered by a non-zero exit, one line on stderr naming
// the option, and no output file.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/io.hpp"

namespace fs = std::filesystem;

namespace {

struct Result {
  int status = -1;  // exit status, or -1 when the process did not exit normally (a crash)
  std::string out, err;
};

std::string read_text(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> names_in(const fs::path& folder) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

// Inputs in in/, outputs expected in out/, the process's stdout and stderr in log/.
class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef EMFLOW_CLI_PATH
    GTEST_SKIP() << "the emflow command-line tool is not built (EMFLOW_BUILD_CLI=OFF)";
#endif
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() / (std::string("emflow_cli_") + info->name() + "_" +
                                         std::to_string(std::random_device{}()));
    for (const char* folder : {"in", "out", "log"}) fs::create_directories(root_ / folder);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::string in(const std::string& name) const { return (root_ / "in" / name).string(); }
  std::string out(const std::string& name) const { return (root_ / "out" / name).string(); }
  std::vector<std::string> outputs() const { return names_in(root_ / "out"); }

  // `environment`: assignments put before the command ("NAME=value ...").
  Result run(const std::string& arguments, const std::string& environment = "") const {
#ifdef EMFLOW_CLI_PATH
    const fs::path log = root_ / "log";
    const std::string command =
        environment + (environment.empty() ? "" : " ") + "'" + EMFLOW_CLI_PATH + "' " + arguments +
        " >'" + (log / "stdout").string() + "' 2>'" + (log / "stderr").string() + "'";
    const int raw = std::system(command.c_str());
    Result result;
    result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    result.out = read_text(log / "stdout");
    result.err = read_text(log / "stderr");
    return result;
#else
    (void)arguments;
    (void)environment;
    return {};
#endif
  }

  fs::path root_;
};

// A layer and a batch of clouds in double; written as float32 or float64 files.
struct Case {
  std::int64_t batch = 2, tokens = 7, dim = 5, heads = 3;
  std::vector<double> cloud, relevance, content, key_bias, offset;
  std::vector<std::int64_t> key_lengths = {7, 4};
  double beta = 0.75;
  emflow::Mask mask = emflow::Mask::causal();

  Case() {
    using emflow::testing::uniform;
    cloud = uniform(batch * tokens * dim, 11);
    // Scaled so the softmax is far from flat.
    relevance = uniform(heads * dim * dim, 12, -1.5, 1.5);
    content = uniform(heads * dim * dim, 13);
    key_bias = uniform(heads * dim, 14);
    offset = uniform(dim, 15);
    // Values exactly representable in float, so float and double files hold the same numbers.
    for (auto* values : {&cloud, &relevance, &content, &key_bias, &offset}) {
      for (double& v : *values) v = static_cast<float>(v);
    }
  }

  // Writes the inputs as T; `in` maps a file name to its path.
  template <class T>
  void write(const std::function<std::string(const std::string&)>& in) const {
    auto save = [&](const std::string& name, emflow::Shape shape, const std::vector<double>& v) {
      emflow::write_npy(in(name),
                        emflow::Tensor<T>(std::move(shape), std::vector<T>(v.begin(), v.end())));
    };
    save("x.npy", {batch, tokens, dim}, cloud);
    save("m.npy", {heads, dim, dim}, relevance);
    save("f.npy", {heads, dim, dim}, content);
    save("u.npy", {heads, dim}, key_bias);
    save("c.npy", {dim}, offset);
    emflow::write_npy(in("l.npy"), emflow::Tensor<std::int64_t>({batch}, key_lengths));
  }

  // emflow::attend on the double reference, in process.
  void expected(std::vector<double>& update, std::vector<double>& lse, std::vector<double>& entropy,
                std::vector<double>& weights) const {
    update.assign(cloud.size(), NAN);
    lse.assign(batch * heads * tokens, NAN);
    entropy.assign(lse.size(), NAN);
    weights.assign(lse.size() * tokens, NAN);
    emflow::AttentionInput<double> input;
    input.cloud = cloud.data();
    input.batch = batch;
    input.tokens = tokens;
    input.dim = dim;
    input.layer = {heads, relevance.data(), content.data(), key_bias.data(), offset.data()};
    input.beta = beta;
    input.mask = mask;
    input.key_lengths = key_lengths.data();
    emflow::AttentionOutput<double> output{update.data(), lse.data(), entropy.data(),
                                           weights.data()};
    emflow::ExecutionOptions options;
    options.device = emflow::Device::reference;
    emflow::attend(input, output, options);
  }
};

template <class T>
std::vector<T> read_values(const std::string& file, const emflow::Shape& shape,
                           emflow::Dtype dtype) {
  const emflow::NpyHeader header = emflow::read_npy_header(file);
  EXPECT_EQ(header.dtype, dtype) << file;
  EXPECT_EQ(header.shape, shape) << file;
  return emflow::read_npy<T>(file).values();
}

template <class T>
class CliAttend : public Cli {};
TYPED_TEST_SUITE(CliAttend, emflow::testing::FloatTypes);

TYPED_TEST(CliAttend, MatchesTheReferenceAndKeepsThePrecision) {
  using T = TypeParam;
  const Case c;
  c.write<T>([this](const std::string& name) { return this->in(name); });
  const Result r = this->run(
      "attend --x " + this->in("x.npy") + " --m " + this->in("m.npy") + " --f " +
      this->in("f.npy") + " --key-bias " + this->in("u.npy") + " --offset " + this->in("c.npy") +
      " --key-lengths " + this->in("l.npy") + " --beta 0.75 --mask causal --device cpu" +
      " --threads 2 --out " + this->out("delta.npy") + " --lse " + this->out("lse.npy") +
      " --entropy " + this->out("h.npy") + " --weights " + this->out("p.npy"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");

  std::vector<double> update, lse, entropy, weights;
  c.expected(update, lse, entropy, weights);
  const emflow::Dtype dtype =
      std::is_same_v<T, float> ? emflow::Dtype::float32 : emflow::Dtype::float64;
  const std::int64_t b = c.batch, n = c.tokens, h = c.heads;
  const auto got_update = read_values<T>(this->out("delta.npy"), {b, n, c.dim}, dtype);
  const auto got_lse = read_values<T>(this->out("lse.npy"), {b, h, n}, dtype);
  const auto got_entropy = read_values<T>(this->out("h.npy"), {b, h, n}, dtype);
  const auto got_weights = read_values<T>(this->out("p.npy"), {b, h, n, n}, dtype);
  const double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  using emflow::testing::relative_error;
  EXPECT_LT(relative_error(got_update, update), tolerance);
  EXPECT_LT(relative_error(got_lse, lse), tolerance);
  EXPECT_LT(relative_error(got_entropy, entropy), tolerance);
  EXPECT_LT(relative_error(got_weights, weights), tolerance);
  // The second cloud has 4 keys: its padding queries get no update and lse = -inf.
  EXPECT_EQ(got_update[(1 * n + 5) * c.dim], T(0));
  EXPECT_TRUE(std::isinf(got_lse[(1 * h + 0) * n + 6]) && got_lse[(1 * h + 0) * n + 6] < 0);
  // Not a vacuous pass: the reference update is far from zero.
  EXPECT_GT(relative_error(std::vector<double>(update.size(), 0.0), update), 0.99);
  EXPECT_EQ(this->outputs().size(), 4u);
}

TEST_F(Cli, OneCloudAndOneHeadKeepTheirRanks) {
  // X (N, d), M and F (d, d), u (d): the update is (N, d) and lse (1, 1, N).
  const std::int64_t n = 9, d = 4;
  const auto cloud = emflow::testing::uniform(n * d, 21);
  const auto relevance = emflow::testing::uniform(d * d, 22, -2, 2);
  const auto content = emflow::testing::uniform(d * d, 23);
  const auto key_bias = emflow::testing::uniform(d, 24);
  emflow::write_npy(in("x.npy"), emflow::Tensor<double>({n, d}, cloud));
  emflow::write_npy(in("m.npy"), emflow::Tensor<double>({d, d}, relevance));
  emflow::write_npy(in("f.npy"), emflow::Tensor<double>({d, d}, content));
  emflow::write_npy(in("u.npy"), emflow::Tensor<double>({d}, key_bias));
  const Result r = run("attend --x " + in("x.npy") + " --m " + in("m.npy") + " --f " + in("f.npy") +
                       " --key-bias " + in("u.npy") + " --mask window:3 --device reference --out " +
                       out("delta.npy") + " --lse " + out("lse.npy"));
  ASSERT_EQ(r.status, 0) << r.err;

  std::vector<double> update(n * d, NAN), lse(n, NAN);
  emflow::AttentionInput<double> input;
  input.cloud = cloud.data();
  input.tokens = n;
  input.dim = d;
  input.layer = {1, relevance.data(), content.data(), key_bias.data(), nullptr};
  input.mask = emflow::Mask::sliding_window(3);
  emflow::ExecutionOptions options;
  options.device = emflow::Device::reference;
  emflow::attend(input, {update.data(), lse.data(), nullptr, nullptr}, options);
  // The same computation in the same precision: identical numbers.
  EXPECT_EQ(read_values<double>(out("delta.npy"), {n, d}, emflow::Dtype::float64), update);
  EXPECT_EQ(read_values<double>(out("lse.npy"), {1, 1, n}, emflow::Dtype::float64), lse);
}

struct BadInput {
  std::string name;
  std::map<std::string, std::string> changes;  // option -> value; "" removes the option
  std::vector<std::string> message;            // what the one line must contain
};

TEST_F(Cli, EveryBadInputFailsWithOneLineAndNoOutput) {
  const Case c;
  c.write<double>([this](const std::string& name) { return in(name); });
  using emflow::Tensor;
  const std::int64_t b = c.batch, n = c.tokens, d = c.dim, h = c.heads;
  emflow::write_npy(in("x_rank1.npy"), Tensor<double>({d}, c.offset));
  emflow::write_npy(in("x_int.npy"), Tensor<std::int64_t>({n, d}));
  emflow::write_npy(in("m_wrong_d.npy"), Tensor<double>({h, d - 1, d - 1}));
  emflow::write_npy(in("f_two_heads.npy"), Tensor<double>({h - 1, d, d}));
  emflow::write_npy(in("m_float.npy"), Tensor<float>({h, d, d}));
  emflow::write_npy(in("u_wrong.npy"), Tensor<double>({h - 1, d}));
  emflow::write_npy(in("u_vector.npy"), Tensor<double>({d}));
  emflow::write_npy(in("c_wrong.npy"), Tensor<double>({d + 1}));
  emflow::write_npy(in("l_long.npy"), Tensor<std::int64_t>({b}, {n, n + 1}));
  emflow::write_npy(in("l_negative.npy"), Tensor<std::int64_t>({b}, {-1, 2}));
  emflow::write_npy(in("l_shape.npy"), Tensor<std::int64_t>({b + 1}));
  emflow::write_npy(in("l_float.npy"), Tensor<double>({b}));
  {
    // A cloud file cut short in its payload.
    const std::string bytes = read_text(in("x.npy"));
    std::ofstream(in("x_truncated.npy"), std::ios::binary) << bytes.substr(0, bytes.size() - 8);
  }
  fs::create_directory(out("taken"));

  const std::map<std::string, std::string> base = {
      {"--x", in("x.npy")},        {"--m", in("m.npy")},      {"--f", in("f.npy")},
      {"--key-bias", in("u.npy")}, {"--offset", in("c.npy")}, {"--key-lengths", in("l.npy")},
      {"--out", out("delta.npy")}, {"--lse", out("lse.npy")}, {"--entropy", out("h.npy")},
      {"--mask", "causal"},        {"--device", "cpu"}};
  const std::vector<BadInput> cases = {
      {"no cloud", {{"--x", ""}}, {"--x", "required"}},
      {"no output", {{"--out", ""}}, {"--out", "required"}},
      {"missing file", {{"--x", in("absent.npy")}}, {"--x", "absent.npy", "cannot open"}},
      {"truncated", {{"--x", in("x_truncated.npy")}}, {"--x", "x_truncated.npy", "truncated"}},
      {"rank 1 cloud", {{"--x", in("x_rank1.npy")}}, {"--x", "rank 1", "expected rank 2 to 3"}},
      {"integer cloud", {{"--x", in("x_int.npy")}}, {"--x", "int64", "float32 or float64"}},
      {"relevance dim", {{"--m", in("m_wrong_d.npy")}}, {"--m", "(3, 4, 4)", "(5, 5)"}},
      {"content heads", {{"--f", in("f_two_heads.npy")}}, {"--f", "(2, 5, 5)", "(3, 5, 5)"}},
      {"mixed precision", {{"--m", in("m_float.npy")}}, {"--m", "float32", "float64", "--x"}},
      {"key bias heads", {{"--key-bias", in("u_wrong.npy")}}, {"--key-bias", "(2, 5)", "(3, 5)"}},
      {"key bias vector", {{"--key-bias", in("u_vector.npy")}}, {"--key-bias", "(5,)", "(3, 5)"}},
      {"offset", {{"--offset", in("c_wrong.npy")}}, {"--offset", "(6,)", "(5,)"}},
      {"key length", {{"--key-lengths", in("l_long.npy")}}, {"--key-lengths", "entry 1", "8"}},
      {"negative key length",
       {{"--key-lengths", in("l_negative.npy")}},
       {"--key-lengths", "entry 0", "-1"}},
      {"key lengths shape", {{"--key-lengths", in("l_shape.npy")}}, {"--key-lengths", "(3,)"}},
      {"float key lengths", {{"--key-lengths", in("l_float.npy")}}, {"--key-lengths", "float64"}},
      {"beta nan", {{"--beta", "nan"}}, {"--beta", "finite"}},
      {"beta text", {{"--beta", "warm"}}, {"--beta", "warm"}},
      {"window 0", {{"--mask", "window:0"}}, {"--mask", "window:0"}},
      {"mask name", {{"--mask", "diagonal"}}, {"--mask", "diagonal"}},
      {"device name", {{"--device", "gpu"}}, {"--device", "gpu"}},
      {"threads", {{"--threads", "-1"}}, {"--threads", "-1"}},
      {"missing folder", {{"--out", out("no/such/delta.npy")}}, {"--out", "does not exist"}},
      {"same output twice", {{"--lse", out("delta.npy")}}, {"--lse", "--out", "delta.npy"}},
      // Passes every check before computing; the last rename fails, and the outputs already
      // renamed into place by this run are removed again.
      {"output is a folder", {{"--weights", out("taken")}}, {"--weights", "taken"}},
      {"unknown option", {{"--bogus", "1"}}, {"--bogus"}},
  };
  for (const BadInput& bad : cases) {
    SCOPED_TRACE(bad.name);
    std::map<std::string, std::string> options = base;
    for (const auto& [option, value] : bad.changes) {
      if (value.empty()) {
        options.erase(option);
      } else {
        options[option] = value;
      }
    }
    std::string arguments = "attend";
    for (const auto& [option, value] : options) arguments += " " + option + " '" + value + "'";
    const Result r = run(arguments);
    EXPECT_GT(r.status, 0) << "exit status (-1: the process crashed)";
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(r.err.rfind("emflow: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (const std::string& part : bad.message) {
      EXPECT_NE(r.err.find(part), std::string::npos) << "'" << part << "' not in: " << r.err;
    }
    EXPECT_EQ(outputs(), std::vector<std::string>{"taken"});
    EXPECT_TRUE(fs::is_empty(out("taken")));
  }
}

TEST_F(Cli, CudaWithoutADeviceIsAnErrorNotACrash) {
  std::string reason;
  if (emflow::testing::cuda_available(&reason)) GTEST_SKIP() << "a CUDA device is present";
  const Case c;
  c.write<float>([this](const std::string& name) { return in(name); });
  const Result r = run("attend --x " + in("x.npy") + " --m " + in("m.npy") + " --f " + in("f.npy") +
                       " --device cuda --out " + out("delta.npy"));
  EXPECT_GT(r.status, 0);
  EXPECT_EQ(r.err.rfind("emflow: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("cuda"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(outputs().empty());
}

TEST_F(Cli, HelpAndVersion) {
  Result r = run("--version");
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out.rfind("emflow ", 0), 0u) << r.out;
  // The processor, the engine's paths and the one taken, and the path of every storage type.
  for (const char* text :
       {"\ncpu: ", "extensions found: ", "engine paths built: ", "engine path taken: ", "\ngpu: ",
        "\n  float64  cpu reference fp64", "\n  float32  cpu cpu_fused fp32",
        "\n  bfloat16 cpu cpu_", "\n  float16  cpu cpu_fused fp32"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " missing in\n" << r.out;
  }
  // The lower paths, where the build holds them all (a checking build configured with
  // EMFLOW_ONLY_CPU_PATH holds one: CMakeLists.txt).
#if defined(EMFLOW_CPU_BUILT_avx2) && defined(EMFLOW_CPU_BUILT_avx512) && \
    defined(EMFLOW_CPU_BUILT_avx512bf16)
  // EMFLOW_CPU_DISABLE=avx512bf16 sends bfloat16 to the widening path, and says so.
  r = run("--version", "EMFLOW_CPU_DISABLE=avx512bf16");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\n  bfloat16 cpu cpu_fused fp32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("paths not taken (EMFLOW_CPU_DISABLE): avx512bf16"), std::string::npos)
      << r.out;
  // EMFLOW_CPU_PATH forces a path the processor has, and refuses another name with the choices.
  r = run("--version", "EMFLOW_CPU_PATH=avx2");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(
      r.out.find("engine path taken: avx2 (uses avx2 fma f16c bmi2), as EMFLOW_CPU_PATH asks"),
      std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\n  bfloat16 cpu cpu_fused fp32"), std::string::npos) << r.out;
  const char* const built = "avx2, avx512, avx512bf16";
#else
  std::string built;
  for (const char* name : {"avx2", "avx512", "avx512bf16"}) {
    if (r.out.find(std::string("engine paths built: ") + name + "\n") != std::string::npos) {
      built = name;
    }
  }
  EXPECT_FALSE(built.empty()) << "one path built, named in\n" << r.out;
#endif
  r = run("--version", "EMFLOW_CPU_PATH=sse9");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(std::string("emflow: error: environment variable EMFLOW_CPU_PATH names "
                                   "'sse9', expected one of this build's paths: ") +
                       built),
            std::string::npos)
      << r.err;
  r = run("--version", "EMFLOW_CPU_DISABLE=avx9");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("emflow: error: environment variable EMFLOW_CPU_DISABLE names 'avx9'"),
            std::string::npos)
      << r.err;

  r = run("--help");
  EXPECT_EQ(r.status, 0);
  for (const char* command : {"attend", "demo"}) {
    EXPECT_NE(r.out.find(command), std::string::npos) << r.out;
  }

  r = run("attend --help");
  EXPECT_EQ(r.status, 0);
  for (const char* text :
       {"--x", "(B, N, d)", "--m", "(H, d, d)", "--f", "--key-bias", "--offset", "--beta", "--mask",
        "window:W", "--key-lengths", "--device", "--threads", "--out", "--lse", "(B, H, N)",
        "--entropy", "--weights", "(B, H, N, N)"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " not in:\n" << r.out;
  }

  r = run("");
  EXPECT_GT(r.status, 0);
  EXPECT_EQ(r.err.rfind("emflow: error: ", 0), 0u) << r.err;
}

TEST_F(Cli, DemoRunsAndChecksItself) {
  const Result r = run("demo --tokens 100 --dim 8 --heads 2 --device cpu --seed 5");
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* text : {"N = 100", "d = 8", "H = 2", "cpu", "ms", "GFLOP/s"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " not in:\n" << r.out;
  }
  // The printed error against the float64 reference is a float32-sized number.
  const std::size_t at = r.out.find("relative error ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const double error = std::strtod(r.out.c_str() + at + 15, nullptr);
  EXPECT_LT(error, 1e-5) << r.out;

  const Result bad = run("demo --tokens 0");
  EXPECT_GT(bad.status, 0);
  EXPECT_NE(bad.err.find("--tokens"), std::string::npos) << bad.err;
}

}  // namespace

// `emflow flow --layers L --generate K`: each generated token's path through the stack equals the
// causal one-pass flow of the grown cloud (prompt and generated tokens as entered), computed here
// in process with emflow::attend layer by layer, and each token enters as the previous one's
// output; pre-norm layers, the other norms and several clouds
// likewise; --plot draws the paths. Bad combinations fail naming the option, what --generate does
// not run (--model, --record-every, an explicit count below 1) is refused by name, and sizes that
// cannot fit are refused before any work, with the bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"

namespace emflow::testing {
namespace {

class Generate : public CliFolder {
 protected:
  Generate() : CliFolder("emflow_generate") {}
};

void to_sphere(std::vector<float>& x, std::int64_t d) {
  for (std::size_t i = 0; i < x.size(); i += static_cast<std::size_t>(d)) {
    double n = 0.0;
    for (std::int64_t a = 0; a < d; ++a) n += double(x[i + a]) * x[i + a];
    for (std::int64_t a = 0; a < d; ++a) x[i + a] = static_cast<float>(x[i + a] / std::sqrt(n));
  }
}

TEST_F(Generate, PathsEqualTheCausalOnePassOfTheGrownCloud) {
  const std::int64_t N = 12, d = 4, L = 3, K = 9;
  const std::vector<double> values = uniform(N * d, 3);
  std::vector<float> prompt(values.begin(), values.end());
  to_sphere(prompt, d);
  const std::vector<double> m = uniform(L * d * d, 4, -1.0, 1.0),
                            f = uniform(L * d * d, 5, -0.5, 0.5);
  const std::vector<float> mf(m.begin(), m.end()), ff(f.begin(), f.end());
  write_npy(path("x.npy"), Tensor<float>({N, d}, prompt));
  write_npy(path("m.npy"), Tensor<float>({L, 1, d, d}, mf));
  write_npy(path("f.npy"), Tensor<float>({L, 1, d, d}, ff));
  const CliRun run =
      emflow("flow --x " + path("x.npy") + " --m " + path("m.npy") + " --f " + path("f.npy") +
             " --layers 3 --norm sphere --beta 1.5 --generate 9 " + "--device cpu --out " +
             path("paths.npy") + " --metrics " + path("moves.csv"));
  ASSERT_EQ(run.status, 0) << run.err;
  const Tensor<float> paths = read_npy<float>(path("paths.npy"));
  ASSERT_EQ(paths.shape(), (Shape{K, L + 1, d}));

  // The grown cloud as entered: the prompt, then each token's path at layer 0.
  std::vector<float> state = prompt;
  for (std::int64_t t = 0; t < K; ++t) {
    for (std::int64_t a = 0; a < d; ++a) state.push_back(paths[(t * (L + 1)) * d + a]);
  }
  for (std::int64_t l = 0; l < L; ++l) {
    std::vector<float> update(state.size());
    AttentionInput<float> in;
    in.cloud = state.data();
    in.tokens = N + K;
    in.dim = d;
    in.layer = {1, mf.data() + l * d * d, ff.data() + l * d * d, nullptr, nullptr};
    in.beta = 1.5;
    in.mask = Mask::causal();
    attend(in, {update.data(), nullptr, nullptr, nullptr}, {Device::reference});
    for (std::size_t k = 0; k < state.size(); ++k) state[k] += update[k];
    to_sphere(state, d);
    for (std::int64_t t = 0; t < K; ++t) {
      for (std::int64_t a = 0; a < d; ++a) {
        EXPECT_NEAR(paths[(t * (L + 1) + l + 1) * d + a], state[(N + t) * d + a], 2e-5)
            << "token " << t << " layer " << l;
      }
    }
  }
  // Each token enters as the previous one's output (the first as the prompt's last output).
  for (std::int64_t t = 1; t < K; ++t) {
    for (std::int64_t a = 0; a < d; ++a) {
      EXPECT_EQ(paths[(t * (L + 1)) * d + a], paths[((t - 1) * (L + 1) + L) * d + a]);
    }
  }
  EXPECT_NE(text_of("moves.csv").find("token,position,layer,move,seconds\n0,12,0,"),
            std::string::npos);
}

// Pre-norm layers under layernorm, and post-norm under rmsnorm, on two clouds of their own beta:
// every generated token's path equals the causal one-pass flow of its grown cloud.
TEST_F(Generate, PreNormOtherNormsAndSeveralClouds) {
  const std::int64_t B = 2, N = 7, d = 5, L = 2, K = 4;
  const std::vector<double> values = uniform(B * N * d, 13);
  const std::vector<float> prompts(values.begin(), values.end());
  const std::vector<double> m = uniform(L * d * d, 14, -1.0, 1.0),
                            f = uniform(L * d * d, 15, -0.5, 0.5);
  const std::vector<float> mf(m.begin(), m.end()), ff(f.begin(), f.end());
  write_npy(path("x.npy"), Tensor<float>({B, N, d}, prompts));
  write_npy(path("m.npy"), Tensor<float>({L, 1, d, d}, mf));
  write_npy(path("f.npy"), Tensor<float>({L, 1, d, d}, ff));
  struct Case {
    const char* options;
    flow::Normalization norm;
    bool pre_norm;
  };
  for (const Case& c : {Case{"--norm layernorm --pre-norm", flow::Normalization::layernorm, true},
                        Case{"--norm rmsnorm", flow::Normalization::rmsnorm, false}}) {
    SCOPED_TRACE(c.options);
    const CliRun run =
        emflow("flow --x " + path("x.npy") + " --m " + path("m.npy") + " --f " + path("f.npy") +
               " --layers 2 --beta 0.5,2 --generate 4 " + c.options + " --device cpu --out " +
               path("paths.npy") + " --metrics " + path("moves.csv"));
    ASSERT_EQ(run.status, 0) << run.err;
    const Tensor<float> paths = read_npy<float>(path("paths.npy"));
    ASSERT_EQ(paths.shape(), (Shape{B, K, L + 1, d}));
    EXPECT_NE(text_of("moves.csv").find("cloud,token,position,layer,move,seconds\n0,0,7,0,"),
              std::string::npos);
    for (std::int64_t b = 0; b < B; ++b) {
      const float* path_of = paths.data() + b * K * (L + 1) * d;
      std::vector<float> state(prompts.begin() + b * N * d, prompts.begin() + (b + 1) * N * d);
      for (std::int64_t t = 0; t < K; ++t) {
        for (std::int64_t a = 0; a < d; ++a) state.push_back(path_of[t * (L + 1) * d + a]);
      }
      for (std::int64_t l = 0; l < L; ++l) {
        std::vector<float> attended = state, update(state.size());
        if (c.pre_norm) flow::normalize(c.norm, attended.data(), N + K, d);
        AttentionInput<float> in;
        in.cloud = attended.data();
        in.tokens = N + K;
        in.dim = d;
        in.layer = {1, mf.data() + l * d * d, ff.data() + l * d * d, nullptr, nullptr};
        in.beta = b == 0 ? 0.5 : 2.0;
        in.mask = Mask::causal();
        attend(in, {update.data(), nullptr, nullptr, nullptr}, {Device::reference});
        for (std::size_t k = 0; k < state.size(); ++k) state[k] += update[k];
        if (!c.pre_norm) flow::normalize(c.norm, state.data(), N + K, d);
        for (std::int64_t t = 0; t < K; ++t) {
          for (std::int64_t a = 0; a < d; ++a) {
            EXPECT_NEAR(path_of[(t * (L + 1) + l + 1) * d + a], state[(N + t) * d + a], 2e-5)
                << "cloud " << b << " token " << t << " layer " << l;
          }
        }
      }
    }
  }
}

// --plot draws the new tokens' paths through the stack (a PNG); one layer shared by a stack of
// three (identity operators) still moves each token through three layers.
TEST_F(Generate, DrawsThePathsOfTheNewTokens) {
  const CliRun run = emflow("flow --tokens 8 --dim 3 --layers 3 --generate 5 --device cpu --plot " +
                            path("g.png") + " --out " + path("p.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  const Tensor<float> paths = read_npy<float>(path("p.npy"));
  ASSERT_EQ(paths.shape(), (Shape{5, 4, 3}));
  EXPECT_NE(paths[3 * 3], paths[0]);  // the first token moved
  const std::string png = text_of("g.png");
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
}

TEST_F(Generate, RefusesWhatItDoesNotRun) {
  struct Case {
    std::string extra, option;
  };
  for (const Case& c :
       {Case{"--time 1", "--generate"}, Case{"--layers 2 --generate -1", "--generate"},
        Case{"--layers 2 --generate 0", "--generate"},
        Case{"--layers 2 --unnormalized", "--generate"},
        Case{"--layers 2 --record-every 2", "--record-every"},
        Case{"--layers 2 --precision float64", "--generate"},
        Case{"--layers 2 --device cuda", "--device"}}) {
    const CliRun run =
        emflow("flow --tokens 8 --dim 3 " +
               std::string(c.extra.find("--generate") == std::string::npos ? "--generate 2 " : "") +
               c.extra + " --out " + path("p.npy"));
    EXPECT_NE(run.status, 0) << c.extra;
    EXPECT_NE(run.err.find(c.option), std::string::npos) << c.extra << ": " << run.err;
  }
}

// A model's layers are not a decoding stack: --model with --generate (whatever the count) is
// refused, naming --generate, and writes nothing.
TEST_F(Generate, RefusesAModel) {
  for (const char* count : {"3", "-5"}) {
    const CliRun run = emflow("flow --model " + path("") + " --x " + path("x.npy") +
                              " --generate " + count + " --out " + path("p.npy"));
    EXPECT_NE(run.status, 0) << count;
    EXPECT_NE(run.err.find("--generate"), std::string::npos) << count << ": " << run.err;
    EXPECT_FALSE(std::filesystem::exists(path("p.npy"))) << count;
  }
}

// Sizes are refused before anything is allocated, naming --generate: paths beyond the 2^31 values
// of an output, and caches that cannot fit in memory (the bytes). The address space is capped,
// so a regression ends in a quick failure to allocate rather than a machine out of memory (not
// under AddressSanitizer, whose shadow memory needs more address space than the cap).
TEST_F(Generate, RefusesSizesBeforeAnyWork) {
#if defined(__SANITIZE_ADDRESS__)
  const std::string cap;
#else
  const std::string cap = "ulimit -v 4194304;";
#endif
  CliRun run =
      emflow("flow --tokens 8 --dim 3 --layers 1 --generate 1000000000 --device cpu --out " +
                 path("p.npy"),
             cap);
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--generate is too large: --generate 1000000000 x --layers 1 + 1"),
            std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("values of the generated paths (--out)"), std::string::npos) << run.err;

  // 255 heads in d = 1: the paths fit (2 10^9 values), the caches may grow to 32 TB.
  write_npy(path("x.npy"), Tensor<float>({8, 1}, std::vector<float>(8, 0.5f)));
  write_npy(path("m.npy"), Tensor<float>({255, 1, 1}, std::vector<float>(255, 0.1f)));
  run = emflow("flow --x " + path("x.npy") + " --m " + path("m.npy") + " --f " + path("m.npy") +
                   " --layers 1 --generate 1000000000 --device cpu --out " + path("p.npy"),
               cap);
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--generate: generate: the generation (paths"), std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("decode caches"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find(" bytes of memory available"), std::string::npos) << run.err;
  EXPECT_FALSE(std::filesystem::exists(path("p.npy")));
}

}  // namespace
}  // namespace emflow::testing

// `emflow flow --layers L --generate K`: each generated token's path through the stack equals the
// causal one-pass flow of the grown cloud (prompt and generated tokens as entered), computed here
// in process with emflow::attend layer by layer, and each token enters as the previous one's
// output. Bad combinations fail naming --generate.
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

TEST_F(Generate, RefusesWhatItDoesNotRun) {
  for (const std::string& extra :
       {std::string("--time 1"), std::string("--layers 2 --pre-norm"),
        std::string("--layers 2 --norm layernorm"), std::string("--layers 2 --batch 2")}) {
    const CliRun run =
        emflow("flow --tokens 8 --dim 3 --generate 2 " + extra + " --out " + path("p.npy"));
    EXPECT_NE(run.status, 0) << extra;
    EXPECT_NE(run.err.find("--generate"), std::string::npos) << extra << ": " << run.err;
  }
}

}  // namespace
}  // namespace emflow::testing

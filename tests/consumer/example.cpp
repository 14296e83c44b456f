// Three tokens in the plane and one head whose relevance M and content F are the identity, under
// a causal mask: each token's update is the softmax-weighted mean of itself and the tokens
// before it, weighted by exp(x_i . x_j).
#include <cmath>
#include <cstdio>
#include <emflow/attention.hpp>
#include <vector>

int main() {
  std::vector<double> cloud = {1, 0,   // x_0
                               0, 1,   // x_1
                               1, 1};  // x_2
  std::vector<double> identity = {1, 0, 0, 1};
  std::vector<double> update(cloud.size());

  emflow::AttentionInput<double> input;
  input.cloud = cloud.data();
  input.tokens = 3;
  input.dim = 2;
  input.layer.relevance = identity.data();  // M: the relevance of t to q is q . t
  input.layer.content = identity.data();    // F: token t contributes t itself
  input.mask = emflow::Mask::causal();
  emflow::AttentionOutput<double> output;
  output.update = update.data();
  emflow::attend(input, output);  // throws emflow::Error on bad input

  // x_0 sees only itself; x_1 scores its keys (0, 1); x_2 scores them (1, 1, 2).
  const double e = std::exp(1.0);
  const double expected[3][2] = {
      {1, 0}, {1 / (1 + e), e / (1 + e)}, {(1 + e) / (2 + e), (1 + e) / (2 + e)}};
  int wrong = 0;
  for (int i = 0; i < 3; ++i) {
    std::printf("delta_%d = (%.6f, %.6f)\n", i, update[2 * i], update[2 * i + 1]);
    for (int k = 0; k < 2; ++k) wrong += std::abs(update[2 * i + k] - expected[i][k]) > 1e-12;
  }
  return wrong == 0 ? 0 : 1;
}

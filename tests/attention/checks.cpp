#include "attention/checks.hpp"

#include <cmath>
#include <cstddef>
#include <limits>

namespace emflow::testing {

reference::Attention composed_reference(const Problem& p, bool with_weights) {
  reference::Layer layer;
  layer.relevance = Tensor<double>({p.heads, p.dim, p.dim}, p.relevance);
  layer.content = Tensor<double>({p.heads, p.dim, p.dim}, p.content);
  if (p.key_bias) layer.key_bias = Tensor<double>({p.heads, p.dim}, p.bias);
  if (p.offset) layer.offset = Tensor<double>({p.dim}, p.shift);
  const Tensor<double> cloud({p.batch, p.tokens, p.dim}, p.cloud);
  return reference::attend(cloud, layer, p.beta, p.mask, p.key_lengths, with_weights);
}

template <class T>
void expect_matches(const Buffers<T>& got, const reference::Attention& want, double tolerance,
                    const std::string& what) {
  double norm = 0.0;
  for (double v : want.update.values()) norm += v * v;
  ASSERT_GT(norm, 0.0) << what << ": the reference update is all zeros; the test would be vacuous";

  EXPECT_TRUE(all_finite_or_neg_inf(got.update)) << what << ": update";
  EXPECT_TRUE(close_to(got.update, want.update.values(), tolerance)) << what << ": update";
  if (!got.lse.empty()) {
    EXPECT_TRUE(all_finite_or_neg_inf(got.lse)) << what << ": lse";
    EXPECT_TRUE(close_to(got.lse, want.lse.values(), tolerance)) << what << ": lse";
  }
  if (!got.entropy.empty()) {
    EXPECT_TRUE(all_finite_or_neg_inf(got.entropy)) << what << ": entropy";
    EXPECT_TRUE(close_to(got.entropy, want.entropy.values(), tolerance)) << what << ": entropy";
  }
  if (!got.weights.empty()) {
    EXPECT_TRUE(all_finite_or_neg_inf(got.weights)) << what << ": weights";
    EXPECT_TRUE(close_to(got.weights, want.weights.values(), tolerance)) << what << ": weights";
    const std::vector<double>& w = want.weights.values();
    for (std::size_t e = 0; e < w.size(); ++e) {
      if (w[e] == 0.0 && got.weights[e] != T(0)) {
        ADD_FAILURE() << what << ": weight " << e << " is hidden by the mask but is "
                      << got.weights[e];
        break;
      }
    }
  }

  // Queries without a visible key (the same for every head): exact zeros and -inf.
  const std::int64_t B = got.input.batch, N = got.input.tokens, d = got.input.dim,
                     H = got.input.layer.heads;
  const T inf = std::numeric_limits<T>::infinity();
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < N; ++i) {
      if (!std::isinf(want.lse[(b * H) * N + i])) continue;
      for (std::int64_t a = 0; a < d; ++a) {
        ASSERT_EQ(got.update[static_cast<std::size_t>((b * N + i) * d + a)], T(0))
            << what << ": cloud " << b << " query " << i << " sees no key";
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const auto row = static_cast<std::size_t>((b * H + h) * N + i);
        if (!got.lse.empty()) {
          ASSERT_EQ(got.lse[row], -inf) << what << ": row " << row;
        }
        if (!got.entropy.empty()) {
          ASSERT_EQ(got.entropy[row], T(0)) << what << ": row " << row;
        }
      }
    }
  }
}

template void expect_matches(const Buffers<float>&, const reference::Attention&, double,
                             const std::string&);
template void expect_matches(const Buffers<double>&, const reference::Attention&, double,
                             const std::string&);

}  // namespace emflow::testing

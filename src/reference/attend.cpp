// The double-precision reference of the EMF contextual update, written for clarity: each line
// is a formula of docs/MATH.md §1. It is the ground truth every backend is tested against, for
// self- and cross-attention and for the partial state over a block of keys (partial.hpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"

namespace emflow::detail {

namespace {

/// One pass over the keys of `in` for every query, in double. With `partial` null it writes the
/// update of emflow::attend to `out`; otherwise the per-head partial state of partial.hpp to
/// `partial` (no offset, no weights), where a head whose visible scores are all -inf keeps
/// lse = -inf with entropy NaN, so that merging it with a part that has finite scores drops it.
template <class T>
void reference_pass(const AttentionInput<T>& in, const AttentionOutput<T>& out,
                    const PartialOutput<T>* partial) {
  const std::int64_t B = in.batch, N = in.tokens, d = in.dim, H = in.layer.heads;
  const std::int64_t Nq = query_count(in);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  std::vector<double> R(static_cast<std::size_t>(Nq * d));  // relevance gradients R = Q M_h
  std::vector<double> C(static_cast<std::size_t>(N * d));   // content C = X F_h^T
  std::vector<double> s(static_cast<std::size_t>(N));       // one query's scores
  std::vector<double> delta(static_cast<std::size_t>(Nq * d));

  for (std::int64_t b = 0; b < B; ++b) {
    const T* X = in.cloud + b * N * d;
    const T* Q = query_rows(in) + b * Nq * d;
    const QueryRule rule = query_rule(in, b);
    std::fill(delta.begin(), delta.end(), 0.0);

    for (std::int64_t h = 0; h < H; ++h) {
      const T* M = in.layer.relevance + h * d * d;
      const T* F = in.layer.content + h * d * d;
      const T* u = in.layer.key_bias ? in.layer.key_bias + h * d : nullptr;
      // A partial state keeps each head apart; the update sums them as it goes.
      if (partial != nullptr) std::fill(delta.begin(), delta.end(), 0.0);

      // R = Q M (row i is r_{q_i}^T = q_i^T M), C = X F^T (row j is (F x_j)^T).
      for (std::int64_t i = 0; i < std::max(N, Nq); ++i) {
        for (std::int64_t a = 0; a < d; ++a) {
          double r = 0.0, c = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            if (i < Nq) r += static_cast<double>(Q[i * d + k]) * static_cast<double>(M[k * d + a]);
            if (i < N) c += static_cast<double>(F[a * d + k]) * static_cast<double>(X[i * d + k]);
          }
          if (i < Nq) R[i * d + a] = r;
          if (i < N) C[i * d + a] = c;
        }
      }

      for (std::int64_t i = 0; i < Nq; ++i) {
        // s_ij = beta * (<r_i, x_j> + <u, x_j>), -inf where masked (the mask, the key length and
        // the positions); m_i = max_j s_ij, NaN as soon as one visible score is NaN
        // (docs/MATH.md §6.6).
        const KeyRange keys = rule.keys(i);
        double m = -inf;
        for (std::int64_t j = 0; j < N; ++j) {
          if (!keys.contains(j)) {
            s[j] = -inf;
            continue;
          }
          double score = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            const double xk = static_cast<double>(X[j * d + k]);
            score += (R[i * d + k] + (u ? static_cast<double>(u[k]) : 0.0)) * xk;
          }
          s[j] = in.beta * score;
          if (s[j] > m || std::isnan(s[j])) m = s[j];  // m stays NaN once it is NaN
        }

        const std::int64_t row = (b * H + h) * Nq + i;
        T* weights_row = out.weights ? out.weights + row * N : nullptr;
        double* o = delta.data() + i * d;
        double lse = -inf, entropy = 0.0;
        if (keys.empty()) {  // no visible key: delta_i = 0, lse_i = -inf, H_i = 0, p_i = 0
          if (weights_row) std::fill(weights_row, weights_row + N, T(0));
        } else if (partial != nullptr && m == -inf) {
          // Every visible score -inf: weight 0 for all, but the contents still count (§6.6).
          entropy = nan;
          for (std::int64_t j = keys.first; j < keys.last; ++j) {
            for (std::int64_t a = 0; a < d; ++a) o[a] += 0.0 * C[j * d + a];
          }
        } else if (!std::isfinite(m)) {
          // A NaN or +inf score, or only -inf ones: the weights are undefined, so the head's lse,
          // entropy, visible weights and its share of delta_i are NaN.
          lse = entropy = nan;
          if (weights_row) {
            for (std::int64_t j = 0; j < N; ++j) {
              weights_row[j] = keys.contains(j) ? static_cast<T>(nan) : T(0);
            }
          }
          for (std::int64_t a = 0; a < d; ++a) o[a] = nan;
        } else {
          // Z_i = sum_j exp(s_ij - m_i); lse_i = m_i + log Z_i; p_ij = exp(s_ij - lse_i).
          double Z = 0.0;
          for (std::int64_t j = 0; j < N; ++j) {
            if (s[j] != -inf) Z += std::exp(s[j] - m);
          }
          lse = m + std::log(Z);

          // delta_i += sum_j p_ij F x_j;  H_i = lse_i - sum_j p_ij s_ij. Every visible key's
          // content is weighted, even with p_ij = 0 (a score of -inf, or one that underflows),
          // so a non-finite F x_j reaches exactly the queries that see key j, as in the fused
          // backends.
          double expected_score = 0.0;
          for (std::int64_t j = 0; j < N; ++j) {
            const double p = (s[j] == -inf) ? 0.0 : std::exp(s[j] - lse);
            if (weights_row) weights_row[j] = static_cast<T>(p);
            if (!keys.contains(j)) continue;
            if (p > 0.0) expected_score += p * s[j];
            for (std::int64_t a = 0; a < d; ++a) o[a] += p * C[j * d + a];
          }
          entropy = lse - expected_score;
        }
        if (partial != nullptr) {
          partial->lse[row] = static_cast<T>(lse);
          partial->entropy[row] = static_cast<T>(entropy);
          T* head = partial->heads + row * d;
          for (std::int64_t a = 0; a < d; ++a) head[a] = static_cast<T>(o[a]);
        } else {
          if (out.lse) out.lse[row] = static_cast<T>(lse);
          if (out.entropy) out.entropy[row] = static_cast<T>(entropy);
        }
      }
    }
    if (partial != nullptr) continue;

    // delta_i += c for every query that sees at least one key; write Delta.
    T* D = out.update + b * Nq * d;
    for (std::int64_t i = 0; i < Nq; ++i) {
      const bool any_key = !rule.keys(i).empty();
      for (std::int64_t a = 0; a < d; ++a) {
        double value = delta[i * d + a];
        if (any_key && in.layer.offset) value += static_cast<double>(in.layer.offset[a]);
        D[i * d + a] = static_cast<T>(value);
      }
    }
  }
}

}  // namespace

template <class T>
void reference_attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) {
  reference_pass<T>(in, out, nullptr);
}

template <class T>
void reference_partial(const AttentionInput<T>& in, const PartialOutput<T>& out) {
  reference_pass(in, AttentionOutput<T>{}, &out);
}

template void reference_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&);
template void reference_attend<double>(const AttentionInput<double>&,
                                       const AttentionOutput<double>&);
template void reference_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&);
template void reference_partial<double>(const AttentionInput<double>&,
                                        const PartialOutput<double>&);

}  // namespace emflow::detail

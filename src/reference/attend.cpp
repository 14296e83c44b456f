// The double-precision reference of the EMF contextual update, written for clarity: each line
// is a formula of docs/MATH.md §1. It is the ground truth every backend is tested against, for
// self- and cross-attention and for the partial state over a block of keys (partial.hpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "core/rotary.hpp"

namespace emflow::detail {

namespace {

/// One query row of one head, from its scores s (N, -inf where key j is hidden or padding), their
/// maximum m (NaN once one is NaN) and the contents C (N x d, row j the content of key j): adds
/// the head's share to the row `o` of the update (of the head, for a partial state), writes the
/// weights row when given, and sets lse and entropy (docs/MATH.md §1.4, §6.6).
template <class T>
void weigh_row(const std::vector<double>& s, double m, KeyRange keys, const double* C,
               std::int64_t N, std::int64_t d, bool partial, T* weights_row, double* o, double& lse,
               double& entropy) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (keys.empty()) {  // no visible key: delta_i = 0, lse_i = -inf, H_i = 0, p_i = 0
    if (weights_row) std::fill(weights_row, weights_row + N, T(0));
  } else if (partial && m == -inf) {
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
}

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
        weigh_row(s, m, keys, C.data(), N, d, partial != nullptr, weights_row, o, lse, entropy);
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

void reference_attend_factored(const AttentionInput<double>& in, const FactoredLayer<double>& f,
                               const AttentionOutput<double>& out,
                               const PartialOutput<double>* partial) {
  const std::int64_t B = in.batch, N = in.tokens, d = in.dim, H = f.heads, r = f.rank;
  const std::int64_t Nq = query_count(in);
  const std::int64_t group = H / f.key_heads();  // query head h reads kv head h / group
  const double inf = std::numeric_limits<double>::infinity();
  const RotaryCall rotary = rotary_call(in, f.rotary);
  const auto count = [](std::int64_t n) { return static_cast<std::size_t>(n); };

  std::vector<double> queries(count(Nq * r));  // R(p_i) A_h q_i
  std::vector<double> keys(count(N * r));      // R(p_j) B_g x_j
  std::vector<double> values(count(r));        // V_g x_j
  std::vector<double> C(count(N * d));         // U_h V_g x_j
  std::vector<double> bias(count(N));          // u_h^T x_j
  std::vector<double> cosines(count(rotary.dim / 2)), sines(cosines.size());
  std::vector<double> s(count(N));
  std::vector<double> delta(count(Nq * d));

  // y = W x for W (rows x d) and x (d), in double.
  const auto apply = [d](const double* W, std::int64_t rows, const double* x, double* y) {
    for (std::int64_t c = 0; c < rows; ++c) {
      double sum = 0.0;
      for (std::int64_t k = 0; k < d; ++k) sum += W[c * d + k] * x[k];
      y[c] = sum;
    }
  };

  for (std::int64_t b = 0; b < B; ++b) {
    const double* X = in.cloud + b * N * d;
    const double* Q = query_rows(in) + b * Nq * d;
    const QueryRule rule = query_rule(in, b);
    std::fill(delta.begin(), delta.end(), 0.0);
    for (std::int64_t h = 0; h < H; ++h) {
      // A partial state keeps each head apart; the update sums them as it goes.
      if (partial != nullptr) std::fill(delta.begin(), delta.end(), 0.0);
      const double* A = f.query_factor + h * r * d;
      const double* Bk = f.key_factor + (h / group) * r * d;
      const double* U = f.content_up + h * d * r;
      const double* V = f.content_down + (h / group) * r * d;
      const double* u = f.key_bias ? f.key_bias + h * d : nullptr;
      for (std::int64_t i = 0; i < Nq; ++i) {
        double* q = queries.data() + i * r;
        apply(A, r, Q + i * d, q);
        if (rotary.dim == 0) continue;
        rotary.angles(rotary.query_position(b, rule, i), cosines.data(), sines.data());
        rotary.rotate(q, cosines.data(), sines.data());
      }
      for (std::int64_t j = 0; j < N; ++j) {
        double* k = keys.data() + j * r;
        apply(Bk, r, X + j * d, k);
        apply(V, r, X + j * d, values.data());
        for (std::int64_t a = 0; a < d; ++a) {
          double sum = 0.0;
          for (std::int64_t c = 0; c < r; ++c) sum += U[a * r + c] * values[count(c)];
          C[count(j * d + a)] = sum;
        }
        double ub = 0.0;
        for (std::int64_t a = 0; u != nullptr && a < d; ++a) ub += u[a] * X[j * d + a];
        bias[count(j)] = ub;
        if (rotary.dim == 0) continue;
        rotary.angles(rotary.key_position(b, rule, j), cosines.data(), sines.data());
        rotary.rotate(k, cosines.data(), sines.data());
      }
      for (std::int64_t i = 0; i < Nq; ++i) {
        // s_ij = beta (<R(p_i) A_h q_i, R(p_j) B_g x_j> + u_h^T x_j), -inf where hidden.
        const KeyRange visible = rule.keys(i);
        double m = -inf;
        for (std::int64_t j = 0; j < N; ++j) {
          if (!visible.contains(j)) {
            s[count(j)] = -inf;
            continue;
          }
          double score = 0.0;
          for (std::int64_t c = 0; c < r; ++c)
            score += queries[count(i * r + c)] * keys[count(j * r + c)];
          const double sj = in.beta * (score + bias[count(j)]);
          s[count(j)] = sj;
          if (sj > m || std::isnan(sj)) m = sj;  // m stays NaN once it is NaN
        }
        const std::int64_t row = (b * H + h) * Nq + i;
        double* weights_row = out.weights ? out.weights + row * N : nullptr;
        double* o = delta.data() + i * d;
        double lse = -inf, entropy = 0.0;
        weigh_row(s, m, visible, C.data(), N, d, partial != nullptr, weights_row, o, lse, entropy);
        if (partial != nullptr) {
          partial->lse[row] = lse;
          partial->entropy[row] = entropy;
          std::copy(o, o + d, partial->heads + row * d);
          continue;
        }
        if (out.lse) out.lse[row] = lse;
        if (out.entropy) out.entropy[row] = entropy;
      }
    }
    if (partial != nullptr) continue;
    double* D = out.update + b * Nq * d;
    for (std::int64_t i = 0; i < Nq; ++i) {
      const bool any_key = !rule.keys(i).empty();
      for (std::int64_t a = 0; a < d; ++a) {
        D[i * d + a] = delta[count(i * d + a)] + (any_key && f.offset ? f.offset[a] : 0.0);
      }
    }
  }
}

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

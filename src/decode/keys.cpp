// KeyStore (keys.hpp): append projects only the new tokens (and rotates their keys at their
// positions); attend splits the visible keys of each query into spans, computes a partial state per
// span (lse, entropy, weighted value, as partial.hpp defines them) and merges the spans in order
// with the merge every backend shares. A task is one query against one set of keys and values
// over one span, for every head of the set's group (grouped kv heads), so each cached key and
// value is read once per group; each exp(s - m) is computed once and reused for the weight.
#include "decode/keys.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.hpp"
#include "core/partial_rows.hpp"

namespace emflow::detail::decode {

namespace {

constexpr std::int64_t kSpanKeys = 1024;  // keys below which a query's span is not split

/// sum_k a[k] b[k] in double. The sum is split into vector lanes (omp simd) and so differs from
/// the sequential one by rounding only; it is the same on every call, thread count and span.
template <class A, class B>
double dot(const A* a, const B* b, std::int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t k = 0; k < n; ++k) sum += static_cast<double>(a[k]) * static_cast<double>(b[k]);
  return sum;
}

/// out[rows x outputs] += rows of `in` (rows x inputs) times map^T, map row-major outputs x inputs.
template <class T>
void append_projected(const T* in, std::int64_t rows, std::int64_t inputs, const T* map,
                      std::int64_t outputs, std::vector<T>& out) {
  for (std::int64_t j = 0; j < rows; ++j) {
    for (std::int64_t o = 0; o < outputs; ++o) {
      out.push_back(static_cast<T>(dot(map + o * inputs, in + j * inputs, inputs)));
    }
  }
}

/// out[outputs] = map (outputs x inputs, row-major) times `in`, in double.
template <class T>
void project(const T* in, std::int64_t inputs, const T* map, std::int64_t outputs, double* out) {
  for (std::int64_t o = 0; o < outputs; ++o) out[o] = dot(map + o * inputs, in, inputs);
}

}  // namespace

template <class T>
KeyStore<T>::KeyStore(const LayerOperators<T>& layer, std::int64_t dim, double beta)
    : dim_(dim), heads_(layer.heads), width_(dim), sets_(layer.heads), beta_(beta) {
  const std::int64_t ops = heads_ * dim * dim;
  query_map_.assign(layer.relevance, layer.relevance + ops);
  value_map_.assign(layer.content, layer.content + ops);
  if (layer.key_bias) key_bias_.assign(layer.key_bias, layer.key_bias + heads_ * dim);
  if (layer.offset) offset_.assign(layer.offset, layer.offset + dim);
  per_set_.resize(static_cast<std::size_t>(sets_));
}

template <class T>
KeyStore<T>::KeyStore(const FactoredLayer<T>& layer, std::int64_t dim, double beta)
    : factored_(true),
      dim_(dim),
      heads_(layer.heads),
      width_(layer.rank),
      sets_(layer.key_heads()),
      beta_(beta) {
  const std::int64_t ops = heads_ * layer.rank * dim, kv_ops = sets_ * layer.rank * dim;
  query_map_.assign(layer.query_factor, layer.query_factor + ops);
  key_map_.assign(layer.key_factor, layer.key_factor + kv_ops);
  up_map_.assign(layer.content_up, layer.content_up + ops);
  value_map_.assign(layer.content_down, layer.content_down + kv_ops);
  if (layer.key_bias) key_bias_.assign(layer.key_bias, layer.key_bias + heads_ * dim);
  if (layer.offset) offset_.assign(layer.offset, layer.offset + dim);
  per_set_.resize(static_cast<std::size_t>(sets_));
  if (layer.key_bias) bias_.resize(static_cast<std::size_t>(heads_));
  if (layer.rotary.dim != 0) {
    // The frequencies do not depend on the length (the constructor refused the dynamic scaling
    // without explicit ones), so they are fixed once for every key and query.
    rotary_.dim = layer.rotary.dim;
    rotary_.interleaved = layer.rotary.pairing == RotaryPairing::interleaved;
    rotary_.inverse_frequencies = rotary_inverse_frequencies(layer.rotary, 1);
  }
}

template <class T>
void KeyStore<T>::append(const T* tokens, std::int64_t count) {
  const std::int64_t d = dim_, w = width_;
  if (!factored_) tokens_.insert(tokens_.end(), tokens, tokens + count * d);
  std::vector<double> key(static_cast<std::size_t>(factored_ ? w : 0));
  std::vector<double> cosines(static_cast<std::size_t>(rotary_.dim / 2)), sines(cosines.size());
  for (std::int64_t g = 0; g < sets_; ++g) {
    Set& set = per_set_[static_cast<std::size_t>(g)];
    append_projected(tokens, count, d, value_map_.data() + g * w * d, w, set.values);
    if (!factored_) continue;
    // k_j = R(j) B_g x_j in double, rounded to T once: each key is rotated here, at its
    // position, and never again.
    for (std::int64_t t = 0; t < count; ++t) {
      project(tokens + t * d, d, key_map_.data() + g * w * d, w, key.data());
      if (rotary_.dim != 0) {
        rotary_.angles(size_ + t, cosines.data(), sines.data());
        rotary_.rotate(key.data(), cosines.data(), sines.data());
      }
      for (const double k : key) set.keys.push_back(static_cast<T>(k));
    }
  }
  for (std::size_t h = 0; h < bias_.size(); ++h) {
    append_projected(tokens, count, d, key_bias_.data() + static_cast<std::int64_t>(h) * d, 1,
                     bias_[h]);
  }
  size_ += count;
}

template <class T>
void KeyStore<T>::clear() {
  size_ = 0;
  tokens_.clear();
  for (Set& set : per_set_) {
    set.keys.clear();
    set.values.clear();
  }
  for (std::vector<T>& bias : bias_) bias.clear();
}

template <class T>
const typename KeyStore<T>::Set& KeyStore<T>::set_of(std::int64_t h) const {
  // Query head h reads kv head h / (heads / kv_heads); the dense form has a set per head.
  return per_set_[static_cast<std::size_t>(h / (heads_ / sets_))];
}

template <class T>
const T* KeyStore<T>::head_keys(std::int64_t h) const {
  return factored_ ? set_of(h).keys.data() : tokens_.data();
}

template <class T>
void KeyStore<T>::project_query(const T* q, std::int64_t h, std::int64_t position,
                                double* p) const {
  const std::int64_t d = dim_, w = width_;
  if (factored_) {  // p = beta R(position) A_h q (beta commutes with the rotation)
    const T* A = query_map_.data() + h * w * d;
    for (std::int64_t k = 0; k < w; ++k) p[k] = beta_ * dot(A + k * d, q, d);
    if (rotary_.dim != 0) {
      std::vector<double> cosines(static_cast<std::size_t>(rotary_.dim / 2)), sines(cosines.size());
      rotary_.angles(position, cosines.data(), sines.data());
      rotary_.rotate(p, cosines.data(), sines.data());
    }
    return;
  }
  // p = beta (M_h^T q + u_h): s_j = <p, x_j>
  const T* M = query_map_.data() + h * d * d;
  const T* u = key_bias_.empty() ? nullptr : key_bias_.data() + h * d;
  for (std::int64_t a = 0; a < d; ++a) {
    double sum = u ? static_cast<double>(u[a]) : 0.0;
    for (std::int64_t k = 0; k < d; ++k) sum += static_cast<double>(q[k]) * M[k * d + a];
    p[a] = beta_ * sum;
  }
}

template <class T>
void KeyStore<T>::attend(const T* queries, std::int64_t count, const QueryRule& rule,
                         const AttentionOutput<T>& output, int threads) const {
  const std::int64_t d = dim_, w = width_, H = heads_;
  // With the thread count left to us, small calls run on one thread, as in the engine: waking a
  // team costs a few microseconds on an idle machine and up to a scheduler time slice on a busy
  // one, more than a call of a few MFLOP (one query against a short cache) takes alone.
  const double work = 2.0 * static_cast<double>(count * H) *
                      (2.0 * static_cast<double>(size_ * w) + static_cast<double>(2 * d * w));
  constexpr double kSmallCallFlop = 4e6;
  const int workers = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();
  // Few queries against many keys: split every query's keys so that each worker has spans.
  std::int64_t spans = 1;
  // The tasks: a query against a set of keys and values (all the heads of its group), per span.
  const std::int64_t group = H / sets_, set_rows = count * sets_;
  if (workers > 1 && size_ >= 2 * kSpanKeys && set_rows < 4 * workers) {
    spans = std::min<std::int64_t>(4 * workers, (size_ + kSpanKeys - 1) / kSpanKeys);
  }
  const std::int64_t span_keys = (size_ + spans - 1) / spans;
  const std::int64_t rows = count * H;
  std::vector<double> projected(static_cast<std::size_t>(rows * w));
  std::vector<double> lse(static_cast<std::size_t>(spans * rows));
  std::vector<double> entropy(lse.size());
  std::vector<double> o(lse.size() * static_cast<std::size_t>(w));
  ParallelErrors errors;
#pragma omp parallel num_threads(workers)
  {
    std::vector<double> scores, exponentials, maxima, expected, inverse;
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      errors.run([&] {
        const std::int64_t i = row % count;
        project_query(queries + i * d, row / count, rule.query_origin + i, &projected[row * w]);
      });
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < spans * set_rows; ++task) {
      errors.run([&] {
        // One query against one set's keys, for every head of the set's group (grouped kv
        // heads; one head in the dense form): each key and value is read once for the group.
        const std::int64_t span = task / set_rows, g = (task % set_rows) / count, i = task % count;
        const KeyRange seen = rule.keys(i);
        const std::int64_t first = std::max(seen.first, span * span_keys);
        const std::int64_t last = std::min(seen.last, (span + 1) * span_keys);
        const std::int64_t n = std::max<std::int64_t>(last - first, 0);
        for (std::int64_t k = 0; k < group; ++k) {
          const std::int64_t at = span * rows + (g * group + k) * count + i;
          std::fill(&o[static_cast<std::size_t>(at * w)], &o[static_cast<std::size_t>(at * w)] + w,
                    0.0);
          lse[static_cast<std::size_t>(at)] = -std::numeric_limits<double>::infinity();
          entropy[static_cast<std::size_t>(at)] = 0.0;
        }
        if (n == 0) return;
        const Set& set = per_set_[static_cast<std::size_t>(g)];
        const T* keys = head_keys(g * group);
        const auto cell = [n](std::int64_t k, std::int64_t j) {
          return static_cast<std::size_t>(k * n + j);
        };
        scores.resize(static_cast<std::size_t>(group * n));
        exponentials.resize(scores.size());
        maxima.assign(static_cast<std::size_t>(group), -std::numeric_limits<double>::infinity());
        expected.assign(maxima.size(), 0.0);
        inverse.resize(maxima.size());
        for (std::int64_t j = first; j < last; ++j) {
          const T* key = keys + j * w;
          for (std::int64_t k = 0; k < group; ++k) {
            const std::int64_t h = g * group + k;
            const double* p = &projected[static_cast<std::size_t>((h * count + i) * w)];
            const double b =
                bias_.empty() ? 0.0
                              : beta_ * static_cast<double>(bias_[static_cast<std::size_t>(h)][j]);
            const double score = b + dot(p, key, w);
            scores[cell(k, j - first)] = score;
            maxima[static_cast<std::size_t>(k)] =
                std::max(maxima[static_cast<std::size_t>(k)], score);
          }
        }
        // exp(s_j - m) once per key: the weights are exp(s_j - m) / sum = exp(s_j - lse).
        for (std::int64_t k = 0; k < group; ++k) {
          const double m = maxima[static_cast<std::size_t>(k)];
          double sum = 0.0;
          for (std::int64_t j = 0; j < n; ++j) {
            exponentials[cell(k, j)] = std::exp(scores[cell(k, j)] - m);
            sum += exponentials[cell(k, j)];
          }
          const std::int64_t at = span * rows + (g * group + k) * count + i;
          lse[static_cast<std::size_t>(at)] = m + std::log(sum);
          inverse[static_cast<std::size_t>(k)] = 1.0 / sum;
        }
        for (std::int64_t j = first; j < last; ++j) {
          const T* v = set.values.data() + j * w;
          for (std::int64_t k = 0; k < group; ++k) {
            const double weight =
                exponentials[cell(k, j - first)] * inverse[static_cast<std::size_t>(k)];
            expected[static_cast<std::size_t>(k)] += weight * scores[cell(k, j - first)];
            const std::int64_t at = span * rows + (g * group + k) * count + i;
            double* state = &o[static_cast<std::size_t>(at * w)];
            for (std::int64_t a = 0; a < w; ++a) state[a] += weight * static_cast<double>(v[a]);
          }
        }
        for (std::int64_t k = 0; k < group; ++k) {
          const std::int64_t at = span * rows + (g * group + k) * count + i;
          entropy[static_cast<std::size_t>(at)] =
              lse[static_cast<std::size_t>(at)] - expected[static_cast<std::size_t>(k)];
        }
      });
    }
    // Merge the spans of each query in order, map each head back, and finish the query.
    std::vector<double> heads_out(static_cast<std::size_t>(H * d)), head_lse(H), head_entropy(H),
        delta(static_cast<std::size_t>(d)), offset;
    if (!offset_.empty()) offset.assign(offset_.begin(), offset_.end());
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < count; ++i) {
      errors.run([&] {
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t row = h * count + i;
          double* state = &o[static_cast<std::size_t>(row * w)];
          double& l = lse[static_cast<std::size_t>(row)];
          double& e = entropy[static_cast<std::size_t>(row)];
          for (std::int64_t span = 1; span < spans; ++span) {
            const std::int64_t other = span * rows + row;
            merge_state(l, e, state, lse[static_cast<std::size_t>(other)],
                        entropy[static_cast<std::size_t>(other)],
                        &o[static_cast<std::size_t>(other * w)], w);
          }
          double* back = &heads_out[static_cast<std::size_t>(h * d)];
          if (factored_) {
            const T* U = up_map_.data() + h * d * w;
            for (std::int64_t a = 0; a < d; ++a) {
              back[a] = dot(U + a * w, state, w);
            }
          } else {
            std::copy(state, state + d, back);
          }
          head_lse[static_cast<std::size_t>(h)] = l;
          head_entropy[static_cast<std::size_t>(h)] = e;
        }
        finish_query<double>(H, 1, head_lse.data(), head_entropy.data(), heads_out.data(), d,
                             offset.empty() ? nullptr : offset.data(), delta.data(),
                             head_lse.data(), head_entropy.data());
        for (std::int64_t a = 0; a < d; ++a) output.update[i * d + a] = static_cast<T>(delta[a]);
        for (std::int64_t h = 0; h < H; ++h) {
          if (output.lse) output.lse[h * count + i] = static_cast<T>(head_lse[h]);
          if (output.entropy) output.entropy[h * count + i] = static_cast<T>(head_entropy[h]);
        }
      });
    }
  }
  errors.rethrow();
}

template class KeyStore<float>;
template class KeyStore<double>;

}  // namespace emflow::detail::decode

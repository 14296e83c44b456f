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
#include <type_traits>

#include "core/backends.hpp"
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
  if (std::is_same_v<T, float> && this_machine().cpu_missing.empty()) {
    const std::int64_t r = width_, K = sets_, H = heads_;
    const auto padded = [](std::int64_t n) {
      return (n + kProductColumns - 1) / kProductColumns * kProductColumns;
    };
    // rows (outputs x depth, row-major) transposed into the panels of a depth x columns B.
    const auto pack = [](std::vector<float>& out, std::int64_t depth, std::int64_t columns,
                         std::int64_t outputs, const auto& row) {
      out.assign(static_cast<std::size_t>(depth * columns), 0.0f);
      for (std::int64_t c = 0; c < outputs; ++c) {
        for (std::int64_t a = 0; a < depth; ++a) {
          out[static_cast<std::size_t>(product_index(depth, columns, a, c))] =
              static_cast<float>(row(c, a));
        }
      }
    };
    key_value_columns_ = padded(2 * K * r);
    pack(key_value_panels_, dim, key_value_columns_, 2 * K * r,
         [&](std::int64_t c, std::int64_t a) {
           return c < K * r ? key_map_[c * dim + a] : value_map_[(c - K * r) * dim + a];
         });
    query_columns_ = padded(H * r);
    pack(query_panels_, dim, query_columns_, H * r,
         [&](std::int64_t c, std::int64_t a) { return query_map_[c * dim + a]; });
    // B's element (k = h r + c, a) is U_h's (a, c): up_map_ holds U_h as d x r.
    up_columns_ = padded(dim);
    pack(up_panels_, H * r, up_columns_, dim, [&](std::int64_t a, std::int64_t k) {
      return up_map_[(k / r) * dim * r + a * r + k % r];
    });
  }
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
  if constexpr (std::is_same_v<T, float>) {
    if (products()) {
      append_products(tokens, count);
      return;
    }
  }
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
void KeyStore<T>::append_products(const T* tokens, std::int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    // The keys and values of every kv head in one float32 product (the engine's, as the fused
    // factored form computes them), then each key rotated at its position in double and written
    // into the transposed panels of its kv head.
    const std::int64_t d = dim_, w = width_, K = sets_, columns = key_value_columns_;
    std::vector<float> products(static_cast<std::size_t>(count * columns));
    cpu_products(tokens, count, d, key_value_panels_.data(), columns, products.data(), 0);
    std::vector<double> key(static_cast<std::size_t>(w));
    std::vector<double> cosines(static_cast<std::size_t>(rotary_.dim / 2)), sines(cosines.size());
    constexpr std::int64_t P = kCachedPanel;
    const std::int64_t panels = (size_ + count + P - 1) / P;
    for (std::int64_t g = 0; g < K; ++g) {
      Set& set = per_set_[static_cast<std::size_t>(g)];
      set.keys.resize(static_cast<std::size_t>(panels * P * w), 0.0f);
      for (std::int64_t t = 0; t < count; ++t) {
        const float* row = products.data() + t * columns;
        set.values.insert(set.values.end(), row + (K + g) * w, row + (K + g + 1) * w);
        std::copy(row + g * w, row + (g + 1) * w, key.begin());
        if (rotary_.dim != 0) {
          rotary_.angles(size_ + t, cosines.data(), sines.data());
          rotary_.rotate(key.data(), cosines.data(), sines.data());
        }
        // Key j at lane j % P of its panel's rows (cpu_cached_partial).
        const std::int64_t j = size_ + t;
        float* slot = set.keys.data() + (j / P) * P * w + j % P;
        for (std::int64_t k = 0; k < w; ++k) slot[k * P] = static_cast<float>(key[k]);
      }
    }
    for (std::size_t h = 0; h < bias_.size(); ++h) {
      append_projected(tokens, count, d, key_bias_.data() + static_cast<std::int64_t>(h) * d, 1,
                       bias_[h]);
    }
    size_ += count;
  }
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
  // The float factored form where the engine runs: the queries of every head in one product, and
  // the merged states of every head (stacked, count x H r) back to the cloud in another.
  std::vector<float> query_products, stacked;
  if constexpr (std::is_same_v<T, float>) {
    if (products()) {
      query_products.resize(static_cast<std::size_t>(count * query_columns_));
      cpu_products(queries, count, d, query_panels_.data(), query_columns_, query_products.data(),
                   threads);
      stacked.resize(static_cast<std::size_t>(count * H * w));
    }
  }
  ParallelErrors errors;
#pragma omp parallel num_threads(workers)
  {
    std::vector<double> scores, exponentials, maxima, expected, inverse;
    // The float32 form's (products()): its group's queries, key bias rows and partial states.
    std::vector<float> group_queries, panel_scratch;
    std::vector<const float*> group_bias;
    std::vector<double> group_lse, group_entropy, group_o;
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      errors.run([&] {
        const std::int64_t i = row % count, h = row / count;
        if (!query_products.empty()) {
          // p = beta R(position) A_h q from the float32 product of every head.
          double* p = &projected[static_cast<std::size_t>(row * w)];
          const float* q = query_products.data() + i * query_columns_ + h * w;
          for (std::int64_t k = 0; k < w; ++k) p[k] = beta_ * static_cast<double>(q[k]);
          if (rotary_.dim != 0) {
            std::vector<double> cosines(static_cast<std::size_t>(rotary_.dim / 2)),
                sines(cosines.size());
            rotary_.angles(rule.query_origin + i, cosines.data(), sines.data());
            rotary_.rotate(p, cosines.data(), sines.data());
          }
          return;
        }
        project_query(queries + i * d, h, rule.query_origin + i, &projected[row * w]);
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
        if constexpr (std::is_same_v<T, float>) {
          if (products()) {  // the group's heads in float32 on the keys' panels
            constexpr std::int64_t P = kCachedPanel;
            group_queries.resize(static_cast<std::size_t>(group * w));
            group_bias.assign(static_cast<std::size_t>(group), nullptr);
            for (std::int64_t k = 0; k < group; ++k) {
              const std::int64_t h = g * group + k;
              const double* p = &projected[static_cast<std::size_t>((h * count + i) * w)];
              std::copy(p, p + w, group_queries.begin() + k * w);
              if (!bias_.empty())
                group_bias[static_cast<std::size_t>(k)] = bias_[static_cast<std::size_t>(h)].data();
            }
            const std::int64_t slots = ((last + P - 1) / P - first / P) * P;
            panel_scratch.resize(static_cast<std::size_t>(group * slots + w));
            group_lse.resize(static_cast<std::size_t>(group));
            group_entropy.resize(group_lse.size());
            group_o.resize(static_cast<std::size_t>(group * w));
            cpu_cached_partial(group_queries.data(), group, w, set.keys.data(), set.values.data(),
                               bias_.empty() ? nullptr : group_bias.data(),
                               static_cast<float>(beta_), first, last, panel_scratch.data(),
                               group_lse.data(), group_entropy.data(), group_o.data());
            for (std::int64_t k = 0; k < group; ++k) {
              const std::int64_t at = span * rows + (g * group + k) * count + i;
              lse[static_cast<std::size_t>(at)] = group_lse[static_cast<std::size_t>(k)];
              entropy[static_cast<std::size_t>(at)] = group_entropy[static_cast<std::size_t>(k)];
              std::copy(group_o.begin() + k * w, group_o.begin() + (k + 1) * w, o.begin() + at * w);
            }
            return;
          }
        }
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
          if (!stacked.empty()) {
            std::copy(state, state + w, stacked.begin() + (i * H + h) * w);
            continue;
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
        if (!stacked.empty()) return;  // finished below, after the product
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
  if constexpr (std::is_same_v<T, float>) {
    if (!stacked.empty()) finish_products(stacked, count, lse, entropy, output, threads);
  }
}

template <class T>
void KeyStore<T>::finish_products(const std::vector<float>& stacked, std::int64_t count,
                                  const std::vector<double>& lse,
                                  const std::vector<double>& entropy,
                                  const AttentionOutput<T>& output, int threads) const {
  if constexpr (std::is_same_v<T, float>) {
    // delta_i = sum_h U_h o_h: one product over the stacked heads. Then the rules of
    // finish_query: a head whose keys all scored -inf makes the update NaN, a query that saw no
    // key gets 0 (its heads' states are 0) and no offset.
    const std::int64_t d = dim_, H = heads_, columns = up_columns_;
    std::vector<float> backs(static_cast<std::size_t>(count * columns));
    cpu_products(stacked.data(), count, H * width_, up_panels_.data(), columns, backs.data(),
                 threads);
    const double inf = std::numeric_limits<double>::infinity();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (std::int64_t i = 0; i < count; ++i) {
      bool saw_key = false, undefined = false;
      for (std::int64_t h = 0; h < H; ++h) {
        double l = lse[static_cast<std::size_t>(h * count + i)];
        double e = entropy[static_cast<std::size_t>(h * count + i)];
        const bool none = saw_no_key(l, e);
        saw_key = saw_key || !none;
        if (l == -inf && !none) l = e = nan;
        undefined = undefined || std::isnan(l);
        if (output.lse) output.lse[h * count + i] = static_cast<T>(l);
        if (output.entropy) output.entropy[h * count + i] = static_cast<T>(e);
      }
      const float* back = backs.data() + i * columns;
      for (std::int64_t a = 0; a < d; ++a) {
        double delta = undefined ? nan : static_cast<double>(back[a]);
        if (saw_key && !offset_.empty()) delta += static_cast<double>(offset_[a]);
        output.update[i * d + a] = static_cast<T>(delta);
      }
    }
  }
}

template class KeyStore<float>;
template class KeyStore<double>;

}  // namespace emflow::detail::decode

// The test matrix: every entry point on every device, for both forms of a layer (dense,
// factored), every storage type (f64, f32, tf32: float storage with TF32 products permitted,
// bf16, f16) and every operation (self-attention, cross-attention, the partial states of two
// blocks of keys merged and finished, the decode cache), on a few small problems.
//
// A target (MatrixTarget) is device x entry x form x storage x operation: the blocking calls
// (attend, attend_factored, attend_partial with merge_partial and finish_partial, BasicDecodeCache)
// on Device::reference, cpu and cuda, and on Device::cuda the stream-ordered calls on device
// buffers (cuda::attend_async, attend_factored_async, attend_partial_async with
// merge_partial_async and finish_partial_async) and the plan (cuda::AttentionPlan, made once and
// run). What each target x case must do is read from route() (capability.hpp) for the call's
// Problem: a supported route runs and meets the accuracy contract (common/accuracy.hpp) against
// one double oracle (cross_oracle of attention/cross.hpp on the inputs rounded to the storage
// type, the factored layer expanded in double); a refused one throws ErrorCode::unsupported with
// route()'s reason. The one skip is Route::device_missing (no CUDA device here), with the
// reason: an unexpected `unsupported` fails. Outputs are poisoned with NaN before each call, and
// every query without a visible key must read exactly 0, -inf and 0.
//
// The factored form also runs with grouped kv heads and rotary positions (MatrixRotary, a llama
// layer): its oracle is the layer's definition in double, each projected query and key turned at
// its position (rotary_oracle), since a rotary layer has no single M_h to expand.
//
// The decode cache is BasicDecodeCache<float> or <double> (the 16-bit types have none, which
// route() says in tests/attention/entry_routes_test.cpp); the partial state of the factored form
// is float or double and blocking only (attend_partial of a FactoredLayer), and the partial state
// has no stream-ordered 16-bit form (attend_partial_async is float or double), so those targets
// do not exist. Names read target_case: cuda_plan_factored_bf16_cross_B2_H2_N7_q5_d5_r3_causal_
// lengths_bias_offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/backends.hpp"
#include "attention/cross.hpp"
#include "common/accuracy.hpp"
#include "common/stored.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/error.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/precision.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include "emflow/cuda.hpp"
#endif

namespace emflow::testing {
namespace {

enum class Storage { f64, f32, tf32, bf16, f16 };
enum class Op { self, cross, partial, decode };
/// blocking: host arrays; async: the stream-ordered calls; plan: cuda::AttentionPlan.
enum class Entry { blocking, async, plan };

const char* to_name(Storage s) {
  const char* names[] = {"f64", "f32", "tf32", "bf16", "f16"};
  return names[static_cast<int>(s)];
}
const char* to_name(Op op) {
  const char* names[] = {"self", "cross", "partial", "decode"};
  return names[static_cast<int>(op)];
}
const char* to_name(Entry e) {
  const char* names[] = {"", "_async", "_plan"};
  return names[static_cast<int>(e)];
}

Precision precision_of(Storage s) {
  switch (s) {
    case Storage::tf32:
      return Precision::tf32;
    case Storage::bf16:
      return Precision::bf16;
    case Storage::f16:
      return Precision::fp16;
    default:
      return Precision::fp32;
  }
}

/// A value as storage `s` holds it (float, and TF32 storage, round to float).
double round_to(Storage s, double v) {
  const float f = static_cast<float>(v);
  switch (s) {
    case Storage::f64:
      return v;
    case Storage::bf16:
      return to_float(to_bfloat16(f));
    case Storage::f16:
      return to_float(to_float16(f));
    default:
      return f;
  }
}

struct MatrixTarget {
  Device device;
  Entry entry;
  Form form;
  Storage storage;
  Op op;

  std::string name() const {
    return std::string(emflow::to_string(device)) + to_name(entry) + "_" + emflow::to_string(form) +
           "_" + to_name(storage) + "_" + to_name(op);
  }
};

/// One problem: B clouds of N keys in R^d, H heads, rank r for the factored form, Nq queries of
/// their own (cross, partial, decode), key and query lengths (cloud 1 shorter), key bias and
/// offset, and the weights asked for where the operation returns them (self, cross).
struct Case {
  std::int64_t batch, heads, tokens, queries, dim, rank;
  Mask mask;
  bool lengths = false, bias = false, offset = false, weights = false;
  /// The factored form only: kv heads (0: heads) and rotary positions over the first `rotary`
  /// coordinates of the rank (half-split pairs, base 10000; 0: none).
  std::int64_t kv_heads = 0, rotary = 0;

  std::string name() const {
    std::string out = "B" + std::to_string(batch) + "_H" + std::to_string(heads) + "_N" +
                      std::to_string(tokens) + "_q" + std::to_string(queries) + "_d" +
                      std::to_string(dim) + "_r" + std::to_string(rank) + "_" +
                      name_part(emflow::to_string(mask));
    if (lengths) out += "_lengths";
    if (bias) out += "_bias";
    if (offset) out += "_offset";
    if (weights) out += "_weights";
    if (kv_heads != 0) out += "_kv" + std::to_string(kv_heads);
    if (rotary != 0) out += "_rotary" + std::to_string(rotary);
    return out;
  }
};

struct Param {
  MatrixTarget target;
  Case c;
};

std::ostream& operator<<(std::ostream& out, const Param& p) {
  return out << p.target.name() << "_" << p.c.name();
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return info.param.target.name() + "_" + info.param.c.name();
}

// ---- The problem in double, rounded to the storage type, and its oracle -------------------

/// A case's arrays as the storage type holds them (in double), the factors of the factored form,
/// and the dense operators the oracle reads (for the factored form, expanded in double).
struct Stored {
  CrossProblem p;  // relevance and content: M_h, F_h (expanded for the factored form)
  std::vector<double> A, B, U, V;  // (H, r, d), (K, r, d), (H, d, r), (K, r, d)
  std::int64_t kv_heads = 0;       // K: the heads of B and V (the factored form)
  std::int64_t rotary = 0;         // rotated coordinates of the rank (0: none)
};

constexpr double kRotaryBase = 10000.0;

/// v (the first `dim` coordinates of a projected query or key, in half-split pairs (t, t + dim
/// / 2)) turned by position * base^(-2t / dim), the angles in double (docs/MATH.md §2.4).
template <class V>
void turn(V* v, std::int64_t dim, std::int64_t position) {
  for (std::int64_t t = 0; t < dim / 2; ++t) {
    const double angle =
        static_cast<double>(position) *
        std::pow(kRotaryBase, -2.0 * static_cast<double>(t) / static_cast<double>(dim));
    const double a = static_cast<double>(v[t]), b = static_cast<double>(v[t + dim / 2]);
    v[t] = static_cast<V>(a * std::cos(angle) - b * std::sin(angle));
    v[t + dim / 2] = static_cast<V>(b * std::cos(angle) + a * std::sin(angle));
  }
}

Stored make_problem(const Case& c, Form form, Storage storage, Op op) {
  Stored s;
  CrossProblem& p = s.p;
  p.batch = c.batch;
  p.heads = c.heads;
  p.tokens = c.tokens;
  p.query_tokens = op == Op::self ? c.tokens : c.queries;
  p.dim = c.dim;
  p.mask = c.mask;
  p.beta = 0.8;
  p.self = op == Op::self;
  p.bias = c.bias;
  p.offset = c.offset;
  if (c.lengths) {
    p.key_lengths = {c.tokens, std::max<std::int64_t>(1, c.tokens - 3)};
    p.key_lengths.resize(static_cast<std::size_t>(c.batch), c.tokens);
    if (!p.self) {
      p.query_lengths = {c.queries, std::max<std::int64_t>(1, c.queries - 2)};
      p.query_lengths.resize(static_cast<std::size_t>(c.batch), c.queries);
    }
  }
  p.fill(500 + static_cast<std::uint64_t>(c.tokens * 13 + c.dim + c.queries));
  for (std::vector<double>* v :
       {&p.cloud, &p.queries, &p.relevance, &p.content, &p.key_bias, &p.shift}) {
    for (double& x : *v) x = round_to(storage, x);
  }
  if (form == Form::factored) {
    const std::int64_t H = c.heads, r = c.rank, d = c.dim;
    const std::int64_t K = c.kv_heads != 0 ? c.kv_heads : H;
    s.kv_heads = K;
    s.rotary = c.rotary;
    const double scale = 1.0 / std::sqrt(static_cast<double>(r));
    const auto factor = [&](std::int64_t heads, std::uint64_t seed) {
      std::vector<double> f = uniform(static_cast<std::size_t>(heads * r * d), seed, -scale, scale);
      for (double& x : f) x = round_to(storage, x);
      return f;
    };
    s.A = factor(H, 71);
    s.B = factor(K, 72);
    s.U = factor(H, 73);
    s.V = factor(K, 74);
    // M_h = A_h^T B_g and F_h = U_h V_g, g = h / (H / K): the oracle of a layer without rotary
    // positions (a rotary layer has no single M_h: rotary_oracle below).
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / (H / K);
      for (std::int64_t k = 0; k < d; ++k) {
        for (std::int64_t a = 0; a < d; ++a) {
          double m = 0.0, f = 0.0;
          for (std::int64_t q = 0; q < r; ++q) {
            m += s.A[static_cast<std::size_t>((h * r + q) * d + k)] *
                 s.B[static_cast<std::size_t>((g * r + q) * d + a)];
            f += s.U[static_cast<std::size_t>((h * d + k) * r + q)] *
                 s.V[static_cast<std::size_t>((g * r + q) * d + a)];
          }
          p.relevance[static_cast<std::size_t>((h * d + k) * d + a)] = m;
          p.content[static_cast<std::size_t>((h * d + k) * d + a)] = f;
        }
      }
    }
  }
  return s;
}

/// The keys query i of cloud b sees: each pair of positions put to Mask::allows.
std::vector<std::int64_t> visible_keys(const CrossProblem& p, std::int64_t b, std::int64_t i) {
  std::vector<std::int64_t> visible;
  for (std::int64_t j = 0; j < p.key_length(b); ++j) {
    if (p.mask.allows(p.query_origin(b) + i, p.key_position + j)) visible.push_back(j);
  }
  return visible;
}

/// The oracle of a rotary layer from the definition, in double (it has no single M_h): per head
/// h, reading kv head g = h / (H / K), q = A_h q_i and k_j = B_g x_j turned at their positions
/// (the mask's: query_origin(b) + i and key_position + j), s_ij = beta (<q, k_j> + u_h^T x_j),
/// the softmax over the visible keys, and update_i = sum_h U_h sum_j w_ij V_g x_j + c.
CrossResult rotary_oracle(const Stored& s) {
  const CrossProblem& p = s.p;
  const std::int64_t B = p.batch, H = p.heads, N = p.tokens, Nq = p.rows(), d = p.dim;
  const std::int64_t K = s.kv_heads, r = static_cast<std::int64_t>(s.A.size()) / (H * d);
  const double inf = std::numeric_limits<double>::infinity();
  const auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  CrossResult out;
  out.update.assign(at(B * Nq * d), 0.0);
  out.lse.assign(at(B * H * Nq), -inf);
  out.entropy.assign(out.lse.size(), 0.0);
  out.weights.assign(at(B * H * Nq * N), 0.0);
  const std::vector<double>& Q = p.self ? p.cloud : p.queries;
  const auto project = [&](const std::vector<double>& w, std::int64_t head, const double* x) {
    std::vector<double> y(at(r), 0.0);
    for (std::int64_t m = 0; m < r; ++m) {
      for (std::int64_t k = 0; k < d; ++k) y[at(m)] += w[at((head * r + m) * d + k)] * x[k];
    }
    return y;
  };
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < p.query_length(b); ++i) {
      const std::vector<std::int64_t> visible = visible_keys(p, b, i);
      if (visible.empty()) continue;
      double* delta = &out.update[at((b * Nq + i) * d)];
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t g = h / (H / K);
        std::vector<double> q = project(s.A, h, &Q[at((b * Nq + i) * d)]);
        turn(q.data(), s.rotary, p.query_origin(b) + i);
        std::vector<double> score;
        std::vector<std::vector<double>> contents;
        for (std::int64_t j : visible) {
          const double* x = &p.cloud[at((b * N + j) * d)];
          std::vector<double> k = project(s.B, g, x);
          turn(k.data(), s.rotary, p.key_position + j);
          double dot = 0.0;
          for (std::int64_t m = 0; m < r; ++m) dot += q[at(m)] * k[at(m)];
          for (std::int64_t a = 0; p.bias && a < d; ++a) dot += p.key_bias[at(h * d + a)] * x[a];
          score.push_back(p.beta * dot);
          contents.push_back(project(s.V, g, x));
        }
        double m = -inf;
        for (double v : score) m = std::max(m, v);
        double z = 0.0;
        for (double v : score) z += std::exp(v - m);
        const double lse = m + std::log(z);
        const std::int64_t row = (b * H + h) * Nq + i;
        double expected = 0.0;
        std::vector<double> o(at(r), 0.0);
        for (std::size_t t = 0; t < visible.size(); ++t) {
          const double w = std::exp(score[t] - lse);
          expected += w * score[t];
          out.weights[at(row * N + visible[t])] = w;
          for (std::int64_t c = 0; c < r; ++c) o[at(c)] += w * contents[t][at(c)];
        }
        for (std::int64_t a = 0; a < d; ++a) {
          for (std::int64_t c = 0; c < r; ++c) delta[a] += s.U[at((h * d + a) * r + c)] * o[at(c)];
        }
        out.lse[at(row)] = lse;
        out.entropy[at(row)] = lse - expected;
      }
      for (std::int64_t a = 0; p.offset && a < d; ++a) delta[a] += p.shift[at(a)];
    }
  }
  return out;
}

/// The naive kernel of the 2x-naive rule, in the storage type's precision: the projections as
/// float dot products rounded to the storage type (dense: R_h = Q M_h with the key bias folded
/// in, C_h = X F_h^T; factored: A_h q, B_h x, V_h x), float scores, softmax and sums, the
/// probabilities rounded to the storage type before the product with the contents, the heads and
/// the offset summed in float and the update rounded once. For TF32 (tests/cuda/tc_reference.hpp's
/// naive TF32 model) the projections are float products of the float inputs rounded to TF32, the
/// scores read the keys rounded to TF32, and the update stays float.
CrossResult naive(const Stored& s, Form form, Storage storage) {
  const CrossProblem& p = s.p;
  const bool tf32 = storage == Storage::tf32;
  const auto rnd = [&](float v) {
    return tf32 ? round_to_tf32(v) : static_cast<float>(round_to(storage, v));
  };
  const auto op = [](double v) { return static_cast<float>(v); };
  const std::int64_t B = p.batch, H = p.heads, N = p.tokens, Nq = p.rows(), d = p.dim;
  const std::int64_t r =
      form == Form::factored ? static_cast<std::int64_t>(s.A.size()) / (H * d) : 0;
  const auto at = [](const std::vector<double>& v, std::int64_t i) {
    return v[static_cast<std::size_t>(i)];
  };
  const std::vector<double>& Q = p.self ? p.cloud : p.queries;
  const float inf = std::numeric_limits<float>::infinity();
  CrossResult out;
  out.update.assign(static_cast<std::size_t>(B * Nq * d), 0.0);
  out.lse.assign(static_cast<std::size_t>(B * H * Nq), -static_cast<double>(inf));
  out.entropy.assign(out.lse.size(), 0.0);
  out.weights.assign(static_cast<std::size_t>(B * H * Nq * N), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < p.query_length(b); ++i) {
      const std::vector<std::int64_t> visible = visible_keys(p, b, i);
      if (visible.empty()) continue;
      std::vector<float> o(static_cast<std::size_t>(d), 0.f);
      const auto q = [&](std::int64_t k) { return op(at(Q, (b * Nq + i) * d + k)); };
      const auto x = [&](std::int64_t j, std::int64_t k) {
        return op(at(p.cloud, (b * N + j) * d + k));
      };
      for (std::int64_t h = 0; h < H; ++h) {
        std::vector<float> score, content;  // content: (visible, d) dense, (visible, r) factored
        if (form == Form::dense) {
          std::vector<float> t(static_cast<std::size_t>(d));
          for (std::int64_t a = 0; a < d; ++a) {
            float sum = 0.f;
            for (std::int64_t k = 0; k < d; ++k)
              sum += q(k) * op(at(p.relevance, (h * d + k) * d + a));
            if (p.bias) sum = rnd(sum) + op(at(p.key_bias, h * d + a));
            t[static_cast<std::size_t>(a)] = rnd(sum);
          }
          for (std::int64_t j : visible) {
            float dot = 0.f;
            for (std::int64_t a = 0; a < d; ++a) {
              dot += t[static_cast<std::size_t>(a)] * (tf32 ? round_to_tf32(x(j, a)) : x(j, a));
            }
            score.push_back(static_cast<float>(p.beta) * dot);
            for (std::int64_t a = 0; a < d; ++a) {
              float c = 0.f;
              for (std::int64_t e = 0; e < d; ++e)
                c += op(at(p.content, (h * d + a) * d + e)) * x(j, e);
              content.push_back(rnd(c));
            }
          }
        } else {
          // Grouped heads read kv head g; rotary positions turn the float sums of the query and
          // key projections before they are rounded, as the projections do.
          const std::int64_t g = h / (H / s.kv_heads);
          std::vector<float> qa(static_cast<std::size_t>(r)), kb(qa.size());
          for (std::int64_t m = 0; m < r; ++m) {
            float sum = 0.f;
            for (std::int64_t k = 0; k < d; ++k) sum += op(at(s.A, (h * r + m) * d + k)) * q(k);
            qa[static_cast<std::size_t>(m)] = sum;
          }
          turn(qa.data(), s.rotary, p.query_origin(b) + i);
          for (float& v : qa) v = rnd(v);
          for (std::int64_t j : visible) {
            for (std::int64_t m = 0; m < r; ++m) {
              float sum = 0.f;
              for (std::int64_t k = 0; k < d; ++k)
                sum += op(at(s.B, (g * r + m) * d + k)) * x(j, k);
              kb[static_cast<std::size_t>(m)] = sum;
            }
            turn(kb.data(), s.rotary, p.key_position + j);
            float dot = 0.f;
            for (std::int64_t m = 0; m < r; ++m) {
              dot += qa[static_cast<std::size_t>(m)] * rnd(kb[static_cast<std::size_t>(m)]);
            }
            if (p.bias) {
              for (std::int64_t k = 0; k < d; ++k) dot += op(at(p.key_bias, h * d + k)) * x(j, k);
            }
            score.push_back(static_cast<float>(p.beta) * dot);
            for (std::int64_t m = 0; m < r; ++m) {
              float v = 0.f;
              for (std::int64_t k = 0; k < d; ++k) v += op(at(s.V, (g * r + m) * d + k)) * x(j, k);
              content.push_back(rnd(v));
            }
          }
        }
        float m = -inf;
        for (float v : score) m = std::max(m, v);
        float l = 0.f;
        for (float v : score) l += std::exp(v - m);
        const float lse = m + std::log(l);
        const std::int64_t row = (b * H + h) * Nq + i;
        const std::int64_t width = form == Form::dense ? d : r;
        std::vector<float> acc(static_cast<std::size_t>(width), 0.f);
        float expected = 0.f;
        for (std::size_t t = 0; t < visible.size(); ++t) {
          const float w = rnd(std::exp(score[t] - m) / l);
          out.weights[static_cast<std::size_t>(row * N + visible[t])] = w;
          expected += w * score[t];
          for (std::int64_t a = 0; a < width; ++a) {
            acc[static_cast<std::size_t>(a)] +=
                w * content[t * static_cast<std::size_t>(width) + static_cast<std::size_t>(a)];
          }
        }
        if (form == Form::dense) {
          for (std::int64_t a = 0; a < d; ++a)
            o[static_cast<std::size_t>(a)] += acc[static_cast<std::size_t>(a)];
        } else {
          for (std::int64_t a = 0; a < d; ++a) {
            float sum = 0.f;
            for (std::int64_t q2 = 0; q2 < r; ++q2) {
              sum += op(at(s.U, (h * d + a) * r + q2)) * rnd(acc[static_cast<std::size_t>(q2)]);
            }
            o[static_cast<std::size_t>(a)] += sum;
          }
        }
        out.lse[static_cast<std::size_t>(row)] = lse;
        out.entropy[static_cast<std::size_t>(row)] = lse - expected;
      }
      for (std::int64_t a = 0; a < d; ++a) {
        float v = o[static_cast<std::size_t>(a)];
        if (p.offset) v += op(at(p.shift, a));
        out.update[static_cast<std::size_t>((b * Nq + i) * d + a)] = tf32 ? v : rnd(v);
      }
    }
  }
  return out;
}

// ---- The call's arrays in T -------------------------------------------------------------

/// The inputs in T, the outputs (poisoned), and AttentionInput / AttentionOutput over them.
template <class T>
struct Arrays {
  using S = Stat<T>;
  std::vector<T> cloud, queries, relevance, content, key_bias, shift, A, B, U, V;
  std::vector<T> update;
  std::vector<S> lse, entropy, weights;
  std::vector<std::int64_t> key_lengths, query_lengths;
  Form form;
  AttentionInput<T> input;
  FactoredLayer<T> layer;

  Arrays(const Stored& s, Form f, bool with_weights)
      : cloud(stored<T>(s.p.cloud)),
        queries(stored<T>(s.p.queries)),
        relevance(stored<T>(s.p.relevance)),
        content(stored<T>(s.p.content)),
        key_bias(stored<T>(s.p.key_bias)),
        shift(stored<T>(s.p.shift)),
        A(stored<T>(s.A)),
        B(stored<T>(s.B)),
        U(stored<T>(s.U)),
        V(stored<T>(s.V)),
        update(static_cast<std::size_t>(s.p.batch * s.p.rows() * s.p.dim)),
        lse(static_cast<std::size_t>(s.p.batch * s.p.heads * s.p.rows())),
        entropy(lse.size()),
        weights(with_weights ? lse.size() * static_cast<std::size_t>(s.p.tokens) : 0),
        key_lengths(s.p.key_lengths),
        query_lengths(s.p.query_lengths),
        form(f) {
    const CrossProblem& p = s.p;
    input.cloud = cloud.data();
    input.batch = p.batch;
    input.tokens = p.tokens;
    input.dim = p.dim;
    input.beta = p.beta;
    input.mask = p.mask;
    input.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
    input.queries = p.self ? nullptr : queries.data();
    input.query_tokens = p.self ? 0 : p.query_tokens;
    input.query_lengths = query_lengths.empty() ? nullptr : query_lengths.data();
    const T* u = p.bias ? key_bias.data() : nullptr;
    const T* c = p.offset ? shift.data() : nullptr;
    if (form == Form::dense) {
      input.layer = {p.heads, relevance.data(), content.data(), u, c};
    } else {
      layer = {p.heads,  static_cast<std::int64_t>(s.A.size()) / (p.heads * p.dim),
               A.data(), B.data(),
               U.data(), V.data(),
               u,        c};
      layer.kv_heads = s.kv_heads;
      layer.rotary.dim = s.rotary;
      layer.rotary.base = kRotaryBase;
    }
    poison();
  }
  void poison() {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    update.assign(update.size(), stored<T>(nan));
    for (auto* v : {&lse, &entropy, &weights}) v->assign(v->size(), static_cast<S>(nan));
  }
  AttentionOutput<T> output() {
    return {update.data(), lse.data(), entropy.data(), weights.empty() ? nullptr : weights.data()};
  }
  LayerOperators<T> dense_layer() const { return input.layer; }
};

/// What a call returned, in double.
struct Got {
  std::vector<double> update, lse, entropy, weights;
};

template <class T>
Got got_of(const Arrays<T>& a) {
  return {values_of(a.update), values_of(a.lse), values_of(a.entropy), values_of(a.weights)};
}

// ---- The two blocks of keys of the partial operation -------------------------------------

/// Keys [start, start + size) of every cloud as an input of their own: key_position at the
/// block's start, the block's key lengths, and each cloud's query origin over the whole cloud.
template <class T>
struct Block {
  std::vector<T> cloud;
  std::vector<std::int64_t> key_lengths, query_positions;
  AttentionInput<T> input;

  Block(const Arrays<T>& whole, const CrossProblem& p, std::int64_t start, std::int64_t size) {
    const std::int64_t d = p.dim;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const auto first = whole.cloud.begin() + (b * p.tokens + start) * d;
      cloud.insert(cloud.end(), first, first + size * d);
      key_lengths.push_back(std::clamp<std::int64_t>(p.key_length(b) - start, 0, size));
      query_positions.push_back(p.query_origin(b));
    }
    input = whole.input;
    input.cloud = cloud.data();
    input.tokens = size;
    input.key_position = start;
    input.key_lengths = key_lengths.data();
    input.query_positions = query_positions.data();
  }
};

template <class T>
struct PartialArrays {
  std::vector<T> heads;
  std::vector<Stat<T>> lse, entropy;
  explicit PartialArrays(const CrossProblem& p)
      : heads(static_cast<std::size_t>(p.batch * p.heads * p.rows() * p.dim),
              stored<T>(std::numeric_limits<double>::quiet_NaN())),
        lse(static_cast<std::size_t>(p.batch * p.heads * p.rows()),
            std::numeric_limits<Stat<T>>::quiet_NaN()),
        entropy(lse.size(), std::numeric_limits<Stat<T>>::quiet_NaN()) {}
  PartialOutput<T> output() { return {heads.data(), lse.data(), entropy.data()}; }
};

// ---- Expected support, read from route() ------------------------------------------------

/// The Problem of the target's first call (for the partial operation: the first block's
/// attend_partial; for the decode cache: its constructor).
template <class T>
emflow::Problem problem_of(const MatrixTarget& t, Arrays<T>& a, const Block<T>* first) {
  const ExecutionOptions options{t.device, 0, precision_of(t.storage)};
  switch (t.op) {
    case Op::self:
    case Op::cross:
      return t.form == Form::dense ? describe(a.input, a.output(), options)
                                   : describe(a.input, a.layer, a.output(), options);
    case Op::partial: {
      PartialOutput<T> out{};
      if (t.form == Form::factored) return describe(first->input, a.layer, out, options);
      return describe(first->input, out, options);
    }
    case Op::decode:
      break;
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const DecodeOptions options_d{t.device, a.input.tokens, precision_of(t.storage)};
    return t.form == Form::dense ? describe(a.dense_layer(), a.input.dim, options_d)
                                 : describe(a.layer, a.input.dim, options_d);
  } else {
    ADD_FAILURE() << "no decode cache for 16-bit storage";
    return emflow::Problem{};
  }
}

/// route()'s reason without its leading operation name ("attend: cuda ..." -> "cuda ..."): the
/// stream-ordered calls and the plan name themselves.
std::string reason_body(const std::string& reason) {
  const std::size_t colon = reason.find(": ");
  return colon == std::string::npos ? reason : reason.substr(colon + 2);
}

// ---- Running a target ---------------------------------------------------------------------

template <class T>
void run_blocking(const MatrixTarget& t, const CrossProblem& p, Arrays<T>& a) {
  const ExecutionOptions options{t.device, 2, precision_of(t.storage)};
  switch (t.op) {
    case Op::self:
    case Op::cross:
      if (t.form == Form::dense) {
        attend(a.input, a.output(), options);
      } else {
        attend_factored(a.input, a.layer, a.output(), options);
      }
      return;
    case Op::partial: {
      const std::int64_t half = p.tokens / 2;
      Block<T> first(a, p, 0, half), second(a, p, half, p.tokens - half);
      PartialArrays<T> into(p), part(p);
      if (t.form == Form::factored) {
        if constexpr (!is_16bit_v<T>) {
          attend_partial(first.input, a.layer, into.output(), options);
          attend_partial(second.input, a.layer, part.output(), options);
        }
      } else {
        attend_partial(first.input, into.output(), options);
        attend_partial(second.input, part.output(), options);
      }
      if constexpr (is_16bit_v<T>) {
        ADD_FAILURE() << "attend_partial ran for 16-bit storage";
      } else {
        const PartialShape shape{p.batch, p.heads, p.rows(), p.dim};
        merge_partial(shape,
                      PartialInput<T>{part.heads.data(), part.lse.data(), part.entropy.data()},
                      into.output());
        finish_partial(shape,
                       PartialInput<T>{into.heads.data(), into.lse.data(), into.entropy.data()},
                       t.form == Form::factored ? a.layer.offset : a.input.layer.offset,
                       AttentionOutput<T>{a.update.data(), a.lse.data(), a.entropy.data()});
      }
      return;
    }
    case Op::decode:
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        const DecodeOptions decode{t.device, p.tokens, precision_of(t.storage)};
        const std::int64_t d = p.dim, H = p.heads, Nq = p.rows();
        for (std::int64_t b = 0; b < p.batch; ++b) {
          std::unique_ptr<BasicDecodeCache<T>> cache =
              t.form == Form::dense
                  ? std::make_unique<BasicDecodeCache<T>>(a.dense_layer(), d, p.beta, decode)
                  : std::make_unique<BasicDecodeCache<T>>(a.layer, d, p.beta, decode);
          cache->append(a.cloud.data() + b * p.tokens * d, p.key_length(b));
          const std::int64_t count = p.query_length(b);
          std::vector<T> update(static_cast<std::size_t>(count * d), stored<T>(NAN));
          std::vector<Stat<T>> lse(static_cast<std::size_t>(H * count), NAN), entropy(lse);
          cache->attend(a.queries.data() + b * Nq * d, count, p.mask,
                        AttentionOutput<T>{update.data(), lse.data(), entropy.data()});
          // Rows of cloud b; the padding queries (i >= count) read 0, -inf and 0.
          for (std::int64_t i = 0; i < Nq; ++i) {
            for (std::int64_t k = 0; k < d; ++k) {
              a.update[static_cast<std::size_t>((b * Nq + i) * d + k)] =
                  i < count ? update[static_cast<std::size_t>(i * d + k)] : T(0);
            }
            for (std::int64_t h = 0; h < H; ++h) {
              const std::size_t row = static_cast<std::size_t>((b * H + h) * Nq + i);
              a.lse[row] = i < count ? lse[static_cast<std::size_t>(h * count + i)]
                                     : -std::numeric_limits<Stat<T>>::infinity();
              a.entropy[row] = i < count ? entropy[static_cast<std::size_t>(h * count + i)] : 0;
            }
          }
        }
      } else {
        ADD_FAILURE() << "no decode cache for 16-bit storage";
      }
      return;
  }
}

#if defined(EMFLOW_WITH_CUDA)
template <class U>
cuda::DeviceBuffer<U> upload(const std::vector<U>& host, cudaStream_t stream) {
  cuda::DeviceBuffer<U> device(host.size());
  device.copy_from_host(host.data(), host.size(), stream);
  return device;
}

template <class U>
U* or_null(cuda::DeviceBuffer<U>& device, const void* host) {
  return host != nullptr ? device.data() : nullptr;
}

/// The arrays of an input on the device, and the input over them.
template <class T>
struct DeviceInput {
  // The host copy a stream-ordered upload reads until the stream is synchronised.
  std::vector<std::int64_t> host_key_lengths;
  cuda::DeviceBuffer<T> cloud, queries, relevance, content, bias, shift, A, B, U, V;
  cuda::DeviceBuffer<std::int64_t> key_lengths, query_lengths, query_positions;
  AttentionInput<T> input;
  FactoredLayer<T> layer;

  DeviceInput(const Arrays<T>& a, const AttentionInput<T>& host, const std::vector<T>& host_cloud,
              const std::vector<std::int64_t>& host_query_positions, cudaStream_t s)
      : host_key_lengths(
            host.key_lengths != nullptr
                ? std::vector<std::int64_t>(host.key_lengths, host.key_lengths + host.batch)
                : std::vector<std::int64_t>{}),
        cloud(upload(host_cloud, s)),
        queries(upload(a.queries, s)),
        relevance(upload(a.relevance, s)),
        content(upload(a.content, s)),
        bias(upload(a.key_bias, s)),
        shift(upload(a.shift, s)),
        A(upload(a.A, s)),
        B(upload(a.B, s)),
        U(upload(a.U, s)),
        V(upload(a.V, s)),
        key_lengths(upload(host_key_lengths, s)),
        query_lengths(upload(a.query_lengths, s)),
        query_positions(upload(host_query_positions, s)) {
    input = host;
    input.cloud = cloud.data();
    input.queries = or_null(queries, host.queries);
    input.key_lengths = or_null(key_lengths, host.key_lengths);
    input.query_lengths = or_null(query_lengths, host.query_lengths);
    input.query_positions = or_null(query_positions, host.query_positions);
    if (a.form == Form::dense) {
      input.layer.relevance = relevance.data();
      input.layer.content = content.data();
      input.layer.key_bias = or_null(bias, host.layer.key_bias);
      input.layer.offset = or_null(shift, host.layer.offset);
    } else {
      layer = a.layer;
      layer.query_factor = A.data();
      layer.key_factor = B.data();
      layer.content_up = U.data();
      layer.content_down = V.data();
      layer.key_bias = or_null(bias, a.layer.key_bias);
      layer.offset = or_null(shift, a.layer.offset);
    }
  }
};

/// The stream-ordered calls (Entry::async) or the plan (Entry::plan) on device buffers.
template <class T>
void run_on_device(const MatrixTarget& t, const CrossProblem& p, Arrays<T>& a) {
  using S = Stat<T>;
  CudaStream stream;
  const cudaStream_t s = stream.stream;
  const cuda::PlanOptions options{Algorithm::automatic, precision_of(t.storage)};
  cuda::DeviceBuffer<T> update = upload(a.update, s);
  cuda::DeviceBuffer<S> lse = upload(a.lse, s), entropy = upload(a.entropy, s),
                        weights = upload(a.weights, s);
  AttentionOutput<T> out{update.data(), lse.data(), entropy.data(),
                         a.weights.empty() ? nullptr : weights.data()};
  const auto workspace_for = [](std::size_t bytes) {
    return cuda::DeviceBuffer<unsigned char>(std::max<std::size_t>(bytes, 1));
  };
  if (t.op == Op::self || t.op == Op::cross) {
    DeviceInput<T> in(a, a.input, a.cloud, {}, s);
    if (t.entry == Entry::async) {
      const std::size_t bytes =
          t.form == Form::dense
              ? cuda::attend_workspace_size(in.input, out, options)
              : cuda::attend_factored_workspace_size(in.input, in.layer, out, options);
      cuda::DeviceBuffer<unsigned char> workspace = workspace_for(bytes);
      if (t.form == Form::dense) {
        cuda::attend_async(in.input, out, workspace.data(), bytes, s, options);
      } else {
        cuda::attend_factored_async(in.input, in.layer, out, workspace.data(), bytes, s, options);
      }
      EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    } else {
      const cuda::AttentionPlan<T> plan =
          t.form == Form::dense ? cuda::AttentionPlan<T>(in.input, out, options)
                                : cuda::AttentionPlan<T>(in.input, in.layer, out, options);
      cuda::DeviceBuffer<unsigned char> workspace = workspace_for(plan.workspace_size());
      if (t.form == Form::dense) {
        plan.run(in.input, out, workspace.data(), plan.workspace_size(), s);
      } else {
        plan.run(in.input, in.layer, out, workspace.data(), plan.workspace_size(), s);
      }
      EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    }
  } else {
    const std::int64_t half = p.tokens / 2;
    Block<T> first(a, p, 0, half), second(a, p, half, p.tokens - half);
    DeviceInput<T> in0(a, first.input, first.cloud, first.query_positions, s);
    DeviceInput<T> in1(a, second.input, second.cloud, second.query_positions, s);
    PartialArrays<T> host_part(p);
    cuda::DeviceBuffer<T> heads0 = upload(host_part.heads, s), heads1 = upload(host_part.heads, s);
    cuda::DeviceBuffer<S> lse0 = upload(host_part.lse, s), lse1 = upload(host_part.lse, s),
                          entropy0 = upload(host_part.lse, s), entropy1 = upload(host_part.lse, s);
    const PartialOutput<T> into{heads0.data(), lse0.data(), entropy0.data()};
    const PartialOutput<T> part{heads1.data(), lse1.data(), entropy1.data()};
    if constexpr (is_16bit_v<T>) {
      // No stream-ordered 16-bit partial state: only the plan exists, and route() refuses it.
      const cuda::AttentionPlan<T> plan(in0.input, into, options);
      ADD_FAILURE() << "a 16-bit partial-state plan was made";
    } else {
      if (t.entry == Entry::async) {
        for (int k = 0; k < 2; ++k) {
          const AttentionInput<T>& in = k == 0 ? in0.input : in1.input;
          const std::size_t bytes = cuda::attend_partial_workspace_size(in, options);
          cuda::DeviceBuffer<unsigned char> workspace = workspace_for(bytes);
          cuda::attend_partial_async(in, k == 0 ? into : part, workspace.data(), bytes, s, options);
          EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        }
      } else {
        for (int k = 0; k < 2; ++k) {
          const AttentionInput<T>& in = k == 0 ? in0.input : in1.input;
          const cuda::AttentionPlan<T> plan(in, k == 0 ? into : part, options);
          cuda::DeviceBuffer<unsigned char> workspace = workspace_for(plan.workspace_size());
          plan.run(in, k == 0 ? into : part, workspace.data(), plan.workspace_size(), s);
          EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        }
      }
      const PartialShape shape{p.batch, p.heads, p.rows(), p.dim};
      cuda::merge_partial_async(shape, PartialInput<T>{part.heads, part.lse, part.entropy}, into,
                                s);
      cuda::finish_partial_async(shape, PartialInput<T>{into.heads, into.lse, into.entropy},
                                 in0.input.layer.offset,
                                 AttentionOutput<T>{out.update, out.lse, out.entropy}, s);
    }
  }
  update.copy_to_host(a.update.data(), a.update.size(), s);
  lse.copy_to_host(a.lse.data(), a.lse.size(), s);
  entropy.copy_to_host(a.entropy.data(), a.entropy.size(), s);
  weights.copy_to_host(a.weights.data(), a.weights.size(), s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
}
#endif

// ---- The check ------------------------------------------------------------------------------

/// The accuracy contract of the storage type (common/accuracy.hpp), and the exact values of the
/// queries without a visible key.
void expect_meets_contract(const Got& got, const CrossResult& exact, const CrossResult& base,
                           Storage storage, const std::string& what) {
  const bool weights = !got.weights.empty();
  if (storage == Storage::f64 || storage == Storage::f32) {
    const double tolerance = relative_tolerance(storage == Storage::f64);
    EXPECT_TRUE(close_to(got.update, exact.update, tolerance)) << what << ": update";
    EXPECT_TRUE(close_to(got.lse, exact.lse, tolerance)) << what << ": lse";
    EXPECT_TRUE(close_to(got.entropy, exact.entropy, tolerance)) << what << ": entropy";
    if (weights) {
      EXPECT_TRUE(close_to(got.weights, exact.weights, tolerance)) << what << ": weights";
    }
  } else {
    std::string failures = check_rule("update", got.update, base.update, exact.update) +
                           check_rule("lse", got.lse, base.lse, exact.lse) +
                           check_rule("entropy", got.entropy, base.entropy, exact.entropy);
    if (weights) failures += check_rule("weights", got.weights, base.weights, exact.weights);
    EXPECT_EQ(failures, "") << what;
  }
  for (std::size_t row = 0; row < exact.lse.size(); ++row) {
    if (!std::isinf(exact.lse[row])) continue;
    EXPECT_EQ(got.lse[row], -std::numeric_limits<double>::infinity()) << what << " lse " << row;
    EXPECT_EQ(got.entropy[row], 0.0) << what << " entropy " << row;
  }
  for (std::size_t k = 0; k < exact.update.size(); ++k) {
    if (exact.update[k] == 0.0) {
      EXPECT_EQ(got.update[k], 0.0) << what << " update " << k;
    }
  }
}

/// Whether a case asks for the weights of a target (self- and cross-attention return them).
bool asks_weights(const MatrixTarget& t, const Case& c) {
  return c.weights && (t.op == Op::self || t.op == Op::cross);
}

/// route()'s answer for the target's first call on `machine`.
template <class T>
Route route_of(const MatrixTarget& t, const CrossProblem& p, Arrays<T>& a, const Machine& machine) {
  const Block<T> first(a, p, 0, p.tokens / 2);
  const Device device = t.entry == Entry::blocking ? t.device : Device::cuda;
  const char* operation = t.op == Op::partial        ? "attend_partial"
                          : t.op == Op::decode       ? "DecodeCache: argument 'device'"
                          : t.form == Form::factored ? "attend_factored"
                                                     : "attend";
  return route(problem_of(t, a, &first), device, machine, operation);
}

template <class T>
void check(const MatrixTarget& t, const Case& c) {
  const std::string what = t.name() + "_" + c.name();
  const Stored s = make_problem(c, t.form, t.storage, t.op);
  Arrays<T> a(s, t.form, asks_weights(t, c));
  const Route want = route_of(t, s.p, a, this_machine());
  if (!want.supported && want.device_missing) GTEST_SKIP() << what << ": " << want.reason;
  try {
    if (t.entry == Entry::blocking) {
      run_blocking(t, s.p, a);
    } else {
#if defined(EMFLOW_WITH_CUDA)
      run_on_device(t, s.p, a);
#else
      ADD_FAILURE() << what << ": route() names cuda in a build without it";
#endif
    }
  } catch (const Error& e) {
    EXPECT_FALSE(want.supported) << what << ": route() says " << to_string(want)
                                 << ", the call threw " << e.what();
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(reason_body(want.reason)), std::string::npos)
        << what << ": the call threw \"" << e.what() << "\", route() says \"" << want.reason
        << "\"";
    return;
  }
  ASSERT_TRUE(want.supported) << what << ": ran, but route() says " << to_string(want);
  expect_meets_contract(got_of(a), s.rotary != 0 ? rotary_oracle(s) : cross_oracle(s.p),
                        t.storage == Storage::f64 || t.storage == Storage::f32
                            ? CrossResult{}
                            : naive(s, t.form, t.storage),
                        t.storage, what);
}

class Matrix : public ::testing::TestWithParam<Param> {};

TEST_P(Matrix, RunsWhereRouteSaysAndMeetsTheContract) {
  const Param& param = GetParam();
  switch (param.target.storage) {
    case Storage::f64:
      check<double>(param.target, param.c);
      break;
    case Storage::f32:
    case Storage::tf32:
      check<float>(param.target, param.c);
      break;
    case Storage::bf16:
      check<bfloat16>(param.target, param.c);
      break;
    case Storage::f16:
      check<float16>(param.target, param.c);
      break;
  }
}

/// Every target that has an entry point: decode for float and double storage only, the
/// partial state in the dense form only and, stream-ordered, for float and double only.
std::vector<MatrixTarget> all_matrix_targets() {
  std::vector<MatrixTarget> out;
  for (Device device : {Device::reference, Device::cpu, Device::cuda}) {
    for (Entry entry : {Entry::blocking, Entry::async, Entry::plan}) {
      if (entry != Entry::blocking && device != Device::cuda) continue;
      for (Form form : {Form::dense, Form::factored}) {
        for (Storage storage :
             {Storage::f64, Storage::f32, Storage::tf32, Storage::bf16, Storage::f16}) {
          const bool wide =
              storage == Storage::f64 || storage == Storage::f32 || storage == Storage::tf32;
          for (Op op : {Op::self, Op::cross, Op::partial, Op::decode}) {
            if (op == Op::decode && (!wide || entry != Entry::blocking)) continue;
            // The factored form's partial state: attend_partial of a FactoredLayer, float and
            // double, blocking (on the host; route() refuses it on cuda).
            if (op == Op::partial && form == Form::factored &&
                (!wide || entry != Entry::blocking)) {
              continue;
            }
            if (op == Op::partial && entry == Entry::async && !wide) continue;
            out.push_back({device, entry, form, storage, op});
          }
        }
      }
    }
  }
  return out;
}

/// Every target crossed with every case (the partial operation needs two keys for two blocks;
/// kv heads and rotary positions are the factored form's).
std::vector<Param> every(const std::vector<Case>& cases) {
  std::vector<Param> out;
  for (const MatrixTarget& t : all_matrix_targets()) {
    for (const Case& c : cases) {
      if (t.op == Op::partial && c.tokens < 2) continue;
      if (t.form == Form::dense && (c.kv_heads != 0 || c.rotary != 0)) continue;
      out.push_back({t, c});
    }
  }
  return out;
}

// Small: two clouds (the second shorter), two heads, causal, key bias and offset; one token; a
// window over a wider cloud with the weights asked for (which the tensor cores refuse).
std::vector<Case> small_cases() {
  return {
      {2, 2, 7, 5, 5, 3, Mask::causal(), true, true, true},
      {1, 1, 1, 1, 1, 1, Mask::none()},
      {1, 2, 33, 9, 16, 4, Mask::sliding_window(5), false, true, false, true},
  };
}

// Wider: several key tiles and a dim past the fused kernel's 256 (the unfused path, and a
// refusal of the tensor cores).
std::vector<Case> wide_cases() {
  return {
      {2, 2, 130, 9, 16, 8, Mask::none(), true, false, true},
      {1, 1, 12, 6, 260, 5, Mask::causal(), false, true, true},
  };
}

// The factored form with grouped kv heads and rotary positions (a llama layer): four heads
// over two kv heads turned over the whole rank, with lengths, bias and offset, causal; three
// heads over one kv head turned over 4 of 6 coordinates under a window; two heads over one kv
// head without rotation (its oracle the expanded layer).
std::vector<Case> rotary_cases() {
  return {
      {2, 4, 9, 5, 6, 4, Mask::causal(), true, true, true, false, 2, 4},
      {1, 3, 12, 4, 8, 6, Mask::sliding_window(4), false, false, true, false, 1, 4},
      {1, 2, 10, 3, 5, 4, Mask::none(), false, true, false, false, 1, 0},
  };
}

INSTANTIATE_TEST_SUITE_P(MatrixSmall, Matrix, ::testing::ValuesIn(every(small_cases())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(MatrixRotary, Matrix, ::testing::ValuesIn(every(rotary_cases())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(MatrixWide, Matrix, ::testing::ValuesIn(every(wide_cases())), param_name);

/// Whether route() runs the target x case on a machine with a CUDA device.
template <class T>
bool supported_with_device(const MatrixTarget& t, const Case& c, const Machine& machine) {
  const Stored s = make_problem(c, t.form, t.storage, t.op);
  Arrays<T> a(s, t.form, asks_weights(t, c));
  return route_of(t, s.p, a, machine).supported;
}

// The matrix covers every form x storage x device pair that route() allows: on a machine with a
// device, each such pair has supported targets x cases in the matrix. Prints how many run of how
// many there are, per device x form x storage.
TEST(MatrixCoverage, EveryPairRouteAllowsRunsInTheMatrix) {
  Machine machine;
  machine.cuda_built = true;
  machine.cuda_device = true;
  std::map<std::string, std::pair<int, int>> counts;  // supported, all
  std::vector<Param> params = every(small_cases());
  for (const Param& p : every(wide_cases())) params.push_back(p);
  for (const Param& p : every(rotary_cases())) params.push_back(p);
  for (const Param& p : params) {
    const MatrixTarget& t = p.target;
    bool ok = false;
    switch (t.storage) {
      case Storage::f64:
        ok = supported_with_device<double>(t, p.c, machine);
        break;
      case Storage::f32:
      case Storage::tf32:
        ok = supported_with_device<float>(t, p.c, machine);
        break;
      case Storage::bf16:
        ok = supported_with_device<bfloat16>(t, p.c, machine);
        break;
      case Storage::f16:
        ok = supported_with_device<float16>(t, p.c, machine);
        break;
    }
    auto& n = counts[std::string(emflow::to_string(t.device)) + " " + emflow::to_string(t.form) +
                     " " + to_name(t.storage)];
    n.first += ok ? 1 : 0;
    n.second += 1;
  }
  int allowed = 0, run = 0;
  for (Device device : {Device::reference, Device::cpu, Device::cuda}) {
    for (Form form : {Form::dense, Form::factored}) {
      for (Storage storage :
           {Storage::f64, Storage::f32, Storage::tf32, Storage::bf16, Storage::f16}) {
        emflow::Problem problem;
        problem.form = form;
        problem.storage = storage == Storage::f64    ? Dtype::float64
                          : storage == Storage::bf16 ? Dtype::bfloat16
                          : storage == Storage::f16  ? Dtype::float16
                                                     : Dtype::float32;
        problem.precision = precision_of(storage);
        problem.tokens = problem.query_tokens = 7;
        problem.dim = 5;
        problem.rank = form == Form::factored ? 3 : 0;
        const std::string key = std::string(emflow::to_string(device)) + " " +
                                emflow::to_string(form) + " " + to_name(storage);
        const std::pair<int, int> n = counts[key];
        std::cout << "[ matrix   ] " << key << ": " << n.first << " of " << n.second
                  << " targets x cases run\n";
        run += n.first;
        if (!route(problem, device, machine).supported) continue;
        ++allowed;
        EXPECT_GT(n.first, 0) << key << ": route() allows it, the matrix runs none";
      }
    }
  }
  std::cout << "[ matrix   ] " << run << " of " << params.size() << " targets x cases run; "
            << allowed << " device x form x storage pairs allowed\n";
  EXPECT_EQ(allowed, 30) << "every device computes every form and storage type";
}

}  // namespace
}  // namespace emflow::testing

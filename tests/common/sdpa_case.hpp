// One SDPA-shaped test call (emflow/sdpa.hpp) as the suites of every device describe it: its
// shapes, scale and visibility, the SdpaInput over host arrays, and the naive 16-bit backward
// pass that the accuracy rule of docs/MATH.md §8.8 holds the fast 16-bit paths to (the CPU's in
// tests/backward/sdpa_test.cpp, the GPU's in tests/cuda/sdpa_cuda_test.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "common/stored.hpp"
#include "emflow/reference.hpp"
#include "emflow/sdpa.hpp"
#include "emflow/tensor.hpp"

namespace emflow::testing {

struct SdpaCase {
  std::string name;
  std::int64_t batch, query_heads, kv_heads, queries, keys, rank, value_rank;
  reference::Visibility visibility;
  double scale = 0.7;
};

/// A case prints as its name (gtest's parameter values).
inline std::ostream& operator<<(std::ostream& out, const SdpaCase& c) { return out << c.name; }

/// The SdpaInput of `c` over Q, K and V (and the case's lengths and positions).
template <class T>
SdpaInput<T> input_of(const SdpaCase& c, const std::vector<T>& Q, const std::vector<T>& K,
                      const std::vector<T>& V) {
  SdpaInput<T> in;
  in.queries = Q.data();
  in.keys = K.data();
  in.values = V.data();
  in.batch = c.batch;
  in.query_heads = c.query_heads;
  in.kv_heads = c.kv_heads;
  in.query_tokens = c.queries;
  in.tokens = c.keys;
  in.rank = c.rank;
  in.value_rank = c.value_rank;
  in.scale = c.scale;
  const reference::Visibility& v = c.visibility;
  in.mask = v.mask;
  in.key_lengths = v.key_lengths.empty() ? nullptr : v.key_lengths.data();
  in.query_lengths = v.query_lengths.empty() ? nullptr : v.query_lengths.data();
  in.key_position = v.key_position;
  in.query_position = v.query_position;
  in.query_positions = v.query_positions.empty() ? nullptr : v.query_positions.data();
  return in;
}

/// `value` rounded to T and read back.
template <class T>
double round_trip(double value) {
  return value_of(stored<T>(value));
}

struct NaiveGradients {
  std::vector<double> queries, keys, values;
};

/// The naive backward pass in the storage type T of docs/MATH.md §8.8: from the stored inputs
/// Q, K, V (as double), the saved forward pass (O in T, lse and H in float32) and the stored
/// upstream gradients `up`, s_ij, p_ij and dS_ij in double, P and dS rounded to T before the
/// three products that read them (summed in double), each gradient rounded to T once.
/// `weights` (the reference's P) says which pairs are visible; rows whose saved lse is not
/// finite see no key (zero gradients).
template <class T>
NaiveGradients naive_sdpa_backward(const SdpaCase& c, const Tensor<double>& Q,
                                   const Tensor<double>& K, const Tensor<double>& V,
                                   const Tensor<double>& weights, const T* output,
                                   const float* lse_of, const float* entropy_of,
                                   const reference::OutputGradients& up) {
  const std::int64_t Nq = c.queries, Nk = c.keys, r = c.rank, rv = c.value_rank;
  NaiveGradients g{std::vector<double>(static_cast<std::size_t>(Q.size()), 0.0),
                   std::vector<double>(static_cast<std::size_t>(K.size()), 0.0),
                   std::vector<double>(static_cast<std::size_t>(V.size()), 0.0)};
  const bool with_update = up.update.size() != 0;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.query_heads; ++h) {
      const std::int64_t set = b * c.kv_heads + h / (c.query_heads / c.kv_heads);
      for (std::int64_t i = 0; i < Nq; ++i) {
        const std::int64_t row = (b * c.query_heads + h) * Nq + i;
        const double lse = lse_of[row];
        if (!std::isfinite(lse)) continue;  // no key: zero gradients
        double e = 0.0;
        if (with_update) {
          for (std::int64_t a = 0; a < rv; ++a) {
            e += up.update[row * rv + a] * value_of(output[row * rv + a]);
          }
        }
        if (up.lse.size() != 0) e -= up.lse[row];
        const double dh = up.entropy.size() == 0 ? 0.0 : up.entropy[row];
        e += dh * entropy_of[row];
        for (std::int64_t j = 0; j < Nk; ++j) {
          if (!(weights[row * Nk + j] > 0.0)) continue;
          double s = 0.0, dp = 0.0;
          for (std::int64_t a = 0; a < r; ++a) s += Q[row * r + a] * K[(set * Nk + j) * r + a];
          s *= c.scale;
          if (with_update) {
            for (std::int64_t a = 0; a < rv; ++a) {
              dp += up.update[row * rv + a] * V[(set * Nk + j) * rv + a];
            }
          }
          const double p = std::exp(s - lse);
          const double p_stored = round_trip<T>(p);
          const double ds_stored = round_trip<T>(p * (dp - e - dh * (s - lse)));
          for (std::int64_t a = 0; a < rv && with_update; ++a) {
            g.values[static_cast<std::size_t>((set * Nk + j) * rv + a)] +=
                p_stored * up.update[row * rv + a];
          }
          for (std::int64_t a = 0; a < r; ++a) {
            g.keys[static_cast<std::size_t>((set * Nk + j) * r + a)] +=
                c.scale * ds_stored * Q[row * r + a];
            g.queries[static_cast<std::size_t>(row * r + a)] +=
                c.scale * ds_stored * K[(set * Nk + j) * r + a];
          }
        }
      }
    }
  }
  for (std::vector<double>* v : {&g.queries, &g.keys, &g.values}) {
    for (double& x : *v) x = round_trip<T>(x);
  }
  return g;
}

}  // namespace emflow::testing

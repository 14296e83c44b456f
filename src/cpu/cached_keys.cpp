// One query's partial state against the float factored decode cache's keys (backends.hpp,
// cpu_cached_partial): the keys of a kv head held transposed in panels of kCachedPanel keys, so
// that the scores of a panel are vector FMAs over the query's coordinates (no horizontal sums),
// the softmax runs on whole vectors with the engine's exp, and the values are summed row by row.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/backends.hpp"
#include "simd.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

static_assert(kCachedPanel % kLanes == 0, "a panel is whole vectors");

void cpu_cached_partial(const float* queries, std::int64_t heads, std::int64_t width,
                        const float* panels, const float* values, const float* const* bias,
                        float bias_scale, std::int64_t first, std::int64_t last, float* scratch,
                        double* lse, double* entropy, double* o) {
  constexpr std::int64_t P = kCachedPanel;
  constexpr int kPerPanel = static_cast<int>(P / kLanes);
  // Panels scored at once, and vectors of o summed at once: independent chains of FMAs.
  constexpr int kGroup = 4, kBlock = 4;
  const float inf = std::numeric_limits<float>::infinity();
  const std::int64_t begin = first / P * P, end = (last + P - 1) / P * P, n = end - begin;
  float* accumulator = scratch + heads * n;  // width floats per head
  for (std::int64_t h = 0; h < heads; ++h) {
    const float* q = queries + h * width;
    float* s = scratch + h * n;
    // Scores, kGroup panels at a time (independent FMA chains); the keys of the first and last
    // panels outside [first, last) and the slots past the cache's end get -inf.
    Vec running = splat(-inf);
    const auto finish = [&](const Vec acc, std::int64_t j0) {
      float lanes[kLanes];
      store(lanes, acc);
      for (int l = 0; l < kLanes; ++l) {
        const std::int64_t j = j0 + l;
        if (j < first || j >= last) {
          lanes[l] = -inf;
        } else if (bias != nullptr) {
          lanes[l] += bias_scale * bias[h][j];
        }
      }
      const Vec scores = load(lanes);
      store(s + (j0 - begin), scores);
      running = max(running, scores);
    };
    std::int64_t t = begin;
    for (; t + kGroup * P <= end; t += kGroup * P) {
      Vec acc[kGroup][kPerPanel] = {};
      const float* panel = panels + t * width;
      for (std::int64_t k = 0; k < width; ++k) {
        const Vec qk = splat(q[k]);
#pragma GCC unroll 8
        for (int u = 0; u < kGroup; ++u) {
#pragma GCC unroll 4
          for (int v = 0; v < kPerPanel; ++v) {
            acc[u][v] = fma(qk, load(panel + u * P * width + k * P + v * kLanes), acc[u][v]);
          }
        }
      }
      for (int u = 0; u < kGroup; ++u)
        for (int v = 0; v < kPerPanel; ++v) finish(acc[u][v], t + u * P + v * kLanes);
    }
    for (; t < end; t += P) {
      Vec acc[kPerPanel] = {};
      const float* panel = panels + t * width;
      for (std::int64_t k = 0; k < width; ++k) {
        const Vec qk = splat(q[k]);
#pragma GCC unroll 4
        for (int v = 0; v < kPerPanel; ++v)
          acc[v] = fma(qk, load(panel + k * P + v * kLanes), acc[v]);
      }
      for (int v = 0; v < kPerPanel; ++v) finish(acc[v], t + v * kLanes);
    }
    const float m = horizontal_max(running);
    // exp(s - m) once per key, its sum Z and sum exp(s - m) (s - m) (the entropy's, as the
    // engine's: both terms non-negative); the weights are exp(s - m) / Z.
    Vec z{}, e{};
    const Vec mv = splat(m);
    for (std::int64_t j = 0; j < n; j += kLanes) {
      const Vec shifted = load(s + j) - mv;
      const Vec weight = exp_nonpositive(shifted);
      z = z + weight;
      e = e + (weight > Vec{} ? weight * shifted : Vec{});
      store(s + j, weight);
    }
    const double sum = horizontal_sum(z), expected = horizontal_sum(e);
    lse[h] = static_cast<double>(m) + std::log(sum);
    entropy[h] = std::log(sum) - expected / sum;
    // o = sum_j weight_j v_j / Z over the visible keys, kBlock vectors of o in registers.
    std::int64_t a = 0;
    for (; a + kBlock * kLanes <= width; a += kBlock * kLanes) {
      Vec acc[kBlock] = {};
      for (std::int64_t j = first; j < last; ++j) {
        const Vec w = splat(s[j - begin]);
        const float* v = values + j * width + a;
#pragma GCC unroll 8
        for (int b = 0; b < kBlock; ++b) acc[b] = fma(w, load(v + b * kLanes), acc[b]);
      }
      for (int b = 0; b < kBlock; ++b) store(accumulator + a + b * kLanes, acc[b]);
    }
    for (; a + kLanes <= width; a += kLanes) {
      Vec acc{};
      for (std::int64_t j = first; j < last; ++j) {
        acc = fma(splat(s[j - begin]), load(values + j * width + a), acc);
      }
      store(accumulator + a, acc);
    }
    for (; a < width; ++a) {
      float sum_a = 0.0f;
      for (std::int64_t j = first; j < last; ++j) sum_a += s[j - begin] * values[j * width + a];
      accumulator[a] = sum_a;
    }
    for (std::int64_t a = 0; a < width; ++a) {
      o[h * width + a] = static_cast<double>(accumulator[a]) / sum;
    }
  }
}

EMFLOW_CPU_END

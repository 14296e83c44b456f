// Measuring tools for benchmarks (tools/measure.hpp) on a small vector kernel of their own: the
// vector the CPU backend chooses for the same flags (src/cpu/simd.hpp; this file is compiled
// with the backend's -march), so `emflow bench --peak` times the FMA instructions the backend
// issues, at its width: AVX-512 16 lanes, AVX 8, otherwise 4 (SSE, or a generic vector the
// compiler lowers to what the target has).
#include "tools/measure.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace emflow::tools {

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
#elif defined(__AVX__)
using Vec = __m256;
constexpr int kLanes = 8;
#elif defined(__SSE2__)
using Vec = __m128;
constexpr int kLanes = 4;
#else
typedef float Vec __attribute__((vector_size(16)));
constexpr int kLanes = 4;
#endif
typedef std::int32_t VecInt __attribute__((vector_size(kLanes * 4)));

Vec splat(float x) { return Vec{} + x; }
Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// a * b + c in one instruction where the target has FMA (ISO C++ never contracts a * b + c).
Vec fma(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__) && defined(__AVX__)
  return _mm256_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

float horizontal_sum(Vec v) {
  float lanes[kLanes];
  store(lanes, v);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// exp(x) for x <= 0 (Cephes' expf: x = n ln 2 + r, exp(r) by a polynomial, 2^n in the exponent
// bits), 0 below -87.3: the speed of a vectorised exp, as numpy's, for the baseline's softmax.
Vec exp_nonpositive(Vec x) {
  const Vec lowest = splat(-87.33654f);
  const Vec xc = x < lowest ? lowest : x;
  const Vec n = (xc * splat(1.44269504f) + splat(12582912.0f)) - splat(12582912.0f);
  const Vec r = fma(n, splat(2.12194440e-4f), fma(n, splat(-0.693359375f), xc));
  Vec p = splat(1.9875691500e-4f);
  for (float c :
       {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = fma(p, r, splat(c));
  }
  const VecInt exponent = (__builtin_convertvector(n, VecInt) + 127) << 23;
  const Vec result = (fma(p, r * r, r) + splat(1.0f)) * (Vec)exponent;
  return x < lowest ? Vec{} : result;
}

}  // namespace

const char* compiled_instruction_set() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#elif defined(__AVX__)
  return "avx";
#elif defined(__SSE2__)
  return "sse2";
#else
  return "generic";
#endif
}

double fma_peak_work(int threads, std::int64_t iterations) {
  // FMA latency (4 cycles) x FMA issue rate (up to 2 per cycle) chains keep every pipe busy.
  constexpr int kChains = kLanes == 16 ? 16 : 10;
  const int team = threads > 0 ? threads : omp_get_max_threads();
  float sink = 0.0f;
#pragma omp parallel num_threads(team) reduction(+ : sink)
  {
    Vec chain[kChains];
    for (int c = 0; c < kChains; ++c) chain[c] = splat(0.01f * static_cast<float>(c));
    // x -> 0.9999 x + 1e-4 converges to 1: no overflow, no denormals.
    const Vec scale = splat(0.9999f), shift = splat(1.0e-4f);
    for (std::int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < kChains; ++c) chain[c] = fma(chain[c], scale, shift);
    }
    Vec total = chain[0];
    for (int c = 1; c < kChains; ++c) total += chain[c];
    sink += horizontal_sum(total);
  }
  // The sum is used, so the loop cannot be removed.
  if (!(sink > 0.0f)) return 0.0;
  return 2.0 * kLanes * kChains * static_cast<double>(iterations) * team;
}

void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads) {
  const int team = threads > 0 ? threads : omp_get_max_threads();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(team) schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * columns;
    // Visible keys of row i form one interval [begin, end).
    std::int64_t begin = 0, end = columns;
    if (mask.kind != MaskKind::none) end = std::min(columns, i + 1);
    if (mask.kind == MaskKind::window) begin = std::max<std::int64_t>(0, i - mask.window + 1);
    std::fill(row, row + begin, 0.0f);
    std::fill(row + std::max(begin, end), row + columns, 0.0f);
    if (end <= begin) continue;
    float m = kNegInf;
    for (std::int64_t j = begin; j < end; ++j) m = std::max(m, row[j]);
    std::int64_t j = begin;
    Vec sum = Vec{};
    for (; j + kLanes <= end; j += kLanes) {
      const Vec p = exp_nonpositive(load(row + j) - splat(m));
      sum += p;
      store(row + j, p);
    }
    float total = horizontal_sum(sum);
    for (; j < end; ++j) {
      row[j] = std::exp(row[j] - m);
      total += row[j];
    }
    const float inverse = 1.0f / total;
    for (j = begin; j < end; ++j) row[j] *= inverse;
  }
}

}  // namespace emflow::tools

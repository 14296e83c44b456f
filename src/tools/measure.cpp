// Measuring tools for benchmarks (tools/measure.hpp) on a small vector kernel of their own,
// compiled once per path of the CPU backend as src/cpu is (src/cpu/target.hpp, the only header
// of the library's tree this file reads): measure_paths.cpp calls the path the engine takes in
// this process, so `emflow bench --peak` times the FMA instructions the engine issues, at its
// width: AVX-512 16 lanes, AVX2 8, the generic path 4 (a generic vector the compiler lowers to
// what the target has).
#include "tools/measure.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "target.hpp"

#define EMFLOW_TOOLS_PATH_NAME(name) #name
#define EMFLOW_TOOLS_PATH(name) EMFLOW_TOOLS_PATH_NAME(name)

EMFLOW_CPU_TARGET_PUSH
namespace emflow::tools::EMFLOW_CPU_TARGET {

namespace {

#if EMFLOW_CPU_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
#elif EMFLOW_CPU_AVX2
using Vec = __m256;
constexpr int kLanes = 8;
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

// a * b + c in one instruction on the x86-64 paths (ISO C++ never contracts a * b + c).
Vec fma(Vec a, Vec b, Vec c) {
#if EMFLOW_CPU_AVX512
  return _mm512_fmadd_ps(a, b, c);
#elif EMFLOW_CPU_AVX2
  return _mm256_fmadd_ps(a, b, c);
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

const char* path() { return EMFLOW_TOOLS_PATH(EMFLOW_CPU_TARGET); }

namespace {

// FMA latency (4 cycles) x FMA issue rate (up to 2 per cycle) chains keep every pipe busy.
constexpr int kChains = kLanes == 16 ? 16 : 10;

// One thread's chains (a function of the path's own, so that the vectors never cross the code
// OpenMP outlines, which Clang compiles for the baseline target).
float run_chains(std::int64_t iterations) {
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
  return horizontal_sum(total);
}

// The softmax of one row over its visible keys [begin, end).
void softmax_row(float* row, std::int64_t begin, std::int64_t end, std::int64_t columns) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(row, row + begin, 0.0f);
  std::fill(row + std::max(begin, end), row + columns, 0.0f);
  if (end <= begin) return;
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

}  // namespace

double fma_peak_work(int threads, std::int64_t iterations) {
  const int team = threads > 0 ? threads : omp_get_max_threads();
  float sink = 0.0f;
#pragma omp parallel num_threads(team) reduction(+ : sink)
  sink += run_chains(iterations);
  // The sum is used, so the loop cannot be removed.
  if (!(sink > 0.0f)) return 0.0;
  return 2.0 * kLanes * kChains * static_cast<double>(iterations) * team;
}

void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads) {
  const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(team) schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    // Visible keys of row i form one interval [begin, end).
    std::int64_t begin = 0, end = columns;
    if (mask.kind != MaskKind::none) end = std::min(columns, i + 1);
    if (mask.kind == MaskKind::window) begin = std::max<std::int64_t>(0, i - mask.window + 1);
    softmax_row(scores + i * columns, begin, end, columns);
  }
}

}  // namespace emflow::tools::EMFLOW_CPU_TARGET
EMFLOW_CPU_TARGET_POP

// The specialised CPU path of the phase diagram: Q = K = V = I, SA on the sphere, RK4, float32.
//
// Why a path of its own: the default sweep is 90 betas x 2048 clouds of 32 tokens in d = 2,
// 300 RK4 steps, i.e. 221 million attention evaluations of a 32-token cloud. Through the generic
// emflow::attend each evaluation costs two d x d projections, a score matrix and a softmax per
// cloud, all of them overhead at d = 2; what remains is 528 exponentials per evaluation.
// Here:
//  * 16 clouds ride in the 16 lanes of a SIMD register (structure of arrays x[token][dim][lane]),
//    each lane with its own beta, so every loop below is a straight lane loop with no
//    horizontal reduction; OpenMP shares the lane groups between the cores.
//  * With M = I the scores beta <x_i, x_j> are symmetric: one exponential per pair serves both
//    tokens. On the sphere <x_i, x_j> <= 1 (up to the O(dt) drift of the RK4 stages), so
//    exp(beta (<x_i, x_j> - 1)) never overflows and no running max is needed.
//  * The exponential is a Cody-Waite reduction and a degree-6 polynomial (relative error about
//    2e-7, float rounding) that the compiler vectorises; libm's expf would not be.
//  * The clustered pairs are counted from the inner products of each step's first stage, which
//    are computed anyway.
//  * The hot function is compiled for AVX-512, AVX2+FMA and the baseline (target_clones), so
//    the library needs no -march flag and still runs on any x86-64.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/parallel.hpp"
#include "internal.hpp"

#if defined(__GNUC__)
#define EMFLOW_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define EMFLOW_ALWAYS_INLINE inline
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMFLOW_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define EMFLOW_SIMD_CLONES
#endif

// The 64-byte vector types below are passed between always-inline functions only, so the
// AVX-512 calling convention GCC warns about never reaches a real call.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wunknown-warning-option"
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace emflow::flow::detail {

namespace {

constexpr int kLanes = 16;
// 16 float lanes: one cloud per lane. GCC and Clang lower these vector types to one zmm
// register, two ymm or four xmm registers depending on the clone being compiled.
using vfloat = float __attribute__((vector_size(64)));
using vint = std::int32_t __attribute__((vector_size(64)));

EMFLOW_ALWAYS_INLINE vfloat splat(float v) { return vfloat{} + v; }
// The bits of an int vector as floats (a GCC/Clang vector cast reinterprets, like bit_cast).
EMFLOW_ALWAYS_INLINE vfloat reinterpret_cast_vector(vint bits) { return (vfloat)bits; }

// 2^x for x in [-126, 127] (clamped outside): x = n + f with n an integer and |f| <= 1/2, then
// the degree-5 polynomial interpolating 2^f at the Chebyshev nodes of [-1/2, 1/2] (relative
// error 1.0e-7, below float rounding) times 2^n built in the exponent bits. The weights are 2^(beta
// log2(e) (<x_i, x_j> - 1)), so no reduction by ln 2 is needed: f = x - n is exact.
EMFLOW_ALWAYS_INLINE vfloat exp2_approx(vfloat x) {
  x = x > -126.0f ? x : splat(-126.0f);
  x = x < 127.0f ? x : splat(127.0f);
  // Adding 1.5 * 2^23 rounds x to the nearest integer n, which then sits in the low mantissa
  // bits of t: the bits of t minus the bits of the constant are n, with no float-to-int
  // conversion.
  const float magic = 12582912.0f;
  const vfloat t = x + magic;
  const vfloat f = x - (t - magic);
  vfloat p = splat(1.3390863364533504e-3f);
  p = p * f + 9.676031918326564e-3f;
  p = p * f + 5.550357114219461e-2f;
  p = p * f + 0.2402210748530821f;
  p = p * f + 0.6931471880262285f;
  p = p * f + 1.0000000754548972f;
  const vint bits = ((vint)t + (127 - 0x4B400000)) << 23;
  return p * reinterpret_cast_vector(bits);
}

// The buffers of one lane group (16 clouds), x[token * dim + a] holding coordinate a of a token
// in every lane. One 64-byte aligned allocation: std::vector would not align a vector type that
// the baseline ABI does not know.
class Block {
 public:
  vfloat *x, *k1, *k2, *k3, *k4, *stage, *acc, *z;
  Block(std::int64_t tokens, std::int64_t dim) {
    const auto n = static_cast<std::size_t>(tokens * dim);
    storage_ = static_cast<vfloat*>(std::aligned_alloc(64, (7 * n + tokens) * sizeof(vfloat)));
    if (!storage_) throw std::bad_alloc();
    vfloat** parts[] = {&x, &k1, &k2, &k3, &k4, &stage, &acc};
    for (std::size_t p = 0; p < 7; ++p) *parts[p] = storage_ + p * n;
    z = storage_ + 7 * n;
    std::fill(storage_, storage_ + 7 * n + tokens, vfloat{});
  }
  ~Block() { std::free(storage_); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

 private:
  vfloat* storage_;
};

// k_i = P_{x_i}(v_i), v_i = sum_j w_ij x_j / sum_j w_ij, w_ij = exp(beta (<x_i, x_j> - 1)),
// for 16 clouds at once, beta given in units of log2(e). With kCount, returns per lane the number
// of pairs i < j with <x_i, x_j> > threshold.
template <int D, bool kCount>
EMFLOW_ALWAYS_INLINE vint drift(const vfloat* __restrict x, vfloat* __restrict k,
                                vfloat* __restrict acc, vfloat* __restrict z, vfloat beta,
                                int tokens, int runtime_dim, float threshold) {
  constexpr int kMax = D > 0 ? D : 1;
  const int dim = D > 0 ? D : runtime_dim;
  std::fill(acc, acc + tokens * dim, vfloat{});
  std::fill(z, z + tokens, vfloat{});
  vint count{};
  const vfloat limit = beta * (threshold - 1.0f);
  for (int i = 0; i < tokens; ++i) {
    const vfloat* xi = x + i * dim;
    vfloat* ai = acc + i * dim;
    // With a fixed dimension the token and its accumulators stay in registers over the j loop,
    // and the token is pre-scaled by beta so each exponent beta (<x_i, x_j> - 1) costs d FMAs.
    vfloat xr[kMax], xb[kMax], ar[kMax];
    vfloat e{};
    if (D > 0) {
      for (int a = 0; a < kMax; ++a) {
        xr[a] = xi[a];
        xb[a] = beta * xr[a];
        e += xb[a] * xr[a];
      }
      e -= beta;
    } else {
      for (int a = 0; a < dim; ++a) e += xi[a] * xi[a];
      e = beta * e - beta;
    }
    const vfloat w_self = exp2_approx(e);
    vfloat zi = w_self;
    if (D > 0) {
      for (int a = 0; a < kMax; ++a) ar[a] = w_self * xr[a];
    } else {
      for (int a = 0; a < dim; ++a) ai[a] += w_self * xi[a];
    }
    for (int j = i + 1; j < tokens; ++j) {
      const vfloat* xj = x + j * dim;
      vfloat* aj = acc + j * dim;
      if (D > 0) {
        e = -beta;
        for (int a = 0; a < kMax; ++a) e += xb[a] * xj[a];
      } else {
        vfloat g{};
        for (int a = 0; a < dim; ++a) g += xi[a] * xj[a];
        e = beta * g - beta;
      }
      // <x_i, x_j> > threshold, i.e. e > beta (threshold - 1); true is -1.
      if (kCount) count -= e > limit;
      const vfloat w = exp2_approx(e);
      zi += w;
      z[j] += w;
      if (D > 0) {
        for (int a = 0; a < kMax; ++a) {
          ar[a] += w * xj[a];
          aj[a] += w * xr[a];
        }
      } else {
        for (int a = 0; a < dim; ++a) {
          ai[a] += w * xj[a];
          aj[a] += w * xi[a];
        }
      }
    }
    z[i] += zi;
    if (D > 0) {
      for (int a = 0; a < kMax; ++a) ai[a] += ar[a];
    }
  }
  for (int i = 0; i < tokens; ++i) {
    const vfloat* xi = x + i * dim;
    const vfloat* ai = acc + i * dim;
    vfloat* ki = k + i * dim;
    const vfloat inv = 1.0f / z[i];
    vfloat dot{};
    for (int a = 0; a < dim; ++a) dot += xi[a] * ai[a];
    for (int a = 0; a < dim; ++a) ki[a] = (ai[a] - dot * xi[a]) * inv;
  }
  return count;
}

// Runs the whole sweep of one lane group; counts (steps + 1, 16) receives the clustered pairs.
template <int D>
EMFLOW_ALWAYS_INLINE void simulate(Block& b, vfloat beta, int tokens, int runtime_dim,
                                   std::int64_t steps, double time, double dt, float threshold,
                                   std::int32_t* counts) {
  const int dim = D > 0 ? D : runtime_dim;
  const int n = tokens * dim;
  vfloat *x = b.x, *stage = b.stage, *k1 = b.k1, *k2 = b.k2, *k3 = b.k3, *k4 = b.k4;
  vfloat *acc = b.acc, *z = b.z;
  for (std::int64_t s = 0;; ++s) {
    const vint count = drift<D, true>(x, k1, acc, z, beta, tokens, dim, threshold);
    std::memcpy(counts + s * kLanes, &count, sizeof count);
    if (s == steps) return;
    const float h = static_cast<float>(step_length(time, dt, steps, s));
    for (int e = 0; e < n; ++e) stage[e] = x[e] + (0.5f * h) * k1[e];
    drift<D, false>(stage, k2, acc, z, beta, tokens, dim, threshold);
    for (int e = 0; e < n; ++e) stage[e] = x[e] + (0.5f * h) * k2[e];
    drift<D, false>(stage, k3, acc, z, beta, tokens, dim, threshold);
    for (int e = 0; e < n; ++e) stage[e] = x[e] + h * k3[e];
    drift<D, false>(stage, k4, acc, z, beta, tokens, dim, threshold);
    const float sixth = h / 6.0f;
    for (int e = 0; e < n; ++e) x[e] += sixth * (k1[e] + 2.0f * (k2[e] + k3[e]) + k4[e]);
    // Back onto the sphere.
    for (int i = 0; i < tokens; ++i) {
      vfloat* xi = x + i * dim;
      vfloat square{};
      for (int a = 0; a < dim; ++a) square += xi[a] * xi[a];
      float lanes[kLanes];
      std::memcpy(lanes, &square, sizeof lanes);
      for (float& v : lanes) v = 1.0f / std::sqrt(v);
      std::memcpy(&square, lanes, sizeof lanes);
      for (int a = 0; a < dim; ++a) xi[a] *= square;
    }
  }
}

// One compiled body per instruction set; d = 2 and 3 get fixed-size inner loops.
EMFLOW_SIMD_CLONES void simulate_block(Block& b, const float* lane_betas, int tokens, int dim,
                                       std::int64_t steps, double time, double dt, float threshold,
                                       std::int32_t* counts) {
  // The weights are computed as powers of 2: beta log2(e) per lane.
  vfloat beta;
  std::memcpy(&beta, lane_betas, sizeof beta);
  beta *= 1.44269504088896341f;
  switch (dim) {
    case 2:
      simulate<2>(b, beta, tokens, dim, steps, time, dt, threshold, counts);
      break;
    case 3:
      simulate<3>(b, beta, tokens, dim, steps, time, dt, threshold, counts);
      break;
    default:
      simulate<0>(b, beta, tokens, dim, steps, time, dt, threshold, counts);
      break;
  }
}

}  // namespace

std::vector<std::int64_t> phase_counts_kernel(const std::vector<float>& initial,
                                              std::int64_t clouds, std::int64_t tokens,
                                              std::int64_t dim, const std::vector<double>& betas,
                                              double time, double dt, double cluster_eps,
                                              int threads, const Progress& progress,
                                              std::int64_t first, std::int64_t last) {
  constexpr int L = kLanes;
  const auto K = static_cast<std::int64_t>(betas.size());
  const std::int64_t total = last - first;
  const std::int64_t blocks = (total + L - 1) / L;
  const std::int64_t steps = continuous_steps(time, dt);
  const auto records = static_cast<std::size_t>(steps + 1);
  const auto threshold = static_cast<float>(1.0 - cluster_eps);
  // Integer counts: their sums are exact, so the diagram does not depend on how the pairs were
  // split among threads (or processes) nor on the order the parts are added in.
  std::vector<std::int64_t> clustered(records * static_cast<std::size_t>(K), 0);
  std::atomic<std::int64_t> done{0};
#ifdef _OPENMP
  const int team = threads > 0 ? threads : omp_get_max_threads();
#else
  const int team = 1;
  (void)threads;
#endif

  ::emflow::detail::ParallelErrors errors;  // allocations and the progress callback may throw
#pragma omp parallel num_threads(team)
  {
    struct Buffers {
      Buffers(std::int64_t tokens, std::int64_t dim, std::size_t records, std::size_t values)
          : block(tokens, dim), counts(records * L), local(values, 0) {}
      Block block;
      std::vector<std::int32_t> counts;
      std::vector<std::int64_t> local;
    };
    std::unique_ptr<Buffers> buffers;
    errors.run(
        [&] { buffers = std::make_unique<Buffers>(tokens, dim, records, clustered.size()); });
    float beta[L];
    std::int64_t beta_of[L];
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t q = 0; q < blocks; ++q) {
      if (!buffers) continue;
      errors.run([&] {
        Block& block = buffers->block;
        std::vector<std::int32_t>& counts = buffers->counts;
        std::vector<std::int64_t>& local = buffers->local;
        // Lane l carries cloud c of beta k, where first + q * L + l = k * C + c; spare lanes of
        // the last group repeat the part's last pair and are not counted. A lane's numbers do
        // not depend on its neighbours, so a pair counts the same in any group.
        for (int l = 0; l < L; ++l) {
          const std::int64_t index = first + std::min(q * L + l, total - 1);
          const std::int64_t k = index / clouds, c = index % clouds;
          beta_of[l] = q * L + l < total ? k : -1;
          beta[l] = static_cast<float>(betas[static_cast<std::size_t>(k)]);
          const float* cloud = initial.data() + c * tokens * dim;
          for (std::int64_t i = 0; i < tokens; ++i)
            for (std::int64_t a = 0; a < dim; ++a)
              block.x[static_cast<std::size_t>(i * dim + a)][l] = cloud[i * dim + a];
        }
        simulate_block(block, beta, static_cast<int>(tokens), static_cast<int>(dim), steps, time,
                       dt, threshold, counts.data());
        for (std::size_t s = 0; s < records; ++s) {
          for (int l = 0; l < L; ++l) {
            if (beta_of[l] < 0) continue;
            local[s * static_cast<std::size_t>(K) + static_cast<std::size_t>(beta_of[l])] +=
                counts[s * L + static_cast<std::size_t>(l)];
          }
        }
        const std::int64_t finished = ++done;
#ifdef _OPENMP
        if (progress && omp_get_thread_num() == 0) progress(finished, blocks);
#else
        if (progress) progress(finished, blocks);
#endif
      });
    }
    if (buffers) {
#pragma omp critical(emflow_phase_reduce)
      for (std::size_t e = 0; e < clustered.size(); ++e) clustered[e] += buffers->local[e];
    }
  }
  errors.rethrow();
  if (progress) progress(blocks, blocks);
  return clustered;
}

std::int64_t phase_kernel_bytes(std::int64_t tokens, std::int64_t dim, int threads) {
#ifdef _OPENMP
  const std::int64_t team = threads > 0 ? threads : omp_get_max_threads();
#else
  const std::int64_t team = 1;
  (void)threads;
#endif
  // Block: 7 arrays of N d lanes and one of N (validated N d stays below 2^31, so no overflow).
  return team * (7 * tokens * dim + tokens) * kLanes * static_cast<std::int64_t>(sizeof(float));
}

std::vector<double> phase_fractions(const std::vector<std::int64_t>& counts, std::int64_t clouds,
                                    std::int64_t tokens) {
  const double pairs = 0.5 * static_cast<double>(tokens) * static_cast<double>(tokens - 1);
  std::vector<double> clustered(counts.size());
  for (std::size_t e = 0; e < counts.size(); ++e) {
    clustered[e] = static_cast<double>(counts[e]) / pairs / static_cast<double>(clouds);
  }
  return clustered;
}

std::vector<double> phase_kernel(const std::vector<float>& initial, std::int64_t clouds,
                                 std::int64_t tokens, std::int64_t dim,
                                 const std::vector<double>& betas, double time, double dt,
                                 double cluster_eps, int threads, const Progress& progress) {
  const auto total = static_cast<std::int64_t>(betas.size()) * clouds;
  return phase_fractions(phase_counts_kernel(initial, clouds, tokens, dim, betas, time, dt,
                                             cluster_eps, threads, progress, 0, total),
                         clouds, tokens);
}

}  // namespace emflow::flow::detail

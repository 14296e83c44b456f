// The phase diagram on the GPU: Q = K = V = I, SA on the sphere, RK4, float32. The same
// equations as the CPU path (src/flow/sphere_kernel.cpp), for every (beta, cloud) pair at once:
//
//   k_i = P_{y_i}(a_i) / z_i,   a_i = sum_j w_ij y_j,   z_i = sum_j w_ij,
//   w_ij = 2^(beta log2(e) (<y_i, y_j> - 1)),   P_y(v) = v - <y, v> y,
//
// at the RK4 stage positions y (the state x, x + h/2 k1, x + h/2 k2, x + h k3), then
// x += h/6 (k1 + 2 (k2 + k3) + k4) and x_i /= ||x_i||. As on the CPU, the reference point of the
// exponent is 1 for every j, the token itself included (its weight uses its own squared norm,
// not 1): on the sphere <y_i, y_j> <= 1 up to the O(h^2) growth of the stage positions' norms,
// so the exponent is at most of order beta log2(e) h^2 and no running max is needed. The clustered
// pairs at step s are the pairs i < j with <x_i, x_j> > 1 - eps at the state before step s (the
// first stage, whose inner products are computed anyway), and at the final state.
//
// Differences from the CPU path, all at float rounding: the CPU uses one exponential per pair
// (the weights are symmetric) and sums in another order; here each token sums over all j in
// order, so every token's drift is computed by one thread with no communication. The CPU decides
// a pair is clustered by comparing beta log2(e) (<x_i, x_j> - 1) with
// beta log2(e) (threshold - 1); here the float inner product is compared with the float
// threshold (1 - eps), which does not depend on beta. Both differ from the generic path (a double
// inner product) only for a pair within float rounding of the threshold. exp2f is CUDA's (2 ulp),
// the CPU's a polynomial (1e-7 relative).
//
// Layout: one thread per token; a block holds G clouds of one beta (G = 128 / N, at least 1, at
// most C, halved while the block's shared memory exceeds the device's opt-in limit), its G * N
// threads rounded up to a warp multiple; block b runs clouds
// [(b % B) G, (b % B) G + G) of beta b / B, B = ceil(C / G) blocks per beta. Every block keeps its
// clouds' stage positions in two shared buffers used in turn (each stage reads one and writes
// the other, so one barrier per stage suffices). Each thread keeps its token's state and RK4
// sums in registers (d = 2, 3: the kernel is compiled for these dimensions) or, for any other d,
// in shared memory laid out [coordinate][thread] so that a warp's accesses hit distinct banks.
//
// Counting: each thread counts its pairs (i, j > i), a warp sums by shuffles, lane 0 stores the
// warp's sum in shared memory and thread 0 adds the block's sum into counts[s][k] (unsigned 64-bit
// atomicAdd). Integer sums do not depend on the order of the atomics, so the result is the same
// bitwise on every run; the host divides once at the end.
//
// Launches: the whole sweep is one launch, unless a progress callback is given; then the steps
// are split into about 20 launches, the state kept in device memory between them, and the host
// waits for each (the progress report needs it).
//
// Cost at d = 2 (ptxas for sm_90: 32 registers, no spills; PTX of the pair loop): per token
// pair one 64-bit shared load (a broadcast when a warp holds one cloud), 5 FFMA, 1 FADD and one
// ex2, so the default sweep (90 x 2048 clouds of 32 tokens, 300 RK4 steps: 2.3e11 token pairs)
// is bound by instruction issue and the ex2 units at roughly 0.1 s on an H200 (estimate).
//
// History: version 1 (this one); checked on the CPU emulation (tests/cuda/emulation), not yet
// run or timed on a GPU. Tuning candidates once it can be timed: the pair-symmetric form (half
// the exponentials, but shared-memory reductions of the weighted sums), ex2.approx.ftz instead
// of exp2f (no subnormal fix-up around the ex2), and fewer barriers per step.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "cuda/cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "launch.cuh"
#include "phase_kernels.hpp"

namespace emflow::flow::detail {

namespace {

using emflow::detail::check_cuda;

constexpr int kTargetThreads = 128;  // threads per block when clouds are small
constexpr int kMaxThreads = 1024;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kLaunchesWithProgress = 20;
constexpr float kLog2e = 1.44269504088896341f;

struct PhaseParams {
  const float* from;        // the state at the first step of the launch
  bool from_initial;        // from is (C, N, d), the same clouds for every beta; else (K C, N, d)
  float* to;                // the state after the launch's last step, or null
  const float* beta_log2e;  // K entries: beta log2(e)
  unsigned long long* counts;  // (S + 1, K) clustered pairs summed over the clouds
  int clouds, tokens, dim, betas;
  int clouds_per_block, blocks_per_beta;
  std::int64_t steps;
  float h, h_last;  // every step but the last, and the last
  float threshold;  // 1 - eps
};

// A token's vector of `dim` coordinates: registers when D > 0, else a strided slot in shared
// memory ([coordinate][thread]).
template <int D>
struct TokenVector {
  float v[D];
  __device__ __forceinline__ void bind(float*, int) {}
  __device__ __forceinline__ float& operator[](int a) { return v[a]; }
};
template <>
struct TokenVector<0> {
  float* base;
  int stride;
  __device__ __forceinline__ void bind(float* b, int s) {
    base = b;
    stride = s;
  }
  __device__ __forceinline__ float& operator[](int a) { return base[a * stride]; }
};

// <u, v> accumulated in coordinate order; the one definition of the inner product, used by the
// weights and by the count.
template <int D>
__device__ __forceinline__ float inner(const float* __restrict__ u, const float* __restrict__ v,
                                       int runtime_dim) {
  const int dim = D > 0 ? D : runtime_dim;
  float g = 0.0f;
#pragma unroll
  for (int a = 0; a < dim; ++a) g = fmaf(u[a], v[a], g);
  return g;
}

// k = P_{y_i}(a_i) / z_i for token i of the cloud whose positions start at `cloud`, written to
// k. With kCount, returns the number of j > i with <y_i, y_j> > threshold.
template <int D, bool kCount>
__device__ __forceinline__ unsigned drift(const float* __restrict__ cloud, int tokens,
                                          int runtime_dim, int i, float beta, float threshold,
                                          TokenVector<D>& k) {
  const int dim = D > 0 ? D : runtime_dim;
  const float* yi = cloud + i * dim;
#pragma unroll
  for (int a = 0; a < dim; ++a) k[a] = 0.0f;
  float z = 0.0f;
  unsigned count = 0;
  for (int j = 0; j < tokens; ++j) {
    const float* yj = cloud + j * dim;
    const float g = inner<D>(yi, yj, dim);
    if (kCount) count += (j > i && g > threshold) ? 1u : 0u;
    const float w = exp2f(fmaf(beta, g, -beta));
    z += w;
#pragma unroll
    for (int a = 0; a < dim; ++a) k[a] = fmaf(w, yj[a], k[a]);
  }
  float dot = 0.0f;
#pragma unroll
  for (int a = 0; a < dim; ++a) dot = fmaf(yi[a], k[a], dot);
  const float inv = 1.0f / z;
#pragma unroll
  for (int a = 0; a < dim; ++a) k[a] = (k[a] - dot * yi[a]) * inv;
  return count;
}

// The block's clustered pairs of one step: a warp sum by shuffles, stored by lane 0. Every
// thread of the block calls it; thread 0 reads the sums after the next barrier (add_counts).
__device__ __forceinline__ void store_warp_count(unsigned count, unsigned* warp_counts) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    count += __shfl_xor_sync(0xffffffffu, count, offset);
  }
  if (threadIdx.x % 32 == 0) warp_counts[threadIdx.x / 32] = count;
}

__device__ __forceinline__ void add_counts(const unsigned* warp_counts,
                                           unsigned long long* counts) {
  if (threadIdx.x != 0) return;
  unsigned long long sum = 0;
  for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) sum += warp_counts[w];
  if (sum != 0) atomicAdd(counts, sum);
}

template <int D>
__global__ void __launch_bounds__(kMaxThreads)
    phase_sweep_kernel(PhaseParams p, std::int64_t step_begin, std::int64_t step_end) {
  EMFLOW_DYNAMIC_SHARED(shared_storage);
  const int N = p.tokens;
  const int dim = D > 0 ? D : p.dim;
  const int t = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int beta_index = static_cast<int>(blockIdx.x) / p.blocks_per_beta;
  const int slot = t / N;  // the block's cloud this thread works on
  const int i = t % N;     // its token
  const int cloud = (static_cast<int>(blockIdx.x) % p.blocks_per_beta) * p.clouds_per_block + slot;
  const bool active = slot < p.clouds_per_block && cloud < p.clouds;
  const float beta = p.beta_log2e[beta_index];
  unsigned long long* counts = p.counts + beta_index;

  // Shared memory: the warps' counts, then the two position buffers [cloud][token][coordinate],
  // then (D = 0 only) the token vectors [vector][coordinate][thread].
  unsigned* warp_counts = reinterpret_cast<unsigned*>(shared_storage);
  float* positions = reinterpret_cast<float*>(shared_storage) + kMaxWarps;
  const int buffer = p.clouds_per_block * N * dim;
  float* y[2] = {positions, positions + buffer};
  float* vectors = positions + 2 * buffer;
  TokenVector<D> x, k1, k23, k;
  x.bind(vectors + t, threads);
  k1.bind(vectors + dim * threads + t, threads);
  k23.bind(vectors + 2 * dim * threads + t, threads);
  k.bind(vectors + 3 * dim * threads + t, threads);

  const std::size_t cloud_values = static_cast<std::size_t>(N) * static_cast<std::size_t>(dim);
  const std::size_t state_cloud =
      static_cast<std::size_t>(beta_index) * static_cast<std::size_t>(p.clouds) +
      static_cast<std::size_t>(cloud);
  const int own = (slot * N + i) * dim;  // this token's offset in a position buffer
  const int cloud_offset = slot * N * dim;
  if (active) {
    const float* from =
        p.from + (p.from_initial ? static_cast<std::size_t>(cloud) : state_cloud) * cloud_values +
        static_cast<std::size_t>(i) * static_cast<std::size_t>(dim);
#pragma unroll
    for (int a = 0; a < dim; ++a) {
      x[a] = from[a];
      y[0][own + a] = x[a];
    }
  }
  __syncthreads();

  for (std::int64_t s = step_begin; s < step_end; ++s) {
    const float h = s + 1 < p.steps ? p.h : p.h_last;
    const float half = 0.5f * h;
    // Stage 1 at the state, counting the clustered pairs; y[1] = x + h/2 k1.
    unsigned count = 0;
    if (active) {
      count = drift<D, true>(y[0] + cloud_offset, N, dim, i, beta, p.threshold, k);
#pragma unroll
      for (int a = 0; a < dim; ++a) {
        k1[a] = k[a];
        y[1][own + a] = x[a] + half * k[a];
      }
    }
    store_warp_count(count, warp_counts);
    __syncthreads();
    add_counts(warp_counts, counts + s * p.betas);
    // Stage 2; y[0] = x + h/2 k2 (every thread has finished reading y[0] at the barrier).
    if (active) {
      drift<D, false>(y[1] + cloud_offset, N, dim, i, beta, p.threshold, k);
#pragma unroll
      for (int a = 0; a < dim; ++a) {
        k23[a] = k[a];
        y[0][own + a] = x[a] + half * k[a];
      }
    }
    __syncthreads();
    // Stage 3; y[1] = x + h k3.
    if (active) {
      drift<D, false>(y[0] + cloud_offset, N, dim, i, beta, p.threshold, k);
#pragma unroll
      for (int a = 0; a < dim; ++a) {
        k23[a] += k[a];
        y[1][own + a] = x[a] + h * k[a];
      }
    }
    __syncthreads();
    // Stage 4, the update, and back onto the sphere; y[0] = the new state.
    if (active) {
      drift<D, false>(y[1] + cloud_offset, N, dim, i, beta, p.threshold, k);
      const float sixth = h / 6.0f;
      float square = 0.0f;
#pragma unroll
      for (int a = 0; a < dim; ++a) {
        x[a] += sixth * (k1[a] + 2.0f * k23[a] + k[a]);
        square = fmaf(x[a], x[a], square);
      }
      const float inv = 1.0f / sqrtf(square);
#pragma unroll
      for (int a = 0; a < dim; ++a) {
        x[a] *= inv;
        y[0][own + a] = x[a];
      }
    }
    __syncthreads();
  }

  if (step_end == p.steps) {
    // The final state's count: the pairs only, no drift.
    unsigned count = 0;
    if (active) {
      const float* cloud_y = y[0] + cloud_offset;
      for (int j = i + 1; j < N; ++j) {
        count += inner<D>(cloud_y + i * dim, cloud_y + j * dim, dim) > p.threshold ? 1u : 0u;
      }
    }
    store_warp_count(count, warp_counts);
    __syncthreads();
    add_counts(warp_counts, counts + p.steps * p.betas);
  }
  if (active && p.to) {
    float* to = p.to + state_cloud * cloud_values + static_cast<std::size_t>(i) * dim;
#pragma unroll
    for (int a = 0; a < dim; ++a) to[a] = x[a];
  }
}

// How a sweep is laid out on the device.
struct Layout {
  int clouds_per_block = 0;
  int threads = 0;
  std::size_t shared_bytes = 0;  // 0: a cloud does not fit one block's threads
};

std::size_t shared_bytes(int clouds_per_block, int threads, std::int64_t tokens, std::int64_t dim) {
  const auto positions = static_cast<std::size_t>(2 * clouds_per_block * tokens * dim);
  const auto vectors = dim == 2 || dim == 3
                           ? 0
                           : static_cast<std::size_t>(4 * threads) * static_cast<std::size_t>(dim);
  return kMaxWarps * sizeof(unsigned) + (positions + vectors) * sizeof(float);
}

Layout layout(std::int64_t clouds, std::int64_t tokens, std::int64_t dim) {
  Layout l;
  if (tokens > kMaxThreads) return l;
  const auto per_block = std::max<std::int64_t>(1, std::min(clouds, kTargetThreads / tokens));
  l.clouds_per_block = static_cast<int>(per_block);
  l.threads = static_cast<int>((per_block * tokens + 31) / 32 * 32);
  l.shared_bytes = shared_bytes(l.clouds_per_block, l.threads, tokens, dim);
  return l;
}

int shared_limit(const char* operation) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), operation, "cudaGetDevice");
  int limit = 0;
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             operation, "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return limit;
}

template <int D>
void launch_sweep(const PhaseParams& params, const Layout& l, unsigned blocks,
                  std::int64_t step_begin, std::int64_t step_end, cudaStream_t stream,
                  const char* operation) {
  check_cuda(
      cudaFuncSetAttribute(phase_sweep_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(l.shared_bytes)),
      operation, "cudaFuncSetAttribute(phase_sweep_kernel)");
  emflow::detail::launch(operation, "phase_sweep_kernel", phase_sweep_kernel<D>, blocks,
                         static_cast<unsigned>(l.threads), l.shared_bytes, stream, params,
                         step_begin, step_end);
}

}  // namespace

std::size_t phase_kernel_cuda_shared_bytes(std::int64_t tokens, std::int64_t dim) {
  return layout(1, tokens, dim).shared_bytes;
}

bool phase_kernel_cuda_fits(std::int64_t tokens, std::int64_t dim) {
  const std::size_t bytes = phase_kernel_cuda_shared_bytes(tokens, dim);
  return bytes > 0 && bytes <= static_cast<std::size_t>(shared_limit("phase"));
}

std::vector<double> phase_kernel_cuda(const std::vector<float>& initial, std::int64_t clouds,
                                      std::int64_t tokens, std::int64_t dim,
                                      const std::vector<double>& betas, std::int64_t steps,
                                      double step, double last_step, double cluster_eps,
                                      const Progress& progress) {
  const char* operation = "phase";
  const auto K = static_cast<std::int64_t>(betas.size());
  const auto records = static_cast<std::size_t>(steps + 1);
  const auto values = static_cast<std::size_t>(clouds * tokens * dim);
  if (initial.size() != values) {
    emflow::detail::fail_argument(operation, "initial", "expected ", values, " values, got ",
                                  initial.size());
  }

  // Fewer clouds per block when the device's shared memory is short (never below one).
  const int limit = shared_limit(operation);
  Layout l = layout(clouds, tokens, dim);
  while (l.clouds_per_block > 1 && l.shared_bytes > static_cast<std::size_t>(limit)) {
    l.clouds_per_block /= 2;
    l.threads = static_cast<int>((l.clouds_per_block * tokens + 31) / 32 * 32);
    l.shared_bytes = shared_bytes(l.clouds_per_block, l.threads, tokens, dim);
  }
  if (l.shared_bytes == 0 || l.shared_bytes > static_cast<std::size_t>(limit)) {
    emflow::detail::fail(ErrorCode::unsupported, operation, ": a cloud of ", tokens,
                         " tokens in d = ", dim, " does not fit one block (", l.shared_bytes,
                         " bytes of shared memory, the device allows ", limit, ")");
  }
  const std::int64_t blocks_per_beta = (clouds + l.clouds_per_block - 1) / l.clouds_per_block;
  const auto blocks = static_cast<unsigned>(blocks_per_beta * K);

  std::vector<float> beta_log2e(static_cast<std::size_t>(K));
  for (std::size_t k = 0; k < beta_log2e.size(); ++k) {
    beta_log2e[k] = static_cast<float>(betas[k]) * kLog2e;  // as the CPU path rounds it
  }

  // Launch failures are read back with cudaGetLastError: an error the caller left pending is
  // reported as such before anything is enqueued.
  emflow::detail::check_no_pending_error(operation);
  // The stream first, so that it outlives the buffers on an error path.
  const emflow::detail::OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const bool chunked = static_cast<bool>(progress) && steps > 1;
  cuda::DeviceBuffer<float> start(values);
  cuda::DeviceBuffer<float> state(chunked ? values * static_cast<std::size_t>(K) : 0);
  cuda::DeviceBuffer<float> beta_buffer(beta_log2e.size());
  cuda::DeviceBuffer<unsigned long long> counts(records * static_cast<std::size_t>(K));
  start.copy_from_host(initial.data(), values, s);
  beta_buffer.copy_from_host(beta_log2e.data(), beta_log2e.size(), s);
  check_cuda(cudaMemsetAsync(counts.data(), 0, counts.bytes(), s), operation, "cudaMemsetAsync");

  PhaseParams params{};
  params.beta_log2e = beta_buffer.data();
  params.counts = counts.data();
  params.clouds = static_cast<int>(clouds);
  params.tokens = static_cast<int>(tokens);
  params.dim = static_cast<int>(dim);
  params.betas = static_cast<int>(K);
  params.clouds_per_block = l.clouds_per_block;
  params.blocks_per_beta = static_cast<int>(blocks_per_beta);
  params.steps = steps;
  params.h = static_cast<float>(step);
  params.h_last = static_cast<float>(last_step);
  params.threshold = static_cast<float>(1.0 - cluster_eps);

  const std::int64_t chunk =
      chunked ? (steps + kLaunchesWithProgress - 1) / kLaunchesWithProgress : steps;
  for (std::int64_t begin = 0; begin < steps; begin += chunk) {
    const std::int64_t end = std::min(steps, begin + chunk);
    params.from_initial = begin == 0;
    params.from = begin == 0 ? start.data() : state.data();
    // The state is read and written in place: each block reads its own clouds before it writes.
    params.to = end < steps ? state.data() : nullptr;
    switch (dim) {
      case 2:
        launch_sweep<2>(params, l, blocks, begin, end, s, operation);
        break;
      case 3:
        launch_sweep<3>(params, l, blocks, begin, end, s, operation);
        break;
      default:
        launch_sweep<0>(params, l, blocks, begin, end, s, operation);
        break;
    }
    if (progress && end < steps) {
      // The host waits so that the report means the steps are done.
      check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
      progress(end, steps);
    }
  }

  std::vector<unsigned long long> pair_counts(counts.size());
  counts.copy_to_host(pair_counts.data(), pair_counts.size(), s);
  // The counts are needed on the host.
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
  const double pairs = 0.5 * static_cast<double>(tokens) * static_cast<double>(tokens - 1);
  std::vector<double> clustered(pair_counts.size());
  for (std::size_t e = 0; e < clustered.size(); ++e) {
    clustered[e] = static_cast<double>(pair_counts[e]) / pairs / static_cast<double>(clouds);
  }
  if (progress) progress(steps, steps);
  return clustered;
}

}  // namespace emflow::flow::detail

// The flow's own kernels (flow_kernels.hpp): the element-wise parts of a step, the normalisations,
// and the observables of recorded clouds. Attention itself is emflow::cuda::attend_async.
//
// Element-wise kernels mirror the host code of src/flow/host_ops.cpp and src/flow/normalize.cpp
// expression by expression (per token statistics in double, in token order), so the device and
// the host differ by rounding only. The file is compiled with -fmad=false (CMakeLists.txt,
// EMFLOW_EXACT_ROUNDING_SOURCES): every product and sum is rounded on its own, as on the host,
// so the observables' pair terms, and with them the cluster decisions, are the host's exactly.
//
// Observables, for B clouds at once, in three kernels and without floating-point atomics:
//   token_norms   one thread per token: ||x_i|| in double, and the token's union-find parent set
//                 to itself.
//   pair_rows     one block per token i: its pairs (i, j > i) in double, thread t the tokens
//                 j = i + 1 + t + k blockDim, so all threads share the row; per-thread sums,
//                 then a fixed tree over the block, into the token's row of partial sums
//                 (sum <x_i, x_j>, energy, clustered pairs, min inner product, max squared
//                 distance). Each clustered pair joins the trees of i and j at once, in a
//                 lock-free union-find over the cloud's parents (ECL-CC: the larger root hooked
//                 under the smaller with atomicCAS, finds halving paths).
//   finish        one block per cloud: the clusters are the roots left (parent[i] == i), then a
//                 fixed tree over the token rows.
// Every reduction has an order that depends on the sizes only, so two runs agree bit for bit;
// the joins race, but the connected components, hence the number of roots, do not depend on
// the order in which the pairs are joined. Scratch is O(B N) in global memory, whatever N.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cuda/cuda_support.hpp"
#include "flow_kernels.hpp"
#include "launch.cuh"

namespace emflow::flow::detail {

namespace {

using emflow::detail::check_cuda;
using emflow::detail::grid_for;

constexpr const char* kOperation = "run_flow";
constexpr int kThreads = 128;  // every block size below is a power of two <= kThreads
constexpr int kMaxBlocks = 4096;

// The per-token partial sums of pair_rows, in this order.
enum RowField : int { kRowSum, kRowEnergy, kRowClustered, kRowMin, kRowMax, kRowFields };

// 64-bit indices for every grid-stride loop: an index below INT_MAX plus a stride of up to
// kMaxBlocks * kThreads would wrap an int (the element counts are only checked to fit in int).
__device__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ std::int64_t grid_stride() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------------------------------------
// Steps

template <class T>
__global__ void axpy_kernel(T* y, const T* x, const T* k, T step, int n) {
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) y[e] = x[e] + step * k[e];
}

template <class T>
__global__ void rk4_combine_kernel(T* x, const T* k1, const T* k2, const T* k3, const T* k4,
                                   T sixth, int n) {
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    x[e] += sixth * (k1[e] + T(2) * (k2[e] + k3[e]) + k4[e]);
  }
}

template <class T>
__global__ void add_kernel(T* x, const T* delta, int n) {
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) x[e] += delta[e];
}

// One thread per token, the host's normalize() line by line (eps as PyTorch's defaults).
template <class T>
__global__ void normalize_kernel(int norm, const T* in, T* out, int rows, int dim, const T* gain,
                                 const T* bias) {
  constexpr double eps = 1e-5;
  const double inv_dim = 1.0 / static_cast<double>(dim);
  const bool layernorm = norm == static_cast<int>(Normalization::layernorm);
  const bool sphere = norm == static_cast<int>(Normalization::sphere);
  for (std::int64_t r = first_index(); r < rows; r += grid_stride()) {
    const T* x = in + static_cast<std::size_t>(r) * dim;
    T* y = out + static_cast<std::size_t>(r) * dim;
    double shift = 0.0, scale = 1.0;
    if (layernorm) {
      double mean = 0.0, var = 0.0;
      for (int a = 0; a < dim; ++a) mean += static_cast<double>(x[a]);
      mean *= inv_dim;
      for (int a = 0; a < dim; ++a) {
        const double c = static_cast<double>(x[a]) - mean;
        var += c * c;
      }
      shift = mean;
      scale = 1.0 / sqrt(var * inv_dim + eps);
    } else {
      double square = 0.0;
      for (int a = 0; a < dim; ++a) square += static_cast<double>(x[a]) * x[a];
      if (!sphere) {
        scale = 1.0 / sqrt(square * inv_dim + eps);
      } else {
        // A zero token has no direction: it stays where it is rather than becoming NaN.
        scale = square > 0.0 ? 1.0 / sqrt(square) : 1.0;
      }
    }
    for (int a = 0; a < dim; ++a) {
      double v = (static_cast<double>(x[a]) - shift) * scale;
      if (!sphere) {
        if (gain != nullptr) v *= static_cast<double>(gain[a]);
        if (layernorm && bias != nullptr) v += static_cast<double>(bias[a]);
      }
      y[a] = static_cast<T>(v);
    }
  }
}

// P_x y = y - <x, y> x, one thread per token.
template <class T>
__global__ void tangent_kernel(const T* cloud, T* update, int rows, int dim) {
  for (std::int64_t r = first_index(); r < rows; r += grid_stride()) {
    const T* x = cloud + static_cast<std::size_t>(r) * dim;
    T* y = update + static_cast<std::size_t>(r) * dim;
    double dot = 0.0;
    for (int a = 0; a < dim; ++a) dot += static_cast<double>(x[a]) * y[a];
    for (int a = 0; a < dim; ++a) y[a] = static_cast<T>(y[a] - dot * x[a]);
  }
}

// USA: sum_j exp(s_ij) F x_j / N = delta_i Z_i / N with Z_i / N = exp(lse_i - log N).
template <class T>
__global__ void usa_accumulate_kernel(T* update, const T* delta, const T* lse, double log_tokens,
                                      bool first, int rows, int dim) {
  const std::int64_t n = static_cast<std::int64_t>(rows) * dim;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const double scale = exp(static_cast<double>(lse[e / dim]) - log_tokens);
    const T term = static_cast<T>(scale * static_cast<double>(delta[e]));
    update[e] = (first ? T(0) : update[e]) + term;
  }
}

// One block per cloud: the mean over heads and tokens, a fixed strided sum then a fixed tree.
template <class T>
__global__ void mean_entropy_kernel(const T* entropy, int heads, int tokens, long long cloud_stride,
                                    long long head_stride, double* out, int out_stride) {
  EMFLOW_SHARED(double, sums, [kThreads]);
  const int b = static_cast<int>(blockIdx.x), t = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const long long count = static_cast<long long>(heads) * tokens;
  double sum = 0.0;
  for (long long k = t; k < count; k += threads) {
    const long long h = k / tokens, i = k - h * tokens;
    sum += static_cast<double>(entropy[h * head_stride + b * cloud_stride + i]);
  }
  sums[t] = sum;
  __syncthreads();
  for (int stride = threads / 2; stride > 0; stride /= 2) {
    if (t < stride) sums[t] += sums[t + stride];
    __syncthreads();
  }
  if (t == 0) out[static_cast<std::size_t>(b) * out_stride] = sums[0] / static_cast<double>(count);
}

// ---------------------------------------------------------------------------------------------
// Observables

template <class T>
__global__ void token_norms_kernel(const T* clouds, int rows, int tokens, int dim, double* norms,
                                   int* parents) {
  for (std::int64_t r = first_index(); r < rows; r += grid_stride()) {
    const T* x = clouds + static_cast<std::size_t>(r) * dim;
    double square = 0.0;
    for (int a = 0; a < dim; ++a) square += static_cast<double>(x[a]) * x[a];
    norms[r] = sqrt(square);
    parents[r] = static_cast<int>(r % tokens);  // indices within the cloud
  }
}

// The union-find of a cloud's clustered pairs, shared by every thread of every block of
// pair_rows. Invariant: parent[v] <= v, equality for the roots; a node that is not a root never
// becomes one again. Hooks (atomicCAS) only change roots; the plain stores of path halving only
// change non-roots, each time to an ancestor, so concurrent finds and hooks keep the partition
// right. The plain accesses are relaxed atomics under the CPU emulation (a checked data race
// otherwise) and volatile on the device (no stale value kept in a register).
__device__ int parent_of(int* parent, int v) {
#if defined(EMFLOW_CUDA_EMULATION)
  return __atomic_load_n(parent + v, __ATOMIC_RELAXED);
#else
  return *static_cast<volatile int*>(parent + v);
#endif
}
__device__ void set_parent(int* parent, int v, int to) {
#if defined(EMFLOW_CUDA_EMULATION)
  __atomic_store_n(parent + v, to, __ATOMIC_RELAXED);
#else
  *static_cast<volatile int*>(parent + v) = to;
#endif
}

// The root of v's tree, each node on the way pointed at its grandparent (path halving).
__device__ int find_root(int* parent, int v) {
  int up = parent_of(parent, v);
  if (up == v) return v;
  int below = v, next;
  while (up > (next = parent_of(parent, up))) {
    set_parent(parent, below, next);
    below = up;
    up = next;
  }
  return up;
}

// Joins the trees of a and b: the larger root under the smaller; when another thread hooked
// that root first, climbs from where it went and tries again.
__device__ void unite(int* parent, int a, int b) {
  int root_a = find_root(parent, a), root_b = find_root(parent, b);
  while (root_a != root_b) {
    const int high = root_a > root_b ? root_a : root_b, low = root_a + root_b - high;
    const int seen = atomicCAS(parent + high, high, low);
    if (seen == high) return;
    const int moved = find_root(parent, seen);
    if (root_a == high) {
      root_a = moved;
    } else {
      root_b = moved;
    }
  }
}

// The fixed tree over a block's per-thread fields (`threads` a power of two): sums for the
// summed fields (kRowSum, kRowEnergy, kRowClustered and, with Fields > kRowFields, the extra
// field), min for kRowMin, max for kRowMax; the totals end in column 0. Begins with a barrier,
// so the fields may have just been written.
template <int Fields>
__device__ void reduce_row_fields(double (*partial)[kThreads], int t, int threads) {
  __syncthreads();
  for (int stride = threads / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      partial[kRowSum][t] += partial[kRowSum][t + stride];
      partial[kRowEnergy][t] += partial[kRowEnergy][t + stride];
      partial[kRowClustered][t] += partial[kRowClustered][t + stride];
      for (int f = kRowFields; f < Fields; ++f) partial[f][t] += partial[f][t + stride];
      const double other_low = partial[kRowMin][t + stride];
      if (other_low < partial[kRowMin][t]) partial[kRowMin][t] = other_low;
      const double other_high = partial[kRowMax][t + stride];
      if (partial[kRowMax][t] < other_high) partial[kRowMax][t] = other_high;
    }
    __syncthreads();
  }
}

// One block per token i (blockIdx.x = b * N + i). Thread t takes the tokens j = i + 1 + t,
// i + 1 + t + blockDim, ...: every thread has work until fewer than blockDim pairs are left.
template <class T>
__global__ void pair_rows_kernel(const T* clouds, int tokens, int dim, const double* betas,
                                 const double* norms, double cluster_eps, double* rows,
                                 int* parents) {
  EMFLOW_SHARED(double, partial, [kRowFields][kThreads]);
  const int row = static_cast<int>(blockIdx.x), t = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int b = row / tokens, i = row - b * tokens;
  const T* cloud = clouds + static_cast<std::size_t>(b) * tokens * dim;
  const T* xi = cloud + static_cast<std::size_t>(i) * dim;
  const double beta = betas[b], norm_i = norms[row];
  const double* cloud_norms = norms + static_cast<std::size_t>(b) * tokens;
  int* const parent = parents + static_cast<std::size_t>(b) * tokens;

  double sum = 0.0, energy = 0.0, clustered = 0.0;
  double low = static_cast<double>(INFINITY), high = 0.0;
  if (t == 0) {
    // The diagonal term of the energy, exp(beta ||x_i||^2), once per token.
    double square = 0.0;
    for (int a = 0; a < dim; ++a) square += static_cast<double>(xi[a]) * xi[a];
    energy = exp(beta * square);
  }
  for (int j = i + 1 + t; j < tokens; j += threads) {
    const T* xj = cloud + static_cast<std::size_t>(j) * dim;
    double g = 0.0, e = 0.0;
    for (int a = 0; a < dim; ++a) {
      const double p = static_cast<double>(xi[a]), q = static_cast<double>(xj[a]);
      g += p * q;
      e += (p - q) * (p - q);
    }
    sum += g;
    energy += 2.0 * exp(beta * g);
    low = g < low ? g : low;  // as std::min / std::max on the host
    high = high < e ? e : high;
    // Clustering is about directions: the cosine, which is the inner product on the sphere.
    const double scale = norm_i * cloud_norms[j];
    if (scale > 0.0 && g > (1.0 - cluster_eps) * scale) {
      clustered += 1.0;
      unite(parent, i, j);
    }
  }

  partial[kRowSum][t] = sum;
  partial[kRowEnergy][t] = energy;
  partial[kRowClustered][t] = clustered;
  partial[kRowMin][t] = low;
  partial[kRowMax][t] = high;
  reduce_row_fields<kRowFields>(partial, t, threads);
  if (t < kRowFields) rows[static_cast<std::size_t>(row) * kRowFields + t] = partial[t][0];
}

// One block per cloud: the clusters (the roots of the union-find that pair_rows completed) and
// the reduction of the token rows into the cloud's observables (all but the entropy).
__global__ void finish_kernel(int tokens, const double* betas, const double* rows,
                              const int* parents, double* out) {
  EMFLOW_SHARED(double, partial, [kRowFields + 1][kThreads]);
  const int b = static_cast<int>(blockIdx.x), t = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int* const parent = parents + static_cast<std::size_t>(b) * tokens;

  double sum = 0.0, energy = 0.0, clustered = 0.0, roots = 0.0;
  double low = static_cast<double>(INFINITY), high = 0.0;
  const double* cloud_rows = rows + static_cast<std::size_t>(b) * tokens * kRowFields;
  for (int i = t; i < tokens; i += threads) {
    const double* r = cloud_rows + static_cast<std::size_t>(i) * kRowFields;
    sum += r[kRowSum];
    energy += r[kRowEnergy];
    clustered += r[kRowClustered];
    low = r[kRowMin] < low ? r[kRowMin] : low;
    high = high < r[kRowMax] ? r[kRowMax] : high;
    if (parent[i] == i) roots += 1.0;
  }
  partial[kRowSum][t] = sum;
  partial[kRowEnergy][t] = energy;
  partial[kRowClustered][t] = clustered;
  partial[kRowMin][t] = low;
  partial[kRowMax][t] = high;
  partial[kRowFields][t] = roots;
  reduce_row_fields<kRowFields + 1>(partial, t, threads);
  if (t == 0) {
    const double n = static_cast<double>(tokens);
    const double pairs = n * (n - 1.0) / 2.0;
    double* o = out + static_cast<std::size_t>(b) * kObservableFields;
    o[kMinInner] = partial[kRowMin][0];
    o[kMeanInner] = partial[kRowSum][0] / pairs;
    o[kClusteredFraction] = partial[kRowClustered][0] / pairs;
    o[kClusters] = partial[kRowFields][0];
    o[kEnergy] = partial[kRowEnergy][0] / (2.0 * betas[b] * n * n);
    o[kDiameter] = sqrt(partial[kRowMax][0]);
  }
}

}  // namespace

ObserveScratchSizes observe_scratch_sizes(std::int64_t batch, std::int64_t tokens) {
  ObserveScratchSizes sizes;
  sizes.norms = batch * tokens;
  sizes.rows = batch * tokens * kRowFields;
  sizes.parents = batch * tokens;
  return sizes;
}

template <class T>
void launch_axpy(T* y, const T* x, const T* k, T step, int n, cuda::Stream stream) {
  emflow::detail::launch(kOperation, "axpy_kernel", axpy_kernel<T>,
                         grid_for(n, kThreads, kMaxBlocks), kThreads, 0, stream, y, x, k, step, n);
}

template <class T>
void launch_rk4_combine(T* x, const T* k1, const T* k2, const T* k3, const T* k4, T sixth, int n,
                        cuda::Stream stream) {
  emflow::detail::launch(kOperation, "rk4_combine_kernel", rk4_combine_kernel<T>,
                         grid_for(n, kThreads, kMaxBlocks), kThreads, 0, stream, x, k1, k2, k3, k4,
                         sixth, n);
}

template <class T>
void launch_add(T* x, const T* delta, int n, cuda::Stream stream) {
  emflow::detail::launch(kOperation, "add_kernel", add_kernel<T>, grid_for(n, kThreads, kMaxBlocks),
                         kThreads, 0, stream, x, delta, n);
}

template <class T>
void launch_normalize(Normalization norm, const T* in, T* out, int rows, int dim, const T* gain,
                      const T* bias, cuda::Stream stream) {
  if (norm == Normalization::none) {
    if (in != out) {
      check_cuda(cudaMemcpyAsync(out, in, static_cast<std::size_t>(rows) * dim * sizeof(T),
                                 cudaMemcpyDeviceToDevice, stream),
                 kOperation, "cudaMemcpyAsync (device to device)");
    }
    return;
  }
  emflow::detail::launch(kOperation, "normalize_kernel", normalize_kernel<T>,
                         grid_for(rows, kThreads, kMaxBlocks), kThreads, 0, stream,
                         static_cast<int>(norm), in, out, rows, dim, gain, bias);
}

template <class T>
void launch_tangent(const T* cloud, T* update, int rows, int dim, cuda::Stream stream) {
  emflow::detail::launch(kOperation, "tangent_kernel", tangent_kernel<T>,
                         grid_for(rows, kThreads, kMaxBlocks), kThreads, 0, stream, cloud, update,
                         rows, dim);
}

template <class T>
void launch_usa_accumulate(T* update, const T* delta, const T* lse, double log_tokens, bool first,
                           int rows, int dim, cuda::Stream stream) {
  emflow::detail::launch(kOperation, "usa_accumulate_kernel", usa_accumulate_kernel<T>,
                         grid_for(rows * dim, kThreads, kMaxBlocks), kThreads, 0, stream, update,
                         delta, lse, log_tokens, first, rows, dim);
}

template <class T>
void launch_mean_entropy(const T* entropy, int batch, int heads, int tokens,
                         std::int64_t cloud_stride, std::int64_t head_stride, double* out,
                         int out_stride, cuda::Stream stream) {
  emflow::detail::launch(kOperation, "mean_entropy_kernel", mean_entropy_kernel<T>,
                         static_cast<unsigned>(batch), kThreads, 0, stream, entropy, heads, tokens,
                         static_cast<long long>(cloud_stride), static_cast<long long>(head_stride),
                         out, out_stride);
}

template <class T>
void launch_observe(const T* clouds, int batch, int tokens, int dim, const double* betas,
                    double cluster_eps, const ObserveScratch& scratch, double* out,
                    cuda::Stream stream) {
  const int rows = batch * tokens;
  emflow::detail::launch(kOperation, "token_norms_kernel", token_norms_kernel<T>,
                         grid_for(rows, kThreads, kMaxBlocks), kThreads, 0, stream, clouds, rows,
                         tokens, dim, scratch.norms, scratch.parents);
  // A block per token, as wide as its first row needs (a size that depends on N only, so the
  // reduction order does too).
  const int pair_threads = tokens <= 32 ? 32 : (tokens <= 64 ? 64 : kThreads);
  emflow::detail::launch(kOperation, "pair_rows_kernel", pair_rows_kernel<T>,
                         static_cast<unsigned>(rows), static_cast<unsigned>(pair_threads), 0,
                         stream, clouds, tokens, dim, betas, scratch.norms, cluster_eps,
                         scratch.rows, scratch.parents);
  emflow::detail::launch(kOperation, "finish_kernel", finish_kernel, static_cast<unsigned>(batch),
                         kThreads, 0, stream, tokens, betas, scratch.rows, scratch.parents, out);
}

#define EMFLOW_FLOW_CUDA_INSTANTIATE(T)                                                        \
  template void launch_axpy<T>(T*, const T*, const T*, T, int, cuda::Stream);                  \
  template void launch_rk4_combine<T>(T*, const T*, const T*, const T*, const T*, T, int,      \
                                      cuda::Stream);                                           \
  template void launch_add<T>(T*, const T*, int, cuda::Stream);                                \
  template void launch_normalize<T>(Normalization, const T*, T*, int, int, const T*, const T*, \
                                    cuda::Stream);                                             \
  template void launch_tangent<T>(const T*, T*, int, int, cuda::Stream);                       \
  template void launch_usa_accumulate<T>(T*, const T*, const T*, double, bool, int, int,       \
                                         cuda::Stream);                                        \
  template void launch_mean_entropy<T>(const T*, int, int, int, std::int64_t, std::int64_t,    \
                                       double*, int, cuda::Stream);                            \
  template void launch_observe<T>(const T*, int, int, int, const double*, double,              \
                                  const ObserveScratch&, double*, cuda::Stream);

EMFLOW_FLOW_CUDA_INSTANTIATE(float)
EMFLOW_FLOW_CUDA_INSTANTIATE(double)
#undef EMFLOW_FLOW_CUDA_INSTANTIATE

}  // namespace emflow::flow::detail

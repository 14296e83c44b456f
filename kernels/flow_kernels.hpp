// The flow's own kernels on the GPU (flow_kernels.cu): the element-wise parts of a step, the
// normalisations, the USA rescaling, the mean entropy and the observables of recorded clouds.
// The device-resident run that enqueues them, with emflow::cuda::attend_async for the attention,
// is src/cuda/flow_ops.cpp.
//
// Every launcher enqueues on `stream`, checks the launch and never synchronises. Pointers are
// device pointers; the caller has checked that the sizes fit in int.
#pragma once

#include <cstdint>

#include "emflow/cuda.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow::detail {

/// The observables of one cloud as the device writes them: kObservableFields doubles in this
/// order (the fields of emflow::flow::Observables; clusters as an exact integer-valued double).
enum ObservableField : int {
  kMinInner,
  kMeanInner,
  kClusteredFraction,
  kClusters,
  kEnergy,
  kEntropy,
  kDiameter,
  kObservableFields
};

/// Device scratch of the observables of B clouds of N tokens (sizes from observe_scratch_sizes).
struct ObserveScratch {
  double* norms = nullptr;  ///< (B * N): ||x_i||
  double* rows = nullptr;   ///< (B * N, kRowFields): per-token sums over its pairs j > i
  int* parents = nullptr;   ///< (B * N): union-find of the clustered pairs, indices per cloud
};

/// Element counts of the ObserveScratch arrays for B clouds of N tokens.
struct ObserveScratchSizes {
  std::int64_t norms = 0, rows = 0, parents = 0;
};
ObserveScratchSizes observe_scratch_sizes(std::int64_t batch, std::int64_t tokens);

/// y = x + step * k over n elements (y may be x).
template <class T>
void launch_axpy(T* y, const T* x, const T* k, T step, int n, cuda::Stream stream);

/// x += sixth * (k1 + 2 (k2 + k3) + k4): the classical RK4 combination.
template <class T>
void launch_rk4_combine(T* x, const T* k1, const T* k2, const T* k3, const T* k4, T sixth, int n,
                        cuda::Stream stream);

/// x += delta over n elements.
template <class T>
void launch_add(T* x, const T* delta, int n, cuda::Stream stream);

/// out = N(in) per token of `dim` (in may be out), as emflow::flow::normalize; gain, bias: (dim)
/// or null. Normalization::none copies (nothing when in == out).
template <class T>
void launch_normalize(Normalization norm, const T* in, T* out, int rows, int dim, const T* gain,
                      const T* bias, cuda::Stream stream);

/// update_i -= <x_i, update_i> x_i: the tangent projection on the sphere.
template <class T>
void launch_tangent(const T* cloud, T* update, int rows, int dim, cuda::Stream stream);

/// USA, one head: update_i (= when first, else +=) exp(lse_i - log N) delta_i.
template <class T>
void launch_usa_accumulate(T* update, const T* delta, const T* lse, double log_tokens, bool first,
                           int rows, int dim, cuda::Stream stream);

/// out[b * out_stride] = mean over heads h and tokens i of
/// entropy[h * head_stride + b * cloud_stride + i], in double, in a fixed order.
template <class T>
void launch_mean_entropy(const T* entropy, int batch, int heads, int tokens,
                         std::int64_t cloud_stride, std::int64_t head_stride, double* out,
                         int out_stride, cuda::Stream stream);

/// The observables of B clouds (B, N, d) except the entropy: out (B, kObservableFields).
/// betas: B doubles on the device. Deterministic: fixed reduction orders, no float atomics; the
/// cluster count is exact whatever the order of the union-find's joins. O(B N) scratch.
template <class T>
void launch_observe(const T* clouds, int batch, int tokens, int dim, const double* betas,
                    double cluster_eps, const ObserveScratch& scratch, double* out,
                    cuda::Stream stream);

}  // namespace emflow::flow::detail

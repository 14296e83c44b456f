// The flow on the GPU: the seam between emflow::flow::run_flow and the device-resident run
// (flow_cuda.cpp), and the launchers of the flow's own kernels (flow_cuda.cu).
//
// run_flow_cuda keeps the whole run in device memory: the state, the RK4 stages, the layers'
// operators and one attention workspace. Every attention evaluation is one
// emflow::cuda::attend_async per run of consecutive clouds that share beta (per head for USA
// with several heads) on one owned stream; the element-wise parts of a step and the
// observables of each recorded state are the kernels below. Only the recorded trajectory and
// the observables come back to the host.
//
// Every launcher enqueues on `stream`, checks the launch and never synchronises. Pointers are
// device pointers; sizes have been checked to fit in int by run_flow_cuda.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/cuda.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow::detail {

/// The device-resident run_flow on arguments that validate_flow has accepted (`betas`: one per
/// cloud). Same results contract as the host run; throws emflow::Error.
template <class T>
FlowResult<T> run_flow_cuda(const Tensor<T>& initial, const std::vector<double>& betas,
                            const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                            const Progress& progress);

extern template FlowResult<float> run_flow_cuda<float>(const Tensor<float>&,
                                                       const std::vector<double>&,
                                                       const std::vector<FlowLayer<float>>&,
                                                       const FlowSettings&, const Progress&);
extern template FlowResult<double> run_flow_cuda<double>(const Tensor<double>&,
                                                         const std::vector<double>&,
                                                         const std::vector<FlowLayer<double>>&,
                                                         const FlowSettings&, const Progress&);

// ---------------------------------------------------------------------------------------------
// Launchers (flow_cuda.cu)

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
  double* norms = nullptr;         ///< (B * N): ||x_i||
  double* rows = nullptr;          ///< (B * N, kRowFields): per-token sums over its pairs j > i
  std::uint32_t* edges = nullptr;  ///< (B * N, words): bit j of token i: pair (i, j) clustered
  int* labels = nullptr;           ///< (B, 2, N): component labels, double-buffered
};

/// Element counts of the ObserveScratch arrays for B clouds of N tokens.
struct ObserveScratchSizes {
  std::int64_t norms = 0, rows = 0, edges = 0, labels = 0;
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
/// betas: B doubles on the device. Deterministic: fixed reduction orders, no float atomics.
template <class T>
void launch_observe(const T* clouds, int batch, int tokens, int dim, const double* betas,
                    double cluster_eps, const ObserveScratch& scratch, double* out,
                    cuda::Stream stream);

}  // namespace emflow::flow::detail

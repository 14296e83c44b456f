// The flow on the host with the operations of host_ops.hpp (std::vector buffers, every attention
// evaluation an emflow::attend call on the chosen device (cpu or reference), the element-wise
// parts OpenMP loops, the observables of a record computed by observe() in double): run_flow on
// Device::cpu and Device::reference, attention_update, and the generic phase sweep off the GPU.
#include "host_ops.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.hpp"
#include "emflow/flow.hpp"
#include "internal.hpp"
#include "stepper.hpp"

namespace emflow::flow {

namespace detail {

template <class T>
FlowResult<T> run_flow_host(const Tensor<T>& initial, const std::vector<double>& betas,
                            const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                            const ExecutionOptions& options, const Progress& progress) {
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  FlowResult<T> result = allocate_result<T>(B, N, d, settings);
  HostOps<T> ops(options, settings.norm_eps);
  ops.record_into(betas, settings.cluster_eps, result.times.size());
  std::vector<LayerView<T>> views;
  views.reserve(layers.size());
  for (const FlowLayer<T>& layer : layers) views.push_back(host_view(layer));
  Tensor<T> state = initial;
  run_recorded(ops, state.data(), views, betas, settings, result, progress);
  ops.finish(result);
  return result;
}

std::vector<double> phase_generic_host(const PhaseProblem& problem, const ExecutionOptions& options,
                                       const Progress& progress) {
  HostOps<float> ops(options);
  const FlowLayer<float> identity =
      make_layer<float>(problem.dim, OperatorKind::identity, OperatorKind::identity, 0);
  std::vector<float> state = problem.clouds;
  return phase_stepped(ops, state.data(), host_view(identity), problem, progress);
}

}  // namespace detail

template <class T>
void attention_update(const T* cloud, std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                      const FlowLayer<T>& layer, const std::vector<double>& betas,
                      const UpdateSettings& settings, T* update, double* mean_entropy,
                      const ExecutionOptions& options) {
  if (static_cast<std::int64_t>(betas.size()) != batch) {
    emflow::detail::fail_argument("attention_update", "betas", "must have one entry per cloud (",
                                  batch, "), got ", betas.size());
  }
  detail::HostOps<T> ops(options);
  detail::StepperShape shape;
  shape.batch = batch;
  shape.tokens = tokens;
  shape.dim = dim;
  shape.max_heads = layer.heads;
  shape.unnormalized = settings.unnormalized;
  shape.tangent = settings.tangent;
  const detail::LayerView<T> view = detail::host_view(layer);
  detail::Stepper<detail::HostOps<T>> stepper(ops, betas, shape, {view});
  stepper.drift(cloud, view, update,
                mean_entropy ? detail::EntropySink{mean_entropy, 1} : detail::EntropySink{});
}

#define EMFLOW_HOST_FLOW_INSTANTIATE(T)                                                 \
  template class detail::Stepper<detail::HostOps<T>>;                                   \
  template FlowResult<T> detail::run_flow_host<T>(                                      \
      const Tensor<T>&, const std::vector<double>&, const std::vector<FlowLayer<T>>&,   \
      const FlowSettings&, const ExecutionOptions&, const Progress&);                   \
  template void attention_update<T>(const T*, std::int64_t, std::int64_t, std::int64_t, \
                                    const FlowLayer<T>&, const std::vector<double>&,    \
                                    const UpdateSettings&, T*, double*, const ExecutionOptions&);

EMFLOW_HOST_FLOW_INSTANTIATE(float)
EMFLOW_HOST_FLOW_INSTANTIATE(double)
#undef EMFLOW_HOST_FLOW_INSTANTIATE

}  // namespace emflow::flow

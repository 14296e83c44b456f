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
void attention_update(const UpdateInput<T>& in, const UpdateOutput<T>& out,
                      const ExecutionOptions& options) {
  const char* const op = "attention_update";
  emflow::detail::expect_not_null(op, "layer", in.layer);
  if (static_cast<std::int64_t>(in.betas.size()) != in.batch) {
    emflow::detail::fail_argument(op, "betas", "must have one entry per cloud (", in.batch,
                                  "), got ", in.betas.size());
  }
  detail::HostOps<T> ops(options);
  detail::StepperShape shape;
  shape.batch = in.batch;
  shape.tokens = in.tokens;
  shape.dim = in.dim;
  shape.max_heads = in.layer->heads;
  shape.unnormalized = in.settings.unnormalized;
  shape.tangent = in.settings.tangent;
  const detail::LayerView<T> view = detail::host_view(*in.layer);
  detail::Stepper<detail::HostOps<T>> stepper(ops, in.betas, shape, {view});
  stepper.drift(
      in.cloud, view, out.update,
      out.mean_entropy ? detail::EntropySink{out.mean_entropy, 1} : detail::EntropySink{});
}

#define EMFLOW_HOST_FLOW_INSTANTIATE(T)                                               \
  template class detail::Stepper<detail::HostOps<T>>;                                 \
  template FlowResult<T> detail::run_flow_host<T>(                                    \
      const Tensor<T>&, const std::vector<double>&, const std::vector<FlowLayer<T>>&, \
      const FlowSettings&, const ExecutionOptions&, const Progress&);                 \
  template void attention_update<T>(const UpdateInput<T>&, const UpdateOutput<T>&,    \
                                    const ExecutionOptions&);

EMFLOW_HOST_FLOW_INSTANTIATE(float)
EMFLOW_HOST_FLOW_INSTANTIATE(double)
#undef EMFLOW_HOST_FLOW_INSTANTIATE

}  // namespace emflow::flow

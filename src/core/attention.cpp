// emflow::attend: validated once (validate.cpp), described and routed (capability.cpp), then run
// by the one backend the route names (backends.hpp); and resolve_device.
#include "emflow/attention.hpp"

#include <string>

#include "backends.hpp"
#include "check.hpp"
#include "dispatch.hpp"
#include "emflow/capability.hpp"
#include "low_precision.hpp"
#include "memory.hpp"

namespace emflow {

Device resolve_device(Device requested) {
  const Machine& machine = this_machine();
  switch (requested) {
    case Device::automatic:
      return machine.cuda_device ? Device::cuda : Device::cpu;
    case Device::cuda:
      if (!machine.cuda_device) {
        detail::fail(ErrorCode::unsupported, "device 'cuda' requested but unavailable: ",
                     machine.cuda_built
                         ? machine.cuda_reason
                         : std::string("emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)"));
      }
      return Device::cuda;
    case Device::cpu:
    case Device::reference:
      return requested;
  }
  return Device::cpu;
}

template <class T>
void attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
            const ExecutionOptions& options) {
  const char* const op = "attend";
  // A failed host allocation anywhere below is reported as ErrorCode::out_of_memory.
  detail::reporting_out_of_memory(op, "", [&] {
    validate(input, output, op);
    check_threads(options.threads, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, output, options);
    problem.finite = detail::inputs_finite(input);
    const Route route = require_route(problem, options.device, op);
    if (route.device == Device::cuda) {
      detail::cuda_attend(input, output, route);
    } else {
      detail::attend_on_host(input, output, route, options.threads);
    }
  });
}

template void attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                            const ExecutionOptions&);
template void attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                             const ExecutionOptions&);
template void attend<bfloat16>(const AttentionInput<bfloat16>&, const AttentionOutput<bfloat16>&,
                               const ExecutionOptions&);
template void attend<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                              const ExecutionOptions&);

}  // namespace emflow

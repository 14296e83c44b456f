// emflow::attend_factored (include/emflow/factored.hpp): validated once (check_factored),
// described and routed (capability.cpp), then run where the route says: the tensor cores
// (cuda_attend_factored), the engine in rank r (cpu_attend_factored, src/cpu/factored.cpp), or,
// for an expanded route, the dense form M_h = A_h^T B_h, F_h = U_h V_h: in double for the
// reference, on the device by the factored layer's plan (src/cuda/) for the GPU's dense kernels.
#include "emflow/factored.hpp"

#include <type_traits>

#include "backends.hpp"
#include "check.hpp"
#include "dispatch.hpp"
#include "emflow/capability.hpp"
#include "low_precision.hpp"
#include "memory.hpp"

namespace emflow {

template <class T>
void attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                     const AttentionOutput<T>& output, const ExecutionOptions& options) {
  const char* const op = "attend_factored";
  detail::reporting_out_of_memory(op, "", [&] {
    detail::check_factored(input, layer, output, op);
    check_threads(options.threads, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, layer, output, options);
    problem.finite = detail::inputs_finite(input, layer);
    const Route route = require_route(problem, options.device, op);
    if (route.device != Device::cuda) {
      detail::attend_factored_on_host(input, layer, output, route, options.threads);
    } else if (is_16bit_v<T> && route.expanded) {
      detail::fail(ErrorCode::internal, op, ": no expanded GPU path for ",
                   to_string(dtype_of<T>()));
    } else {  // the factored layer's plan on the device: tensor cores, or expanded there
      detail::cuda_attend_factored(input, layer, output, route);
    }
  });
}

template void attend_factored<float>(const AttentionInput<float>&, const FactoredLayer<float>&,
                                     const AttentionOutput<float>&, const ExecutionOptions&);
template void attend_factored<double>(const AttentionInput<double>&, const FactoredLayer<double>&,
                                      const AttentionOutput<double>&, const ExecutionOptions&);
template void attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                        const FactoredLayer<bfloat16>&,
                                        const AttentionOutput<bfloat16>&, const ExecutionOptions&);
template void attend_factored<float16>(const AttentionInput<float16>&,
                                       const FactoredLayer<float16>&,
                                       const AttentionOutput<float16>&, const ExecutionOptions&);

}  // namespace emflow

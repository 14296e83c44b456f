// Partial states over blocks of keys and their exact merge (include/emflow/partial.hpp): the
// dispatch of attend_partial on its route, and the host merge and finish (validated by
// validate.cpp).
//
// The state of a head and a query is (o, lse, H). Besides §1.4's states it has one more: a
// block whose visible keys all scored -inf keeps lse = -inf with H = NaN (the query saw keys
// whose weights are undefined unless another block has a finite score); a block where the query
// sees no key is lse = -inf, H = 0, o = 0 and changes nothing in a merge.
#include "emflow/partial.hpp"

#include <cstdint>
#include <type_traits>

#include "backends.hpp"
#include "check.hpp"
#include "dispatch.hpp"
#include "emflow/capability.hpp"
#include "low_precision.hpp"
#include "memory.hpp"
#include "partial_rows.hpp"

namespace emflow {

template <class T>
void attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                    const ExecutionOptions& options) {
  const char* const op = "attend_partial";
  detail::reporting_out_of_memory(op, "", [&] {
    detail::check_partial(input, output, op);
    check_threads(options.threads, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, output, options);
    problem.finite = detail::inputs_finite(input);
    const Route route = require_route(problem, options.device, op);
    // Partial states are float or double: route() refuses the 16-bit types.
    if constexpr (!is_16bit_v<T>) {
      if (route.device == Device::cuda) {
        detail::cuda_attend_partial(input, output, route);
        return;
      }
      if (route.kernel == Kernel::reference) {
        detail::reference_partial(input, output);
        return;
      }
      if constexpr (std::is_same_v<T, float>) {
        detail::cpu_partial(input, output, options.threads);
        return;
      }
    }
    detail::fail(ErrorCode::internal, op, ": no kernel for ", to_string(route));
  });
}

template <class T>
void attend_partial(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const PartialOutput<T>& output, const ExecutionOptions& options) {
  const char* const op = "attend_partial";
  detail::reporting_out_of_memory(op, "", [&] {
    detail::check_partial_factored(input, layer, output, op);
    check_threads(options.threads, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, layer, output, options);
    problem.finite = detail::inputs_finite(input, layer);
    const Route route = require_route(problem, options.device, op);
    if (route.device == Device::cuda || route.kernel != Kernel::reference || route.expanded) {
      detail::fail(ErrorCode::internal, op, ": no factored partial-state kernel for ",
                   to_string(route));
    }
    detail::partial_factored_on_host(input, layer, output);
  });
}

template <class T>
void merge_partial(const PartialShape& shape, const PartialInput<T>& part,
                   const PartialOutput<T>& into) {
  detail::check_merge(shape, part, into, "merge_partial");
  const std::int64_t rows = shape.batch * shape.heads * shape.query_tokens, d = shape.dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    detail::merge_state(into.lse[r], into.entropy[r], into.heads + r * d, part.lse[r],
                        part.entropy[r], part.heads + r * d, d);
  }
}

template <class T>
void finish_partial(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                    const AttentionOutput<T>& output) {
  detail::check_finish(shape, state, offset, output, "finish_partial");
  const std::int64_t B = shape.batch, H = shape.heads, Nq = shape.query_tokens, D = shape.dim;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      const std::int64_t row = b * H * Nq + i;
      detail::finish_query(H, Nq, state.lse + row, state.entropy + row, state.heads + row * D, D,
                           offset, output.update + (b * Nq + i) * D,
                           output.lse ? output.lse + row : nullptr,
                           output.entropy ? output.entropy + row : nullptr);
    }
  }
}

template void attend_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&,
                                    const ExecutionOptions&);
template void attend_partial<double>(const AttentionInput<double>&, const PartialOutput<double>&,
                                     const ExecutionOptions&);
// The 16-bit types are refused by route() (no kernel forms their partial states) with the reason.
template void attend_partial<bfloat16>(const AttentionInput<bfloat16>&,
                                       const PartialOutput<bfloat16>&, const ExecutionOptions&);
template void attend_partial<float16>(const AttentionInput<float16>&, const PartialOutput<float16>&,
                                      const ExecutionOptions&);
template void attend_partial<float>(const AttentionInput<float>&, const FactoredLayer<float>&,
                                    const PartialOutput<float>&, const ExecutionOptions&);
template void attend_partial<double>(const AttentionInput<double>&, const FactoredLayer<double>&,
                                     const PartialOutput<double>&, const ExecutionOptions&);
template void merge_partial<float>(const PartialShape&, const PartialInput<float>&,
                                   const PartialOutput<float>&);
template void merge_partial<double>(const PartialShape&, const PartialInput<double>&,
                                    const PartialOutput<double>&);
template void finish_partial<float>(const PartialShape&, const PartialInput<float>&, const float*,
                                    const AttentionOutput<float>&);
template void finish_partial<double>(const PartialShape&, const PartialInput<double>&,
                                     const double*, const AttentionOutput<double>&);

}  // namespace emflow

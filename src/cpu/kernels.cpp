// The table of this compilation's path (kernels.hpp).
#include "kernels.hpp"

#include "target.hpp"

#define EMFLOW_CPU_NAME_OF(name) #name
#define EMFLOW_CPU_NAME(name) EMFLOW_CPU_NAME_OF(name)

EMFLOW_CPU_BEGIN

extern const Kernels kernels {
  EMFLOW_CPU_NAME(EMFLOW_CPU_TARGET), &cpu_attend, &cpu_partial, &cpu_attend_factored,
      &cpu_products, &cpu_cached_partial,
#if EMFLOW_CPU_AVX512BF16
      &cpu_products_bf16,
#else
      nullptr,
#endif
      &cpu_gated_silu,
#if EMFLOW_CPU_AVX512BF16
      &cpu_attend_bf16,
#else
      nullptr,
#endif
      &padded_columns, &pack_key_rows, &project_rows, &attend_cached, &sdpa_inputs_finite,
      &sdpa_forward, &sdpa_backward_finite, &sdpa_backward,
#if EMFLOW_CPU_AVX512BF16
      &sdpa_backward_bf16,
#else
      nullptr,
#endif
      &layer_backward
};

EMFLOW_CPU_END

// The table of one instruction-set path of the CPU backend: its entry points, which dispatch.cpp
// calls through the table of the path this process takes (target.hpp tells how each path is
// built). Every path fills every entry, except the bfloat16 ones below the avx512bf16 path
// (null there: route() sends no call to them unless Machine::avx512_bf16).
#pragma once

#include <cstdint>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "emflow/precision.hpp"
#include "engine.hpp"
#include "layer_backward.hpp"
#include "sdpa.hpp"
#include "target.hpp"

namespace emflow::detail::cpu {

struct Kernels {
  const char* name;  ///< the path: EMFLOW_CPU_TARGET
  // core/backends.hpp
  void (*attend)(const AttentionInput<float>&, const AttentionOutput<float>&, int);
  void (*partial)(const AttentionInput<float>&, const PartialOutput<float>&, int);
  void (*attend_factored)(const AttentionInput<float>&, const FactoredLayer<float>&,
                          const AttentionOutput<float>&, int);
  void (*products)(const float*, std::int64_t, std::int64_t, const float*, std::int64_t, float*,
                   int);
  void (*cached_partial)(const float*, std::int64_t, std::int64_t, const float*, const float*,
                         const float* const*, float, std::int64_t, std::int64_t, float*, double*,
                         double*, double*);
  void (*products_bf16)(const float*, std::int64_t, std::int64_t, const bfloat16*, std::int64_t,
                        float*, int);
  void (*gated_silu)(const float*, std::int64_t, std::int64_t, float*);
  void (*attend_bf16)(const AttentionInput<float>&, const AttentionOutput<bfloat16>&, int);
  // engine.hpp
  std::int64_t (*padded_columns)(std::int64_t);
  void (*pack_key_rows)(const float*, std::int64_t, std::int64_t, std::int64_t, float*);
  void (*project_rows)(const float*, std::int64_t, std::int64_t, const float*, std::int64_t,
                       float*);
  void (*attend_cached)(const float*, std::int64_t, const QueryRule&, const CachedOperands&,
                        const EngineLayer&, const AttentionOutput<float>&, int);
  // sdpa.hpp
  bool (*sdpa_inputs_finite)(const SdpaArrays&);
  void (*sdpa_forward)(const SdpaArrays&, float*, float*, float*, int);
  bool (*sdpa_backward_finite)(const SdpaArrays&, const SdpaBackwardArrays&);
  void (*sdpa_backward)(const SdpaArrays&, const SdpaBackwardArrays&, const SdpaGradientArrays&,
                        int);
  void (*sdpa_backward_bf16)(const SdpaArrays&, const SdpaBackwardArrays&,
                             const SdpaGradientArrays&, int);
  // layer_backward.hpp
  bool (*layer_backward)(const BackwardClouds&, const BackwardLayer&, const LayerUpstream&,
                         const BackwardLayerGradients&, int);
};

}  // namespace emflow::detail::cpu

#if defined(EMFLOW_CPU_TARGET)
// A path's own definitions of the entry points of core/backends.hpp (the contracts written
// there), and its table (kernels.cpp).
EMFLOW_CPU_BEGIN
void cpu_attend(const AttentionInput<float>& input, const AttentionOutput<float>& output,
                int threads);
void cpu_partial(const AttentionInput<float>& input, const PartialOutput<float>& output,
                 int threads);
void cpu_attend_factored(const AttentionInput<float>& input, const FactoredLayer<float>& layer,
                         const AttentionOutput<float>& output, int threads);
void cpu_products(const float* A, std::int64_t rows, std::int64_t depth, const float* B,
                  std::int64_t columns, float* C, int threads);
void cpu_cached_partial(const float* queries, std::int64_t heads, std::int64_t width,
                        const float* panels, const float* values, const float* const* bias,
                        float bias_scale, std::int64_t first, std::int64_t last, float* scratch,
                        double* lse, double* entropy, double* o);
void cpu_gated_silu(const float* gate_up, std::int64_t rows, std::int64_t inner, float* hidden);
#if EMFLOW_CPU_AVX512BF16
void cpu_products_bf16(const float* A, std::int64_t rows, std::int64_t depth, const bfloat16* B,
                       std::int64_t columns, float* C, int threads);
void cpu_attend_bf16(const AttentionInput<float>& input, const AttentionOutput<bfloat16>& output,
                     int threads);
#endif
extern const Kernels kernels;
EMFLOW_CPU_END
#endif

// The instruction-set extensions the CPU engine was compiled to use (backends.hpp,
// cpu_compiled_features): read from the target's macros in a file compiled as the rest of
// src/cpu (-march=native by default), so that src/core can refuse the engine on a processor that
// lacks one of them instead of stopping on an illegal instruction. Plain strings only: nothing
// here may instantiate a template that code built for the baseline target could link to.
#include "core/backends.hpp"
#include "simd.hpp"

#if defined(__AVX2__)
#define EMFLOW_HAS_AVX2 " avx2"
#else
#define EMFLOW_HAS_AVX2 ""
#endif
#if defined(__FMA__)
#define EMFLOW_HAS_FMA " fma"
#else
#define EMFLOW_HAS_FMA ""
#endif
#if defined(__F16C__)
#define EMFLOW_HAS_F16C " f16c"
#else
#define EMFLOW_HAS_F16C ""
#endif
#if defined(__BMI2__)
#define EMFLOW_HAS_BMI2 " bmi2"
#else
#define EMFLOW_HAS_BMI2 ""
#endif
#if defined(__AVX512F__)
#define EMFLOW_HAS_AVX512F " avx512f"
#else
#define EMFLOW_HAS_AVX512F ""
#endif
#if defined(__AVX512DQ__)
#define EMFLOW_HAS_AVX512DQ " avx512dq"
#else
#define EMFLOW_HAS_AVX512DQ ""
#endif
#if defined(__AVX512BW__)
#define EMFLOW_HAS_AVX512BW " avx512bw"
#else
#define EMFLOW_HAS_AVX512BW ""
#endif
#if defined(__AVX512VL__)
#define EMFLOW_HAS_AVX512VL " avx512vl"
#else
#define EMFLOW_HAS_AVX512VL ""
#endif
#if defined(__AVX512VNNI__)
#define EMFLOW_HAS_AVX512VNNI " avx512vnni"
#else
#define EMFLOW_HAS_AVX512VNNI ""
#endif
#if defined(__AVX512VBMI__)
#define EMFLOW_HAS_AVX512VBMI " avx512vbmi"
#else
#define EMFLOW_HAS_AVX512VBMI ""
#endif
#if defined(__AVX512BF16__)
#define EMFLOW_HAS_AVX512BF16 " avx512bf16"
#else
#define EMFLOW_HAS_AVX512BF16 ""
#endif
#if defined(__AVX512FP16__)
#define EMFLOW_HAS_AVX512FP16 " avx512fp16"
#else
#define EMFLOW_HAS_AVX512FP16 ""
#endif
#if defined(__AMX_TILE__)
#define EMFLOW_HAS_AMX_TILE " amx-tile"
#else
#define EMFLOW_HAS_AMX_TILE ""
#endif
#if defined(__AMX_BF16__)
#define EMFLOW_HAS_AMX_BF16 " amx-bf16"
#else
#define EMFLOW_HAS_AMX_BF16 ""
#endif
#if defined(__AMX_INT8__)
#define EMFLOW_HAS_AMX_INT8 " amx-int8"
#else
#define EMFLOW_HAS_AMX_INT8 ""
#endif

namespace emflow::detail {

const char* cpu_compiled_features() {
  static const char features[] = EMFLOW_HAS_AVX2 EMFLOW_HAS_FMA EMFLOW_HAS_F16C EMFLOW_HAS_BMI2
      EMFLOW_HAS_AVX512F EMFLOW_HAS_AVX512DQ EMFLOW_HAS_AVX512BW EMFLOW_HAS_AVX512VL
          EMFLOW_HAS_AVX512VNNI EMFLOW_HAS_AVX512VBMI EMFLOW_HAS_AVX512BF16 EMFLOW_HAS_AVX512FP16
              EMFLOW_HAS_AMX_TILE EMFLOW_HAS_AMX_BF16 EMFLOW_HAS_AMX_INT8;
  return features[0] == ' ' ? features + 1 : features;  // each name comes with a space before it
}

const char* cpu_instruction_set() { return cpu::instruction_set(); }

}  // namespace emflow::detail

// Reading and writing the storage types on the device: float32 values widened exactly from, and
// rounded once (to nearest even) to, bfloat16 and float16 (emflow/precision.hpp's conversions,
// the host's bits).
#pragma once

#include "emflow/precision.hpp"

namespace emflow::detail {

__device__ __forceinline__ void store(bfloat16* p, float v) { *p = to_bfloat16(v); }
__device__ __forceinline__ void store(float16* p, float v) { *p = to_float16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ float widen(bfloat16 v) { return to_float(v); }
__device__ __forceinline__ float widen(float16 v) { return to_float(v); }
__device__ __forceinline__ float widen(float v) { return v; }

}  // namespace emflow::detail

// The host kernels of a routed call (Device::cpu, Device::reference) for every storage type
// (docs/MATH.md §6.1, §7): the kernel the route names runs in its own arithmetic type, float for
// the CPU engine and the reference's float form (which accumulates in double), double for the
// double reference; the stored values are widened to it exactly (precision.hpp) and the update is
// narrowed back to the storage type once, the statistics written as Stat<T>. Nothing here
// chooses a kernel: the route does (src/core/capability.cpp).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/precision.hpp"

namespace emflow::detail {

/// A kernel's value in the storage type T, rounded to nearest even once (through float for the
/// 16-bit types).
template <class T, class U>
T narrow(U value) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, float16>) {
    return to_float16(static_cast<float>(value));
  } else {
    return static_cast<T>(value);
  }
}

/// emflow::attend on validated input for a supported host route (Kernel::reference, cpu_fused or
/// cpu_bf16).
template <class T>
void attend_on_host(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                    const Route& route, int threads);

/// emflow::attend_factored on validated input for a supported host route: the expanded
/// reference, or the engine in rank r.
template <class T>
void attend_factored_on_host(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                             const AttentionOutput<T>& output, const Route& route, int threads);

/// attend_partial of a factored layer on validated input (Kernel::reference, never expanded):
/// the factored form in double (rotary positions and grouped kv heads included), the state
/// narrowed to T once. T is float or double.
template <class T>
void partial_factored_on_host(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                              const PartialOutput<T>& output);

/// The dense expansion of a factored layer (Route::expanded): M_h = A_h^T B_h and F_h = U_h V_h
/// summed in double from the stored factors, with the key bias and offset, stored in U.
template <class U>
struct ExpandedLayer {
  std::int64_t heads = 1;
  std::vector<U> relevance, content, key_bias, offset;

  template <class T>
  ExpandedLayer(const FactoredLayer<T>& layer, std::int64_t dim);

  LayerOperators<U> operators() const {
    return {heads, relevance.data(), content.data(), key_bias.empty() ? nullptr : key_bias.data(),
            offset.empty() ? nullptr : offset.data()};
  }
};

}  // namespace emflow::detail

// emflow: the factored form of an attention layer (docs/MATH.md §2), which is what QKV
// attention is. Per head h, with rank r:
//
//   M_h = A_h^T B_h    A_h, B_h in R^{r x d}                (relevance)
//   F_h = U_h V_h      U_h in R^{d x r}, V_h in R^{r x d}   (content)
//
// so that query i scores key j and token j contributes
//
//   s_ij = beta (<A_h x_i, B_h x_j> + u_h^T x_j)      F_h x_j = U_h (V_h x_j)
//
// The update is the one of emflow::attend with these M_h and F_h. Computed in this form, the
// scores cost 2 N^2 r instead of 2 N^2 d and the content 2 N^2 r instead of 2 N^2 d, so with
// r << d the factored form is the fast path: queries A_h x_i and keys B_h x_j meet in R^r, and
// the weighted average of the V_h x_j is mapped back to E by U_h once per query.
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"

namespace emflow {

/// The operators of one layer in factored form. All arrays row-major, heads one after another.
template <class T>
struct FactoredLayer {
  std::int64_t heads = 1;
  std::int64_t rank = 1;            ///< r >= 1
  const T* query_factor = nullptr;  ///< A: (heads, rank, dim). Required.
  const T* key_factor = nullptr;    ///< B: (heads, rank, dim), M_h = A_h^T B_h. Required.
  const T* content_up = nullptr;    ///< U: (heads, dim, rank). Required.
  const T* content_down = nullptr;  ///< V: (heads, rank, dim), F_h = U_h V_h. Required.
  const T* key_bias = nullptr;      ///< u: (heads, dim), adds u_h^T x_j to every score. Optional.
  const T* offset = nullptr;        ///< c: (dim), added to every visible query's update. Optional.
};

/// The contextual update of `layer` on the clouds of `input`, with the same meaning, outputs and
/// rules as emflow::attend (attention.hpp). The operators come from `layer` only: input.layer
/// must be left empty (null pointers).
///
/// Where it runs is route()'s answer (capability.hpp) for the call, as for every entry point.
/// Device::cpu (and automatic without a GPU) computes float inputs in float32 in the factored
/// form, at the lower cost; double inputs, and float inputs holding a non-finite value (in the
/// clouds or the factors), are expanded to dense M_h, F_h and computed by the double reference.
/// Device::reference expands to dense M_h, F_h in double and runs the reference. Device::cuda
/// without the tensor cores (below) expands to dense operators in T and runs the GPU's dense
/// kernels (fused or unfused, as attend would).
/// bfloat16 and float16 (docs/MATH.md §7): the inputs are widened exactly to float and the float
/// path above runs (Device::cpu), or to double and the reference runs (Device::reference); the
/// update is rounded to T, lse, entropy and weights are float32. Device::cuda (and automatic when
/// a device is usable, weights are not asked for and rank <= 256) runs
/// cuda::attend_factored_async (cuda.hpp) on the tensor cores, which refuses weights; without a
/// device Device::cuda is ErrorCode::unsupported. float input with ExecutionOptions::precision
/// tf32 on Device::cuda (or automatic with a device) runs the same path with TF32 products
/// where it computes what is asked (no weights, rank <= 256), float32 products elsewhere; on the
/// host devices tf32 computes fp32 (attention.hpp).
/// Throws emflow::Error (invalid_argument) naming the first offending argument.
template <class T>
void attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                     const AttentionOutput<T>& output, const ExecutionOptions& options = {});

extern template void attend_factored<float>(const AttentionInput<float>&,
                                            const FactoredLayer<float>&,
                                            const AttentionOutput<float>&, const ExecutionOptions&);
extern template void attend_factored<double>(const AttentionInput<double>&,
                                             const FactoredLayer<double>&,
                                             const AttentionOutput<double>&,
                                             const ExecutionOptions&);
extern template void attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                               const FactoredLayer<bfloat16>&,
                                               const AttentionOutput<bfloat16>&,
                                               const ExecutionOptions&);
extern template void attend_factored<float16>(const AttentionInput<float16>&,
                                              const FactoredLayer<float16>&,
                                              const AttentionOutput<float16>&,
                                              const ExecutionOptions&);

}  // namespace emflow

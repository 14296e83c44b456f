// emflow: the update over part of the keys, and the exact merge of such parts (docs/MATH.md §1).
//
// A cloud too large for one pass (or spread over devices or processes) is split into blocks of
// keys. Over one block K_a, per cloud b, head h and query i, the partial state is
//
//   lse_a   = log sum_{j in K_a} exp(s_ij)                          (-inf: no visible key in K_a)
//   o_a     = sum_{j in K_a} exp(s_ij - lse_a) F_h x_j              (0 when lse_a = -inf)
//   H_a     = lse_a - sum_{j in K_a} exp(s_ij - lse_a) s_ij         (0 when no key is visible)
//
// and two parts over disjoint key sets merge exactly into the state over their union:
//
//   lse = m + log(exp(lse_a - m) + exp(lse_b - m)),  m = max(lse_a, lse_b)
//   w_a = exp(lse_a - lse),  o = w_a o_a + w_b o_b
//   H   = lse - w_a (lse_a - H_a) - w_b (lse_b - H_b)
//
// (merge_partial forms H as w_a (H_a + lse - lse_a) + w_b (H_b + lse - lse_b), the same value
// without the cancellation where lse is large)
//
// where a part with lse = -inf has weight 0 and changes nothing. Non-finite scores
// (docs/MATH.md §6.6): a NaN or +inf visible score makes a part NaN (lse, H and o), and so every
// merge with it; a part whose visible scores are all -inf has lse = -inf and H = NaN, which a
// part with a finite score overrides and which finish_partial otherwise turns into NaN.
// finish_partial() then forms the update delta_i = sum_h o^h_i + c (c only for queries that saw a
// key), lse and entropy, equal to emflow::attend over all the keys. The keys of a block are given
// as the cloud of an AttentionInput (with key_position set to where the block starts, so masks see
// true positions, and an explicit query_position, or query_positions per cloud for a ragged batch);
// the queries as its `queries`.
//
// The factored form (attend_partial of a FactoredLayer) has the same state with
// F_h x_j = U_h V_{g(h)} x_j, its rotary positions and grouped kv heads included: each block's keys
// are rotated at their absolute positions (key_position + j) and the queries at theirs, and since
// a score depends on R(p_i)^T R(p_j) = R(p_j - p_i) only, the blocks merge into the one call's
// state exactly (docs/MATH.md §2.4).
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"

namespace emflow {

/// The partial state over one block of keys. All three arrays are required. The statistics have
/// the type of AttentionOutput's (Stat<T>: double for double, float otherwise).
template <class T>
struct PartialOutput {
  T* heads = nullptr;          ///< o: (batch, heads, Nq, dim), per head, before the sum over heads
  Stat<T>* lse = nullptr;      ///< (batch, heads, Nq)
  Stat<T>* entropy = nullptr;  ///< H: (batch, heads, Nq)
};

/// The same state, read-only.
template <class T>
struct PartialInput {
  const T* heads = nullptr;
  const Stat<T>* lse = nullptr;
  const Stat<T>* entropy = nullptr;
};

/// The shape every array of a partial state shares.
struct PartialShape {
  std::int64_t batch = 1;
  std::int64_t heads = 1;
  std::int64_t query_tokens = 1;  ///< Nq
  std::int64_t dim = 1;
};

/// The partial state of `input`'s queries over `input`'s keys (input.layer.offset is not used:
/// it belongs to finish_partial). Same validation, devices and options as emflow::attend: the
/// device and the kernel are the ones route() names for the call (capability.hpp), and
/// ExecutionOptions::precision is checked as for attend (tf32 for float is a permission that
/// every partial-state kernel meets with fp32 products). T is float or double; bfloat16 and
/// float16 compile and are refused (ErrorCode::unsupported, route()'s reason): no kernel forms
/// their partial states.
template <class T>
void attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                    const ExecutionOptions& options = {});

/// The partial state of `input`'s queries over `input`'s keys for a factored layer (factored.hpp;
/// input.layer must be empty, layer.offset is not used: it belongs to finish_partial), with its
/// rotary positions and grouped kv heads. The state is the one above with F_h x_j = U_h V_h x_j,
/// in the cloud's space, so blocks merge and finish exactly as for the dense form. The keys and
/// queries sit where attend_factored puts them: key j of the block at key_position + j (or
/// rotary.key_positions), the queries at their mask positions (query_position, query_positions,
/// or rotary.query_positions), so a block given with key_position = its first key's position and
/// the queries' explicit position rotates as the one call over all the keys does, and the merged
/// blocks equal attend_factored (R(p_j - p_i) = R(p_i)^T R(p_j) depends on the two positions
/// only). Runs on the host (Device::cpu, Device::reference, and automatic) in the double
/// reference of the factored form, the state rounded to T once; Device::cuda is refused
/// (ErrorCode::unsupported, route()'s reason). The dynamic rotary scaling without explicit
/// inverse_frequencies is refused (ErrorCode::unsupported): its frequencies follow the whole
/// sequence, which one block does not see. T is float or double.
template <class T>
void attend_partial(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const PartialOutput<T>& output, const ExecutionOptions& options = {});

/// into = merge(into, part), element by element, on the host.
template <class T>
void merge_partial(const PartialShape& shape, const PartialInput<T>& part,
                   const PartialOutput<T>& into);

/// The update, lse and entropy (any of lse / entropy may be null) of a merged state on the host:
/// update = sum_h heads + offset (offset: dim entries or null, added where a query saw a key).
template <class T>
void finish_partial(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                    const AttentionOutput<T>& output);

extern template void attend_partial<float>(const AttentionInput<float>&,
                                           const PartialOutput<float>&, const ExecutionOptions&);
extern template void attend_partial<double>(const AttentionInput<double>&,
                                            const PartialOutput<double>&, const ExecutionOptions&);
extern template void attend_partial<bfloat16>(const AttentionInput<bfloat16>&,
                                              const PartialOutput<bfloat16>&,
                                              const ExecutionOptions&);
extern template void attend_partial<float16>(const AttentionInput<float16>&,
                                             const PartialOutput<float16>&,
                                             const ExecutionOptions&);
extern template void attend_partial<float>(const AttentionInput<float>&,
                                           const FactoredLayer<float>&, const PartialOutput<float>&,
                                           const ExecutionOptions&);
extern template void attend_partial<double>(const AttentionInput<double>&,
                                            const FactoredLayer<double>&,
                                            const PartialOutput<double>&, const ExecutionOptions&);
extern template void merge_partial<float>(const PartialShape&, const PartialInput<float>&,
                                          const PartialOutput<float>&);
extern template void merge_partial<double>(const PartialShape&, const PartialInput<double>&,
                                           const PartialOutput<double>&);
extern template void finish_partial<float>(const PartialShape&, const PartialInput<float>&,
                                           const float*, const AttentionOutput<float>&);
extern template void finish_partial<double>(const PartialShape&, const PartialInput<double>&,
                                            const double*, const AttentionOutput<double>&);

}  // namespace emflow

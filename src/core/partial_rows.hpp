// The merge of two partial states of one head and one query (docs/MATH.md §1.6, partial.hpp),
// shared by merge_partial and the CPU engine's split over key blocks, so both merge alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace emflow::detail {

/// (la, ha, oa) = merge((la, ha, oa), (lb, hb, ob)) for a state of `dim` contents.
template <class T>
inline void merge_state(T& la, T& ha, T* oa, T lb, T hb, const T* ob, std::int64_t dim) {
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  if (std::isnan(la) || std::isnan(lb) || la == inf || lb == inf) {
    // Undefined weights in either part (a NaN or +inf score) make the whole state NaN.
    la = ha = nan;
    for (std::int64_t a = 0; a < dim; ++a) oa[a] = nan;
    return;
  }
  if (la == -inf && lb == -inf) {
    // No finite score on either side: the contents (zero, or NaN from a key with weight 0)
    // add, and a part whose keys all scored -inf (H = NaN) marks the union so.
    ha = std::isnan(ha) || std::isnan(hb) ? nan : T(0);
    for (std::int64_t a = 0; a < dim; ++a) oa[a] += ob[a];
    return;
  }
  // lse = m + log(e^{la - m} + e^{lb - m}); w = e^{l - lse}. With the gaps lse - l (>= 0),
  // H = sum w (H_part + gap): the entropy of a mixture, every term non-negative, so nothing
  // cancels where lse is large. A part with lse = -inf has w = 0 and adds nothing to H; its
  // contents still meet the weight 0, so a NaN there survives as in one pass.
  const T m = la > lb ? la : lb;
  const T lse = m + std::log1p(std::exp((la > lb ? lb : la) - m));
  const T wa = std::exp(la - lse), wb = std::exp(lb - lse);
  T entropy = 0;
  if (la != -inf) entropy += wa * (ha + (lse - la));
  if (lb != -inf) entropy += wb * (hb + (lse - lb));
  la = lse;
  ha = entropy;
  for (std::int64_t a = 0; a < dim; ++a) oa[a] = wa * oa[a] + wb * ob[a];
}

/// True when a finished state says the query saw no key at all (lse = -inf, H = 0).
template <class T>
inline bool saw_no_key(T lse, T entropy) {
  return lse == -std::numeric_limits<T>::infinity() && entropy == T(0);
}

/// The update, lse and entropy of one query from its merged heads: head h's state is lse[h s],
/// entropy[h s] and o[h s dim .. + dim) (s = head_stride). delta = sum_h o_h (+ offset when the
/// query saw a key), 0 when it saw none; a head whose keys all scored -inf is NaN (§6.6).
/// lse_out and entropy_out (same strides) may be null.
template <class T>
inline void finish_query(std::int64_t heads, std::int64_t head_stride, const T* lse,
                         const T* entropy, const T* o, std::int64_t dim, const T* offset, T* delta,
                         T* lse_out, T* entropy_out) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (std::int64_t a = 0; a < dim; ++a) delta[a] = T(0);
  // Every head sees the same keys: lse = -inf with H = 0 in each means no key at all.
  bool saw_key = false;
  for (std::int64_t h = 0; h < heads; ++h) {
    T l = lse[h * head_stride], e = entropy[h * head_stride];
    const T* head = o + h * head_stride * dim;
    const bool none = saw_no_key(l, e);
    saw_key = saw_key || !none;
    if (l == -std::numeric_limits<T>::infinity() && !none) l = e = nan;
    for (std::int64_t a = 0; a < dim; ++a) delta[a] += std::isnan(l) ? nan : head[a];
    if (lse_out) lse_out[h * head_stride] = l;
    if (entropy_out) entropy_out[h * head_stride] = e;
  }
  if (saw_key && offset != nullptr) {
    for (std::int64_t a = 0; a < dim; ++a) delta[a] += offset[a];
  }
}

}  // namespace emflow::detail

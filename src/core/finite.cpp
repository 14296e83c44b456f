#include "emflow/finite.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "check.hpp"
#include "dispatch.hpp"
#include "queries.hpp"

namespace emflow {

template <class T>
std::int64_t find_non_finite(const T* data, std::int64_t count) noexcept {
  for (std::int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(data[i])) return i;
  }
  return -1;
}

std::string multi_index(const Shape& shape, std::int64_t index) {
  const std::int64_t count = detail::checked_product("multi_index", "shape", shape);
  if (index < 0 || index >= count) {
    detail::fail_argument("multi_index", "index", "must be in [0, ", count, ") for shape ",
                          to_string(shape), ", got ", index);
  }
  // Peel the axes off from the last (fastest varying) to the first.
  Shape position(shape.size(), 0);
  for (std::size_t axis = shape.size(); axis-- > 0;) {
    position[axis] = index % shape[axis];
    index /= shape[axis];
  }
  std::string text = "[";
  for (std::size_t axis = 0; axis < position.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(position[axis]);
  }
  return text + "]";
}

template <class T>
void require_finite(const Tensor<T>& array, const std::string& what) {
  const std::int64_t first = find_non_finite(array.data(), array.size());
  if (first < 0) return;
  detail::fail(ErrorCode::invalid_argument, what, ": element ", multi_index(array.shape(), first),
               " is ", array[first],
               "; every value must be finite (NaN and infinity refused by --check-finite)");
}

namespace detail {

// Integer tests of the exponent field without an early exit, so the loop vectorises.
template <class T>
bool all_finite(const T* values, std::int64_t count) {
  if (values == nullptr) return true;
  using Bits = std::conditional_t<sizeof(T) == 8, std::uint64_t,
                                  std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
  constexpr auto exponent = static_cast<Bits>(std::is_same_v<T, double>     ? 0x7ff0000000000000u
                                              : std::is_same_v<T, float>    ? 0x7f800000u
                                              : std::is_same_v<T, bfloat16> ? 0x7f80u
                                                                            : 0x7c00u);
  unsigned bad = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    Bits bits;
    std::memcpy(&bits, values + i, sizeof bits);
    bad |= static_cast<unsigned>((bits & exponent) == exponent);
  }
  return bad == 0;
}

template bool all_finite<float>(const float*, std::int64_t);
template bool all_finite<double>(const double*, std::int64_t);

namespace {

// The keys of each cloud (its first key_lengths[b] tokens, all without lengths). A NaN in a key
// reaches, through the products of the CPU engine's tiles, queries that the mask hides it from
// (0 * NaN), so such a cloud goes to the reference. A padding token takes part in nothing; a NaN
// in a query, or in a dense operator, reaches exactly the rows docs/MATH.md §6.6 names on every
// kernel, so neither leaves the fast path. The 16-bit types ask every stored value of the cloud
// and the queries to be finite: their AVX512-BF16 kernel has no NaN rule of its own.
template <class T>
bool keys_finite(const AttentionInput<T>& in) {
  if constexpr (is_16bit_v<T>) {
    return all_finite(in.cloud, in.batch * in.tokens * in.dim) &&
           all_finite(in.queries, in.queries ? in.batch * in.query_tokens * in.dim : 0);
  }
  for (std::int64_t b = 0; b < in.batch; ++b) {
    const std::int64_t keys = in.key_lengths ? in.key_lengths[b] : in.tokens;
    if (!all_finite(in.cloud + b * in.tokens * in.dim, keys * in.dim)) return false;
  }
  return true;
}

}  // namespace

template <class T>
bool inputs_finite(const AttentionInput<T>& in) {
  if constexpr (is_16bit_v<T>) {
    const std::int64_t H = in.layer.heads, d = in.dim;
    return keys_finite(in) && all_finite(in.layer.relevance, H * d * d) &&
           all_finite(in.layer.content, H * d * d) && all_finite(in.layer.key_bias, H * d) &&
           all_finite(in.layer.offset, d);
  }
  return keys_finite(in);
}

template <class T>
bool inputs_finite(const AttentionInput<T>& in, const FactoredLayer<T>& f) {
  const std::int64_t factor = f.heads * f.rank * in.dim;
  const std::int64_t shared = f.key_heads() * f.rank * in.dim;  // B and V: the kv heads
  return keys_finite(in) && all_finite(f.query_factor, factor) &&
         all_finite(f.key_factor, shared) && all_finite(f.content_up, factor) &&
         all_finite(f.content_down, shared) && all_finite(f.key_bias, f.heads * in.dim) &&
         all_finite(f.offset, in.dim);
}

#define EMFLOW_INPUTS_FINITE(T)                             \
  template bool inputs_finite<T>(const AttentionInput<T>&); \
  template bool inputs_finite<T>(const AttentionInput<T>&, const FactoredLayer<T>&);
EMFLOW_INPUTS_FINITE(float)
EMFLOW_INPUTS_FINITE(double)
EMFLOW_INPUTS_FINITE(bfloat16)
EMFLOW_INPUTS_FINITE(float16)
#undef EMFLOW_INPUTS_FINITE

}  // namespace detail

template std::int64_t find_non_finite<float>(const float*, std::int64_t) noexcept;
template std::int64_t find_non_finite<double>(const double*, std::int64_t) noexcept;
template void require_finite<float>(const Tensor<float>&, const std::string&);
template void require_finite<double>(const Tensor<double>&, const std::string&);

}  // namespace emflow

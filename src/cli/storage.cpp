#include "storage.hpp"

#include <cstdint>
#include <type_traits>

namespace emflow::cli {
template <class S>
std::vector<S> stored(const float* values, std::int64_t count) {
  std::vector<S> out;
  if (values == nullptr) return out;
  out.reserve(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    if constexpr (std::is_same_v<S, bfloat16>) {
      out.push_back(to_bfloat16(values[i]));
    } else if constexpr (std::is_same_v<S, float16>) {
      out.push_back(to_float16(values[i]));
    } else {
      out.push_back(values[i]);
    }
  }
  return out;
}

template std::vector<float> stored<float>(const float*, std::int64_t);
template std::vector<bfloat16> stored<bfloat16>(const float*, std::int64_t);
template std::vector<float16> stored<float16>(const float*, std::int64_t);

namespace {

template <class S>
const S* data_or_null(const std::vector<S>& values) {
  return values.empty() ? nullptr : values.data();
}

template <class S>
void attend_as(const AttentionInput<float>& in, const AttentionOutput<float>& out,
               ExecutionOptions options) {
  const StoredInput<S> s(in);
  const std::int64_t Nq = in.queries != nullptr ? in.query_tokens : in.tokens;
  std::vector<S> update(static_cast<std::size_t>(in.batch * Nq * in.dim));
  options.precision = std::is_same_v<S, bfloat16> ? Precision::bf16 : Precision::fp16;
  attend(s.input, AttentionOutput<S>{update.data(), out.lse, out.entropy, out.weights}, options);
  for (std::size_t i = 0; i < update.size(); ++i) out.update[i] = to_float(update[i]);
}

}  // namespace

template <class S>
StoredInput<S>::StoredInput(const AttentionInput<float>& from) {
  const std::int64_t d = from.dim, H = from.layer.heads;
  const std::int64_t Nq = from.queries != nullptr ? from.query_tokens : from.tokens;
  cloud = stored<S>(from.cloud, from.batch * from.tokens * d);
  queries = stored<S>(from.queries, from.batch * Nq * d);
  relevance = stored<S>(from.layer.relevance, H * d * d);
  content = stored<S>(from.layer.content, H * d * d);
  key_bias = stored<S>(from.layer.key_bias, H * d);
  offset = stored<S>(from.layer.offset, d);
  input = with_arrays(from, data_or_null(cloud), data_or_null(queries),
                      {H, data_or_null(relevance), data_or_null(content), data_or_null(key_bias),
                       data_or_null(offset)});
}

void attend_stored(Precision precision, const AttentionInput<float>& input,
                   const AttentionOutput<float>& output, const ExecutionOptions& options) {
  if (precision == Precision::bf16) {
    attend_as<bfloat16>(input, output, options);
  } else {
    attend_as<float16>(input, output, options);
  }
}

template struct StoredInput<bfloat16>;
template struct StoredInput<float16>;

}  // namespace emflow::cli

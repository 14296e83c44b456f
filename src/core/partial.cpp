// Partial states over blocks of keys and their exact merge (include/emflow/partial.hpp): the
// validation and dispatch of attend_partial, and the host merge and finish.
//
// The state of a head and a query is (o, lse, H). Besides §1.4's states it has one more: a
// block whose visible keys all scored -inf keeps lse = -inf with H = NaN (the query saw keys
// whose weights are undefined unless another block has a finite score); a block where the query
// sees no key is lse = -inf, H = 0, o = 0 and changes nothing in a merge.
#include "emflow/partial.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

#include "backends.hpp"
#include "check.hpp"
#include "memory.hpp"
#include "queries.hpp"

namespace emflow {

namespace {

using detail::checked_multiply;
using detail::expect_not_null;
using detail::fail_argument;

/// B * H * Nq and B * H * Nq * d fit in int64 and every extent is >= 1.
void check_partial_shape(const char* op, const PartialShape& shape) {
  detail::expect_positive(op, "batch", shape.batch);
  detail::expect_positive(op, "heads", shape.heads);
  detail::expect_positive(op, "query_tokens", shape.query_tokens);
  detail::expect_positive(op, "dim", shape.dim);
  const std::int64_t rows = checked_multiply(
      op, "lse", checked_multiply(op, "lse", shape.batch, shape.heads), shape.query_tokens);
  checked_multiply(op, "heads", rows, shape.dim);
}

template <class T>
void expect_partial(const char* op, const char* prefix, const T* heads, const T* lse,
                    const T* entropy) {
  const std::string name = prefix;
  expect_not_null(op, (name + "heads").c_str(), heads);
  expect_not_null(op, (name + "lse").c_str(), lse);
  expect_not_null(op, (name + "entropy").c_str(), entropy);
}

struct PartialBytes {
  std::size_t heads, rows;
};

template <class T>
PartialBytes partial_bytes(const PartialShape& s) {
  const auto rows = static_cast<std::size_t>(s.batch * s.heads * s.query_tokens);
  return {rows * static_cast<std::size_t>(s.dim) * sizeof(T), rows * sizeof(T)};
}

template <class T>
PartialShape shape_of(const AttentionInput<T>& in) {
  return {in.batch, in.layer.heads, detail::query_count(in), in.dim};
}

}  // namespace

template <class T>
void attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                    const ExecutionOptions& options) {
  const char* const op = "attend_partial";
  detail::reporting_out_of_memory(op, "", [&] {
    // Everything of attend's validation (the update pointer stands in for the heads, whose size
    // is checked below), then the partial state's own arrays.
    AttentionOutput<T> stand_in;
    stand_in.update = output.heads;
    stand_in.lse = output.lse;
    stand_in.entropy = output.entropy;
    detail::check_arguments(input, stand_in, op);
    expect_partial(op, "", output.heads, output.lse, output.entropy);
    const PartialShape shape = shape_of(input);
    check_partial_shape(op, shape);
    const PartialBytes bytes = partial_bytes<T>(shape);
    const auto B = static_cast<std::size_t>(input.batch), N = static_cast<std::size_t>(input.tokens);
    const auto d = static_cast<std::size_t>(input.dim), H = static_cast<std::size_t>(shape.heads);
    const auto Nq = static_cast<std::size_t>(shape.query_tokens);
    const detail::MemoryRange ranges[] = {
        {"cloud", input.cloud, B * N * d * sizeof(T), false},
        {"queries", input.queries, B * Nq * d * sizeof(T), false},
        {"relevance", input.layer.relevance, H * d * d * sizeof(T), false},
        {"content", input.layer.content, H * d * d * sizeof(T), false},
        {"key_bias", input.layer.key_bias, H * d * sizeof(T), false},
        {"offset", input.layer.offset, d * sizeof(T), false},
        {"key_lengths", input.key_lengths, B * sizeof(std::int64_t), false},
        {"query_lengths", input.query_lengths, B * sizeof(std::int64_t), false},
        {"query_positions", input.query_positions, B * sizeof(std::int64_t), false},
        {"heads", output.heads, bytes.heads, true},
        {"lse", output.lse, bytes.rows, true},
        {"entropy", output.entropy, bytes.rows, true},
    };
    detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
    if (options.threads < 0) fail_argument(op, "threads", "must be >= 0, got ", options.threads);
    switch (resolve_device(options.device)) {
      case Device::reference:
        detail::reference_partial(input, output);
        return;
      case Device::cuda:
        detail::cuda_attend_partial(input, output);
        return;
      case Device::cpu:
      case Device::automatic:
        detail::cpu_partial(input, output, options.threads);
        return;
    }
  });
}

template <class T>
void merge_partial(const PartialShape& shape, const PartialInput<T>& part,
                   const PartialOutput<T>& into) {
  const char* const op = "merge_partial";
  check_partial_shape(op, shape);
  expect_partial(op, "part.", part.heads, part.lse, part.entropy);
  expect_partial(op, "into.", into.heads, into.lse, into.entropy);
  const PartialBytes bytes = partial_bytes<T>(shape);
  const detail::MemoryRange ranges[] = {
      {"part.heads", part.heads, bytes.heads, false},
      {"part.lse", part.lse, bytes.rows, false},
      {"part.entropy", part.entropy, bytes.rows, false},
      {"into.heads", into.heads, bytes.heads, true},
      {"into.lse", into.lse, bytes.rows, true},
      {"into.entropy", into.entropy, bytes.rows, true},
  };
  detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);

  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::int64_t rows = shape.batch * shape.heads * shape.query_tokens, d = shape.dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T la = into.lse[r], lb = part.lse[r];
    const T ha = into.entropy[r], hb = part.entropy[r];
    T* oa = into.heads + r * d;
    const T* ob = part.heads + r * d;
    if (std::isnan(la) || std::isnan(lb) || la == inf || lb == inf) {
      // Undefined weights in either part (a NaN or +inf score) make the whole state NaN.
      into.lse[r] = into.entropy[r] = nan;
      for (std::int64_t a = 0; a < d; ++a) oa[a] = nan;
      continue;
    }
    if (la == -inf && lb == -inf) {
      // No finite score on either side: the contents (zero, or NaN from a key with weight 0)
      // add, and a part whose keys all scored -inf (H = NaN) marks the union so.
      into.entropy[r] = std::isnan(ha) || std::isnan(hb) ? nan : T(0);
      for (std::int64_t a = 0; a < d; ++a) oa[a] += ob[a];
      continue;
    }
    // lse = m + log(e^{la - m} + e^{lb - m}); w = e^{l - lse}. With the two gaps g = lse - l
    // (>= 0), H = sum w (H_part + g): the entropy of a mixture, every term non-negative, so no
    // cancellation where lse is large. A part with lse = -inf has w = 0 and adds nothing to H;
    // its contents still meet the weight 0, so a NaN there survives as in one pass.
    const T m = la > lb ? la : lb;
    const T lse = m + std::log1p(std::exp((la > lb ? lb : la) - m));
    const T wa = std::exp(la - lse), wb = std::exp(lb - lse);
    T entropy = 0;
    if (la != -inf) entropy += wa * (ha + (lse - la));
    if (lb != -inf) entropy += wb * (hb + (lse - lb));
    into.lse[r] = lse;
    into.entropy[r] = entropy;
    for (std::int64_t a = 0; a < d; ++a) oa[a] = wa * oa[a] + wb * ob[a];
  }
}

template <class T>
void finish_partial(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                    const AttentionOutput<T>& output) {
  const char* const op = "finish_partial";
  check_partial_shape(op, shape);
  expect_partial(op, "state.", state.heads, state.lse, state.entropy);
  expect_not_null(op, "update", output.update);
  if (output.weights != nullptr) {
    fail_argument(op, "weights", "must be null: a partial state holds no weights");
  }
  const PartialBytes bytes = partial_bytes<T>(shape);
  const auto Bq = static_cast<std::size_t>(shape.batch * shape.query_tokens);
  const auto d = static_cast<std::size_t>(shape.dim);
  const detail::MemoryRange ranges[] = {
      {"state.heads", state.heads, bytes.heads, false},
      {"state.lse", state.lse, bytes.rows, false},
      {"state.entropy", state.entropy, bytes.rows, false},
      {"offset", offset, d * sizeof(T), false},
      {"update", output.update, Bq * d * sizeof(T), true},
      {"lse", output.lse, bytes.rows, true},
      {"entropy", output.entropy, bytes.rows, true},
  };
  detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);

  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::int64_t B = shape.batch, H = shape.heads, Nq = shape.query_tokens, D = shape.dim;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      T* delta = output.update + (b * Nq + i) * D;
      for (std::int64_t a = 0; a < D; ++a) delta[a] = T(0);
      // Every head sees the same keys: lse = -inf with H = 0 in each means no key at all.
      bool saw_key = false;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t row = (b * H + h) * Nq + i;
        T lse = state.lse[row], entropy = state.entropy[row];
        const T* o = state.heads + row * D;
        const bool none = lse == -inf && entropy == T(0);
        saw_key = saw_key || !none;
        if (lse == -inf && !none) lse = entropy = nan;  // every visible score -inf (§6.6)
        for (std::int64_t a = 0; a < D; ++a) delta[a] += std::isnan(lse) ? nan : o[a];
        if (output.lse) output.lse[row] = lse;
        if (output.entropy) output.entropy[row] = entropy;
      }
      if (saw_key && offset != nullptr) {
        for (std::int64_t a = 0; a < D; ++a) delta[a] += offset[a];
      }
    }
  }
}

template void attend_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&,
                                    const ExecutionOptions&);
template void attend_partial<double>(const AttentionInput<double>&, const PartialOutput<double>&,
                                     const ExecutionOptions&);
template void merge_partial<float>(const PartialShape&, const PartialInput<float>&,
                                   const PartialOutput<float>&);
template void merge_partial<double>(const PartialShape&, const PartialInput<double>&,
                                    const PartialOutput<double>&);
template void finish_partial<float>(const PartialShape&, const PartialInput<float>&, const float*,
                                    const AttentionOutput<float>&);
template void finish_partial<double>(const PartialShape&, const PartialInput<double>&,
                                     const double*, const AttentionOutput<double>&);

}  // namespace emflow

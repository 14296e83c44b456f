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

#include "backends.hpp"
#include "check.hpp"
#include "memory.hpp"
#include "partial_rows.hpp"
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
    const auto B = static_cast<std::size_t>(input.batch),
               N = static_cast<std::size_t>(input.tokens);
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
    check_threads(options.threads, op);
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

  const std::int64_t rows = shape.batch * shape.heads * shape.query_tokens, d = shape.dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    detail::merge_state(into.lse[r], into.entropy[r], into.heads + r * d, part.lse[r],
                        part.entropy[r], part.heads + r * d, d);
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

  const std::int64_t B = shape.batch, H = shape.heads, Nq = shape.query_tokens, D = shape.dim;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      const std::int64_t row = b * H * Nq + i;
      detail::finish_query(H, Nq, state.lse + row, state.entropy + row, state.heads + row * D, D,
                           offset, output.update + (b * Nq + i) * D,
                           output.lse ? output.lse + row : nullptr,
                           output.entropy ? output.entropy + row : nullptr);
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

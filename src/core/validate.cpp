// The one validator (validate.hpp): shapes, sizes, pointers, positions, lengths, memory ranges
// and precisions of every call, host or device, written once.
#include "validate.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "check.hpp"
#include "emflow/capability.hpp"
#include "queries.hpp"
#include "rotary.hpp"

namespace emflow {

template <class T>
void validate(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op) {
  detail::check_arguments(in, out, op);
  detail::check_no_overlap(in, out, op);
}

namespace detail {

namespace {
/// The largest |beta| a float call accepts: 2^64, the square root of the float range, leaves
/// scores up to 2^64 in magnitude before beta * score overflows.
constexpr double kMaxFloatBeta = 18446744073709551616.0;

/// Sequence positions (key_position + N, query_position + Nq and the aligned origin) stay within
/// +-2^60, so every difference of two positions that a mask forms fits in int64.
constexpr std::int64_t kPositionLimit = std::int64_t{1} << 60;

void check_position(const char* op, const char* argument, std::int64_t first, std::int64_t count) {
  if (first < -kPositionLimit || first > kPositionLimit || count > kPositionLimit ||
      first + count > kPositionLimit) {
    fail_argument(op, argument, "must keep its positions within +-2^60 (", kPositionLimit,
                  "), got ", first, " for ", count, " rows");
  }
}

template <class T>
MemoryRange range(const char* name, const T* pointer, std::size_t count, bool written) {
  return {name, pointer, count * sizeof(T), written};
}

void expect_state(const char* op, const char* heads, const char* lse, const char* entropy,
                  const void* heads_pointer, const void* lse_pointer, const void* entropy_pointer) {
  expect_not_null(op, heads, heads_pointer);
  expect_not_null(op, lse, lse_pointer);
  expect_not_null(op, entropy, entropy_pointer);
}

/// Rows (B * H * Nq) and values (rows * dim) of a validated partial shape.
struct StateSize {
  std::size_t rows, values;
};

StateSize state_size(const PartialShape& s) {
  const auto rows = static_cast<std::size_t>(s.batch * s.heads * s.query_tokens);
  return {rows, rows * static_cast<std::size_t>(s.dim)};
}

}  // namespace

template <class T>
void check_shapes(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op) {
  expect_positive(op, "batch", in.batch);
  expect_positive(op, "tokens", in.tokens);
  expect_positive(op, "dim", in.dim);
  expect_positive(op, "heads", in.layer.heads);
  // Every size product a backend forms must fit in int64 (and hence in size_t on 64-bit hosts).
  checked_multiply(op, "cloud", checked_multiply(op, "cloud", in.batch, in.tokens), in.dim);
  checked_multiply(op, "relevance", checked_multiply(op, "relevance", in.layer.heads, in.dim),
                   in.dim);
  if (in.queries != nullptr) {
    if (in.query_tokens < 1) {
      fail_argument(op, "query_tokens", "must be >= 1 with queries, got ", in.query_tokens);
    }
    checked_multiply(op, "queries", checked_multiply(op, "queries", in.batch, in.query_tokens),
                     in.dim);
  } else if (in.query_tokens != 0 && in.query_tokens != in.tokens) {
    fail_argument(op, "query_tokens", "must be 0 or tokens (", in.tokens,
                  ") without queries (self-attention), got ", in.query_tokens);
  }
  const std::int64_t Nq = query_count(in);
  const std::int64_t rows =
      checked_multiply(op, "lse", checked_multiply(op, "lse", in.batch, in.layer.heads), Nq);
  if (out.weights != nullptr) checked_multiply(op, "weights", rows, in.tokens);
  check_position(op, "key_position", in.key_position, in.tokens);
  if (in.query_position != kAlignToEnd) {
    check_position(op, "query_position", in.query_position, Nq);
  }
  if (!std::isfinite(in.beta)) fail_argument(op, "beta", "must be finite, got ", in.beta);
  // Float backends compute beta * score in float: beta and the score share the float range
  // (docs/MATH.md §6.6), so a beta that is finite as a double but not as a float, or one that
  // overflows against scores of order 1, never reaches them.
  if (!std::is_same_v<T, double> && std::abs(in.beta) > kMaxFloatBeta) {
    fail_argument(op, "beta", "must satisfy |beta| <= 2^64 (", kMaxFloatBeta,
                  ") for float and 16-bit input, got ", in.beta);
  }
  if (in.mask.kind == MaskKind::window && in.mask.window < 1) {
    fail_argument(op, "mask", "window width must be >= 1, got ", in.mask.window);
  }
}

template <class T>
void check_lengths(const AttentionInput<T>& in, const char* op) {
  const std::int64_t Nq = query_count(in);
  for (std::int64_t b = 0; in.key_lengths != nullptr && b < in.batch; ++b) {
    const std::int64_t length = in.key_lengths[b];
    if (length < 0 || length > in.tokens) {
      fail_argument(op, "key_lengths", "entry ", b, " must be in [0, ", in.tokens, "], got ",
                    length);
    }
  }
  for (std::int64_t b = 0; in.query_lengths != nullptr && b < in.batch; ++b) {
    const std::int64_t length = in.query_lengths[b];
    if (length < 0 || length > Nq) {
      fail_argument(op, "query_lengths", "entry ", b, " must be in [0, ", Nq, "], got ", length);
    }
  }
  for (std::int64_t b = 0; in.query_positions != nullptr && b < in.batch; ++b) {
    if (in.query_positions[b] == kAlignToEnd) {
      fail_argument(op, "query_positions", "entry ", b, " must be a position, not kAlignToEnd");
    }
    check_position(op, "query_positions", in.query_positions[b], Nq);
  }
}

template <class T>
void check_arguments(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op,
                     Lengths lengths) {
  check_shapes(in, out, op);
  expect_not_null(op, "cloud", in.cloud);
  expect_not_null(op, "relevance", in.layer.relevance);
  expect_not_null(op, "content", in.layer.content);
  expect_not_null(op, "update", out.update);
  // Values in device memory (Lengths::device) are not read here: the kernels clamp them.
  if (lengths == Lengths::host) check_lengths(in, op);
  if (in.query_position == kAlignToEnd && in.key_position != 0) {
    // The aligned origin key_position + Lk - Lq lies within [key_position - Nq, key_position + N].
    check_position(op, "key_position", in.key_position - query_count(in),
                   in.tokens + query_count(in));
  }
}

void check_disjoint(const MemoryRange* ranges, std::size_t count, const char* operation) {
  for (std::size_t a = 0; a < count; ++a) {
    for (std::size_t b = a + 1; b < count; ++b) {
      const MemoryRange& x = ranges[a];
      const MemoryRange& y = ranges[b];
      if (!(x.written || y.written) || x.pointer == nullptr || y.pointer == nullptr ||
          x.bytes == 0 || y.bytes == 0) {
        continue;
      }
      const auto x0 = reinterpret_cast<std::uintptr_t>(x.pointer), x1 = x0 + x.bytes;
      const auto y0 = reinterpret_cast<std::uintptr_t>(y.pointer), y1 = y0 + y.bytes;
      if (x1 <= y0 || y1 <= x0) continue;
      const MemoryRange& written = y.written ? y : x;
      const MemoryRange& other = y.written ? x : y;
      fail_argument(operation, written.name, "shares memory with ", other.name,
                    "; outputs must not overlap inputs, other outputs or the workspace");
    }
  }
}

template <class T>
void check_no_overlap(const AttentionInput<T>& in, const AttentionOutput<T>& out,
                      const char* operation, const void* workspace, std::size_t workspace_bytes) {
  // Sizes fit in int64 (check_shapes multiplied them with checks).
  const auto B = static_cast<std::size_t>(in.batch), N = static_cast<std::size_t>(in.tokens);
  const auto d = static_cast<std::size_t>(in.dim);
  const auto H = static_cast<std::size_t>(in.layer.heads);
  const auto Nq = static_cast<std::size_t>(query_count(in));
  const MemoryRange ranges[] = {
      range("cloud", in.cloud, B * N * d, false),
      range("queries", in.queries, B * Nq * d, false),
      range("query_lengths", in.query_lengths, B, false),
      range("query_positions", in.query_positions, B, false),
      range("relevance", in.layer.relevance, H * d * d, false),
      range("content", in.layer.content, H * d * d, false),
      range("key_bias", in.layer.key_bias, H * d, false),
      range("offset", in.layer.offset, d, false),
      range("key_lengths", in.key_lengths, B, false),
      {"workspace", workspace, workspace_bytes, true},
      range("update", out.update, B * Nq * d, true),
      range("lse", out.lse, B * H * Nq, true),
      range("entropy", out.entropy, B * H * Nq, true),
      range("weights", out.weights, B * H * Nq * N, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
}

namespace {

/// check_factored without its memory ranges.
template <class T>
void check_factored_arguments(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                              const AttentionOutput<T>& output, const char* op, Lengths lengths) {
  if (input.layer.relevance != nullptr || input.layer.content != nullptr ||
      input.layer.key_bias != nullptr || input.layer.offset != nullptr) {
    fail_argument(op, "input.layer",
                  "must be empty (null pointers): the operators come from 'layer'");
  }
  expect_positive(op, "heads", layer.heads);
  expect_positive(op, "rank", layer.rank);
  expect_not_null(op, "query_factor", layer.query_factor);
  expect_not_null(op, "key_factor", layer.key_factor);
  expect_not_null(op, "content_up", layer.content_up);
  expect_not_null(op, "content_down", layer.content_down);
  if (input.dim >= 1) {
    checked_multiply(op, "query_factor",
                     checked_multiply(op, "query_factor", layer.heads, layer.rank), input.dim);
  }
  // Everything else (sizes, cloud, beta, mask, key lengths, outputs) as for emflow::attend; the
  // dense operator pointers are stand-ins there, only checked for null and never read.
  AttentionInput<T> shape = input;
  shape.layer.heads = layer.heads;
  shape.layer.relevance = layer.query_factor;
  shape.layer.content = layer.content_down;
  check_arguments(shape, output, op, lengths);
  check_grouping_and_rotary(layer.heads, layer.rank, layer.kv_heads, layer.rotary, input.batch,
                            input.tokens, query_count(input), op, lengths);
}

}  // namespace

template <class T>
void check_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const AttentionOutput<T>& output, const char* op, const void* workspace,
                    std::size_t workspace_bytes, Lengths lengths) {
  check_factored_arguments(input, layer, output, op, lengths);
  // No output may share memory with the factors (sizes fit: checked above).
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto Nq = static_cast<std::size_t>(query_count(input));
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(layer.heads);
  const auto K = static_cast<std::size_t>(layer.key_heads());
  const auto r = static_cast<std::size_t>(layer.rank);
  const Rotary& rotary = layer.rotary;
  const MemoryRange ranges[] = {
      range("cloud", input.cloud, B * N * d, false),
      range("queries", input.queries, B * Nq * d, false),
      range("query_lengths", input.query_lengths, B, false),
      range("query_positions", input.query_positions, B, false),
      range("query_factor", layer.query_factor, H * r * d, false),
      range("key_factor", layer.key_factor, K * r * d, false),
      range("content_up", layer.content_up, H * d * r, false),
      range("content_down", layer.content_down, K * r * d, false),
      range("rotary.inverse_frequencies", rotary.inverse_frequencies,
            static_cast<std::size_t>(rotary.dim / 2), false),
      range("rotary.key_positions", rotary.key_positions, B * N, false),
      range("rotary.query_positions", rotary.query_positions, B * Nq, false),
      range("key_bias", layer.key_bias, H * d, false),
      range("offset", layer.offset, d, false),
      range("key_lengths", input.key_lengths, B, false),
      range("update", output.update, B * Nq * d, true),
      range("lse", output.lse, B * H * Nq, true),
      range("entropy", output.entropy, B * H * Nq, true),
      range("weights", output.weights, B * H * Nq * N, true),
      {"workspace", workspace, workspace_bytes, true},
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
}

void check_partial_shape(const PartialShape& shape, const char* op) {
  expect_positive(op, "batch", shape.batch);
  expect_positive(op, "heads", shape.heads);
  expect_positive(op, "query_tokens", shape.query_tokens);
  expect_positive(op, "dim", shape.dim);
  const std::int64_t rows = checked_multiply(
      op, "lse", checked_multiply(op, "lse", shape.batch, shape.heads), shape.query_tokens);
  checked_multiply(op, "heads", rows, shape.dim);
}

template <class T>
void check_partial(const AttentionInput<T>& input, const PartialOutput<T>& output, const char* op,
                   const void* workspace, std::size_t workspace_bytes, Lengths lengths) {
  // Everything of attend's validation (the heads stand in for the update, whose size is checked
  // below), then the partial state's own arrays.
  AttentionOutput<T> stand_in;
  stand_in.update = output.heads;
  stand_in.lse = output.lse;
  stand_in.entropy = output.entropy;
  expect_state(op, "heads", "lse", "entropy", output.heads, output.lse, output.entropy);
  check_arguments(input, stand_in, op, lengths);
  const PartialShape shape{input.batch, input.layer.heads, query_count(input), input.dim};
  check_partial_shape(shape, op);
  const StateSize state = state_size(shape);
  const auto B = static_cast<std::size_t>(input.batch), N = static_cast<std::size_t>(input.tokens);
  const auto d = static_cast<std::size_t>(input.dim), H = static_cast<std::size_t>(shape.heads);
  const auto Nq = static_cast<std::size_t>(shape.query_tokens);
  const MemoryRange ranges[] = {
      range("cloud", input.cloud, B * N * d, false),
      range("queries", input.queries, B * Nq * d, false),
      range("relevance", input.layer.relevance, H * d * d, false),
      range("content", input.layer.content, H * d * d, false),
      range("key_bias", input.layer.key_bias, H * d, false),
      range("offset", input.layer.offset, d, false),
      range("key_lengths", input.key_lengths, B, false),
      range("query_lengths", input.query_lengths, B, false),
      range("query_positions", input.query_positions, B, false),
      {"workspace", workspace, workspace_bytes, true},
      range("heads", output.heads, state.values, true),
      range("lse", output.lse, state.rows, true),
      range("entropy", output.entropy, state.rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
}

template <class T>
void check_partial_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                            const PartialOutput<T>& output, const char* op) {
  // attend_factored's checks (the heads standing in for the update, whose size is checked
  // below), then the partial state's own arrays against every input.
  expect_state(op, "heads", "lse", "entropy", output.heads, output.lse, output.entropy);
  AttentionOutput<T> stand_in;
  stand_in.update = output.heads;
  stand_in.lse = output.lse;
  stand_in.entropy = output.entropy;
  check_factored_arguments(input, layer, stand_in, op, Lengths::host);
  check_fixed_frequencies(layer.rotary, op,
                          "a partial state sees one block of keys, not the whole call's longest "
                          "sequence that the dynamic frequencies depend on");
  const PartialShape shape{input.batch, layer.heads, query_count(input), input.dim};
  check_partial_shape(shape, op);
  const StateSize state = state_size(shape);
  const auto B = static_cast<std::size_t>(input.batch), N = static_cast<std::size_t>(input.tokens);
  const auto Nq = static_cast<std::size_t>(shape.query_tokens);
  const auto d = static_cast<std::size_t>(input.dim), H = static_cast<std::size_t>(layer.heads);
  const auto K = static_cast<std::size_t>(layer.key_heads());
  const auto r = static_cast<std::size_t>(layer.rank);
  const Rotary& rotary = layer.rotary;
  const MemoryRange ranges[] = {
      range("cloud", input.cloud, B * N * d, false),
      range("queries", input.queries, B * Nq * d, false),
      range("query_factor", layer.query_factor, H * r * d, false),
      range("key_factor", layer.key_factor, K * r * d, false),
      range("content_up", layer.content_up, H * d * r, false),
      range("content_down", layer.content_down, K * r * d, false),
      range("rotary.inverse_frequencies", rotary.inverse_frequencies,
            static_cast<std::size_t>(rotary.dim / 2), false),
      range("rotary.key_positions", rotary.key_positions, B * N, false),
      range("rotary.query_positions", rotary.query_positions, B * Nq, false),
      range("key_bias", layer.key_bias, H * d, false),
      range("offset", layer.offset, d, false),
      range("key_lengths", input.key_lengths, B, false),
      range("query_lengths", input.query_lengths, B, false),
      range("query_positions", input.query_positions, B, false),
      range("heads", output.heads, state.values, true),
      range("lse", output.lse, state.rows, true),
      range("entropy", output.entropy, state.rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
}

template <class T>
void check_merge(const PartialShape& shape, const PartialInput<T>& part,
                 const PartialOutput<T>& into, const char* op) {
  check_partial_shape(shape, op);
  expect_state(op, "part.heads", "part.lse", "part.entropy", part.heads, part.lse, part.entropy);
  expect_state(op, "into.heads", "into.lse", "into.entropy", into.heads, into.lse, into.entropy);
  const StateSize state = state_size(shape);
  const MemoryRange ranges[] = {
      range("part.heads", part.heads, state.values, false),
      range("part.lse", part.lse, state.rows, false),
      range("part.entropy", part.entropy, state.rows, false),
      range("into.heads", into.heads, state.values, true),
      range("into.lse", into.lse, state.rows, true),
      range("into.entropy", into.entropy, state.rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
}

template <class T>
void check_finish(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                  const AttentionOutput<T>& output, const char* op) {
  check_partial_shape(shape, op);
  expect_state(op, "state.heads", "state.lse", "state.entropy", state.heads, state.lse,
               state.entropy);
  expect_not_null(op, "update", output.update);
  if (output.weights != nullptr) {
    fail_argument(op, "weights", "must be null: a partial state holds no weights");
  }
  const StateSize size = state_size(shape);
  const auto updates = static_cast<std::size_t>(shape.batch * shape.query_tokens * shape.dim);
  const MemoryRange ranges[] = {
      range("state.heads", state.heads, size.values, false),
      range("state.lse", state.lse, size.rows, false),
      range("state.entropy", state.entropy, size.rows, false),
      range("offset", offset, static_cast<std::size_t>(shape.dim), false),
      range("update", output.update, updates, true),
      range("lse", output.lse, size.rows, true),
      range("entropy", output.entropy, size.rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);
}

std::string precision_mismatch(Dtype storage, Precision precision) {
  const auto needs = [&](Dtype wanted) {
    return storage == wanted ? std::string()
                             : concat(to_string(precision), " needs ", to_string(wanted),
                                      " storage, got ", to_string(storage));
  };
  switch (precision) {
    case Precision::fp32:
      return {};
    case Precision::tf32:
      // A permission, as allow_tf32: the host devices' fp32 products meet the TF32 accuracy
      // bound; on 'cuda' the tensor-core paths use it where they compute what is asked.
      return needs(Dtype::float32);
    case Precision::bf16:
      return needs(Dtype::bfloat16);
    case Precision::fp16:
      return needs(Dtype::float16);
  }
  return concat("unknown precision ", static_cast<int>(precision));
}

template <class T>
void check_precision(const ExecutionOptions& options, const char* op) {
  const std::string mismatch = precision_mismatch(dtype_of<T>(), options.precision);
  if (!mismatch.empty()) fail_argument(op, "precision", mismatch);
}

#define EMFLOW_VALIDATE(T)                                                                         \
  template void check_shapes<T>(const AttentionInput<T>&, const AttentionOutput<T>&, const char*); \
  template void check_lengths<T>(const AttentionInput<T>&, const char*);                           \
  template void check_arguments<T>(const AttentionInput<T>&, const AttentionOutput<T>&,            \
                                   const char*, Lengths);                                          \
  template void check_no_overlap<T>(const AttentionInput<T>&, const AttentionOutput<T>&,           \
                                    const char*, const void*, std::size_t);                        \
  template void check_factored<T>(const AttentionInput<T>&, const FactoredLayer<T>&,               \
                                  const AttentionOutput<T>&, const char*, const void*,             \
                                  std::size_t, Lengths);                                           \
  template void check_partial<T>(const AttentionInput<T>&, const PartialOutput<T>&, const char*,   \
                                 const void*, std::size_t, Lengths);                               \
  template void check_partial_factored<T>(const AttentionInput<T>&, const FactoredLayer<T>&,       \
                                          const PartialOutput<T>&, const char*);                   \
  template void check_merge<T>(const PartialShape&, const PartialInput<T>&,                        \
                               const PartialOutput<T>&, const char*);                              \
  template void check_finish<T>(const PartialShape&, const PartialInput<T>&, const T*,             \
                                const AttentionOutput<T>&, const char*);                           \
  template void check_precision<T>(const ExecutionOptions&, const char*);
EMFLOW_VALIDATE(float)
EMFLOW_VALIDATE(double)
EMFLOW_VALIDATE(bfloat16)
EMFLOW_VALIDATE(float16)
#undef EMFLOW_VALIDATE

}  // namespace detail

template void validate<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                              const char*);
template void validate<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                               const char*);
template void validate<bfloat16>(const AttentionInput<bfloat16>&, const AttentionOutput<bfloat16>&,
                                 const char*);
template void validate<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                                const char*);

}  // namespace emflow

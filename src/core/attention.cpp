// Validation and backend dispatch for emflow::attend: each operation is specified once here and
// implemented by the backends behind src/core/backends.hpp.
#include "emflow/attention.hpp"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backends.hpp"
#include "check.hpp"
#include "low_precision.hpp"
#include "memory.hpp"
#include "queries.hpp"

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
}  // namespace

template <class T>
void check_shapes(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op) {
  expect_positive(op, "batch", in.batch);
  expect_positive(op, "tokens", in.tokens);
  expect_positive(op, "dim", in.dim);
  expect_positive(op, "heads", in.layer.heads);
  // Every size product a backend forms must fit in int64 (and hence in size_t on 64-bit hosts).
  const std::int64_t cloud =
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
  (void)cloud;
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
void check_arguments(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op,
                     Lengths lengths) {
  check_shapes(in, out, op);
  expect_not_null(op, "cloud", in.cloud);
  expect_not_null(op, "relevance", in.layer.relevance);
  expect_not_null(op, "content", in.layer.content);
  expect_not_null(op, "update", out.update);
  // Values in device memory (Lengths::device) are not read here: the kernels clamp them.
  const bool read = lengths == Lengths::host;
  if (read && in.key_lengths != nullptr) {
    for (std::int64_t b = 0; b < in.batch; ++b) {
      const std::int64_t length = in.key_lengths[b];
      if (length < 0 || length > in.tokens) {
        fail_argument(op, "key_lengths", "entry ", b, " must be in [0, ", in.tokens, "], got ",
                      length);
      }
    }
  }
  if (read && in.query_lengths != nullptr) {
    const std::int64_t Nq = query_count(in);
    for (std::int64_t b = 0; b < in.batch; ++b) {
      const std::int64_t length = in.query_lengths[b];
      if (length < 0 || length > Nq) {
        fail_argument(op, "query_lengths", "entry ", b, " must be in [0, ", Nq, "], got ", length);
      }
    }
  }
  if (read && in.query_positions != nullptr) {
    for (std::int64_t b = 0; b < in.batch; ++b) {
      if (in.query_positions[b] == kAlignToEnd) {
        fail_argument(op, "query_positions", "entry ", b, " must be a position, not kAlignToEnd");
      }
      check_position(op, "query_positions", in.query_positions[b], query_count(in));
    }
  }
  if (in.query_position == kAlignToEnd && in.key_position != 0) {
    // The aligned origin key_position + Lk - Lq lies within [key_position - Nq, key_position + N].
    check_position(op, "key_position", in.key_position - query_count(in),
                   in.tokens + query_count(in));
  }
}

template <class T>
void expect_self_attention(const AttentionInput<T>& in, const char* op) {
  if (!plain_self_attention(in)) {
    fail(ErrorCode::unsupported, op,
         ": this backend does not implement cross-attention (queries, query_tokens, "
         "query_lengths, key_position, query_position, query_positions) yet");
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
  // Sizes fit in int64 (validate() multiplied them with checks).
  const auto B = static_cast<std::size_t>(in.batch), N = static_cast<std::size_t>(in.tokens);
  const auto d = static_cast<std::size_t>(in.dim);
  const auto H = static_cast<std::size_t>(in.layer.heads);
  const auto Nq = static_cast<std::size_t>(query_count(in));
  const MemoryRange ranges[] = {
      {"cloud", in.cloud, B * N * d * sizeof(T), false},
      {"queries", in.queries, B * Nq * d * sizeof(T), false},
      {"query_lengths", in.query_lengths, B * sizeof(std::int64_t), false},
      {"query_positions", in.query_positions, B * sizeof(std::int64_t), false},
      {"relevance", in.layer.relevance, H * d * d * sizeof(T), false},
      {"content", in.layer.content, H * d * d * sizeof(T), false},
      {"key_bias", in.layer.key_bias, H * d * sizeof(T), false},
      {"offset", in.layer.offset, d * sizeof(T), false},
      {"key_lengths", in.key_lengths, B * sizeof(std::int64_t), false},
      {"workspace", workspace, workspace_bytes, true},
      {"update", out.update, B * Nq * d * sizeof(T), true},
      {"lse", out.lse, B * H * Nq * sizeof(Stat<T>), true},
      {"entropy", out.entropy, B * H * Nq * sizeof(Stat<T>), true},
      {"weights", out.weights, B * H * Nq * N * sizeof(Stat<T>), true},
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
}

template void check_shapes<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                  const char*);
template void check_shapes<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                   const char*);
template void check_arguments<float>(const AttentionInput<float>&,
                                   const AttentionOutput<float>&, const char*, Lengths);
template void check_arguments<double>(const AttentionInput<double>&,
                                   const AttentionOutput<double>&, const char*, Lengths);
template void expect_self_attention<float>(const AttentionInput<float>&, const char*);
template void expect_self_attention<double>(const AttentionInput<double>&, const char*);
template void check_no_overlap<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                      const char*, const void*, std::size_t);
template void check_no_overlap<double>(const AttentionInput<double>&,
                                       const AttentionOutput<double>&, const char*, const void*,
                                       std::size_t);
template void check_shapes<bfloat16>(const AttentionInput<bfloat16>&,
                                     const AttentionOutput<bfloat16>&, const char*);
template void check_shapes<float16>(const AttentionInput<float16>&,
                                    const AttentionOutput<float16>&, const char*);
template void check_arguments<bfloat16>(const AttentionInput<bfloat16>&,
                                   const AttentionOutput<bfloat16>&, const char*, Lengths);
template void check_arguments<float16>(const AttentionInput<float16>&,
                                   const AttentionOutput<float16>&, const char*, Lengths);
template void check_no_overlap<bfloat16>(const AttentionInput<bfloat16>&,
                                         const AttentionOutput<bfloat16>&, const char*, const void*,
                                         std::size_t);
template void check_no_overlap<float16>(const AttentionInput<float16>&,
                                        const AttentionOutput<float16>&, const char*, const void*,
                                        std::size_t);

}  // namespace detail

Device resolve_device(Device requested) {
  std::string reason;
  switch (requested) {
    case Device::automatic:
      return detail::cuda_device_available(&reason) ? Device::cuda : Device::cpu;
    case Device::cuda:
      if (!detail::cuda_device_available(&reason)) {
        detail::fail(ErrorCode::unsupported, "device 'cuda' requested but unavailable: ", reason);
      }
      return Device::cuda;
    case Device::cpu:
    case Device::reference:
      return requested;
  }
  return Device::cpu;
}

template <class T>
void attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
            const ExecutionOptions& options) {
  // A failed host allocation anywhere below is reported as ErrorCode::out_of_memory.
  detail::reporting_out_of_memory("attend", "", [&] {
    validate(input, output, "attend");
    if (options.threads < 0) {
      detail::fail_argument("attend", "threads", "must be >= 0, got ", options.threads);
    }
    if constexpr (is_16bit_v<T>) {
      const Device device = detail::resolve_16bit_device(options.device, input, output, "attend");
      detail::check_precision<T>(options, "attend");
      if (device == Device::cuda) {
        detail::cuda_attend(input, output, options.precision);
      } else {
        detail::attend_16bit(input, output, device, options.threads);
      }
      return;
    }
    const Device device = resolve_device(options.device);
    detail::check_precision<T>(options, "attend");
    switch (device) {
      case Device::reference:
        detail::reference_attend(input, output);
        return;
      case Device::cuda:
        detail::cuda_attend(input, output, options.precision);
        return;
      case Device::cpu:
      case Device::automatic:
        detail::cpu_attend(input, output, options.threads);
        return;
    }
  });
}

template void validate<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                              const char*);
template void validate<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                               const char*);
template void attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                            const ExecutionOptions&);
template void attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                             const ExecutionOptions&);
template void validate<bfloat16>(const AttentionInput<bfloat16>&, const AttentionOutput<bfloat16>&,
                                 const char*);
template void validate<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                                const char*);
template void attend<bfloat16>(const AttentionInput<bfloat16>&, const AttentionOutput<bfloat16>&,
                               const ExecutionOptions&);
template void attend<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                              const ExecutionOptions&);

}  // namespace emflow

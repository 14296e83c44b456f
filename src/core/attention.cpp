// Validation and backend dispatch for emflow::attend: each operation is specified once here and
// implemented by the backends behind src/core/backends.hpp.
#include "emflow/attention.hpp"

#include <cmath>
#include <cstdint>

#include "backends.hpp"
#include "check.hpp"
#include "memory.hpp"

namespace emflow {

template <class T>
void validate(const AttentionInput<T>& in, const AttentionOutput<T>& out, const char* op) {
  using detail::checked_multiply;
  using detail::expect_not_null;
  using detail::expect_positive;
  using detail::fail_argument;

  expect_positive(op, "batch", in.batch);
  expect_positive(op, "tokens", in.tokens);
  expect_positive(op, "dim", in.dim);
  expect_positive(op, "heads", in.layer.heads);
  // Every size product a backend forms must fit in int64 (and hence in size_t on 64-bit hosts).
  const std::int64_t cloud =
      checked_multiply(op, "cloud", checked_multiply(op, "cloud", in.batch, in.tokens), in.dim);
  checked_multiply(op, "relevance", checked_multiply(op, "relevance", in.layer.heads, in.dim),
                   in.dim);
  const std::int64_t rows =
      checked_multiply(op, "lse", checked_multiply(op, "lse", in.batch, in.layer.heads), in.tokens);
  if (out.weights != nullptr) checked_multiply(op, "weights", rows, in.tokens);
  (void)cloud;

  expect_not_null(op, "cloud", in.cloud);
  expect_not_null(op, "relevance", in.layer.relevance);
  expect_not_null(op, "content", in.layer.content);
  expect_not_null(op, "update", out.update);

  if (!std::isfinite(in.beta)) fail_argument(op, "beta", "must be finite, got ", in.beta);
  if (in.mask.kind == MaskKind::window && in.mask.window < 1) {
    fail_argument(op, "mask", "window width must be >= 1, got ", in.mask.window);
  }
  if (in.key_lengths != nullptr) {
    for (std::int64_t b = 0; b < in.batch; ++b) {
      const std::int64_t length = in.key_lengths[b];
      if (length < 0 || length > in.tokens) {
        fail_argument(op, "key_lengths", "entry ", b, " must be in [0, ", in.tokens, "], got ",
                      length);
      }
    }
  }
  detail::check_no_overlap(in, out, op);
}

namespace detail {

template <class T>
void check_no_overlap(const AttentionInput<T>& in, const AttentionOutput<T>& out,
                      const char* operation, const void* workspace, std::size_t workspace_bytes) {
  struct Range {
    const char* name;
    std::uintptr_t begin, end;
    bool output;
  };
  // Sizes fit in int64 (validate() multiplied them with checks).
  const auto B = static_cast<std::uintptr_t>(in.batch), N = static_cast<std::uintptr_t>(in.tokens);
  const auto d = static_cast<std::uintptr_t>(in.dim);
  const auto H = static_cast<std::uintptr_t>(in.layer.heads);
  Range ranges[12];
  int count = 0;
  auto add = [&](const char* name, const void* pointer, std::uintptr_t bytes, bool output) {
    if (pointer == nullptr || bytes == 0) return;
    const auto begin = reinterpret_cast<std::uintptr_t>(pointer);
    ranges[count++] = {name, begin, begin + bytes, output};
  };
  add("cloud", in.cloud, B * N * d * sizeof(T), false);
  add("relevance", in.layer.relevance, H * d * d * sizeof(T), false);
  add("content", in.layer.content, H * d * d * sizeof(T), false);
  add("key_bias", in.layer.key_bias, H * d * sizeof(T), false);
  add("offset", in.layer.offset, d * sizeof(T), false);
  add("key_lengths", in.key_lengths, B * sizeof(std::int64_t), false);
  add("workspace", workspace, workspace_bytes, true);
  add("update", out.update, B * N * d * sizeof(T), true);
  add("lse", out.lse, B * H * N * sizeof(T), true);
  add("entropy", out.entropy, B * H * N * sizeof(T), true);
  add("weights", out.weights, B * H * N * N * sizeof(T), true);
  for (int a = 0; a < count; ++a) {
    for (int b = a + 1; b < count; ++b) {
      const Range& x = ranges[a];
      const Range& y = ranges[b];
      if (!(x.output || y.output) || x.end <= y.begin || y.end <= x.begin) continue;
      const Range& written = y.output ? y : x;
      const Range& other = y.output ? x : y;
      fail_argument(operation, written.name, "shares memory with ", other.name,
                    "; outputs must not overlap inputs, other outputs or the workspace");
    }
  }
}

template void check_no_overlap<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                      const char*, const void*, std::size_t);
template void check_no_overlap<double>(const AttentionInput<double>&,
                                       const AttentionOutput<double>&, const char*, const void*,
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
    switch (resolve_device(options.device)) {
      case Device::reference:
        detail::reference_attend(input, output);
        return;
      case Device::cuda:
        detail::cuda_attend(input, output);
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

}  // namespace emflow

// The stream-ordered public API of cuda.hpp: attend_workspace_size is a plan's size, and
// attend_async / attend_partial_async check the caller's arguments and pointers, then make a plan
// and enqueue it. merge_partial_async and finish_partial_async are element-wise kernels.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "attend_plan.hpp"
#include "kernels/attention_kernels.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/low_precision.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "kernels/tc_attention.hpp"
#include "tc_dense.hpp"

namespace emflow::cuda {

namespace {

using emflow::detail::current_device;
using emflow::detail::expect_device_pointer;
using emflow::detail::expect_workspace;
using emflow::detail::fail_argument;

// validate() reads length values, which live on the device here: check shapes and pointers only;
// the kernels clamp the lengths.
template <class T>
void check_input(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const char* operation) {
  emflow::detail::check_arguments(input, output, operation, emflow::detail::Lengths::device);
}

template <class T>
void expect_input_on_device(const AttentionInput<T>& input, const char* operation, int device) {
  expect_device_pointer(operation, "cloud", input.cloud, device);
  expect_device_pointer(operation, "queries", input.queries, device);
  expect_device_pointer(operation, "relevance", input.layer.relevance, device);
  expect_device_pointer(operation, "content", input.layer.content, device);
  expect_device_pointer(operation, "key_bias", input.layer.key_bias, device);
  expect_device_pointer(operation, "offset", input.layer.offset, device);
  expect_device_pointer(operation, "key_lengths", input.key_lengths, device);
  expect_device_pointer(operation, "query_lengths", input.query_lengths, device);
  expect_device_pointer(operation, "query_positions", input.query_positions, device);
}

// Partial states hold batch * heads * query_tokens rows of dim values; each must fit in int.
void check_partial_shape(const PartialShape& shape, const char* operation) {
  using emflow::detail::checked_multiply;
  emflow::detail::expect_positive(operation, "batch", shape.batch);
  emflow::detail::expect_positive(operation, "heads", shape.heads);
  emflow::detail::expect_positive(operation, "query_tokens", shape.query_tokens);
  emflow::detail::expect_positive(operation, "dim", shape.dim);
  const std::int64_t rows = checked_multiply(
      operation, "heads", checked_multiply(operation, "heads", shape.batch, shape.heads),
      shape.query_tokens);
  checked_multiply(operation, "heads", rows, shape.dim);
  if (shape.batch * shape.query_tokens > INT32_MAX || shape.heads > INT32_MAX ||
      shape.dim > INT32_MAX || rows > INT32_MAX) {
    emflow::detail::fail(ErrorCode::unsupported, operation, ": a partial state of ", rows,
                         " rows exceeds the CUDA backend's limit of ", INT32_MAX);
  }
}

template <class T>
emflow::detail::MemoryRange range(const char* name, const T* pointer, std::int64_t count,
                                  bool written) {
  return {name, pointer, static_cast<std::size_t>(count) * sizeof(T), written};
}

// Whether attend_async runs the dense form on the tensor cores (tc_dense.cpp) for storage type T
// and `precision`: always for 16-bit T (their own precision or fp32, the same computation), for
// float with tf32 where that path computes what is asked (a permission, not a demand: elsewhere
// float32 products meet the TF32 bound), never for fp32. Other pairs are named as invalid.
template <class T>
bool on_tensor_cores(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                     Algorithm algorithm, Precision precision, const char* operation) {
  ExecutionOptions options;
  options.precision = precision;
  emflow::detail::check_precision<T>(options, operation);
  if constexpr (is_16bit_v<T>) {
    return true;
  } else {
    return std::is_same_v<T, float> && precision == Precision::tf32 && output.weights == nullptr &&
           input.dim <= emflow::detail::kTcMaxDim && algorithm != Algorithm::unfused;
  }
}

}  // namespace

template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  Algorithm algorithm, Precision precision) {
  if (on_tensor_cores(input, output, algorithm, precision, "attend_workspace_size")) {
    return emflow::detail::tc_dense_workspace_size(input, output, algorithm,
                                                   "attend_workspace_size");
  }
  if constexpr (is_16bit_v<T>) {
    return 0;  // not reached: 16-bit input always runs on the tensor cores
  } else {
    return emflow::detail::AttentionPlan<T>(input, output, algorithm, "attend_workspace_size",
                                            /*query_device=*/false)
        .workspace_bytes();
  }
}

template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream, Algorithm algorithm,
                  Precision precision) {
  using namespace emflow::detail;
  const char* const operation = "attend_async";
  if (on_tensor_cores(input, output, algorithm, precision, operation)) {
    tc_dense_attend_async(input, output, workspace, workspace_bytes, stream, algorithm, operation);
    return;
  }
  if constexpr (!is_16bit_v<T>) {
    check_input(input, output, operation);
    // Shapes, algorithm, device (unsupported without one), a pending error, shared memory. The
    // plan reads a pending error before any query of its own, so launch failures read back later
    // are ours; the pointer queries below leave none behind (check_cuda clears what it reports).
    const AttentionPlan<T> plan(input, output, algorithm, operation);
    const int device = plan.device();
    expect_input_on_device(input, operation, device);
    expect_device_pointer(operation, "update", output.update, device);
    expect_device_pointer(operation, "lse", output.lse, device);
    expect_device_pointer(operation, "entropy", output.entropy, device);
    expect_device_pointer(operation, "weights", output.weights, device);
    expect_workspace(operation, workspace, workspace_bytes, plan.workspace_bytes(), device);
    check_no_overlap(input, output, operation, workspace, plan.workspace_bytes());
    plan.enqueue(input, output, workspace, stream);
  }
}

template <class T>
std::size_t attend_partial_workspace_size(const AttentionInput<T>& input, Algorithm algorithm) {
  return emflow::detail::AttentionPlan<T>(input, PartialOutput<T>{}, algorithm,
                                          "attend_partial_workspace_size",
                                          /*query_device=*/false)
      .workspace_bytes();
}

template <class T>
void attend_partial_async(const AttentionInput<T>& input, const PartialOutput<T>& output,
                          void* workspace, std::size_t workspace_bytes, Stream stream,
                          Algorithm algorithm) {
  using namespace emflow::detail;
  const char* const operation = "attend_partial_async";
  expect_not_null(operation, "heads", output.heads);
  expect_not_null(operation, "lse", output.lse);
  expect_not_null(operation, "entropy", output.entropy);
  // The update's own checks, with the partial state's rows standing in for the update.
  AttentionOutput<T> as_update;
  as_update.update = output.heads;
  check_input(input, as_update, operation);
  const AttentionPlan<T> plan(input, output, algorithm, operation);
  const int device = plan.device();
  expect_input_on_device(input, operation, device);
  expect_device_pointer(operation, "heads", output.heads, device);
  expect_device_pointer(operation, "lse", output.lse, device);
  expect_device_pointer(operation, "entropy", output.entropy, device);
  expect_workspace(operation, workspace, workspace_bytes, plan.workspace_bytes(), device);
  // The inputs, the workspace and the state (its rows are Nq * heads per cloud).
  const std::int64_t queries = input.queries != nullptr ? input.query_tokens : input.tokens;
  const std::int64_t stats = input.batch * input.layer.heads * queries;
  const std::int64_t H = input.layer.heads, d = input.dim;
  const MemoryRange ranges[] = {
      range("cloud", input.cloud, input.batch * input.tokens * d, false),
      range("queries", input.queries, input.batch * queries * d, false),
      range("relevance", input.layer.relevance, H * d * d, false),
      range("content", input.layer.content, H * d * d, false),
      range("key_bias", input.layer.key_bias, H * d, false),
      range("key_lengths", input.key_lengths, input.batch, false),
      range("query_lengths", input.query_lengths, input.batch, false),
      range("query_positions", input.query_positions, input.batch, false),
      {"workspace", workspace, plan.workspace_bytes(), true},
      range("heads", output.heads, stats * d, true),
      range("lse", output.lse, stats, true),
      range("entropy", output.entropy, stats, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
  plan.enqueue(input, output, workspace, stream);
}

template <class T>
void merge_partial_async(const PartialShape& shape, const PartialInput<T>& part,
                         const PartialOutput<T>& into, Stream stream) {
  using namespace emflow::detail;
  const char* const operation = "merge_partial_async";
  check_partial_shape(shape, operation);
  const void* const arrays[] = {part.heads, part.lse, part.entropy,
                                into.heads, into.lse, into.entropy};
  const char* const names[] = {"part.heads", "part.lse", "part.entropy",
                               "into.heads", "into.lse", "into.entropy"};
  for (int k = 0; k < 6; ++k) expect_not_null(operation, names[k], arrays[k]);
  const int device = current_device(operation);
  for (int k = 0; k < 6; ++k) expect_device_pointer(operation, names[k], arrays[k], device);
  const std::int64_t rows = shape.batch * shape.heads * shape.query_tokens;
  const MemoryRange ranges[] = {
      range("part.heads", part.heads, rows * shape.dim, false),
      range("part.lse", part.lse, rows, false),
      range("part.entropy", part.entropy, rows, false),
      range("into.heads", into.heads, rows * shape.dim, true),
      range("into.lse", into.lse, rows, true),
      range("into.entropy", into.entropy, rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
  launch_merge_partial<T>(part.heads, part.lse, part.entropy, into.heads, into.lse, into.entropy,
                          rows, static_cast<int>(shape.dim), stream, operation);
}

template <class T>
void finish_partial_async(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                          const AttentionOutput<T>& output, Stream stream) {
  using namespace emflow::detail;
  const char* const operation = "finish_partial_async";
  check_partial_shape(shape, operation);
  expect_not_null(operation, "heads", state.heads);
  expect_not_null(operation, "lse", state.lse);
  expect_not_null(operation, "entropy", state.entropy);
  expect_not_null(operation, "update", output.update);
  if (output.weights != nullptr) {
    fail_argument(operation, "weights", "must be null: a partial state holds no weights");
  }
  const int device = current_device(operation);
  const void* const arrays[] = {state.heads,   state.lse,  state.entropy, offset,
                                output.update, output.lse, output.entropy};
  const char* const names[] = {"heads",  "lse",        "entropy",       "offset",
                               "update", "output.lse", "output.entropy"};
  for (int k = 0; k < 7; ++k) expect_device_pointer(operation, names[k], arrays[k], device);
  const std::int64_t rows = shape.batch * shape.heads * shape.query_tokens;
  const MemoryRange ranges[] = {
      range("heads", state.heads, rows * shape.dim, false),
      range("lse", state.lse, rows, false),
      range("entropy", state.entropy, rows, false),
      range("offset", offset, shape.dim, false),
      range("update", output.update, shape.batch * shape.query_tokens * shape.dim, true),
      range("output.lse", output.lse, rows, true),
      range("output.entropy", output.entropy, rows, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
  launch_finish_partial<T>(state.heads, state.lse, state.entropy, offset, output.update, output.lse,
                           output.entropy, static_cast<int>(shape.batch),
                           static_cast<int>(shape.heads), static_cast<int>(shape.query_tokens),
                           static_cast<int>(shape.dim), stream, operation);
}

#define EMFLOW_INSTANTIATE_ASYNC(T)                                                               \
  template std::size_t attend_workspace_size<T>(const AttentionInput<T>&,                         \
                                                const AttentionOutput<T>&, Algorithm, Precision); \
  template void attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, void*,       \
                                std::size_t, Stream, Algorithm, Precision);                       \
  template std::size_t attend_partial_workspace_size<T>(const AttentionInput<T>&, Algorithm);     \
  template void attend_partial_async<T>(const AttentionInput<T>&, const PartialOutput<T>&, void*, \
                                        std::size_t, Stream, Algorithm);                          \
  template void merge_partial_async<T>(const PartialShape&, const PartialInput<T>&,               \
                                       const PartialOutput<T>&, Stream);                          \
  template void finish_partial_async<T>(const PartialShape&, const PartialInput<T>&, const T*,    \
                                        const AttentionOutput<T>&, Stream);
EMFLOW_INSTANTIATE_ASYNC(float)
EMFLOW_INSTANTIATE_ASYNC(double)
#undef EMFLOW_INSTANTIATE_ASYNC
// 16-bit storage: the dense form on the tensor cores (tc_dense.cpp).
#define EMFLOW_INSTANTIATE_16BIT(T)                                                               \
  template std::size_t attend_workspace_size<T>(const AttentionInput<T>&,                         \
                                                const AttentionOutput<T>&, Algorithm, Precision); \
  template void attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, void*,       \
                                std::size_t, Stream, Algorithm, Precision);
EMFLOW_INSTANTIATE_16BIT(bfloat16)
EMFLOW_INSTANTIATE_16BIT(float16)
#undef EMFLOW_INSTANTIATE_16BIT

}  // namespace emflow::cuda

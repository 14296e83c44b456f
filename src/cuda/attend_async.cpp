// The stream-ordered public API of cuda.hpp: each workspace size is a plan's, sized without a
// device, and each attend_*_async call is a plan made and run in one call
// (cuda::AttentionPlan, plan.cpp), after checking that every pointer is device memory of the
// plan's device and that no output overlaps an input, another output or the workspace.
// merge_partial_async and finish_partial_async are element-wise kernels (kernels/key_splits.cu).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "kernels/attention_kernels.hpp"
#include "plan_access.hpp"

namespace emflow::cuda {

namespace {

using emflow::detail::current_device;
using emflow::detail::expect_device_pointer;
using emflow::detail::expect_workspace;

// The inputs every form reads, on `device`.
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

template <class T>
void expect_output_on_device(const AttentionOutput<T>& output, const char* operation, int device) {
  expect_device_pointer(operation, "update", output.update, device);
  expect_device_pointer(operation, "lse", output.lse, device);
  expect_device_pointer(operation, "entropy", output.entropy, device);
  expect_device_pointer(operation, "weights", output.weights, device);
}

// Partial states hold batch * heads * query_tokens rows of dim values; each must fit in int.
// (The host's merge_partial and finish_partial check the same shape: src/core/partial.cpp.)
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

}  // namespace

template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  const PlanOptions& options) {
  return detail::PlanAccess::workspace_size("attend_workspace_size", input, output, options);
}

template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream, const PlanOptions& options) {
  const char* const operation = "attend_async";
  emflow::detail::check_arguments(input, output, operation, emflow::detail::Lengths::device);
  // Shapes, route, device (unsupported without one), a pending error, shared memory. The plan
  // reads a pending error before any query of its own, so launch failures read back later are
  // ours; the pointer queries below leave none behind (check_cuda clears what it reports).
  const AttentionPlan<T> plan = detail::PlanAccess::make(operation, input, output, options);
  const int device = plan.device();
  expect_input_on_device(input, operation, device);
  expect_output_on_device(output, operation, device);
  expect_workspace(operation, workspace, workspace_bytes, plan.workspace_size(), device);
  emflow::detail::check_no_overlap(input, output, operation, workspace, plan.workspace_size());
  plan.run(input, output, workspace, workspace_bytes, stream);
}

template <class T>
std::size_t attend_factored_workspace_size(const AttentionInput<T>& input,
                                           const FactoredLayer<T>& layer,
                                           const AttentionOutput<T>& output,
                                           const PlanOptions& options) {
  return detail::PlanAccess::workspace_size("attend_factored_workspace_size", input, layer, output,
                                            options);
}

template <class T>
void attend_factored_async(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream, const PlanOptions& options) {
  const char* const operation = "attend_factored_async";
  emflow::detail::check_factored(input, layer, output, operation, nullptr, 0,
                                 emflow::detail::Lengths::device);
  const AttentionPlan<T> plan = detail::PlanAccess::make(operation, input, layer, output, options);
  const int device = plan.device();
  expect_input_on_device(input, operation, device);
  const char* const names[] = {"query_factor", "key_factor", "content_up",
                               "content_down", "key_bias",   "offset"};
  const void* const factors[] = {layer.query_factor, layer.key_factor, layer.content_up,
                                 layer.content_down, layer.key_bias,   layer.offset};
  for (int k = 0; k < 6; ++k) expect_device_pointer(operation, names[k], factors[k], device);
  expect_output_on_device(output, operation, device);
  expect_workspace(operation, workspace, workspace_bytes, plan.workspace_size(), device);
  // The factored layer's ranges with the workspace's.
  emflow::detail::check_factored(input, layer, output, operation, workspace, plan.workspace_size(),
                                 emflow::detail::Lengths::device);
  plan.run(input, layer, output, workspace, workspace_bytes, stream);
}

template <class T>
std::size_t attend_partial_workspace_size(const AttentionInput<T>& input,
                                          const PlanOptions& options) {
  return detail::PlanAccess::workspace_size("attend_partial_workspace_size", input,
                                            PartialOutput<T>{}, options);
}

template <class T>
void attend_partial_async(const AttentionInput<T>& input, const PartialOutput<T>& output,
                          void* workspace, std::size_t workspace_bytes, Stream stream,
                          const PlanOptions& options) {
  using namespace emflow::detail;
  const char* const operation = "attend_partial_async";
  expect_not_null(operation, "heads", output.heads);
  expect_not_null(operation, "lse", output.lse);
  expect_not_null(operation, "entropy", output.entropy);
  // The update's own checks, with the partial state's rows standing in for the update.
  AttentionOutput<T> as_update;
  as_update.update = output.heads;
  check_arguments(input, as_update, operation, Lengths::device);
  const AttentionPlan<T> plan = cuda::detail::PlanAccess::make(operation, input, output, options);
  const int device = plan.device();
  expect_input_on_device(input, operation, device);
  expect_device_pointer(operation, "heads", output.heads, device);
  expect_device_pointer(operation, "lse", output.lse, device);
  expect_device_pointer(operation, "entropy", output.entropy, device);
  expect_workspace(operation, workspace, workspace_bytes, plan.workspace_size(), device);
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
      {"workspace", workspace, plan.workspace_size(), true},
      range("heads", output.heads, stats * d, true),
      range("lse", output.lse, stats, true),
      range("entropy", output.entropy, stats, true),
  };
  check_disjoint(ranges, sizeof ranges / sizeof ranges[0], operation);
  plan.run(input, output, workspace, workspace_bytes, stream);
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

#define EMFLOW_INSTANTIATE_ASYNC(T)                                                             \
  template std::size_t attend_workspace_size<T>(const AttentionInput<T>&,                       \
                                                const AttentionOutput<T>&, const PlanOptions&); \
  template void attend_async<T>(const AttentionInput<T>&, const AttentionOutput<T>&, void*,     \
                                std::size_t, Stream, const PlanOptions&);                       \
  template std::size_t attend_factored_workspace_size<T>(                                       \
      const AttentionInput<T>&, const FactoredLayer<T>&, const AttentionOutput<T>&,             \
      const PlanOptions&);                                                                      \
  template void attend_factored_async<T>(const AttentionInput<T>&, const FactoredLayer<T>&,     \
                                         const AttentionOutput<T>&, void*, std::size_t, Stream, \
                                         const PlanOptions&);
EMFLOW_INSTANTIATE_ASYNC(float)
EMFLOW_INSTANTIATE_ASYNC(double)
EMFLOW_INSTANTIATE_ASYNC(bfloat16)
EMFLOW_INSTANTIATE_ASYNC(float16)
#undef EMFLOW_INSTANTIATE_ASYNC
// Partial states: float and double.
#define EMFLOW_INSTANTIATE_PARTIAL(T)                                                             \
  template std::size_t attend_partial_workspace_size<T>(const AttentionInput<T>&,                 \
                                                        const PlanOptions&);                      \
  template void attend_partial_async<T>(const AttentionInput<T>&, const PartialOutput<T>&, void*, \
                                        std::size_t, Stream, const PlanOptions&);                 \
  template void merge_partial_async<T>(const PartialShape&, const PartialInput<T>&,               \
                                       const PartialOutput<T>&, Stream);                          \
  template void finish_partial_async<T>(const PartialShape&, const PartialInput<T>&, const T*,    \
                                        const AttentionOutput<T>&, Stream);
EMFLOW_INSTANTIATE_PARTIAL(float)
EMFLOW_INSTANTIATE_PARTIAL(double)
#undef EMFLOW_INSTANTIATE_PARTIAL

}  // namespace emflow::cuda

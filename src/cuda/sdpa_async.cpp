// The SDPA-shaped operator on the caller's device arrays and stream (cuda.hpp), which the
// blocking forms run on device copies of host arrays (src/cuda/sdpa.cpp); no synchronisation.
// The plan strategies of both passes (sdpa_strategy.hpp), and sdpa_attend_async /
// sdpa_backward_async and their workspace sizes as a plan made and run in one call. Forward:
// float with Precision::fp32 on the float32 kernel (kernels/sdpa_backward.cu), else the
// tensor-core attention kernel, the 16-bit output rounded by a kernel. Backward: the row terms'
// kernel, then the backward kernels (kernels/sdpa_backward.cu: float32 for float, the tensor cores
// for 16-bit storage), the gradients rounded and the dscale terms summed by kernels. The checks
// and the route are the blocking forms' (core/sdpa_checks.hpp, route()), the lengths trusted on
// the device as attend_async's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/check.hpp"
#include "core/sdpa_checks.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "kernels/sdpa_backward.hpp"
#include "kernels/tc_attention.hpp"
#include "plan_access.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"
#include "sdpa_strategy.hpp"
#include "tc_state.hpp"

namespace emflow::cuda {

namespace {

using emflow::detail::expect_device_pointer;
using emflow::detail::expect_workspace;
using emflow::detail::MemoryRange;

std::size_t rows_of(std::int64_t batch, std::int64_t heads, std::int64_t tokens) {
  return static_cast<std::size_t>(batch * heads * tokens);
}

template <class T>
emflow::detail::KernelMask device_mask(const SdpaInput<T>& in) {
  emflow::detail::KernelMask mask;
  mask.rule = in.mask;
  mask.key_lengths = in.key_lengths;
  mask.query_lengths = in.query_lengths;
  mask.key_position = in.key_position;
  mask.query_position = in.query_position;
  mask.query_positions = in.query_positions;
  return mask;
}

template <class T>
void expect_input_on_device(const SdpaInput<T>& in, const char* op, int device) {
  expect_device_pointer(op, "queries", in.queries, device);
  expect_device_pointer(op, "keys", in.keys, device);
  expect_device_pointer(op, "values", in.values, device);
  expect_device_pointer(op, "key_lengths", in.key_lengths, device);
  expect_device_pointer(op, "query_lengths", in.query_lengths, device);
  expect_device_pointer(op, "query_positions", in.query_positions, device);
}

template <class V>
MemoryRange range(const char* name, const V* pointer, std::size_t count, bool written) {
  return {name, pointer, count * sizeof(V), written};
}

}  // namespace

}  // namespace emflow::cuda

namespace emflow::detail {

template <class T>
SdpaStrategy<T>::SdpaStrategy(const Problem& problem, Kernel kernel, int key_splits,
                              const char* operation)
    : float32_(kernel == Kernel::cuda_fused),
      width_(static_cast<int>(std::max(problem.rank, problem.dim))),
      rank_(static_cast<int>(problem.rank)) {
  if (float32_ && !std::is_same_v<T, float>) {
    fail(ErrorCode::internal, operation, ": the float32 SDPA kernel computes float storage only");
  }
  const std::size_t rows = cuda::rows_of(problem.batch, problem.heads, problem.query_tokens);
  const auto r = static_cast<std::int64_t>(problem.rank);
  if (!float32_) {
    splits_ = choose_key_splits(problem.batch, problem.heads, problem.query_tokens, problem.tokens,
                                true, key_splits);
  }
  const auto split_rows = static_cast<std::int64_t>(
      splits_.splits > 1 ? static_cast<std::size_t>(splits_.splits) * rows : 0);
  const auto row_count = static_cast<std::int64_t>(rows);
  WorkspaceCursor at(operation);
  own_out_ = !std::is_same_v<T, float>;
  if (own_out_) out_ = at.take(row_count * r, sizeof(float), "out");
  own_lse_ = !problem.lse;
  if (own_lse_) lse_ = at.take(row_count, sizeof(float), "lse");
  if (split_rows > 0) {
    split_out_ = at.take(split_rows * r, sizeof(float), "split_out");
    split_lse_ = at.take(split_rows, sizeof(float), "split_lse");
    split_entropy_ = at.take(split_rows, sizeof(float), "split_entropy");
  }
  bytes_ = at.aligned_total();
}

template <class T>
void SdpaStrategy<T>::bind(int device, bool prepare, const char* operation) {
  const int limit = shared_memory_limit(device, operation);
  if (float32_) {
    expect_shared_memory(operation, "the float32 SDPA kernel", sdpa_backward_shared_bytes(width_),
                         device, limit, "use device 'cpu'");
    if (prepare) prepare_sdpa_forward(width_, operation);
    return;
  }
  expect_shared_memory(
      operation, "the tensor-core attention", tc_shared_bytes(tc_type<T>(), rank_), device, limit,
      std::is_same_v<T, float> ? "use Precision::fp32 (the float32 kernel)" : "use device 'cpu'");
  if (prepare) prepare_tc_attention(tc_type<T>(), rank_, operation);
}

template <class T>
void SdpaStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                          const char* operation) const {
  const SdpaInput<T>& input = *call.sdpa;
  const SdpaOutput<T>& output = *call.sdpa_output;
  float* const lse =
      own_lse_ ? reinterpret_cast<float*>(base + lse_) : static_cast<float*>(output.lse);
  if constexpr (std::is_same_v<T, float>) {
    if (float32_) {  // float products (Precision::fp32): kernels/sdpa_backward.cu
      SdpaForwardArgs args;
      args.query = input.queries;
      args.key = input.keys;
      args.value = input.values;
      args.output = output.output;
      args.lse = lse;
      args.entropy = output.entropy;
      args.scale = static_cast<float>(input.scale);
      args.batch = static_cast<int>(input.batch);
      args.heads = static_cast<int>(input.query_heads);
      args.kv_heads = static_cast<int>(input.kv_heads);
      args.queries = static_cast<int>(input.query_tokens);
      args.tokens = static_cast<int>(input.tokens);
      args.rank = static_cast<int>(input.rank);
      args.value_rank = static_cast<int>(input.value_rank);
      args.mask = cuda::device_mask(input);
      launch_sdpa_forward(args, stream, operation);
      return;
    }
  }
  float* const out = own_out_ ? reinterpret_cast<float*>(base + out_) : nullptr;
  TcAttentionArgs args;
  args.type = tc_type<T>();
  args.query = input.queries;
  args.key = input.keys;
  args.value = input.values;
  args.kv_heads = static_cast<int>(input.kv_heads);
  args.batch_major = true;
  args.scale = static_cast<float>(input.scale * 1.4426950408889634);  // base 2 in the kernel
  if constexpr (std::is_same_v<T, float>) {
    args.out = output.output;
  } else {
    args.out = out;
  }
  args.lse = lse;
  args.entropy = output.entropy;
  args.batch = static_cast<int>(input.batch);
  args.heads = static_cast<int>(input.query_heads);
  args.tokens = static_cast<int>(input.tokens);
  args.queries = static_cast<int>(input.query_tokens);
  args.dim = static_cast<int>(input.rank);
  args.mask = cuda::device_mask(input);
  args.splits = splits_.splits;
  args.split_keys = splits_.keys;
  if (splits_.splits > 1) {
    args.split_out = reinterpret_cast<float*>(base + split_out_);
    args.split_lse = reinterpret_cast<float*>(base + split_lse_);
    args.split_entropy = reinterpret_cast<float*>(base + split_entropy_);
  }
  launch_tc_attention(args, stream, operation);
  if constexpr (!std::is_same_v<T, float>) {
    launch_narrow(out, output.output,
                  cuda::rows_of(input.batch, input.query_heads, input.query_tokens) *
                      static_cast<std::size_t>(input.rank),
                  stream, operation);
  }
}

template <class T>
SdpaBackwardStrategy<T>::SdpaBackwardStrategy(const Problem& problem, const SdpaBackwardForm& form,
                                              const char* operation)
    : form_(form), width_(static_cast<int>(std::max(problem.rank, problem.dim))) {
  const auto rows =
      static_cast<std::int64_t>(cuda::rows_of(problem.batch, problem.heads, problem.query_tokens));
  const auto kv =
      static_cast<std::int64_t>(cuda::rows_of(problem.batch, problem.kv_heads, problem.tokens));
  const std::int64_t r = problem.rank, rv = problem.dim;
  constexpr std::int64_t kTile = kSdpaBackwardTile;
  // One dscale term per query tile (the queries' kernel), or per key tile with atomics.
  blocks_ = static_cast<int>(
      form.deterministic
          ? (problem.query_tokens + kTile - 1) / kTile * problem.heads * problem.batch
          : (problem.tokens + kTile - 1) / kTile * problem.kv_heads * problem.batch);
  WorkspaceCursor at(operation);
  if (!std::is_same_v<T, float>) {  // the tensor cores read Q, K and V as they are
    query_gradient_ = at.take(rows * r, sizeof(float), "query_gradient");
    key_gradient_ = at.take(kv * r, sizeof(float), "key_gradient");
    value_gradient_ = at.take(kv * rv, sizeof(float), "value_gradient");
  }
  output_gradient_ = at.take(rows * rv, sizeof(float), "output_gradient");
  lse_ = at.take(rows, sizeof(float), "lse");
  row_term_ = at.take(rows, sizeof(float), "row_term");
  if (form.entropy) entropy_gradient_ = at.take(rows, sizeof(float), "entropy_gradient");
  if (form.scale) scale_terms_ = at.take(blocks_, sizeof(float), "scale_terms");
  bytes_ = at.aligned_total();
}

template <class T>
void SdpaBackwardStrategy<T>::bind(int device, bool prepare, const char* operation) {
  if constexpr (std::is_same_v<T, float>) {
    expect_shared_memory(operation, "the float32 SDPA backward kernels",
                         sdpa_backward_shared_bytes(width_), device,
                         shared_memory_limit(device, operation), "use device 'cpu'");
    if (prepare) prepare_sdpa_backward(width_, operation);
  } else {
    if (prepare) prepare_sdpa_backward_tc<T>(width_, operation);
  }
}

template <class T>
void SdpaBackwardStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                                  const char* operation) const {
  const SdpaInput<T>& input = *call.sdpa;
  const SdpaSaved<T>& saved = *call.saved;
  const UpstreamGradients<T>& upstream = *call.upstream;
  const SdpaGradientOutput<T>& gradients = *call.gradients;
  auto at = [base](std::size_t offset) { return reinterpret_cast<float*>(base + offset); };
  const std::size_t rows = cuda::rows_of(input.batch, input.query_heads, input.query_tokens);
  const std::size_t kv = cuda::rows_of(input.batch, input.kv_heads, input.tokens);
  const auto r = static_cast<std::size_t>(input.rank);
  const auto rv = static_cast<std::size_t>(input.value_rank);
  SdpaBackwardArgs args;
  if constexpr (std::is_same_v<T, float>) {
    args.query = input.queries;
    args.key = input.keys;
    args.value = input.values;
    args.query_gradient = gradients.queries;
    args.key_gradient = gradients.keys;
    args.value_gradient = gradients.values;
  } else {
    args.query_gradient = at(query_gradient_);
    args.key_gradient = at(key_gradient_);
    args.value_gradient = at(value_gradient_);
  }
  const KernelMask mask = cuda::device_mask(input);
  SdpaRowTermsArgs<T> terms;
  terms.output = saved.output;
  terms.output_gradient = upstream.update;
  terms.lse = saved.lse;
  terms.entropy = saved.entropy;
  terms.lse_gradient = upstream.lse;
  terms.entropy_gradient = upstream.entropy;
  terms.output_gradient32 = at(output_gradient_);
  terms.lse32 = at(lse_);
  terms.row_term = at(row_term_);
  terms.entropy_gradient32 = form_.entropy ? at(entropy_gradient_) : nullptr;
  terms.batch = static_cast<int>(input.batch);
  terms.heads = static_cast<int>(input.query_heads);
  terms.queries = static_cast<int>(input.query_tokens);
  terms.tokens = static_cast<int>(input.tokens);
  terms.value_rank = static_cast<int>(input.value_rank);
  terms.mask = mask;
  launch_sdpa_row_terms(terms, stream, operation);

  args.output_gradient = terms.output_gradient32;
  args.lse = terms.lse32;
  args.row_term = terms.row_term;
  args.entropy_gradient = terms.entropy_gradient32;
  args.scale_terms = form_.scale ? at(scale_terms_) : nullptr;
  args.scale = static_cast<float>(input.scale);
  args.batch = terms.batch;
  args.heads = terms.heads;
  args.kv_heads = static_cast<int>(input.kv_heads);
  args.queries = terms.queries;
  args.tokens = terms.tokens;
  args.rank = static_cast<int>(input.rank);
  args.value_rank = terms.value_rank;
  args.mask = mask;
  args.atomic_queries = !form_.deterministic;
  if (args.atomic_queries) {  // the atomics add to zeros
    check_cuda(cudaMemsetAsync(args.query_gradient, 0, rows * r * sizeof(float), stream), operation,
               "cudaMemsetAsync");
  }
  if constexpr (std::is_same_v<T, float>) {
    launch_sdpa_backward(args, stream, operation);
  } else {  // the tensor cores on Q, K and V as stored
    launch_sdpa_backward_tc(args, input.queries, input.keys, input.values, stream, operation);
    launch_narrow(args.query_gradient, gradients.queries, rows * r, stream, operation);
    launch_narrow(args.key_gradient, gradients.keys, kv * r, stream, operation);
    launch_narrow(args.value_gradient, gradients.values, kv * rv, stream, operation);
  }
  if (form_.scale) {
    launch_sdpa_scale_sum(args.scale_terms, blocks_, gradients.scale, stream, operation);
  }
}

template class SdpaStrategy<float>;
template class SdpaStrategy<bfloat16>;
template class SdpaStrategy<float16>;
template class SdpaBackwardStrategy<float>;
template class SdpaBackwardStrategy<bfloat16>;
template class SdpaBackwardStrategy<float16>;

}  // namespace emflow::detail

namespace emflow::cuda {

template <class T>
std::size_t sdpa_workspace_size(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                                const PlanOptions& options) {
  return detail::PlanAccess::workspace_size("sdpa_workspace_size", input, output, options);
}

// A plan made and run in one call, after the checks a plan's run leaves to its caller: every
// pointer device memory of the plan's device (the workspace too), no output overlapping an input,
// another output or the workspace.
template <class T>
void sdpa_attend_async(const SdpaInput<T>& input, const SdpaOutput<T>& output, void* workspace,
                       std::size_t workspace_bytes, Stream stream, const PlanOptions& options) {
  const char* const op = "sdpa_attend_async";
  const AttentionPlan<T> plan = detail::PlanAccess::make(op, input, output, options);
  const int device = plan.device();
  expect_input_on_device(input, op, device);
  expect_device_pointer(op, "output", output.output, device);
  expect_device_pointer(op, "lse", output.lse, device);
  expect_device_pointer(op, "entropy", output.entropy, device);
  expect_workspace(op, workspace, workspace_bytes, plan.workspace_size(), device);
  const std::size_t rows = rows_of(input.batch, input.query_heads, input.query_tokens);
  std::vector<MemoryRange> ranges = emflow::detail::sdpa_input_ranges(input);
  ranges.insert(ranges.end(),
                {range("output", output.output, rows * input.value_rank, true),
                 range("lse", output.lse, rows, true), range("entropy", output.entropy, rows, true),
                 range("workspace", static_cast<const unsigned char*>(workspace),
                       plan.workspace_size(), true)});
  emflow::detail::check_disjoint(ranges.data(), ranges.size(), op);
  plan.run(input, output, workspace, workspace_bytes, stream);
}

template <class T>
std::size_t sdpa_backward_workspace_size(const SdpaInput<T>& input,
                                         const UpstreamGradients<T>& upstream,
                                         const SdpaGradientOutput<T>& gradients,
                                         const SdpaBackwardOptions& options) {
  return detail::PlanAccess::workspace_size("sdpa_backward_workspace_size", input, upstream,
                                            gradients, options);
}

// As sdpa_attend_async: a plan made and run in one call after the pointer and overlap checks.
template <class T>
void sdpa_backward_async(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                         const UpstreamGradients<T>& upstream,
                         const SdpaGradientOutput<T>& gradients, void* workspace,
                         std::size_t workspace_bytes, Stream stream,
                         const SdpaBackwardOptions& options) {
  const char* const op = "sdpa_backward_async";
  const AttentionPlan<T> plan = detail::PlanAccess::make(op, input, upstream, gradients, options);
  const int device = plan.device();
  expect_input_on_device(input, op, device);
  const char* const names[] = {"saved.output",      "saved.lse",      "saved.entropy",
                               "upstream.update",   "upstream.lse",   "upstream.entropy",
                               "gradients.queries", "gradients.keys", "gradients.values",
                               "gradients.scale"};
  const void* const pointers[] = {
      saved.output,     saved.lse,         saved.entropy,  upstream.update,  upstream.lse,
      upstream.entropy, gradients.queries, gradients.keys, gradients.values, gradients.scale};
  for (std::size_t k = 0; k < std::size(names); ++k) {
    expect_device_pointer(op, names[k], pointers[k], device);
  }
  expect_workspace(op, workspace, workspace_bytes, plan.workspace_size(), device);
  const std::size_t rows = rows_of(input.batch, input.query_heads, input.query_tokens);
  const std::size_t kv = rows_of(input.batch, input.kv_heads, input.tokens);
  const auto r = static_cast<std::size_t>(input.rank);
  const auto rv = static_cast<std::size_t>(input.value_rank);
  std::vector<MemoryRange> ranges = emflow::detail::sdpa_input_ranges(input);
  ranges.insert(ranges.end(), {range("saved.output", saved.output, rows * rv, false),
                               range("saved.lse", saved.lse, rows, false),
                               range("saved.entropy", saved.entropy, rows, false),
                               range("upstream.update", upstream.update, rows * rv, false),
                               range("upstream.lse", upstream.lse, rows, false),
                               range("upstream.entropy", upstream.entropy, rows, false),
                               range("gradients.queries", gradients.queries, rows * r, true),
                               range("gradients.keys", gradients.keys, kv * r, true),
                               range("gradients.values", gradients.values, kv * rv, true),
                               range("gradients.scale", gradients.scale, 1, true),
                               range("workspace", static_cast<const unsigned char*>(workspace),
                                     plan.workspace_size(), true)});
  emflow::detail::check_disjoint(ranges.data(), ranges.size(), op);
  plan.run(input, saved, upstream, gradients, workspace, workspace_bytes, stream);
}

#define EMFLOW_CUDA_SDPA(T)                                                                       \
  template std::size_t sdpa_workspace_size<T>(const SdpaInput<T>&, const SdpaOutput<T>&,          \
                                              const PlanOptions&);                                \
  template void sdpa_attend_async<T>(const SdpaInput<T>&, const SdpaOutput<T>&, void*,            \
                                     std::size_t, Stream, const PlanOptions&);                    \
  template std::size_t sdpa_backward_workspace_size<T>(                                           \
      const SdpaInput<T>&, const UpstreamGradients<T>&, const SdpaGradientOutput<T>&,             \
      const SdpaBackwardOptions&);                                                                \
  template void sdpa_backward_async<T>(const SdpaInput<T>&, const SdpaSaved<T>&,                  \
                                       const UpstreamGradients<T>&, const SdpaGradientOutput<T>&, \
                                       void*, std::size_t, Stream, const SdpaBackwardOptions&);
EMFLOW_CUDA_SDPA(float)
EMFLOW_CUDA_SDPA(bfloat16)
EMFLOW_CUDA_SDPA(float16)
#undef EMFLOW_CUDA_SDPA

}  // namespace emflow::cuda

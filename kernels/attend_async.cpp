// The stream-ordered public API of cuda.hpp: attend_workspace_size is a plan's size, and
// attend_async checks the caller's arguments and pointers, then makes a plan and enqueues it.
#include <cuda_runtime.h>

#include <cstdint>

#include "attend_plan.hpp"
#include "core/backends.hpp"
#include "core/check.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"

namespace emflow::cuda {

namespace {

// A pointer the kernels will dereference must be reachable from the current device.
void expect_device_pointer(const char* operation, const char* argument, const void* pointer,
                           int device) {
  using emflow::detail::fail_argument;
  if (pointer == nullptr) return;
  cudaPointerAttributes attributes{};
  emflow::detail::check_cuda(cudaPointerGetAttributes(&attributes, pointer), operation,
                             "cudaPointerGetAttributes");
  if (attributes.type == cudaMemoryTypeUnregistered) {
    fail_argument(operation, argument,
                  "must be device memory (cudaMalloc, managed or registered host memory), got an "
                  "ordinary host pointer");
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device) {
    fail_argument(operation, argument, "is memory of device ", attributes.device,
                  ", but the current device is ", device);
  }
}

}  // namespace

template <class T>
std::size_t attend_workspace_size(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                  Algorithm algorithm) {
  return emflow::detail::AttentionPlan<T>(input, output, algorithm, "attend_workspace_size",
                                          /*query_device=*/false)
      .workspace_bytes();
}

template <class T>
void attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
                  std::size_t workspace_bytes, Stream stream, Algorithm algorithm) {
  using namespace emflow::detail;
  const char* const operation = "attend_async";
  // validate() reads key length values, which live on the device here: check shapes and
  // pointers only; the kernels clamp the lengths. Overlaps are checked below, with the workspace.
  AttentionInput<T> shapes = input;
  shapes.key_lengths = nullptr;
  // The query lengths and positions per cloud are device arrays here too.
  shapes.query_lengths = nullptr;
  shapes.query_positions = nullptr;
  check_arguments(shapes, output, operation);
  // Shapes, algorithm, device (unsupported without one), a pending error, shared memory. The
  // plan reads a pending error before any query of its own, so launch failures read back later
  // are ours; the pointer queries below leave none behind (check_cuda clears what it reports).
  const AttentionPlan<T> plan(input, output, algorithm, operation);
  const int device = plan.device();
  expect_device_pointer(operation, "cloud", input.cloud, device);
  expect_device_pointer(operation, "relevance", input.layer.relevance, device);
  expect_device_pointer(operation, "content", input.layer.content, device);
  expect_device_pointer(operation, "key_bias", input.layer.key_bias, device);
  expect_device_pointer(operation, "offset", input.layer.offset, device);
  expect_device_pointer(operation, "key_lengths", input.key_lengths, device);
  expect_device_pointer(operation, "update", output.update, device);
  expect_device_pointer(operation, "lse", output.lse, device);
  expect_device_pointer(operation, "entropy", output.entropy, device);
  expect_device_pointer(operation, "weights", output.weights, device);
  if (workspace == nullptr) fail_argument(operation, "workspace", "must not be null");
  expect_device_pointer(operation, "workspace", workspace, device);
  if (workspace_bytes < plan.workspace_bytes()) {
    fail_argument(operation, "workspace_bytes", "must be >= ", plan.workspace_bytes(),
                  " (attend_workspace_size), got ", workspace_bytes);
  }
  if (reinterpret_cast<std::uintptr_t>(workspace) % kWorkspaceAlignment != 0) {
    fail_argument(operation, "workspace", "must be aligned to ", kWorkspaceAlignment,
                  " bytes, got address ", workspace);
  }
  check_no_overlap(input, output, operation, workspace, plan.workspace_bytes());
  plan.enqueue(input, output, workspace, stream);
}

template std::size_t attend_workspace_size<float>(const AttentionInput<float>&,
                                                  const AttentionOutput<float>&, Algorithm);
template std::size_t attend_workspace_size<double>(const AttentionInput<double>&,
                                                   const AttentionOutput<double>&, Algorithm);
template void attend_async<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                  void*, std::size_t, Stream, Algorithm);
template void attend_async<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                   void*, std::size_t, Stream, Algorithm);

}  // namespace emflow::cuda

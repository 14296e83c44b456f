// The dense EMF form on the tensor cores (tc_dense.cpp): what cuda::attend_workspace_size and
// cuda::attend_async (emflow/cuda.hpp, attend_async.cpp) run for 16-bit T, and for float with
// precision tf32. T is bfloat16, float16 or float (TF32 operands).
#pragma once

#include <cstddef>

#include "emflow/attention.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

/// Bytes of workspace tc_dense_attend_async needs (reads no memory, needs no device); throws as
/// its checks do.
template <class T>
std::size_t tc_dense_workspace_size(const AttentionInput<T>& input,
                                    const AttentionOutput<T>& output, cuda::Algorithm algorithm,
                                    const char* operation);

/// Checks the arguments, pointers and workspace, then enqueues the dense form on `stream`.
template <class T>
void tc_dense_attend_async(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                           void* workspace, std::size_t workspace_bytes, cuda::Stream stream,
                           cuda::Algorithm algorithm, const char* operation);

}  // namespace emflow::detail

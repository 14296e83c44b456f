// The seam between the public API and the backends. attend() validates once, then calls one
// of these; each backend implements the same contract as emflow::attend (attention.hpp) on
// validated input. Tests hold every backend against reference_attend.
#pragma once

#include <cstddef>
#include <string>

#include "emflow/attention.hpp"

namespace emflow::detail {

/// Double accumulation, written for clarity (src/reference/).
template <class T>
void reference_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output);

/// Fast multi-threaded CPU backend (src/cpu/).
template <class T>
void cpu_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output, int threads);

/// Blocking CUDA path on host arrays (kernels/, or a stub without CUDA).
template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output);

/// Refuses outputs that share memory with an input, with another output or with the workspace
/// (when given): every backend reads its inputs while it writes its outputs, so an aliased
/// output would silently corrupt the result. Compares address ranges only; reads no memory, so
/// it serves host and device pointers alike. Shapes must already be checked (validate()).
template <class T>
void check_no_overlap(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                      const char* operation, const void* workspace = nullptr,
                      std::size_t workspace_bytes = 0);

/// Whether a CUDA device can be used; when not, `reason` says why (no CUDA build, no device,
/// driver error).
bool cuda_device_available(std::string* reason);

}  // namespace emflow::detail

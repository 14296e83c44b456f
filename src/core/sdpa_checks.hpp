// The checks of the SDPA-shaped operator's calls (src/core/sdpa.cpp), shared with the CUDA
// backend's stream-ordered forms (src/cuda/sdpa_async.cpp), so that the blocking and the async
// calls validate and route alike.
#pragma once

#include <vector>

#include "emflow/capability.hpp"
#include "emflow/sdpa.hpp"
#include "validate.hpp"

namespace emflow::detail {

/// Every check of the input, naming the argument: extents, size products, the grouping of the
/// heads, the scale, the arrays, then the mask, lengths and positions (check_arguments; the
/// lengths and positions are read only for Lengths::host). `written`: an output the call writes
/// (not null), for the stand-in check of check_arguments.
template <class T>
void check_sdpa(const SdpaInput<T>& in, T* written, const char* op,
                Lengths lengths = Lengths::host);

/// The arrays every call reads (Q, K, V, the lengths and positions), for the overlap checks.
template <class T>
std::vector<MemoryRange> sdpa_input_ranges(const SdpaInput<T>& in);

/// The Problem of an SDPA-shaped call (its route is capability.cpp's: route()).
template <class T>
Problem sdpa_problem(const SdpaInput<T>& in, Operation operation, const ExecutionOptions& options);

}  // namespace emflow::detail

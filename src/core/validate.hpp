// The one validator of emflow's calls: every check of an argument that an entry point makes,
// host or device, blocking or stream-ordered, is written here once (src/core/validate.cpp) and
// reached through these functions. Each throws emflow::Error (ErrorCode::invalid_argument, the
// operation, the argument, the expected and the actual value) on the first bad argument.
//
// Lengths::host or Lengths::device says where the length and position arrays of a call live:
// host memory, whose values the checks read, or device memory (the stream-ordered calls of
// cuda.hpp), whose values they cannot read without a synchronisation: then only their presence
// is checked, and the kernels clamp the values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

namespace emflow::detail {

/// Where the length and position arrays of a call live (see above).
enum class Lengths { host, device };

/// The checks of validate() that read no array: batch, tokens, dim and heads >= 1, every size
/// product fits in int64, the positions stay within +-2^60, beta is finite (and |beta| <= 2^64
/// for float and 16-bit input), the mask is valid. For callers that hold no host arrays (the
/// CUDA backend's plan, which sees device pointers or none).
template <class T>
void check_shapes(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                  const char* operation);

/// The values of the host length and position arrays: key_lengths in [0, N], query_lengths in
/// [0, Nq], query_positions positions (not kAlignToEnd) within +-2^60.
template <class T>
void check_lengths(const AttentionInput<T>& input, const char* operation);

/// validate() without the overlap check: check_shapes, the pointers that must be given, the
/// aligned origin of the positions, and check_lengths for Lengths::host. For callers whose
/// operators are not the dense ones (attend_factored, attend_partial), which then check their own
/// memory ranges with check_disjoint.
template <class T>
void check_arguments(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                     const char* operation, Lengths lengths = Lengths::host);

/// One array an operation reads or writes: `bytes` from `pointer` (null or 0 bytes: absent).
struct MemoryRange {
  const char* name;
  const void* pointer;
  std::size_t bytes;
  bool written;
};

/// Refuses a written range that shares memory with any other range (read or written), naming
/// both: every backend reads its inputs while it writes its outputs, so an aliased output would
/// silently corrupt the result. Compares addresses only and reads no memory, so it serves host
/// and device pointers alike.
void check_disjoint(const MemoryRange* ranges, std::size_t count, const char* operation);

/// check_disjoint over the arrays of an attend call (sizes from validated shapes), plus the
/// workspace when given (written).
template <class T>
void check_no_overlap(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                      const char* operation, const void* workspace = nullptr,
                      std::size_t workspace_bytes = 0);

/// attend_factored's checks under the name `operation`: input.layer empty, the layer (heads,
/// rank, the four factors), then check_arguments on the shapes, then no output sharing memory
/// with an input, another output or the workspace (when given).
template <class T>
void check_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const AttentionOutput<T>& output, const char* operation,
                    const void* workspace = nullptr, std::size_t workspace_bytes = 0,
                    Lengths lengths = Lengths::host);

/// Every extent of a partial state >= 1, and B * H * Nq * dim fits in int64.
void check_partial_shape(const PartialShape& shape, const char* operation);

/// attend_partial's checks under the name `operation`: everything of check_arguments (the heads
/// standing in for the update), the three arrays of the state given, its shape, and no array of
/// the state sharing memory with an input, another array or the workspace (when given).
template <class T>
void check_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                   const char* operation, const void* workspace = nullptr,
                   std::size_t workspace_bytes = 0, Lengths lengths = Lengths::host);

/// attend_partial's checks for a factored layer: check_factored (the heads standing in for the
/// update), the three arrays of the state given, its shape (heads: the layer's), no array of the
/// state sharing memory with an input or another array, and frequencies that do not depend on
/// the call (check_fixed_frequencies).
template <class T>
void check_partial_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                            const PartialOutput<T>& output, const char* operation);

/// merge_partial's checks: the shape, both states given (named "part.heads", "into.lse", ...),
/// `into` sharing no memory with `part`.
template <class T>
void check_merge(const PartialShape& shape, const PartialInput<T>& part,
                 const PartialOutput<T>& into, const char* operation);

/// finish_partial's checks: the shape, the state and the update given, no weights asked, no
/// output sharing memory with the state, the offset or another output.
template <class T>
void check_finish(const PartialShape& shape, const PartialInput<T>& state, const T* offset,
                  const AttentionOutput<T>& output, const char* operation);

/// Why `precision` cannot be asked of `storage` ("tf32 needs float32 storage, got float64"), or
/// empty when the pair is valid (ExecutionOptions::precision): fp32 for every storage type, tf32
/// for float32, bf16 for bfloat16, fp16 for float16. route() refuses with this reason, and
/// check_precision makes it an invalid argument: the rule is written once, here.
std::string precision_mismatch(Dtype storage, Precision precision);

/// Refuses (invalid_argument naming 'precision') an ExecutionOptions::precision that the storage
/// type T cannot be asked for (precision_mismatch).
template <class T>
void check_precision(const ExecutionOptions& options, const char* operation);

}  // namespace emflow::detail

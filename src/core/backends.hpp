// The seam between the public API and the backends. attend() validates once, then calls one
// of these; each backend implements the same contract as emflow::attend (attention.hpp) on
// validated input. Tests hold every backend against reference_attend.
#pragma once

#include <cstddef>
#include <string>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"

namespace emflow::detail {

/// Double accumulation, written for clarity (src/reference/).
template <class T>
void reference_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output);

/// Fast multi-threaded CPU backend (src/cpu/).
template <class T>
void cpu_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output, int threads);

/// Whether this processor has AVX512-BF16, which cpu_attend_bf16 needs.
bool cpu_bf16_available();

/// The AVX512-BF16 CPU path (src/cpu/attend_bf16.cpp) of bfloat16 self-attention of a dense
/// layer without weights: `input` holds the stored bfloat16 values widened to float, all finite;
/// writes the update in bfloat16 and lse and entropy in float32 (docs/MATH.md §7).
void cpu_attend_bf16(const AttentionInput<float>& input, const AttentionOutput<bfloat16>& output,
                     int threads);

/// Blocking CUDA path on host arrays (kernels/, or a stub without CUDA); `precision` as
/// cuda::attend_async takes it (checked before).
template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 Precision precision = storage_precision<T>());

/// Blocking CUDA path of attend_partial on host arrays (kernels/, or a stub without CUDA).
template <class T>
void cuda_attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output);

/// The checks of validate() that read no array: batch, tokens, dim and heads >= 1, every size
/// product fits in int64, beta is finite (and |beta| <= 2^64 for float), the mask is valid. For
/// callers that hold no host arrays (the CUDA backend's plan, which sees device pointers or none).
template <class T>
void check_shapes(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                  const char* operation);

/// Where the length and position arrays of a call live: host memory, whose values the checks
/// read, or device memory (the stream-ordered calls), whose values they cannot read without a
/// synchronisation: only their presence is checked, and the kernels clamp the values.
enum class Lengths { host, device };

/// validate() without the overlap check: shapes, sizes, pointers, beta, the mask and the key
/// lengths (their values only for Lengths::host). For callers whose operators are not the dense
/// ones (attend_factored), which then check their own memory ranges with check_disjoint.
template <class T>
void check_arguments(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                     const char* operation, Lengths lengths = Lengths::host);

/// attend_factored's checks of its arguments under the name `operation`: the layer (heads, rank,
/// the four factors), then check_arguments on the shapes, then no output sharing memory with an
/// input, another output or the workspace (when given). Reads the length and position values
/// for Lengths::host only.
template <class T>
void check_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                    const AttentionOutput<T>& output, const char* operation,
                    const void* workspace = nullptr, std::size_t workspace_bytes = 0,
                    Lengths lengths = Lengths::host);

/// Blocking CUDA path of attend_factored on host arrays of any storage type (src/cuda/, or a stub
/// without CUDA): copies to the device, runs a cuda::AttentionPlan of the factored layer (the
/// tensor cores, or the layer expanded to dense operators on the device), copies back.
template <class T>
void cuda_attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output,
                          Precision precision = storage_precision<T>());

/// Throws ErrorCode::unsupported unless `input` is self-attention without query lengths or
/// positions: for a backend that does not implement cross-attention yet.
template <class T>
void expect_self_attention(const AttentionInput<T>& input, const char* operation);

/// reference_attend's partial state over the input's keys (partial.hpp): per head, no offset.
template <class T>
void reference_partial(const AttentionInput<T>& input, const PartialOutput<T>& output);

/// The fast CPU backend's partial state (src/cpu/).
template <class T>
void cpu_partial(const AttentionInput<T>& input, const PartialOutput<T>& output, int threads);

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

/// Whether a CUDA device can be used; when not, `reason` says why (no CUDA build, no device,
/// driver error).
bool cuda_device_available(std::string* reason);

}  // namespace emflow::detail

// The 16-bit storage types (bfloat16, float16) on the host devices (docs/MATH.md §7): the inputs
// are widened exactly to float (Device::cpu) or double (Device::reference), the float or double
// operation runs, and the update is rounded back to the storage type.
#pragma once

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"

namespace emflow::detail {

/// Refuses an ExecutionOptions::precision that the storage type T cannot honour, naming the
/// option (invalid_argument): tf32 for a type other than float, bf16 or fp16 for another storage
/// type. tf32 for float is a permission on every device (docs/MATH.md §7.2): the host devices
/// compute in fp32, the CUDA paths on the tensor cores where those compute what is asked.
template <class T>
void check_precision(const ExecutionOptions& options, const char* operation);

/// The first output that the tensor-core paths (src/cuda/tc_dense.cpp, tc_factored.cpp) do not
/// compute, by name ("weights": the N x N weights are never formed), or null when they compute
/// every one given (update, lse, entropy). The one place that says so: the kernels' refusals and
/// the choice of Device::automatic read it.
const char* tensor_core_missing_output(const void* weights);

/// The device a 16-bit emflow::attend call runs on: cuda when requested (ErrorCode::unsupported
/// without a usable device) and for automatic when a device exists and the tensor-core path
/// computes what `output` asks (tensor_core_missing_output, dim <= 256); else cpu or reference.
template <class T>
Device resolve_16bit_device(Device requested, const AttentionInput<T>& input,
                            const AttentionOutput<T>& output, const char* operation);

/// The device a 16-bit attend_factored call runs on: cuda when requested (ErrorCode::unsupported
/// without a usable device) and for automatic when a device exists and the tensor-core path
/// computes what `output` asks (no weights, rank <= 256); else cpu or reference.
template <class T>
Device resolve_16bit_factored_device(Device requested, const FactoredLayer<T>& layer,
                                     const AttentionOutput<T>& output, const char* operation);

/// emflow::attend for 16-bit T on validated input, on Device::cpu or Device::reference.
template <class T>
void attend_16bit(const AttentionInput<T>& input, const AttentionOutput<T>& output, Device device,
                  int threads);

/// emflow::attend_factored for 16-bit T on validated input, on Device::cpu or Device::reference.
template <class T>
void attend_factored_16bit(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, Device device, int threads);

}  // namespace emflow::detail

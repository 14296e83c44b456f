// Placeholder: the CUDA attention backend (unfused cuBLAS path and fused flash-style kernel)
// lands with the CUDA backend issue.
#include "core/backends.hpp"
#include "core/check.hpp"

namespace emflow::detail {

template <class T>
void cuda_attend(const AttentionInput<T>&, const AttentionOutput<T>&) {
  fail(ErrorCode::unsupported, "attend: the CUDA attention backend is not implemented yet");
}

template void cuda_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&);
template void cuda_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&);

}  // namespace emflow::detail

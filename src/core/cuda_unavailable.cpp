// Compiled only when emflow is built without CUDA: the CUDA backend reports that it is absent.
// route() never names Device::cuda then (Machine::cuda_built is false), so these only guard.
#include "backends.hpp"
#include "check.hpp"

namespace emflow::detail {

bool cuda_device_available(std::string* reason) {
  if (reason) *reason = "emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)";
  return false;
}

template <class T>
void cuda_attend(const AttentionInput<T>&, const AttentionOutput<T>&, const Route&) {
  fail(ErrorCode::unsupported, "attend: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}

template <class T>
void cuda_attend_partial(const AttentionInput<T>&, const PartialOutput<T>&, const Route&) {
  fail(ErrorCode::unsupported,
       "attend_partial: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}

template <class T>
void cuda_sdpa_attend(const SdpaInput<T>&, const SdpaOutput<T>&, Precision) {
  fail(ErrorCode::unsupported, "sdpa_attend: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}
template <class T>
void cuda_sdpa_backward(const SdpaInput<T>&, const SdpaSaved<T>&, const UpstreamGradients<T>&,
                        const SdpaGradientOutput<T>&) {
  fail(ErrorCode::unsupported,
       "sdpa_backward: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}
#define EMFLOW_CUDA_SDPA_BLOCKING(T)                                                       \
  template void cuda_sdpa_attend<T>(const SdpaInput<T>&, const SdpaOutput<T>&, Precision); \
  template void cuda_sdpa_backward<T>(const SdpaInput<T>&, const SdpaSaved<T>&,            \
                                      const UpstreamGradients<T>&, const SdpaGradientOutput<T>&);
EMFLOW_CUDA_SDPA_BLOCKING(float)
EMFLOW_CUDA_SDPA_BLOCKING(bfloat16)
EMFLOW_CUDA_SDPA_BLOCKING(float16)
#undef EMFLOW_CUDA_SDPA_BLOCKING

template <class T>
void cuda_attend_factored(const AttentionInput<T>&, const FactoredLayer<T>&,
                          const AttentionOutput<T>&, const Route&) {
  fail(ErrorCode::unsupported,
       "attend_factored: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}

template void cuda_attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                             const FactoredLayer<bfloat16>&,
                                             const AttentionOutput<bfloat16>&, const Route&);
template void cuda_attend_factored<float16>(const AttentionInput<float16>&,
                                            const FactoredLayer<float16>&,
                                            const AttentionOutput<float16>&, const Route&);
template void cuda_attend_factored<float>(const AttentionInput<float>&, const FactoredLayer<float>&,
                                          const AttentionOutput<float>&, const Route&);
template void cuda_attend_factored<double>(const AttentionInput<double>&,
                                           const FactoredLayer<double>&,
                                           const AttentionOutput<double>&, const Route&);
template void cuda_attend_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&,
                                         const Route&);
template void cuda_attend_partial<double>(const AttentionInput<double>&,
                                          const PartialOutput<double>&, const Route&);
template void cuda_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                 const Route&);
template void cuda_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                  const Route&);
template void cuda_attend<bfloat16>(const AttentionInput<bfloat16>&,
                                    const AttentionOutput<bfloat16>&, const Route&);
template void cuda_attend<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                                   const Route&);

}  // namespace emflow::detail

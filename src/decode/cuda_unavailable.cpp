// Compiled only when emflow is built without CUDA: a decode cache on Device::cuda is refused.
#include "core/check.hpp"
#include "cuda/decode_cache.hpp"

namespace emflow::detail::decode {

struct DeviceCache::Buffers {};

DeviceCache::DeviceCache(const LayerOperators<float>&, std::int64_t, double, std::int64_t) {
  fail(ErrorCode::unsupported,
       "DecodeCache: 'device' cuda: emflow was built without CUDA (EMFLOW_WITH_CUDA=OFF)");
}
DeviceCache::~DeviceCache() = default;
void DeviceCache::append(const float*, std::int64_t, std::int64_t) {}
void DeviceCache::attend(const float*, std::int64_t, const QueryRule&,
                         const AttentionOutput<float>&) {}

}  // namespace emflow::detail::decode

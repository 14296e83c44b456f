// detail::decode::DeviceCache (src/cuda/decode_cache.hpp): the device form of the float decode
// cache.
//
// Layout: keys (capacity, dim); contents (heads, capacity, dim), head h's rows at h capacity dim,
// so an append writes each head's new rows in place. The computation of attend() is the cache's
// plan (cuda::AttentionPlan through detail::PlanAccess, decode_strategy.hpp), made with the cache:
// route() asked, the fused kernel readied on the cache's device, and its workspace, with the
// buffers of kMaxQueries queries and their outputs, allocated once for the capacity. attend()
// takes its queries kMaxQueries at a time, so no call allocates; every call makes the cache's
// device current and restores the caller's.
#include "decode_cache.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/check.hpp"
#include "cuda_support.hpp"
#include "decode_strategy.hpp"
#include "emflow/cuda.hpp"
#include "kernels/decode_kernels.hpp"
#include "plan_access.hpp"

namespace emflow::detail::decode {

namespace {
constexpr const char* kOperation = "DecodeCache";
// Queries per run of the plan: four of the fused kernel's query blocks. Fewer queries get the
// key splits; a longer block of queries (a prompt) is taken in runs of this many.
constexpr std::int64_t kMaxQueries = 256;
}  // namespace

struct DeviceCache::Buffers {
  explicit Buffers(cuda::AttentionPlan<float> made) : plan(std::move(made)) {}
  // Declared first, so it outlives every buffer (cudaFree waits for the device).
  OwnedStream stream{kOperation};
  cuda::AttentionPlan<float> plan;
  std::int64_t dim = 0, heads = 0, capacity = 0;
  double beta = 1.0;
  cuda::DeviceBuffer<float> keys, contents, relevance, content, key_bias, offset;
  cuda::DeviceBuffer<float> queries, update, lse, entropy;  // kMaxQueries of them
  cuda::DeviceBuffer<unsigned char> workspace;
};

DeviceCache::DeviceCache(const LayerOperators<float>& layer, std::int64_t dim, double beta,
                         std::int64_t capacity) {
  DecodeShape shape;
  shape.dim = dim;
  shape.heads = layer.heads;
  shape.capacity = capacity;
  shape.queries = kMaxQueries;
  // Refuses what route() refuses for Operation::decode (no device, dim > 256, no capacity) and a
  // pending error; the plan's device is the current one.
  buffers_ = std::make_unique<Buffers>(cuda::detail::PlanAccess::decode(kOperation, shape));
  Buffers& b = *buffers_;
  b.dim = dim;
  b.heads = layer.heads;
  b.capacity = capacity;
  b.beta = beta;
  const auto d = static_cast<std::size_t>(dim), H = static_cast<std::size_t>(layer.heads);
  const auto cap = static_cast<std::size_t>(capacity);
  const auto Q = static_cast<std::size_t>(kMaxQueries);
  b.keys = cuda::DeviceBuffer<float>(cap * d);
  b.contents = cuda::DeviceBuffer<float>(H * cap * d);
  b.relevance = cuda::DeviceBuffer<float>(H * d * d);
  b.content = cuda::DeviceBuffer<float>(H * d * d);
  b.queries = cuda::DeviceBuffer<float>(Q * d);
  b.update = cuda::DeviceBuffer<float>(Q * d);
  b.lse = cuda::DeviceBuffer<float>(H * Q);
  b.entropy = cuda::DeviceBuffer<float>(H * Q);
  b.workspace = cuda::DeviceBuffer<unsigned char>(b.plan.workspace_size());
  cudaStream_t s = b.stream.get();
  b.relevance.copy_from_host(layer.relevance, H * d * d, s);
  b.content.copy_from_host(layer.content, H * d * d, s);
  if (layer.key_bias) {
    b.key_bias = cuda::DeviceBuffer<float>(H * d);
    b.key_bias.copy_from_host(layer.key_bias, H * d, s);
  }
  if (layer.offset) {
    b.offset = cuda::DeviceBuffer<float>(d);
    b.offset.copy_from_host(layer.offset, d, s);
  }
  // The operators are the caller's: the copies must have read them before this returns.
  check_cuda(cudaStreamSynchronize(s), kOperation, "cudaStreamSynchronize");
}

DeviceCache::~DeviceCache() {
  // The buffers are the cache's device's: freed with it current.
  if (!buffers_) return;
  try {
    const DeviceGuard on_device(buffers_->plan.device(), kOperation);
    buffers_.reset();
  } catch (...) {
    buffers_.reset();  // the device cannot be made current: free what can be freed
  }
}

void DeviceCache::append(const float* tokens, std::int64_t first, std::int64_t count) {
  const char* const op = "DecodeCache::append";
  Buffers& b = *buffers_;
  check_no_pending_error(op);
  const DeviceGuard on_device(b.plan.device(), op);
  cudaStream_t s = b.stream.get();
  const auto d = static_cast<std::size_t>(b.dim);
  float* rows = b.keys.data() + static_cast<std::size_t>(first) * d;
  cuda::detail::copy_host_to_device(rows, tokens,
                                    static_cast<std::size_t>(count) * d * sizeof(float), s);
  launch_project_rows(rows, static_cast<int>(count), static_cast<int>(b.dim), b.content.data(),
                      true, nullptr, 1.f, static_cast<int>(b.heads),
                      static_cast<std::size_t>(b.capacity) * d,
                      b.contents.data() + static_cast<std::size_t>(first) * d, s, op);
  // The tokens are the caller's: the copy must have read them before this returns.
  check_cuda(cudaStreamSynchronize(s), op, "cudaStreamSynchronize");
}

void DeviceCache::attend(const float* host_queries, std::int64_t count, const QueryRule& rule,
                         const AttentionOutput<float>& output) {
  const char* const op = "DecodeCache::attend";
  Buffers& b = *buffers_;
  check_no_pending_error(op);
  const DeviceGuard on_device(b.plan.device(), op);
  cudaStream_t s = b.stream.get();
  const auto d = static_cast<std::size_t>(b.dim), H = static_cast<std::size_t>(b.heads);
  DecodeCall call;
  call.keys = b.keys.data();
  call.contents = b.contents.data();
  call.relevance = b.relevance.data();
  call.key_bias = b.key_bias.size() ? b.key_bias.data() : nullptr;
  call.offset = b.offset.size() ? b.offset.data() : nullptr;
  call.beta = b.beta;
  call.update = b.update.data();
  call.lse = b.lse.data();
  call.entropy = b.entropy.data();
  call.queries = b.queries.data();
  call.rule = rule;
  // Runs of kMaxQueries queries through one set of buffers: stream order keeps a run's copies
  // back ahead of the next run's writes.
  for (std::int64_t first = 0; first < count; first += kMaxQueries) {
    const std::int64_t n = std::min(kMaxQueries, count - first);
    const auto rows = static_cast<std::size_t>(n);
    b.queries.copy_from_host(host_queries + static_cast<std::size_t>(first) * d, rows * d, s);
    call.count = n;
    call.rule.query_length = n;
    call.rule.query_origin = rule.query_origin + first;
    cuda::detail::PlanAccess::run_decode(b.plan, call, b.workspace.data(), b.workspace.size(), s);
    b.update.copy_to_host(output.update + static_cast<std::size_t>(first) * d, rows * d, s);
    // lse and entropy are (heads, count): each head's run is a slice of its row.
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t at = h * static_cast<std::size_t>(count) + static_cast<std::size_t>(first);
      if (output.lse) {
        cuda::detail::copy_device_to_host(output.lse + at, b.lse.data() + h * rows,
                                          rows * sizeof(float), s);
      }
      if (output.entropy) {
        cuda::detail::copy_device_to_host(output.entropy + at, b.entropy.data() + h * rows,
                                          rows * sizeof(float), s);
      }
    }
  }
  check_cuda(cudaStreamSynchronize(s), op, "cudaStreamSynchronize");
}

}  // namespace emflow::detail::decode

// detail::decode::DeviceCache (src/cuda/decode_cache.hpp): the device form of the float decode cache.
//
// Layout: keys (capacity, dim); contents (heads, capacity, dim), head h's rows at h capacity dim,
// so an append writes each head's new rows in place. attend() runs the fused kernel once per head
// (heads = 1, its content rows at head h's block), each with the key splits choose_key_splits
// gives one head, so few queries still fill the device; each head's splits merge into its slot
// of a partial state (heads, Nq, dim), and finish_partial sums the heads and adds the offset.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "attend_plan.hpp"
#include "kernels/attention_kernels.hpp"
#include "core/check.hpp"
#include "cuda_support.hpp"
#include "decode_cache.hpp"
#include "kernels/decode_kernels.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail::decode {

namespace {
constexpr const char* kOperation = "DecodeCache";
}  // namespace

struct DeviceCache::Buffers {
  std::int64_t dim = 0, heads = 0, capacity = 0, size = 0;
  double beta = 1.0;
  int device = 0;
  OwnedStream stream{kOperation};
  cuda::DeviceBuffer<float> keys, contents, relevance, content, key_bias, offset;
  // Per call, grown to the largest call so far.
  std::int64_t query_room = 0, split_room = 0;
  cuda::DeviceBuffer<float> queries, projected, split_rows, split_lse, split_entropy;
  cuda::DeviceBuffer<float> state_rows, state_lse, state_entropy, update, lse, entropy;

  void ensure(std::int64_t count, std::int64_t splits) {
    const auto n = static_cast<std::size_t>(count), d = static_cast<std::size_t>(dim),
               H = static_cast<std::size_t>(heads);
    if (count > query_room) {
      queries = cuda::DeviceBuffer<float>(n * d);
      projected = cuda::DeviceBuffer<float>(H * n * d);
      state_rows = cuda::DeviceBuffer<float>(H * n * d);
      state_lse = cuda::DeviceBuffer<float>(H * n);
      state_entropy = cuda::DeviceBuffer<float>(H * n);
      update = cuda::DeviceBuffer<float>(n * d);
      lse = cuda::DeviceBuffer<float>(H * n);
      entropy = cuda::DeviceBuffer<float>(H * n);
      query_room = count;
      split_room = 0;
    }
    if (splits * count > split_room) {
      const auto s = static_cast<std::size_t>(splits);
      split_rows = cuda::DeviceBuffer<float>(s * n * d);
      split_lse = cuda::DeviceBuffer<float>(s * n);
      split_entropy = cuda::DeviceBuffer<float>(s * n);
      split_room = splits * count;
    }
  }
};

DeviceCache::DeviceCache(const LayerOperators<float>& layer, std::int64_t dim, double beta,
                         std::int64_t capacity) {
  std::string reason;
  if (!cuda::device_available(&reason)) {
    fail(ErrorCode::unsupported, kOperation, ": 'device' cuda: ", reason);
  }
  if (dim > kFusedMaxDim) {
    fail(ErrorCode::unsupported, kOperation, ": 'dim' ", dim, " on the device: at most ",
         kFusedMaxDim);
  }
  check_no_pending_error(kOperation);
  int device = 0;
  check_cuda(cudaGetDevice(&device), kOperation, "cudaGetDevice");
  prepare_fused_attention(static_cast<int>(dim), device, kOperation);
  buffers_ = std::make_unique<Buffers>();
  Buffers& b = *buffers_;
  b.dim = dim;
  b.heads = layer.heads;
  b.capacity = capacity;
  b.beta = beta;
  b.device = device;
  const auto d = static_cast<std::size_t>(dim), H = static_cast<std::size_t>(layer.heads);
  const auto cap = static_cast<std::size_t>(capacity);
  b.keys = cuda::DeviceBuffer<float>(cap * d);
  b.contents = cuda::DeviceBuffer<float>(H * cap * d);
  b.relevance = cuda::DeviceBuffer<float>(H * d * d);
  b.content = cuda::DeviceBuffer<float>(H * d * d);
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

DeviceCache::~DeviceCache() = default;

void DeviceCache::append(const float* tokens, std::int64_t first, std::int64_t count) {
  const char* const op = "DecodeCache::append";
  Buffers& b = *buffers_;
  check_no_pending_error(op);
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
  b.size = first + count;
}

void DeviceCache::attend(const float* host_queries, std::int64_t count, const QueryRule& rule,
                         const AttentionOutput<float>& output) {
  const char* const op = "DecodeCache::attend";
  Buffers& b = *buffers_;
  check_no_pending_error(op);
  cudaStream_t s = b.stream.get();
  const std::int64_t N = rule.key_length;
  const KeySplits splits = choose_key_splits(1, 1, count, N, true);
  b.ensure(count, splits.splits);
  const int Nq = static_cast<int>(count), d = static_cast<int>(b.dim);
  const int H = static_cast<int>(b.heads);
  const std::size_t rows = static_cast<std::size_t>(Nq) * d;
  b.queries.copy_from_host(host_queries, rows, s);
  // The fused kernel's queries: beta log2(e) (Q M_h + u_h), (heads, Nq, dim).
  launch_project_rows(b.queries.data(), Nq, d, b.relevance.data(), false,
                      b.key_bias.size() ? b.key_bias.data() : nullptr,
                      static_cast<float>(b.beta * 1.4426950408889634), H, rows, b.projected.data(),
                      s, op);
  KernelMask mask;
  mask.rule = rule.mask;
  mask.key_position = 0;
  mask.query_position = rule.query_origin;
  for (int h = 0; h < H; ++h) {
    FusedAttentionArgs args;
    args.query = b.projected.data() + h * rows;
    args.cloud = b.keys.data();
    args.content = b.contents.data() + static_cast<std::size_t>(h) * b.capacity * d;
    args.batch = 1;
    args.heads = 1;
    args.tokens = static_cast<int>(N);
    args.queries = Nq;
    args.dim = d;
    args.split_keys = splits.keys;
    args.splits = splits.splits;
    args.partial_state = true;
    args.mask = mask;
    args.out.batch_stride = rows;
    args.out.head_stride = rows;
    float* state_rows = b.state_rows.data() + h * rows;
    float* state_lse = b.state_lse.data() + static_cast<std::size_t>(h) * Nq;
    float* state_entropy = b.state_entropy.data() + static_cast<std::size_t>(h) * Nq;
    if (splits.splits == 1) {
      args.out.rows = state_rows;
      args.out.lse = state_lse;
      args.out.entropy = state_entropy;
      launch_fused_attention(args, s, op);
      continue;
    }
    // The splits of one head reuse one scratch: the heads run one after another on the stream.
    args.out.rows = b.split_rows.data();
    args.out.lse = b.split_lse.data();
    args.out.entropy = b.split_entropy.data();
    args.out.split_rows = rows;
    args.out.split_stats = static_cast<std::size_t>(Nq);
    launch_fused_attention(args, s, op);
    SplitMerge merge;
    merge.rows = args.out.rows;
    merge.lse = args.out.lse;
    merge.entropy = args.out.entropy;
    merge.splits = splits.splits;
    merge.batch = 1;
    merge.heads = 1;
    merge.queries = Nq;
    merge.dim = d;
    merge.heads_out = state_rows;
    merge.lse_out = state_lse;
    merge.entropy_out = state_entropy;
    launch_merge_splits(merge, s, op);
  }
  launch_finish_partial<float>(b.state_rows.data(), b.state_lse.data(), b.state_entropy.data(),
                               b.offset.size() ? b.offset.data() : nullptr, b.update.data(),
                               b.lse.data(), b.entropy.data(), 1, H, Nq, d, s, op);
  b.update.copy_to_host(output.update, rows, s);
  const auto stats = static_cast<std::size_t>(H) * Nq;
  if (output.lse) b.lse.copy_to_host(output.lse, stats, s);
  if (output.entropy) b.entropy.copy_to_host(output.entropy, stats, s);
  check_cuda(cudaStreamSynchronize(s), op, "cudaStreamSynchronize");
}

}  // namespace emflow::detail::decode

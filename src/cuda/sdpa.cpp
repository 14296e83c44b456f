// The blocking CUDA path of emflow::sdpa_attend (include/emflow/sdpa.hpp) on Device::cuda:
// the SDPA-shaped operator is the tensor-core attention kernel itself (kernels/tc_attention.cu)
// on the caller's projected queries, keys and values, read in their own layout (batch, heads,
// tokens, rank: TcAttentionArgs::batch_major) with grouped kv heads, the mask rule, key and query
// lengths and positions, and key splits by the float kernel's rule for few queries. Host arrays
// are copied to the device on a stream of their own, the float32 output, lse and entropy are
// copied back and the stream synchronised; the output is rounded to T once, on the host. The
// arguments were validated and routed by sdpa_attend (route(): bf16 or fp16 storage, or float
// with Precision::tf32; value_rank equal to rank, at most kTensorCoreMaxDim).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "core/low_precision.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "kernels/tc_attention.hpp"
#include "products_strategy.hpp"
#include "tc_state.hpp"

namespace emflow::detail {

namespace {

/// A device copy of `count` host values, or an empty buffer for an absent array.
template <class V>
cuda::DeviceBuffer<V> upload(const V* host, std::size_t count, cudaStream_t stream) {
  if (host == nullptr) return cuda::DeviceBuffer<V>();
  cuda::DeviceBuffer<V> buffer(count);
  buffer.copy_from_host(host, count, stream);
  return buffer;
}

template <class V>
const V* data_or_null(const cuda::DeviceBuffer<V>& buffer) {
  return buffer.size() > 0 ? buffer.data() : nullptr;
}

}  // namespace

template <class T>
void cuda_sdpa_attend(const SdpaInput<T>& input, const SdpaOutput<T>& output, const Route& route) {
  const char* const operation = "sdpa_attend";
  (void)route;  // the products follow from T: TF32 for float, the storage type's otherwise
  // The stream first, so that it outlives every buffer (as in attend_blocking.cpp).
  const OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto Hq = static_cast<std::size_t>(input.query_heads);
  const auto Hkv = static_cast<std::size_t>(input.kv_heads);
  const auto Nq = static_cast<std::size_t>(input.query_tokens);
  const auto Nk = static_cast<std::size_t>(input.tokens);
  const auto r = static_cast<std::size_t>(input.rank);
  const std::size_t rows = B * Hq * Nq;

  const cuda::DeviceBuffer<T> queries = upload(input.queries, rows * r, s);
  const cuda::DeviceBuffer<T> keys = upload(input.keys, B * Hkv * Nk * r, s);
  const cuda::DeviceBuffer<T> values = upload(input.values, B * Hkv * Nk * r, s);
  const cuda::DeviceBuffer<std::int64_t> key_lengths = upload(input.key_lengths, B, s);
  const cuda::DeviceBuffer<std::int64_t> query_lengths = upload(input.query_lengths, B, s);
  const cuda::DeviceBuffer<std::int64_t> query_positions = upload(input.query_positions, B, s);
  // lse always: the key splits' merge and the kernel's statistics are written whether asked or
  // not; copied back only when asked.
  cuda::DeviceBuffer<float> out(rows * r), lse(rows), entropy(output.entropy ? rows : 0);

  TcAttentionArgs args;
  args.type = tc_type<T>();
  args.query = queries.data();
  args.key = keys.data();
  args.value = values.data();
  args.kv_heads = static_cast<int>(Hkv);
  args.batch_major = true;
  args.scale = static_cast<float>(input.scale * 1.4426950408889634);  // base 2 in the kernel
  args.out = out.data();
  args.lse = lse.data();
  args.entropy = output.entropy ? entropy.data() : nullptr;
  args.batch = static_cast<int>(B);
  args.heads = static_cast<int>(Hq);
  args.tokens = static_cast<int>(Nk);
  args.queries = static_cast<int>(Nq);
  args.dim = static_cast<int>(r);
  args.mask.rule = input.mask;
  args.mask.key_lengths = data_or_null(key_lengths);
  args.mask.query_lengths = data_or_null(query_lengths);
  args.mask.key_position = input.key_position;
  args.mask.query_position = input.query_position;
  args.mask.query_positions = data_or_null(query_positions);
  // Few queries against many keys: split the keys (flash-decoding), merged in split order.
  const KeySplits splits = choose_key_splits(input.batch, input.query_heads, input.query_tokens,
                                             input.tokens, true);
  args.splits = splits.splits;
  args.split_keys = splits.keys;
  const std::size_t split_rows = splits.splits > 1 ? static_cast<std::size_t>(splits.splits) * rows : 0;
  cuda::DeviceBuffer<float> split_out(split_rows * r), split_lse(split_rows),
      split_entropy(split_rows);
  if (splits.splits > 1) {
    args.split_out = split_out.data();
    args.split_lse = split_lse.data();
    args.split_entropy = split_entropy.data();
  }
  prepare_tc_attention(args.type, args.dim, operation);
  launch_tc_attention(args, s, operation);

  std::vector<float> rows_out(rows * r);
  out.copy_to_host(rows_out.data(), rows_out.size(), s);
  if (output.lse) lse.copy_to_host(output.lse, rows, s);
  if (output.entropy) entropy.copy_to_host(output.entropy, rows, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
  for (std::size_t e = 0; e < rows_out.size(); ++e) {
    if constexpr (std::is_same_v<T, float>) {
      output.output[e] = rows_out[e];
    } else {
      output.output[e] = narrow<T>(rows_out[e]);
    }
  }
}

template void cuda_sdpa_attend<float>(const SdpaInput<float>&, const SdpaOutput<float>&,
                                      const Route&);
template void cuda_sdpa_attend<bfloat16>(const SdpaInput<bfloat16>&, const SdpaOutput<bfloat16>&,
                                         const Route&);
template void cuda_sdpa_attend<float16>(const SdpaInput<float16>&, const SdpaOutput<float16>&,
                                        const Route&);

}  // namespace emflow::detail

// The blocking CUDA paths of emflow::sdpa_attend and sdpa_backward (include/emflow/sdpa.hpp) on
// Device::cuda. The forward:
// the SDPA-shaped operator is the tensor-core attention kernel itself (kernels/tc_attention.cu)
// on the caller's projected queries, keys and values, read in their own layout (batch, heads,
// tokens, rank: TcAttentionArgs::batch_major) with grouped kv heads, the mask rule, key and query
// lengths and positions, and key splits by the float kernel's rule for few queries. Host arrays
// are copied to the device on a stream of their own, the float32 output, lse and entropy are
// copied back and the stream synchronised; the output is rounded to T once, on the host. The
// arguments were validated and routed by sdpa_attend (route(): bf16 or fp16 storage, or float
// with Precision::tf32; value_rank equal to rank, at most kTensorCoreMaxDim). The backward: the
// float32 kernels of kernels/sdpa_backward.cu on the arrays core/sdpa.cpp prepared (16-bit
// input widened, the row terms E_i computed), dQ, dK, dV copied back in float32.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "core/low_precision.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "kernels/sdpa_backward.hpp"
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

/// The device copies of an SDPA input's per-cloud lengths and positions, and the mask over them.
class DeviceMask {
 public:
  template <class T>
  DeviceMask(const SdpaInput<T>& in, cudaStream_t stream)
      : key_lengths_(upload(in.key_lengths, static_cast<std::size_t>(in.batch), stream)),
        query_lengths_(upload(in.query_lengths, static_cast<std::size_t>(in.batch), stream)),
        query_positions_(upload(in.query_positions, static_cast<std::size_t>(in.batch), stream)) {
    mask_.rule = in.mask;
    mask_.key_lengths = data_or_null(key_lengths_);
    mask_.query_lengths = data_or_null(query_lengths_);
    mask_.key_position = in.key_position;
    mask_.query_position = in.query_position;
    mask_.query_positions = data_or_null(query_positions_);
  }
  const KernelMask& mask() const noexcept { return mask_; }

 private:
  cuda::DeviceBuffer<std::int64_t> key_lengths_, query_lengths_, query_positions_;
  KernelMask mask_;
};

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
  const DeviceMask mask(input, s);
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
  args.mask = mask.mask();
  // Few queries against many keys: split the keys (flash-decoding), merged in split order.
  const KeySplits splits =
      choose_key_splits(input.batch, input.query_heads, input.query_tokens, input.tokens, true);
  args.splits = splits.splits;
  args.split_keys = splits.keys;
  const std::size_t split_rows =
      splits.splits > 1 ? static_cast<std::size_t>(splits.splits) * rows : 0;
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

void cuda_sdpa_backward(const CudaSdpaBackward& arrays, float* query_gradient, float* key_gradient,
                        float* value_gradient, double* scale_gradient) {
  const char* const operation = "sdpa_backward";
  const SdpaInput<float>& in = arrays.input;
  const OwnedStream stream(operation);  // first: see cuda_sdpa_attend
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(in.batch);
  const auto Hq = static_cast<std::size_t>(in.query_heads);
  const auto Hkv = static_cast<std::size_t>(in.kv_heads);
  const auto Nq = static_cast<std::size_t>(in.query_tokens);
  const auto Nk = static_cast<std::size_t>(in.tokens);
  const auto r = static_cast<std::size_t>(in.rank);
  const auto rv = static_cast<std::size_t>(in.value_rank);
  const std::size_t rows = B * Hq * Nq;

  const cuda::DeviceBuffer<float> queries = upload(in.queries, rows * r, s);
  const cuda::DeviceBuffer<float> keys = upload(in.keys, B * Hkv * Nk * r, s);
  const cuda::DeviceBuffer<float> values = upload(in.values, B * Hkv * Nk * rv, s);
  const cuda::DeviceBuffer<float> output_gradient = upload(arrays.output_gradient, rows * rv, s);
  const cuda::DeviceBuffer<float> lse = upload(arrays.lse, rows, s);
  const cuda::DeviceBuffer<float> row_term = upload(arrays.row_term, rows, s);
  const cuda::DeviceBuffer<float> entropy_gradient = upload(arrays.entropy_gradient, rows, s);
  const DeviceMask mask(in, s);
  cuda::DeviceBuffer<float> dq(rows * r), dk(B * Hkv * Nk * r), dv(B * Hkv * Nk * rv);
  const std::size_t query_blocks = (Nq + kSdpaBackwardTile - 1) / kSdpaBackwardTile * Hq * B;
  cuda::DeviceBuffer<float> scale_terms(scale_gradient != nullptr ? query_blocks : 0);

  SdpaBackwardArgs args;
  args.query = queries.data();
  args.key = keys.data();
  args.value = values.data();
  args.output_gradient = output_gradient.data();
  args.lse = lse.data();
  args.row_term = row_term.data();
  args.entropy_gradient = data_or_null(entropy_gradient);
  args.query_gradient = dq.data();
  args.key_gradient = dk.data();
  args.value_gradient = dv.data();
  args.scale_terms = scale_gradient != nullptr ? scale_terms.data() : nullptr;
  args.scale = static_cast<float>(in.scale);
  args.batch = static_cast<int>(B);
  args.heads = static_cast<int>(Hq);
  args.kv_heads = static_cast<int>(Hkv);
  args.queries = static_cast<int>(Nq);
  args.tokens = static_cast<int>(Nk);
  args.rank = static_cast<int>(r);
  args.value_rank = static_cast<int>(rv);
  args.mask = mask.mask();
  prepare_sdpa_backward(args.rank > args.value_rank ? args.rank : args.value_rank, operation);
  launch_sdpa_backward(args, s, operation);

  std::vector<float> terms(scale_terms.size());
  dq.copy_to_host(query_gradient, dq.size(), s);
  dk.copy_to_host(key_gradient, dk.size(), s);
  dv.copy_to_host(value_gradient, dv.size(), s);
  if (!terms.empty()) scale_terms.copy_to_host(terms.data(), terms.size(), s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
  if (scale_gradient != nullptr) {
    double sum = 0.0;  // in block order: the same bits run to run
    for (float t : terms) sum += static_cast<double>(t);
    *scale_gradient = sum;
  }
}

template void cuda_sdpa_attend<float>(const SdpaInput<float>&, const SdpaOutput<float>&,
                                      const Route&);
template void cuda_sdpa_attend<bfloat16>(const SdpaInput<bfloat16>&, const SdpaOutput<bfloat16>&,
                                         const Route&);
template void cuda_sdpa_attend<float16>(const SdpaInput<float16>&, const SdpaOutput<float16>&,
                                        const Route&);

}  // namespace emflow::detail

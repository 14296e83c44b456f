// emflow::distributed: sequence-parallel attention over a ring of ranks (docs/MATH.md §1 for
// the update, partial.hpp for the partial states and their merge).
//
// Every rank holds a shard of the tokens of every cloud of a batch: its queries and its keys.
// The key shards travel around the ring (rank r sends what it holds to r + 1 and receives from
// r - 1), P - 1 transfers in all, each one started before the rank computes its queries against
// the shard it already holds, so the transfer runs behind the computation. The partial states of
// a query are merged in the order the shards arrive (its own first, then those of r - 1, r - 2,
// ...), a fixed order for a fixed rank count: two runs give the same bits. The result equals
// emflow::attend over the whole cloud to rounding (1e-6 relative in float, 1e-12 in double).
//
// Shards (Layout): contiguous gives rank r one run of about N / P tokens; zigzag cuts the
// sequence into 2P runs and gives rank r runs r and 2P - 1 - r, so that under a causal or window
// mask every rank has as many visible pairs as every other (ring-flash-attention's zigzag).
// Segment pairs that the mask or the key lengths hide entirely are not computed.
//
// The same ring carries the SDPA-shaped operator (sdpa.hpp) on projected queries, keys and
// values, forward and backward (sdpa_attend, sdpa_backward below; docs/MATH.md §8.9): the
// backward pass for training with the sequence spread over ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/backward.hpp"
#include "emflow/distributed.hpp"
#include "emflow/factored.hpp"
#include "emflow/sdpa.hpp"
#include "emflow/tensor.hpp"

namespace emflow::distributed {

enum class Layout {
  contiguous,  ///< rank r: tokens [r N / P, (r + 1) N / P)
  zigzag,      ///< rank r: runs r and 2P - 1 - r of 2P near-equal runs
};

/// zigzag for causal and window masks, contiguous otherwise.
Layout default_layout(const Mask& mask) noexcept;

/// A run of consecutive tokens of every cloud: sequence positions [position, position + count).
struct Segment {
  std::int64_t position = 0;
  std::int64_t count = 0;
};

/// The runs rank `rank` of `ranks` holds of a sequence of `tokens` tokens, in order of position
/// (empty runs left out). Every rank can compute every other rank's shard.
std::vector<Segment> shard(Layout layout, std::int64_t tokens, int ranks, int rank);
/// The number of tokens of a shard (the sum of its counts).
std::int64_t shard_tokens(const std::vector<Segment>& segments) noexcept;

/// A rank's part of a batch: an AttentionInput (attention.hpp) whose `cloud` is this rank's tokens
/// and whose `tokens` is N, the whole cloud's token count, plus the layout of the shards. Arrays
/// are segment-major: the block of segment s, (batch, count_s, dim) for the cloud and the update,
/// (batch, heads, count_s) for lse and entropy, follows the block of segment s - 1. The layer,
/// beta, mask and key lengths (optional, `batch` entries, of the whole cloud) are the whole
/// batch's and the same on every rank. The ring's queries are the shard's own tokens: queries,
/// query_tokens, query_lengths and the positions must keep their defaults (invalid_argument
/// otherwise).
template <class T>
struct ShardInput : AttentionInput<T> {
  Layout layout = Layout::contiguous;
};

template <class T>
struct ShardOutput {
  T* update = nullptr;         ///< required (segment-major, the cloud's layout)
  Stat<T>* lse = nullptr;      ///< optional (segment-major, (batch, heads, count_s) blocks)
  Stat<T>* entropy = nullptr;  ///< optional
};

/// Where the time of one call went (for benchmarks): seconds computing, and seconds spent
/// waiting for transfers after the computation of a step had finished (the part not hidden).
struct RingTimes {
  double compute = 0.0;
  double exposed_wait = 0.0;
  std::int64_t bytes_sent = 0;
};

/// Sequence-parallel self-attention (see above). Collective over `comm` (host memory). Checks its
/// arguments on every rank and agrees on the outcome before any transfer, so a bad argument on
/// one rank is the same emflow::Error on every rank; a failure during the ring (out of memory)
/// is agreed on at the end. The partial states live in host memory and are computed by
/// attend_partial on the device that route() (capability.hpp) names for the whole batch's
/// partial state under `options` (Device::automatic: the GPU when one is usable, its blocks
/// copied there and back, else the CPU); options.precision as for attend_partial. A device or
/// precision that no partial-state kernel takes is refused on every rank with route()'s reason
/// (ErrorCode::unsupported).
template <class T>
void attend(Communicator& comm, const ShardInput<T>& input, const ShardOutput<T>& output,
            const ExecutionOptions& options = {}, RingTimes* times = nullptr);

/// The same for a layer in the factored form (factored.hpp): input.layer empty, the operators
/// from `layer`, its rotary positions and grouped kv heads included. Each block of keys is turned
/// at its positions in the whole sequence (the shard's), the queries at theirs, so the ring's
/// result equals emflow::attend_factored over the whole cloud to rounding (partial.hpp: the
/// factored partial states merge exactly). The positions are the sequence's: Rotary's explicit
/// key_positions and query_positions must be null (invalid_argument naming them); the dynamic
/// scaling needs explicit inverse_frequencies (unsupported otherwise, as for attend_partial).
template <class T>
void attend(Communicator& comm, const ShardInput<T>& input, const FactoredLayer<T>& layer,
            const ShardOutput<T>& output, const ExecutionOptions& options = {},
            RingTimes* times = nullptr);

/// A rank's part of the SDPA-shaped operator (sdpa.hpp) over a sequence of `tokens` tokens spread
/// over the ring: the projected queries, keys and values of the shard's own tokens, segment-major
/// (the block of segment s, (batch, heads, count_s, width), follows the block of segment s - 1):
/// queries (batch, query_heads, count_s, rank), keys (batch, kv_heads, count_s, rank), values
/// (batch, kv_heads, count_s, value_rank); the output, the saved statistics, the upstream
/// gradients and the gradients likewise, lse and entropy (batch, query_heads, count_s) blocks
/// (gather_shard with batch * heads as its batch cuts them from whole arrays). Token t sits at
/// sequence position t as a query and as a key, and with key lengths the tokens t >= L_b are
/// padding as queries too (they see no key): the ring computes sdpa_attend over the whole
/// sequence with query_tokens = tokens, key_position = query_position = 0 and query_lengths =
/// key_lengths. scale, mask, key_lengths (`batch` entries, the whole sequence's), the heads and
/// the ranks are the same on every rank; query_tokens, query_lengths, key_position,
/// query_position and query_positions must keep their defaults (invalid_argument otherwise).
template <class T>
struct SdpaShardInput : SdpaInput<T> {
  Layout layout = Layout::contiguous;
};

/// The SDPA-shaped operator's forward pass over the ring: the key and value shards travel as the
/// cloud shards of attend do, each block of queries against a block of keys is sdpa_attend on
/// the device `options` names, and the blocks merge exactly (merge_partial). output required,
/// lse and entropy optional (the backward pass reads lse). Equal to sdpa_attend over the whole
/// sequence to rounding (1e-6 relative in float, 1e-12 in double); the same bits run to run for
/// a fixed rank count. Collective; errors agreed on every rank, as attend.
template <class T>
void sdpa_attend(Communicator& comm, const SdpaShardInput<T>& input, const SdpaOutput<T>& output,
                 const ExecutionOptions& options = {}, RingTimes* times = nullptr);

/// Its backward pass over the ring (docs/MATH.md §8.9). The queries, their saved statistics (the
/// ring forward's O, lse and H of this shard; sdpa.hpp's SdpaSaved) and their upstream gradients
/// stay on their rank; the key and value shards travel as in the forward pass, and one step
/// behind them their gradients: at step t a rank runs sdpa_backward of its queries against the
/// block it holds with the whole sequence's statistics (which every fast path reads instead of
/// recomputing, so a block gives its exact share), adds the block's dQ to its own, waits for
/// the held shard's dK and dV accumulated by the ranks before it, adds the block's, and passes
/// them on; after P steps each shard's dK and dV are back at their owner. gradients: dQ, dK, dV
/// of this rank's shard (segment-major, required); dscale (optional): the whole sequence's, the
/// same on every rank (one allreduce). Equal to sdpa_backward over the whole sequence to
/// rounding (1e-5 relative in float, 1e-12 in double); the same bits run to run for a fixed
/// rank count. Device::reference is refused (it recomputes the statistics from the block).
template <class T>
void sdpa_backward(Communicator& comm, const SdpaShardInput<T>& input, const SdpaSaved<T>& saved,
                   const UpstreamGradients<T>& upstream, const SdpaGradientOutput<T>& gradients,
                   const ExecutionOptions& options = {}, RingTimes* times = nullptr);

/// The backward pass of attend over the ring (backward.hpp's attend_backward, docs/MATH.md §8.4,
/// §8.9) for the layer and shards of `input`: every rank projects its own tokens for every head
/// (queries M_h^T x_i + u_h, keys x_j, values F_h x_j), the SDPA ring recomputes the heads'
/// forward pass and runs its backward pass (sdpa_backward above: each key shard's dK and dV come
/// home), and each rank applies the chain rule to its own tokens. upstream: this shard's dDelta
/// (segment-major, the cloud's layout), dlse and dH ((batch, heads, count_s) blocks), each
/// optional. gradients.cloud: this shard's dX (segment-major); relevance, content, key_bias,
/// offset and beta: the whole batch's, the same on every rank (each rank's terms summed in rank
/// order by one allreduce each); gradients.queries must be null. Padding tokens (beyond the key
/// lengths) are not read and get exact zeros. Equal to attend_backward over the whole batch to
/// rounding. Collective; errors agreed on every rank.
template <class T>
void attend_backward(Communicator& comm, const ShardInput<T>& input,
                     const UpstreamGradients<T>& upstream, const LayerGradientOutput<T>& gradients,
                     const ExecutionOptions& options = {}, RingTimes* times = nullptr);

/// The same for a layer in the factored form (attend_factored_backward, docs/MATH.md §8.5):
/// queries (A_h x_i, 1), keys (B_h x_j, u_h^T x_j), values V_h x_j, dO_h = U_h^T dDelta. Rotary
/// positions and grouped kv heads have no backward pass yet (unsupported, as in one process).
template <class T>
void attend_factored_backward(Communicator& comm, const ShardInput<T>& input,
                              const FactoredLayer<T>& layer, const UpstreamGradients<T>& upstream,
                              const FactoredGradientOutput<T>& gradients,
                              const ExecutionOptions& options = {}, RingTimes* times = nullptr);

/// Rows of a whole batch (batch, tokens, width) that a shard holds, segment-major (for tests and
/// for callers that hold the whole batch): width = dim for clouds.
template <class T>
std::vector<T> gather_shard(const T* whole, std::int64_t batch, std::int64_t tokens,
                            std::int64_t width, const std::vector<Segment>& segments);
/// The inverse: writes a shard's rows into a whole (batch, tokens, width) array.
template <class T>
void scatter_shard(const T* part, std::int64_t batch, std::int64_t tokens, std::int64_t width,
                   const std::vector<Segment>& segments, T* whole);

/// Reads rank `rank`'s shard of the cloud in the .npy file `path`, (N, d) or (B, N, d), of dtype
/// float32 for T = float, float64 for double: only its own rows, by offset reads of the payload
/// (read_npy_header gives where the payload starts). Returns the segment-major rows; `shape`
/// receives the file's shape. Throws ErrorCode::io naming the file.
template <class T>
std::vector<T> read_shard(const std::string& path, Layout layout, int ranks, int rank,
                          Shape* shape);

#define EMFLOW_DISTRIBUTED_DECLARE(T)                                                             \
  extern template void attend<T>(Communicator&, const ShardInput<T>&, const ShardOutput<T>&,      \
                                 const ExecutionOptions&, RingTimes*);                            \
  extern template void attend<T>(Communicator&, const ShardInput<T>&, const FactoredLayer<T>&,    \
                                 const ShardOutput<T>&, const ExecutionOptions&, RingTimes*);     \
  extern template std::vector<T> gather_shard<T>(const T*, std::int64_t, std::int64_t,            \
                                                 std::int64_t, const std::vector<Segment>&);      \
  extern template void scatter_shard<T>(const T*, std::int64_t, std::int64_t, std::int64_t,       \
                                        const std::vector<Segment>&, T*);                         \
  extern template std::vector<T> read_shard<T>(const std::string&, Layout, int, int, Shape*);     \
  extern template void sdpa_attend<T>(Communicator&, const SdpaShardInput<T>&,                    \
                                      const SdpaOutput<T>&, const ExecutionOptions&, RingTimes*); \
  extern template void sdpa_backward<T>(                                                          \
      Communicator&, const SdpaShardInput<T>&, const SdpaSaved<T>&, const UpstreamGradients<T>&,  \
      const SdpaGradientOutput<T>&, const ExecutionOptions&, RingTimes*);                         \
  extern template void attend_backward<T>(                                                        \
      Communicator&, const ShardInput<T>&, const UpstreamGradients<T>&,                           \
      const LayerGradientOutput<T>&, const ExecutionOptions&, RingTimes*);                        \
  extern template void attend_factored_backward<T>(                                               \
      Communicator&, const ShardInput<T>&, const FactoredLayer<T>&, const UpstreamGradients<T>&,  \
      const FactoredGradientOutput<T>&, const ExecutionOptions&, RingTimes*);
EMFLOW_DISTRIBUTED_DECLARE(float)
EMFLOW_DISTRIBUTED_DECLARE(double)
#undef EMFLOW_DISTRIBUTED_DECLARE

}  // namespace emflow::distributed

// The SDPA-shaped operator over a ring of ranks (emflow/sequence_parallel.hpp: sdpa_attend,
// sdpa_backward; docs/MATH.md §8.9).
//
// Forward, step t of P: rank r holds the key and value shard of rank o = (r - t) mod P, starts
// passing it on to r + 1, runs sdpa_attend of each of its query segments against each held key
// segment that the mask and the lengths leave visible, and merges the blocks into one state per
// query segment (merge_partial; the first block is written straight into the state). The
// output, lse and entropy are the states.
//
// Backward, step t: the same blocks through sdpa_backward with the whole sequence's saved
// statistics, so each block gives its exact share. The block's dQ is added to the rank's own;
// its dK and dV into a local buffer for shard o. Then the rank waits for shard o's accumulator
// (which rank r - 1 passed on at the end of its step t - 1; at t = 0 the shard is the rank's own
// and its accumulator starts at the local buffer), adds the local buffer, and passes the sum on
// to r + 1, which holds shard o at step t + 1. The P-th pass brings each shard's sum home. The
// key and value shards travel ahead of the computation (as in the forward); the gradients one
// step behind it, so their transfer runs behind the next step's computation. Every sum is taken
// in a fixed order (the steps, then the segments), so two runs give the same bits.
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <memory>
#include <vector>

#include "check.hpp"
#include "emflow/partial.hpp"
#include "emflow/sequence_parallel.hpp"
#include "ring.hpp"

namespace emflow::distributed {

namespace {

using detail::any_visible;
using detail::Clock;
using detail::local_lengths;
using detail::run_steps;
using detail::seconds_since;

template <class T>
void add_into(T* into, const T* values, std::size_t count) {
  for (std::size_t e = 0; e < count; ++e) into[e] += values[e];
}

// The arguments every rank checks before any transfer.
template <class T>
void check_input(Communicator& comm, const SdpaShardInput<T>& in, const char* op) {
  if (comm.memory() != Memory::host) {
    detail::fail(ErrorCode::unsupported, op,
                 ": needs a host communicator (the blocks of the ring are computed on the host)");
  }
  detail::expect_positive(op, "batch", in.batch);
  detail::expect_positive(op, "query_heads", in.query_heads);
  detail::expect_positive(op, "kv_heads", in.kv_heads);
  detail::expect_positive(op, "tokens", in.tokens);
  detail::expect_positive(op, "rank", in.rank);
  detail::expect_positive(op, "value_rank", in.value_rank);
  if (in.query_heads % in.kv_heads != 0) {
    detail::fail_argument(op, "query_heads", "must be a multiple of kv_heads (", in.kv_heads,
                          "), got ", in.query_heads);
  }
  if (in.query_tokens != 0 || in.query_lengths != nullptr || in.key_position != 0 ||
      in.query_position != kAlignToEnd || in.query_positions != nullptr) {
    detail::fail_argument(op, "query_tokens",
                          "and query_lengths, key_position, query_position and query_positions "
                          "must keep their defaults: the ring's queries are the shard's own "
                          "tokens at their positions in the sequence");
  }
  if (!std::isfinite(in.scale)) {
    detail::fail_argument(op, "scale", "must be finite, got ", in.scale);
  }
  if (in.mask.kind == MaskKind::window && in.mask.window < 1) {
    detail::fail_argument(op, "mask", "window must be >= 1, got ", in.mask.window);
  }
  if (in.key_lengths) {
    for (std::int64_t b = 0; b < in.batch; ++b) {
      if (in.key_lengths[b] < 0 || in.key_lengths[b] > in.tokens) {
        detail::fail_argument(op, "key_lengths", "entry ", b, " is ", in.key_lengths[b],
                              ", expected a length in [0, ", in.tokens, "]");
      }
    }
  }
  if (shard_tokens(shard(in.layout, in.tokens, comm.size(), comm.rank())) > 0) {
    detail::expect_not_null(op, "queries", in.queries);
    detail::expect_not_null(op, "keys", in.keys);
    detail::expect_not_null(op, "values", in.values);
  }
}

// What both passes share: the shapes, the shards, the key and value shard in hand and the one
// arriving, and the block inputs.
template <class T>
struct SdpaRing {
  SdpaRing(Communicator& comm, const SdpaShardInput<T>& input) : in(input) {
    P = comm.size();
    r = comm.rank();
    queries = shard(in.layout, in.tokens, P, r);
    for (int o = 0; o < P; ++o) capacity = std::max(capacity, tokens_of(o));
    held.resize(static_cast<std::size_t>(capacity * key_width()));
    next.resize(held.size());
    const std::int64_t local = tokens_of(r);
    std::copy(in.keys, in.keys + local * kv_rows() * in.rank, held.begin());
    std::copy(in.values, in.values + local * kv_rows() * in.value_rank,
              held.begin() + local * kv_rows() * in.rank);
    if (in.key_lengths) lengths.assign(in.key_lengths, in.key_lengths + in.batch);
  }

  std::int64_t tokens_of(int owner) const {
    return shard_tokens(shard(in.layout, in.tokens, P, owner));
  }
  std::int64_t kv_rows() const { return in.batch * in.kv_heads; }
  std::int64_t q_rows() const { return in.batch * in.query_heads; }
  // Elements per token of a key and value shard (its keys, then its values).
  std::int64_t key_width() const { return kv_rows() * (in.rank + in.value_rank); }
  std::size_t shard_bytes(int owner) const {
    return static_cast<std::size_t>(tokens_of(owner) * key_width()) * sizeof(T);
  }

  // The block of query segment q against key segment k: keys and values at `keys`, `values`.
  SdpaInput<T> block(const Segment& q, const T* q_rows_at, const Segment& k, const T* keys,
                     const T* values, std::vector<std::int64_t>& q_lengths,
                     std::vector<std::int64_t>& k_lengths) const {
    SdpaInput<T> b;
    b.queries = q_rows_at;
    b.keys = keys;
    b.values = values;
    b.batch = in.batch;
    b.query_heads = in.query_heads;
    b.kv_heads = in.kv_heads;
    b.query_tokens = q.count;
    b.tokens = k.count;
    b.rank = in.rank;
    b.value_rank = in.value_rank;
    b.scale = in.scale;
    b.mask = in.mask;
    if (in.key_lengths) {
      q_lengths = local_lengths(lengths, q);
      k_lengths = local_lengths(lengths, k);
      b.query_lengths = q_lengths.data();
      b.key_lengths = k_lengths.data();
    }
    b.key_position = k.position;
    b.query_position = q.position;
    return b;
  }

  // Calls visit(a, q_offset, k, k_offset, block) for every visible block of this rank's query
  // segment a (q_offset tokens into the shard) against a segment k of shard `owner` (held;
  // k_offset tokens into it), in the fixed order: the query segments, then the key segments.
  template <class Visit>
  void for_each_block(int owner, Visit&& visit) {
    const std::vector<Segment> keys = shard(in.layout, in.tokens, P, owner);
    const std::vector<std::int64_t>* lengths_or_null = in.key_lengths ? &lengths : nullptr;
    const T* values_at = held.data() + tokens_of(owner) * kv_rows() * in.rank;
    std::int64_t q_offset = 0;
    for (std::size_t a = 0; a < queries.size(); ++a) {
      const Segment& q = queries[a];
      std::int64_t k_offset = 0;
      for (std::size_t s = 0; s < keys.size(); ++s) {
        const Segment& k = keys[s];
        if (any_visible(in.mask, q, k, lengths_or_null)) {
          std::vector<std::int64_t> q_lengths, k_lengths;
          const SdpaInput<T> b =
              block(q, in.queries + q_offset * q_rows() * in.rank, k,
                    held.data() + k_offset * kv_rows() * in.rank,
                    values_at + k_offset * kv_rows() * in.value_rank, q_lengths, k_lengths);
          visit(a, q_offset, k, k_offset, b);
        }
        k_offset += k.count;
      }
      q_offset += q.count;
    }
  }

  const SdpaShardInput<T>& in;
  int P = 1, r = 0;
  std::int64_t capacity = 0;
  std::vector<Segment> queries;
  std::vector<T> held, next;
  std::vector<std::int64_t> lengths;
};

template <class T>
void ring_sdpa_attend(Communicator& comm, const SdpaShardInput<T>& input,
                      const SdpaOutput<T>& output, const ExecutionOptions& options,
                      RingTimes* times) {
  const char* op = "distributed sdpa_attend";
  struct Query {
    std::vector<T> output;
    std::vector<Stat<T>> lse, entropy;
    bool started = false;
    PartialOutput<T> out() { return {output.data(), lse.data(), entropy.data()}; }
    PartialInput<T> in() const { return {output.data(), lse.data(), entropy.data()}; }
  };
  std::unique_ptr<SdpaRing<T>> ring;
  std::vector<Query> states;
  Query part;
  agreed(comm, [&] {
    check_input(comm, input, op);
    if (shard_tokens(shard(input.layout, input.tokens, comm.size(), comm.rank())) > 0) {
      detail::expect_not_null(op, "output", output.output);
    }
    ring = std::make_unique<SdpaRing<T>>(comm, input);
    const std::int64_t rows = input.batch * input.query_heads;
    std::int64_t largest = 0;
    for (const Segment& q : ring->queries) {
      Query s;
      s.output.assign(static_cast<std::size_t>(rows * q.count * input.value_rank), T(0));
      s.lse.assign(static_cast<std::size_t>(rows * q.count),
                   -std::numeric_limits<Stat<T>>::infinity());
      s.entropy.assign(s.lse.size(), Stat<T>(0));
      states.push_back(std::move(s));
      largest = std::max(largest, q.count);
    }
    part.output.resize(static_cast<std::size_t>(rows * largest * input.value_rank));
    part.lse.resize(static_cast<std::size_t>(rows * largest));
    part.entropy.resize(part.lse.size());
  });
  RingTimes local;
  std::exception_ptr error =
      run_steps(comm, *ring, local, [&](int owner, Transfer* transfer, bool failed) {
        if (failed) return;
        const auto start = Clock::now();
        ring->for_each_block(owner, [&](std::size_t a, std::int64_t, const Segment&, std::int64_t,
                                        const SdpaInput<T>& block) {
          Query& state = states[a];
          const Segment& q = ring->queries[a];
          const PartialOutput<T> into = state.started ? part.out() : state.out();
          sdpa_attend(block, SdpaOutput<T>{into.heads, into.lse, into.entropy}, options);
          if (state.started) {
            merge_partial(PartialShape{input.batch, input.query_heads, q.count, input.value_rank},
                          part.in(), state.out());
          }
          state.started = true;
          if (transfer) comm.poll(*transfer);
        });
        local.compute += seconds_since(start);
      });
  if (!error) {
    T* out = output.output;
    Stat<T>* lse = output.lse;
    Stat<T>* entropy = output.entropy;
    for (const Query& s : states) {
      out = std::copy(s.output.begin(), s.output.end(), out);
      if (lse) lse = std::copy(s.lse.begin(), s.lse.end(), lse);
      if (entropy) entropy = std::copy(s.entropy.begin(), s.entropy.end(), entropy);
    }
  }
  agree(comm, error);
  if (times) *times = local;
}

template <class T>
void ring_sdpa_backward(Communicator& comm, const SdpaShardInput<T>& input,
                        const SdpaSaved<T>& saved, const UpstreamGradients<T>& upstream,
                        const SdpaGradientOutput<T>& gradients, const ExecutionOptions& options,
                        RingTimes* times) {
  const char* op = "distributed sdpa_backward";
  std::unique_ptr<SdpaRing<T>> ring;
  // The gradients of the shard in hand: this step's blocks (local), the sum arriving from rank
  // r - 1 (incoming) and the sum passed on (outgoing); each laid out as a key and value shard.
  std::vector<T> local_sum, incoming, outgoing, block_queries, block_keys, block_values;
  agreed(comm, [&] {
    check_input(comm, input, op);
    if (options.device == Device::reference) {
      detail::fail(ErrorCode::unsupported, op,
                   ": Device::reference recomputes the statistics of each block instead of "
                   "reading the whole sequence's; use Device::cpu (double runs the reference "
                   "with the statistics read)");
    }
    if (shard_tokens(shard(input.layout, input.tokens, comm.size(), comm.rank())) > 0) {
      detail::expect_not_null(op, "saved.lse", saved.lse);
      if (upstream.update) detail::expect_not_null(op, "saved.output", saved.output);
      if (upstream.entropy) detail::expect_not_null(op, "saved.entropy", saved.entropy);
      detail::expect_not_null(op, "gradients.queries", gradients.queries);
      detail::expect_not_null(op, "gradients.keys", gradients.keys);
      detail::expect_not_null(op, "gradients.values", gradients.values);
    }
    ring = std::make_unique<SdpaRing<T>>(comm, input);
    const auto shard_size = static_cast<std::size_t>(ring->capacity * ring->key_width());
    local_sum.resize(shard_size);
    incoming.resize(shard_size);
    outgoing.resize(shard_size);
    std::int64_t largest_q = 0;
    for (const Segment& q : ring->queries) largest_q = std::max(largest_q, q.count);
    block_queries.resize(static_cast<std::size_t>(ring->q_rows() * largest_q * input.rank));
    block_keys.resize(static_cast<std::size_t>(ring->kv_rows() * ring->capacity * input.rank));
    block_values.resize(
        static_cast<std::size_t>(ring->kv_rows() * ring->capacity * input.value_rank));
  });
  const std::int64_t local_tokens = ring->tokens_of(ring->r);
  const std::int64_t q_rows = ring->q_rows(), kv_rows = ring->kv_rows(), rk = input.rank,
                     rv = input.value_rank;
  if (local_tokens > 0) std::fill_n(gradients.queries, q_rows * local_tokens * rk, T(0));
  double dscale = 0.0;
  RingTimes local;
  std::unique_ptr<Transfer> gradient_transfer;
  const int P = ring->P;
  std::exception_ptr error =
      run_steps(comm, *ring, local, [&](int owner, Transfer* transfer, bool failed) {
        const std::int64_t n = ring->tokens_of(owner);
        const auto count = static_cast<std::size_t>(n * ring->key_width());
        std::exception_ptr step_error;
        if (!failed) {
          const auto start = Clock::now();
          try {
            std::fill_n(local_sum.begin(), count, T(0));
            T* keys_sum = local_sum.data();
            T* values_sum = local_sum.data() + n * kv_rows * rk;
            ring->for_each_block(owner, [&](std::size_t a, std::int64_t q_offset, const Segment& k,
                                            std::int64_t k_offset, const SdpaInput<T>& block) {
              const Segment& q = ring->queries[a];
              const std::int64_t stats = q_offset * q_rows, outs = stats * rv;
              SdpaSaved<T> block_saved;
              block_saved.output = saved.output ? saved.output + outs : nullptr;
              block_saved.lse = saved.lse + stats;
              block_saved.entropy = saved.entropy ? saved.entropy + stats : nullptr;
              UpstreamGradients<T> block_upstream;
              block_upstream.update = upstream.update ? upstream.update + outs : nullptr;
              block_upstream.lse = upstream.lse ? upstream.lse + stats : nullptr;
              block_upstream.entropy = upstream.entropy ? upstream.entropy + stats : nullptr;
              double block_scale = 0.0;
              sdpa_backward(
                  block, block_saved, block_upstream,
                  {block_queries.data(), block_keys.data(), block_values.data(), &block_scale},
                  options);
              add_into(gradients.queries + stats * rk, block_queries.data(),
                       static_cast<std::size_t>(q_rows * q.count * rk));
              add_into(keys_sum + k_offset * kv_rows * rk, block_keys.data(),
                       static_cast<std::size_t>(kv_rows * k.count * rk));
              add_into(values_sum + k_offset * kv_rows * rv, block_values.data(),
                       static_cast<std::size_t>(kv_rows * k.count * rv));
              dscale += block_scale;
              if (transfer) comm.poll(*transfer);
              if (gradient_transfer) comm.poll(*gradient_transfer);
            });
          } catch (...) {
            step_error = std::current_exception();
          }
          local.compute += seconds_since(start);
        }
        // The sum of shard `owner` so far: the rank's own shard starts at this step's blocks.
        if (gradient_transfer) {
          const auto wait_start = Clock::now();
          comm.wait(*gradient_transfer);
          local.exposed_wait += seconds_since(wait_start);
          add_into(incoming.data(), local_sum.data(), count);
          incoming.swap(outgoing);
        } else {
          std::copy_n(local_sum.begin(), count, outgoing.begin());
        }
        // Pass it on to r + 1, which holds this shard at step t + 1 (the P-th pass takes it
        // home), and receive the sum of the shard this rank holds next.
        const int following = (owner - 1 + P) % P;
        gradient_transfer = comm.start_shift(outgoing.data(), ring->shard_bytes(owner),
                                             incoming.data(), ring->shard_bytes(following));
        local.bytes_sent += static_cast<std::int64_t>(ring->shard_bytes(owner));
        if (step_error) std::rethrow_exception(step_error);
      });
  // The last pass: this rank's own shard, summed over every rank.
  if (gradient_transfer) {
    const auto wait_start = Clock::now();
    comm.wait(*gradient_transfer);
    local.exposed_wait += seconds_since(wait_start);
  }
  if (!error && local_tokens > 0) {
    std::copy_n(incoming.begin(), kv_rows * local_tokens * rk, gradients.keys);
    std::copy_n(incoming.begin() + kv_rows * local_tokens * rk, kv_rows * local_tokens * rv,
                gradients.values);
  }
  agree(comm, error);
  comm.allreduce_sum(&dscale, 1);
  if (gradients.scale) *gradients.scale = dscale;
  if (times) *times = local;
}

}  // namespace

template <class T>
void sdpa_attend(Communicator& comm, const SdpaShardInput<T>& input, const SdpaOutput<T>& output,
                 const ExecutionOptions& options, RingTimes* times) {
  ring_sdpa_attend(comm, input, output, options, times);
}

template <class T>
void sdpa_backward(Communicator& comm, const SdpaShardInput<T>& input, const SdpaSaved<T>& saved,
                   const UpstreamGradients<T>& upstream, const SdpaGradientOutput<T>& gradients,
                   const ExecutionOptions& options, RingTimes* times) {
  ring_sdpa_backward(comm, input, saved, upstream, gradients, options, times);
}

#define EMFLOW_DISTRIBUTED_SDPA(T)                                                             \
  template void sdpa_attend<T>(Communicator&, const SdpaShardInput<T>&, const SdpaOutput<T>&,  \
                               const ExecutionOptions&, RingTimes*);                           \
  template void sdpa_backward<T>(Communicator&, const SdpaShardInput<T>&, const SdpaSaved<T>&, \
                                 const UpstreamGradients<T>&, const SdpaGradientOutput<T>&,    \
                                 const ExecutionOptions&, RingTimes*);
EMFLOW_DISTRIBUTED_SDPA(float)
EMFLOW_DISTRIBUTED_SDPA(double)
#undef EMFLOW_DISTRIBUTED_SDPA

}  // namespace emflow::distributed

// Sequence-parallel attention over a ring of ranks (emflow/sequence_parallel.hpp).
//
// Step t of P: rank r holds the key shard of rank (r - t) mod P. It starts passing that shard on
// to r + 1 (and receiving the next from r - 1), computes the partial states of its query
// segments against the held key segments (attend_partial), and merges them into one state per
// query segment (merge_partial), in the order of the steps and, within a step, of the key
// segments. The first partial a query segment gets is written straight into its state, so a
// query segment's state over one block is that block's partial bit for bit. At the end
// finish_partial forms the update, lse and entropy.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.hpp"
#include "emflow/capability.hpp"
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

// Keys of longer segments are taken in pieces of at most this many, so that the transfer in
// flight is polled (and progresses) between pieces.
constexpr std::int64_t kKeyPiece = 4096;

template <class T>
struct State {
  std::vector<T> heads;
  std::vector<Stat<T>> lse, entropy;
  bool started = false;
  PartialOutput<T> out() { return {heads.data(), lse.data(), entropy.data()}; }
  PartialInput<T> in() const { return {heads.data(), lse.data(), entropy.data()}; }
};

// The arguments of a call, and the device of its partial states (route()'s, for the whole
// batch's partial state under `options`; every block's attend_partial runs there).
// `factored`: the layer in the factored form (in.layer then empty), or null for in.layer.
template <class T>
Device check_input(Communicator& comm, const ShardInput<T>& in, const FactoredLayer<T>* factored,
                   const ShardOutput<T>& out, const ExecutionOptions& options) {
  const char* op = "distributed attend";
  if (comm.memory() != Memory::host) {
    detail::fail(ErrorCode::unsupported, op,
                 ": needs a host communicator (the partial states of "
                 "the ring are computed on the host)");
  }
  detail::expect_positive(op, "batch", in.batch);
  detail::expect_positive(op, "tokens", in.tokens);
  detail::expect_positive(op, "dim", in.dim);
  if (factored != nullptr) {
    if (in.layer.relevance != nullptr || in.layer.content != nullptr) {
      detail::fail_argument(op, "layer",
                            "must be empty with a FactoredLayer (the operators come from it)");
    }
    detail::expect_positive(op, "heads", factored->heads);
    detail::expect_positive(op, "rank", factored->rank);
    detail::expect_not_null(op, "query_factor", factored->query_factor);
    detail::expect_not_null(op, "key_factor", factored->key_factor);
    detail::expect_not_null(op, "content_up", factored->content_up);
    detail::expect_not_null(op, "content_down", factored->content_down);
    if (factored->rotary.key_positions != nullptr || factored->rotary.query_positions != nullptr) {
      detail::fail_argument(op, "rotary.key_positions",
                            "and query_positions must be null: the ring turns each token at its "
                            "position in the sequence (the shard's)");
    }
  } else {
    detail::expect_positive(op, "heads", in.layer.heads);
    detail::expect_not_null(op, "relevance", in.layer.relevance);
    detail::expect_not_null(op, "content", in.layer.content);
  }
  if (in.queries != nullptr || in.query_tokens != 0 || in.query_lengths != nullptr ||
      in.key_position != 0 || in.query_position != kAlignToEnd || in.query_positions != nullptr) {
    detail::fail_argument(op, "queries",
                          "and query_tokens, query_lengths, key_position, query_position and "
                          "query_positions must keep their defaults: the ring's queries are the "
                          "shard's own tokens");
  }
  if (!std::isfinite(in.beta)) detail::fail_argument(op, "beta", "must be finite, got ", in.beta);
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
  const std::int64_t local = shard_tokens(shard(in.layout, in.tokens, comm.size(), comm.rank()));
  if (local > 0) {
    detail::expect_not_null(op, "cloud", in.cloud);
    detail::expect_not_null(op, "update", out.update);
  }
  // The whole batch's partial state: the shapes that bound every block's.
  const auto& whole = static_cast<const AttentionInput<T>&>(in);
  Problem problem = factored != nullptr ? describe(whole, *factored, PartialOutput<T>{}, options)
                                        : describe(whole, PartialOutput<T>{}, options);
  problem.lse = problem.entropy = true;
  return require_route(problem, options.device, op).device;
}

// One call's buffers and state; made (and so allocated) before the first transfer.
template <class T>
struct Ring {
  Ring(Communicator& comm, const ShardInput<T>& input, const FactoredLayer<T>* layer)
      : in(input), factored(layer) {
    P = comm.size();
    r = comm.rank();
    B = in.batch;
    H = factored != nullptr ? factored->heads : in.layer.heads;
    d = in.dim;
    queries = shard(in.layout, in.tokens, P, r);
    std::int64_t capacity = 0;
    for (int o = 0; o < P; ++o) {
      capacity = std::max(capacity, shard_tokens(shard(in.layout, in.tokens, P, o)));
    }
    held.resize(static_cast<std::size_t>(capacity * B * d));
    next.resize(held.size());
    std::copy(in.cloud, in.cloud + shard_tokens(queries) * B * d, held.begin());
    states.resize(queries.size());
    std::int64_t scratch_rows = 0;
    for (std::size_t a = 0; a < queries.size(); ++a) {
      const std::size_t rows = static_cast<std::size_t>(B * H * queries[a].count);
      states[a].heads.resize(rows * static_cast<std::size_t>(d));
      states[a].lse.assign(rows, -std::numeric_limits<Stat<T>>::infinity());
      states[a].entropy.assign(rows, Stat<T>(0));
      scratch_rows = std::max(scratch_rows, B * H * queries[a].count);
    }
    part.heads.resize(static_cast<std::size_t>(scratch_rows * d));
    part.lse.resize(static_cast<std::size_t>(scratch_rows));
    part.entropy.resize(static_cast<std::size_t>(scratch_rows));
    if (in.key_lengths) lengths.assign(in.key_lengths, in.key_lengths + B);
  }

  std::size_t shard_bytes(int owner) const {
    return static_cast<std::size_t>(shard_tokens(shard(in.layout, in.tokens, P, owner)) * B * d) *
           sizeof(T);
  }

  // The queries of this rank against the key shard of `owner`, held in `held`.
  void compute(Communicator& comm, int owner, Transfer* transfer, const ExecutionOptions& options) {
    const std::vector<Segment> keys = shard(in.layout, in.tokens, P, owner);
    const std::vector<std::int64_t>* lengths_or_null = in.key_lengths ? &lengths : nullptr;
    const T* query_rows = in.cloud;
    for (std::size_t a = 0; a < queries.size(); ++a) {
      const Segment& q = queries[a];
      const PartialShape shape{B, H, q.count, d};
      std::vector<std::int64_t> query_lengths;
      if (in.key_lengths) query_lengths = local_lengths(lengths, q);
      const T* key_rows = held.data();
      for (const Segment& whole : keys) {
        for (std::int64_t first = 0; first < whole.count; first += kKeyPiece) {
          const Segment k{whole.position + first, std::min(kKeyPiece, whole.count - first)};
          if (!any_visible(in.mask, q, k, lengths_or_null)) continue;
          // A piece of a segment is contiguous within each cloud only: with several clouds its
          // rows are copied out into one (B, k.count, d) block.
          std::vector<T> piece;
          const T* piece_rows = key_rows + first * d;
          if (k.count != whole.count && B > 1) {
            piece.resize(static_cast<std::size_t>(B * k.count * d));
            for (std::int64_t b = 0; b < B; ++b) {
              std::copy(key_rows + (b * whole.count + first) * d,
                        key_rows + (b * whole.count + first + k.count) * d,
                        piece.begin() + b * k.count * d);
            }
            piece_rows = piece.data();
          }
          std::vector<std::int64_t> key_lengths;
          if (in.key_lengths) key_lengths = local_lengths(lengths, k);
          AttentionInput<T> block;
          block.cloud = piece_rows;
          block.batch = B;
          block.tokens = k.count;
          block.dim = d;
          block.layer = in.layer;
          block.beta = in.beta;
          block.mask = in.mask;
          block.key_lengths = in.key_lengths ? key_lengths.data() : nullptr;
          block.queries = query_rows;
          block.query_tokens = q.count;
          block.query_lengths = in.key_lengths ? query_lengths.data() : nullptr;
          block.key_position = k.position;
          block.query_position = q.position;
          if (factored != nullptr) block.layer = {};
          State<T>& state = states[a];
          const PartialOutput<T> into = state.started ? part.out() : state.out();
          if (factored != nullptr) {
            // The block's keys turned at key_position + j, its queries at query_position + i:
            // their positions in the whole sequence.
            attend_partial(block, *factored, into, options);
          } else {
            attend_partial(block, into, options);
          }
          if (state.started) merge_partial(shape, part.in(), state.out());
          state.started = true;
          if (transfer) comm.poll(*transfer);
        }
        key_rows += B * whole.count * d;
      }
      query_rows += B * q.count * d;
    }
  }

  void finish(const ShardOutput<T>& out) const {
    T* update = out.update;
    Stat<T>* lse = out.lse;
    Stat<T>* entropy = out.entropy;
    for (std::size_t a = 0; a < queries.size(); ++a) {
      const PartialShape shape{B, H, queries[a].count, d};
      AttentionOutput<T> result;
      result.update = update;
      result.lse = lse;
      result.entropy = entropy;
      finish_partial(shape, states[a].in(),
                     factored != nullptr ? factored->offset : in.layer.offset, result);
      update += B * queries[a].count * d;
      if (lse) lse += B * H * queries[a].count;
      if (entropy) entropy += B * H * queries[a].count;
    }
  }

  const ShardInput<T>& in;
  const FactoredLayer<T>* factored = nullptr;
  int P = 1, r = 0;
  std::int64_t B = 1, H = 1, d = 1;
  std::vector<Segment> queries;
  std::vector<T> held, next;
  std::vector<State<T>> states;
  State<T> part;
  std::vector<std::int64_t> lengths;
};

template <class T>
void ring_attend(Communicator& comm, const ShardInput<T>& input, const FactoredLayer<T>* factored,
                 const ShardOutput<T>& output, const ExecutionOptions& options, RingTimes* times) {
  // Every block on the device route() named for the whole batch.
  ExecutionOptions host = options;
  std::unique_ptr<Ring<T>> ring;
  agreed(comm, [&] {
    host.device = check_input(comm, input, factored, output, options);
    check_threads(options.threads, "sequence_parallel::attend");
    ring = std::make_unique<Ring<T>>(comm, input, factored);
  });
  RingTimes local;
  std::exception_ptr error =
      run_steps(comm, *ring, local, [&](int owner, Transfer* transfer, bool failed) {
        if (failed) return;
        const auto compute_start = Clock::now();
        ring->compute(comm, owner, transfer, host);
        local.compute += seconds_since(compute_start);
      });
  if (!error) {
    try {
      ring->finish(output);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(comm, error);
  if (times) *times = local;
}

}  // namespace

template <class T>
void attend(Communicator& comm, const ShardInput<T>& input, const ShardOutput<T>& output,
            const ExecutionOptions& options, RingTimes* times) {
  ring_attend<T>(comm, input, nullptr, output, options, times);
}

template <class T>
void attend(Communicator& comm, const ShardInput<T>& input, const FactoredLayer<T>& layer,
            const ShardOutput<T>& output, const ExecutionOptions& options, RingTimes* times) {
  ring_attend(comm, input, &layer, output, options, times);
}

#define EMFLOW_DISTRIBUTED_ATTEND(T)                                                    \
  template void attend<T>(Communicator&, const ShardInput<T>&, const ShardOutput<T>&,   \
                          const ExecutionOptions&, RingTimes*);                         \
  template void attend<T>(Communicator&, const ShardInput<T>&, const FactoredLayer<T>&, \
                          const ShardOutput<T>&, const ExecutionOptions&, RingTimes*);
EMFLOW_DISTRIBUTED_ATTEND(float)
EMFLOW_DISTRIBUTED_ATTEND(double)
#undef EMFLOW_DISTRIBUTED_ATTEND

}  // namespace emflow::distributed

// The flow across ranks (emflow/distributed_flow.hpp): the run of a part of every cloud
// (flow::PartRun, emflow/flow_parts.hpp), this rank's tokens, with the three operations that
// need the other ranks.
//
// * attend: the ring of sequence_parallel.hpp on this rank's tokens (contiguous shards).
// * sum_over_parts: the mean entropies, one allreduce_sum of B doubles per evaluated record,
//   which adds the ranks' sums in rank order.
// * observe: every observable is a sum, minimum or count over the pairs (i, j) of a cloud, so a
//   rank needs every token. Per record, for B clouds of N tokens in R^d on P ranks:
//   - the clouds meet on every rank: a gather of each rank's B N d / P values to rank 0 (which
//     puts them in place and keeps them for the trajectory) and a broadcast of the B N d values
//     back: (P - 1) / P * B N d values into rank 0, B N d out to every other rank, B N d memory
//     on every rank (as the single-process run, which holds the whole state);
//   - each rank sums the pairs (i, j > i) of the rows i of its two runs of a zigzag split (runs r
//     and 2P - 1 - r of 2P), about N^2 / (2P) pairs per cloud on every rank: O(B N^2 d / P)
//     (flow::pair_sums);
//   - the partial sums (4 doubles and 1 count per cloud) and the cluster forests (N integers
//     per cloud) are gathered on rank 0, B (5 + N) 8-byte values from each rank, which adds the
//     sums in rank order (a fixed order: the same bits in every run) and merges the forests
//     (exact, O(P B N) near-constant-time joins; flow::observables_from_parts), then
//     broadcasts the B finished observables.
//   Which rows a rank sums decides only the order of additions; integer counts are exact.
#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "check.hpp"
#include "emflow/distributed_flow.hpp"
#include "emflow/flow_parts.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::distributed {

namespace {

static_assert(std::is_trivially_copyable_v<flow::Observables>);

// The sums of one cloud's part as they travel: min, sum, energy, diameter^2, then the
// clustered count and the forest.
constexpr std::int64_t kSums = 4;

template <class T>
class ShardOps final : public flow::PartOperations<T> {
 public:
  ShardOps(Communicator& comm, const ExecutionOptions& options, std::int64_t batch,
           std::int64_t tokens, std::int64_t dim, const std::vector<double>& betas,
           double cluster_eps, Tensor<T>* whole)
      : comm_(comm),
        options_(options),
        batch_(batch),
        tokens_(tokens),
        dim_(dim),
        betas_(betas),
        cluster_eps_(cluster_eps),
        whole_(whole) {
    const int P = comm.size();
    for (int o = 0; o < P; ++o) {
      shards_.push_back(shard(Layout::contiguous, tokens, P, o));
      counts_.push_back(static_cast<std::size_t>(batch * shard_tokens(shards_.back()) * dim) *
                        sizeof(T));
    }
    for (const Segment& s : shard(Layout::zigzag, tokens, P, comm.rank())) {
      rows_.push_back({s.position, s.count});
    }
    clouds_.resize(static_cast<std::size_t>(batch * tokens * dim));
    if (comm.rank() == 0) received_.resize(clouds_.size());
    part_values_ = static_cast<std::size_t>(batch * (kSums + 1 + tokens));
    parts_.resize(part_values_ * (comm.rank() == 0 ? static_cast<std::size_t>(P) + 1 : 1));
  }

  void attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) override {
    ShardInput<T> s;
    s.cloud = in.cloud;
    s.batch = in.batch;
    s.tokens = tokens_;
    s.dim = in.dim;
    s.layer = in.layer;
    s.beta = in.beta;
    s.layout = Layout::contiguous;
    distributed::attend(comm_, s, {out.update, out.lse, out.entropy}, options_);
  }

  void sum_over_parts(double* values, std::int64_t count) override {
    comm_.allreduce_sum(values, count);
  }

  void observe(const T* x, std::int64_t r, flow::Observables* out) override {
    const std::int64_t B = batch_, N = tokens_;
    gather_clouds(x, r);

    // This rank's part of every cloud: [sums (kSums doubles), clustered, forest (N)] per cloud,
    // as 8-byte values (the doubles' bits kept).
    const std::vector<flow::PairSums> sums =
        flow::pair_sums(clouds_.data(), B, N, dim_, betas_, cluster_eps_, rows_);
    for (std::int64_t b = 0; b < B; ++b) {
      const flow::PairSums& part = sums[static_cast<std::size_t>(b)];
      std::int64_t* to = parts_.data() + b * (kSums + 1 + N);
      const double values[kSums] = {part.min_inner, part.sum_inner, part.energy, part.diameter_sq};
      std::memcpy(to, values, sizeof values);
      to[kSums] = part.clustered;
      std::copy(part.forest.begin(), part.forest.end(), to + kSums + 1);
    }
    const std::size_t bytes = part_values_ * sizeof(std::int64_t);
    comm_.gather(parts_.data(), parts_.data() + part_values_,
                 std::vector<std::size_t>(static_cast<std::size_t>(comm_.size()), bytes), 0);
    if (comm_.rank() == 0) {
      for (std::int64_t b = 0; b < B; ++b) out[b] = combine(b);
    }
    comm_.broadcast(out, static_cast<std::size_t>(B) * sizeof(flow::Observables), 0);
  }

 private:
  // The whole clouds (B, N, d) into clouds_ on every rank, and into record r of the whole
  // trajectory on rank 0.
  void gather_clouds(const T* x, std::int64_t r) {
    const std::int64_t B = batch_, N = tokens_, d = dim_;
    comm_.gather(x, received_.data(), counts_, 0);
    std::vector<T> whole;
    T* at = nullptr;
    if (comm_.rank() == 0) {
      at = whole_->data() + r * B * N * d;
      const T* part = received_.data();
      for (std::size_t o = 0; o < shards_.size(); ++o) {
        scatter_shard(part, B, N, d, shards_[o], at);
        part += counts_[o] / sizeof(T);
      }
    } else {
      whole.resize(clouds_.size());
      at = whole.data();
    }
    comm_.broadcast(at, clouds_.size() * sizeof(T), 0);
    std::copy(at, at + clouds_.size(), clouds_.begin());
  }

  // Cloud b's observables from every rank's part, added in rank order.
  flow::Observables combine(std::int64_t b) const {
    const std::int64_t N = tokens_;
    std::vector<flow::PairSums> parts(static_cast<std::size_t>(comm_.size()));
    std::vector<const flow::PairSums*> order;
    for (int o = 0; o < comm_.size(); ++o) {
      const std::int64_t* from =
          parts_.data() + part_values_ * (static_cast<std::size_t>(o) + 1) + b * (kSums + 1 + N);
      double values[kSums];
      std::memcpy(values, from, sizeof values);
      flow::PairSums& part = parts[static_cast<std::size_t>(o)];
      part.min_inner = values[0];
      part.sum_inner = values[1];
      part.energy = values[2];
      part.diameter_sq = values[3];
      part.clustered = from[kSums];
      part.forest.assign(from + kSums + 1, from + kSums + 1 + N);
      order.push_back(&part);
    }
    return flow::observables_from_parts(order, N, betas_[static_cast<std::size_t>(b)]);
  }

  Communicator& comm_;
  ExecutionOptions options_;
  std::int64_t batch_, tokens_, dim_;
  const std::vector<double>& betas_;  // one per cloud
  double cluster_eps_;
  Tensor<T>* whole_;  // rank 0: the whole trajectory
  std::vector<std::vector<Segment>> shards_;
  std::vector<std::size_t> counts_;
  std::vector<flow::RowRun> rows_;
  std::vector<double> clouds_;
  std::vector<T> received_;
  std::size_t part_values_ = 0;
  // This rank's part first; on rank 0 every rank's after it, in rank order.
  std::vector<std::int64_t> parts_;
};

// A fingerprint of what must be the same on every rank (sizes, settings, betas, operators):
// FNV-1a over their bytes.
struct Fingerprint {
  std::uint64_t hash = 14695981039346656037ull;
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  }
  template <class V>
  void add(const V& value) {
    add(&value, sizeof value);
  }
  template <class V>
  void add(const std::vector<V>& values) {
    add(values.size());
    add(values.data(), values.size() * sizeof(V));
  }
};

template <class T>
std::int64_t fingerprint(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                         const std::vector<double>& betas,
                         const std::vector<flow::FlowLayer<T>>& layers,
                         const flow::FlowSettings& s) {
  Fingerprint f;
  for (const std::int64_t v : {batch, tokens, dim, s.layers, s.record_every}) f.add(v);
  for (const int v : {static_cast<int>(s.norm), static_cast<int>(s.integrator),
                      static_cast<int>(s.pre_norm), static_cast<int>(s.unnormalized)}) {
    f.add(v);
  }
  for (const double v : {s.time, s.dt, s.cluster_eps, s.norm_eps}) f.add(v);
  f.add(betas);
  for (const auto& layer : layers) {
    f.add(layer.heads);
    for (const auto* part : {&layer.relevance, &layer.content, &layer.key_bias, &layer.offset,
                             &layer.norm_gain, &layer.norm_bias}) {
      f.add(*part);
    }
  }
  return static_cast<std::int64_t>(f.hash >> 1);
}

}  // namespace

template <class T>
flow::FlowResult<T> run_flow(Communicator& comm, const T* shard_rows, std::int64_t batch,
                             std::int64_t tokens, std::int64_t dim,
                             const std::vector<double>& betas_in,
                             const std::vector<flow::FlowLayer<T>>& layers,
                             const flow::FlowSettings& settings, const ExecutionOptions& options,
                             const flow::Progress& progress) {
  const char* op = "distributed run_flow";
  const int P = comm.size();
  ExecutionOptions host = options;
  std::optional<flow::PartRun<T>> run;
  Tensor<T> whole;
  std::optional<ShardOps<T>> ops;
  const std::int64_t local =
      shard_tokens(shard(Layout::contiguous, std::max<std::int64_t>(tokens, 0), P, comm.rank()));
  // Every rank's part must fit the same run: a rank with other sizes or settings would wait for
  // transfers its partners never start. One minimum over the fingerprint and its negation tells.
  std::int64_t mark[2] = {fingerprint(batch, tokens, dim, betas_in, layers, settings), 0};
  mark[1] = -mark[0];
  comm.allreduce_min(mark, 2);
  agreed(comm, [&] {
    if (comm.memory() != Memory::host) {
      detail::fail(ErrorCode::unsupported, op,
                   ": needs a host communicator (the ring runs on the host)");
    }
    if (mark[0] != -mark[1]) {
      detail::fail_argument(op, "settings",
                            "differ between the ranks (sizes, betas, layers or settings must be "
                            "the same on every rank)");
    }
    check_threads(options.threads, op);
    if (host.device == Device::automatic) host.device = Device::cpu;
    if (host.device != Device::cpu && host.device != Device::reference) {
      detail::fail(ErrorCode::unsupported, op, ": runs on the host (device cpu or reference), got ",
                   to_string(options.device));
    }
    if (tokens < P) {
      detail::fail_argument(op, "tokens", "must be at least the number of ranks (", P, "), got ",
                            tokens);
    }
    if (shard_rows == nullptr) detail::fail_argument(op, "shard", "is null");
    // The arguments of the run (as run_flow checks them), the result of this rank's tokens.
    run.emplace(Shape{batch, tokens, dim}, local, betas_in, layers, settings);
    if (comm.rank() == 0) whole = Tensor<T>(Shape{run->records(), batch, tokens, dim});
    ops.emplace(comm, host, batch, tokens, dim, run->betas(), settings.cluster_eps, &whole);
  });
  if (!run || !ops) detail::fail(ErrorCode::internal, op, ": the run was not prepared");
  flow::FlowResult<T> result = run->run(*ops, shard_rows, progress);
  if (comm.rank() == 0) result.trajectory = std::move(whole);
  return result;
}

#define EMFLOW_DISTRIBUTED_FLOW(T)                                        \
  template flow::FlowResult<T> run_flow<T>(                               \
      Communicator&, const T*, std::int64_t, std::int64_t, std::int64_t,  \
      const std::vector<double>&, const std::vector<flow::FlowLayer<T>>&, \
      const flow::FlowSettings&, const ExecutionOptions&, const flow::Progress&);
EMFLOW_DISTRIBUTED_FLOW(float)
EMFLOW_DISTRIBUTED_FLOW(double)
#undef EMFLOW_DISTRIBUTED_FLOW

}  // namespace emflow::distributed

// The ring of sequence-parallel attention under mpirun (float32, one cloud, one head):
//
//   mpirun -np P emflow_bench_mpi_ring [N [d [repeats [mask [op]]]]]
//                                                      (defaults 32768 64 3 none attend)
//
// op: attend (the update, distributed::attend) or backward (the layer's gradients,
// distributed::attend_backward: the SDPA ring's forward pass recomputed, then its backward pass
// with each shard's dK and dV passed on behind its keys; every gradient asked for).
// Each rank holds N / P tokens and runs the op with one thread (OMP_NUM_THREADS=1),
// once with the ring's transfers and once with them removed (a communicator whose shifts move
// nothing: the same computation on stale keys). Rank 0 prints, per variant, the best wall time
// over the repeats (the slowest rank's), the computing time, the wait that the computation did
// not hide, the CPU time of the slowest rank (which the machine's load changes much less than
// the wall time) and the bytes each rank sent. Compare P = 2
// against P = 1 for the speed-up; the ratio of the two variants is the cost of the transfers.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <string>
#include <vector>

#include "emflow/backward.hpp"
#include "emflow/distributed.hpp"
#include "emflow/sequence_parallel.hpp"
#include "tools/problem.hpp"

namespace {

using emflow::distributed::Communicator;

// Every collective as `inner`; shifts start and finish at once without moving a byte.
class NoTransfers final : public Communicator {
 public:
  explicit NoTransfers(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  emflow::distributed::Memory memory() const override { return inner_.memory(); }
  std::unique_ptr<emflow::distributed::Transfer> start_shift(const void*, std::size_t, void*,
                                                             std::size_t) override {
    return std::make_unique<emflow::distributed::Transfer>();
  }
  void wait(emflow::distributed::Transfer&) override {}
  void allreduce_sum(double* v, std::int64_t n) override { inner_.allreduce_sum(v, n); }
  void allreduce_sum(std::int64_t* v, std::int64_t n) override { inner_.allreduce_sum(v, n); }
  void allreduce_min(std::int64_t* v, std::int64_t n) override { inner_.allreduce_min(v, n); }
  void broadcast(void* d, std::size_t b, int root) override { inner_.broadcast(d, b, root); }
  void gather(const void* s, void* r, const std::vector<std::size_t>& c, int root) override {
    inner_.gather(s, r, c, root);
  }

 private:
  Communicator& inner_;
};

struct Timing {
  double wall = 1e300, compute = 0, exposed = 0, cpu = 0;
  std::int64_t bytes = 0;
};

// Argument `index` as an integer in [1, max] into `value` (unchanged when absent); false with a
// message when it is not one, rather than atoll's 0 for "32k".
bool positive_argument(int argc, char** argv, int index, const char* name, std::int64_t max,
                       std::int64_t& value) {
  if (argc <= index) return true;
  const char* text = argv[index];
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || parsed <= 0 || parsed > max) {
    std::fprintf(stderr, "emflow_bench_mpi_ring: %s must be an integer in [1, %lld], got '%s'\n",
                 name, static_cast<long long>(max), text);
    return false;
  }
  value = parsed;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  auto world = emflow::distributed::world(&argc, &argv);
  Communicator& comm = *world;
  constexpr std::int64_t kLargest = std::numeric_limits<std::int64_t>::max();
  std::int64_t N = 32768, d = 64, repeat_count = 3;
  if (!positive_argument(argc, argv, 1, "N", kLargest, N) ||
      !positive_argument(argc, argv, 2, "d", kLargest, d) ||
      !positive_argument(argc, argv, 3, "repeats", std::numeric_limits<int>::max(), repeat_count)) {
    return 2;
  }
  const int repeats = static_cast<int>(repeat_count);
  const emflow::Mask mask = emflow::parse_mask(argc > 4 ? argv[4] : "none");
  const std::string op = argc > 5 ? argv[5] : "attend";
  if (op != "attend" && op != "backward") {
    std::fprintf(stderr, "emflow_bench_mpi_ring: op must be attend or backward, got '%s'\n",
                 op.c_str());
    return 2;
  }
  const bool backward = op == "backward";
  const emflow::tools::BenchProblem problem(1, N, d, 1, mask);
  const emflow::distributed::Layout layout = emflow::distributed::default_layout(mask);
  const auto segments = emflow::distributed::shard(layout, N, comm.size(), comm.rank());
  const std::vector<float> cloud =
      emflow::distributed::gather_shard(problem.cloud.data(), 1, N, d, segments);
  std::vector<float> update(cloud.size());
  // The operators' gradients of the backward pass; its upstream gradient dDelta is the shard's
  // own rows (any values do).
  std::vector<float> dM(static_cast<std::size_t>(d * d)), dF(dM.size());
  double dbeta = 0.0;
  emflow::distributed::ShardInput<float> in;
  in.cloud = cloud.data();
  in.tokens = N;
  in.dim = d;
  in.layer = problem.input.layer;
  in.beta = problem.input.beta;
  in.mask = mask;
  in.layout = layout;

  // The two variants alternate, repeat by repeat, so that a change in the machine's load
  // reaches both alike; each keeps its best repeat.
  NoTransfers silent(comm);
  Communicator* variants[2] = {&comm, &silent};
  Timing best[2];
  for (int k = 0; k < repeats; ++k) {
    for (int v = 0; v < 2; ++v) {
      emflow::distributed::RingTimes times;
      std::int64_t go = 1;
      comm.allreduce_sum(&go, 1);  // start together
      const auto start = std::chrono::steady_clock::now();
      const std::clock_t cpu_start = std::clock();
      if (backward) {
        emflow::LayerGradientOutput<float> gradients;
        gradients.cloud = update.data();
        gradients.relevance = dM.data();
        gradients.content = dF.data();
        gradients.beta = &dbeta;
        emflow::distributed::attend_backward(*variants[v], in, {cloud.data()}, gradients,
                                             {emflow::Device::cpu, 1}, &times);
      } else {
        emflow::distributed::attend(*variants[v], in, {update.data(), nullptr, nullptr},
                                    {emflow::Device::cpu, 1}, &times);
      }
      const double mine[4] = {
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
          times.compute, times.exposed_wait,
          static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC};
      // The slowest rank decides: the maximum, through a sum of one-hot vectors.
      std::vector<double> all(static_cast<std::size_t>(4 * comm.size()), 0.0);
      std::copy(mine, mine + 4, all.begin() + 4 * comm.rank());
      comm.allreduce_sum(all.data(), static_cast<std::int64_t>(all.size()));
      double slowest[4] = {0, 0, 0, 0};
      for (int r = 0; r < comm.size(); ++r) {
        for (int j = 0; j < 4; ++j) slowest[j] = std::max(slowest[j], all[4 * r + j]);
      }
      if (slowest[0] < best[v].wall) {
        best[v] = {slowest[0], slowest[1], slowest[2], slowest[3], times.bytes_sent};
      }
    }
  }
  if (comm.rank() == 0) {
    for (int v = 0; v < 2; ++v) {
      std::printf(
          "P=%d N=%lld d=%lld mask=%s op=%s transfers=%s: wall %.3f s, compute %.3f s, "
          "exposed wait %.4f s, CPU time %.3f s (slowest rank), %lld bytes sent per rank, "
          "%.2f GFLOP/s per rank\n",
          comm.size(), static_cast<long long>(N), static_cast<long long>(d),
          emflow::to_string(mask).c_str(), op.c_str(), v == 0 ? "on" : "off", best[v].wall,
          best[v].compute, best[v].exposed, best[v].cpu, static_cast<long long>(best[v].bytes),
          // The backward pass: its forward recomputed (4 N^2 d) and its five products (10 N^2 d).
          (backward ? 14.0 : 4.0) * N * N * d / best[v].wall / comm.size() * 1e-9);
    }
  }
  return 0;
}

// emflow attend --distributed: the update of one layer with the tokens spread over the ranks of
// an MPI job (emflow/sequence_parallel.hpp). Every rank checks the arguments and reads the
// operators and its own rows of --x; every step that can fail on one rank is agreed on, so a bad
// input or a failed allocation on any rank is one error on every rank, reported once by rank 0.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common.hpp"
#include "distributed_commands.hpp"
#include "emflow/distributed.hpp"
#include "emflow/finite.hpp"
#include "emflow/io.hpp"
#include "emflow/sequence_parallel.hpp"
#include "job.hpp"

namespace emflow::cli {
namespace {

using distributed::Segment;

template <class T>
void run(const AttendFiles& a, distributed::Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  OutputFiles outputs;
  Mask mask;
  ExecutionOptions options;
  distributed::Layout layout = distributed::Layout::contiguous;
  Shape shape;
  std::vector<T> cloud;
  const LayerFiles layer_files{a.relevance, a.content, a.key_bias, a.offset};
  LayerArrays<T> layer;
  Tensor<std::int64_t> key_lengths;
  std::int64_t batch = 1, tokens = 0, dim = 0;
  std::vector<Segment> segments;
  const Dtype dtype = sizeof(T) == 4 ? Dtype::float32 : Dtype::float64;
  Tensor<T> update, lse, entropy;  // the whole outputs, on rank 0
  std::vector<T> local_update, local_lse, local_entropy;
  const bool stats = !a.lse.empty() || !a.entropy.empty();

  distributed::agreed(comm, [&] {
    if (!a.weights.empty()) {
      fail_option("--weights",
                  "is not available with --distributed (the weights of a query "
                  "against every key would meet on one rank)");
    }
    mask = parse_mask(a.mask, "--mask");
    if (!std::isfinite(a.beta)) fail_option("--beta", "must be finite, got ", a.beta);
    options = execution_options(a.device, a.threads);
    if (options.device == Device::automatic) options.device = Device::cpu;
    if (options.device != Device::cpu && options.device != Device::reference) {
      fail_option("--device", "with --distributed must be cpu or reference, got ", a.device);
    }
    if (r == 0) {
      outputs.declare("--out", a.update);
      if (!a.lse.empty()) outputs.declare("--lse", a.lse);
      if (!a.entropy.empty()) outputs.declare("--entropy", a.entropy);
      outputs.declare_input("--x", a.cloud);
      layer_files.declare_inputs(outputs);
      outputs.declare_input("--key-lengths", a.key_lengths);
    }
    layout = distributed::default_layout(mask);
    cloud = naming_option(
        "--x", [&] { return distributed::read_shard<T>(a.cloud, layout, P, r, &shape); });
    batch = shape.size() == 3 ? shape[0] : 1;
    tokens = shape[shape.size() - 2];
    dim = shape[shape.size() - 1];
    segments = distributed::shard(layout, tokens, P, r);
    layer = read_layer<T>(layer_files, dtype, dim);
    if (!a.key_lengths.empty()) {
      key_lengths = read_lengths("--key-lengths", a.key_lengths, batch, tokens, "(N from --x)");
    }
    if (a.check_finite) {
      require_finite_shard(cloud, segments, shape, batch, tokens, dim, "--x '" + a.cloud + "'");
      require_finite_layer(layer, layer_files);
    }
    const std::int64_t local = distributed::shard_tokens(segments);
    local_update.resize(static_cast<std::size_t>(batch * local * dim));
    if (stats) {
      local_lse.resize(static_cast<std::size_t>(batch * layer.heads * local));
      local_entropy.resize(local_lse.size());
    }
    if (r == 0) {
      update = allocate_output<T>("--out", shape);
      if (stats) {
        lse = allocate_output<T>("--lse", Shape{batch, layer.heads, tokens});
        entropy = allocate_output<T>("--entropy", Shape{batch, layer.heads, tokens});
      }
    }
  });

  distributed::ShardInput<T> in;
  in.cloud = cloud.data();
  in.batch = batch;
  in.tokens = tokens;
  in.dim = dim;
  in.layer = layer.operators();
  in.beta = a.beta;
  in.mask = mask;
  in.key_lengths = key_lengths.size() > 0 ? key_lengths.data() : nullptr;
  in.layout = layout;
  distributed::attend(comm, in,
                      {local_update.data(), stats ? local_lse.data() : nullptr,
                       stats ? local_entropy.data() : nullptr},
                      options);

  // Rank 0 gathers every shard (in rank order) and puts its rows in place.
  const auto collect = [&](const std::vector<T>& local, std::int64_t rows_per_token,
                           std::int64_t width, T* whole) {
    std::vector<std::size_t> counts;
    std::vector<std::vector<Segment>> shards;
    for (int o = 0; o < P; ++o) {
      shards.push_back(distributed::shard(layout, tokens, P, o));
      counts.push_back(static_cast<std::size_t>(rows_per_token * width *
                                                distributed::shard_tokens(shards.back())) *
                       sizeof(T));
    }
    std::vector<T> all;
    if (r == 0) {
      all = distributed::agreed(comm, [&] {
        return std::vector<T>(static_cast<std::size_t>(rows_per_token * tokens * width));
      });
    } else {
      distributed::agree(comm, nullptr);
    }
    comm.gather(local.data(), all.data(), counts, 0);
    if (r != 0) return;
    const T* part = all.data();
    for (int o = 0; o < P; ++o) {
      distributed::scatter_shard(part, rows_per_token, tokens, width, shards[o], whole);
      part += counts[static_cast<std::size_t>(o)] / sizeof(T);
    }
  };
  collect(local_update, batch, dim, update.data());
  if (stats) {
    collect(local_lse, batch * layer.heads, 1, lse.data());
    collect(local_entropy, batch * layer.heads, 1, entropy.data());
  }
  distributed::agreed(comm, [&] {
    if (r != 0) return;
    outputs.stage_npy(a.update, update);
    if (!a.lse.empty()) outputs.stage_npy(a.lse, lse);
    if (!a.entropy.empty()) outputs.stage_npy(a.entropy, entropy);
    outputs.commit();
  });
}

}  // namespace

void run_attend_distributed(const AttendFiles& files) {
  distributed::Communicator& comm = job();
  const Dtype dtype = distributed::agreed(comm, [&] { return float_dtype("--x", files.cloud); });
  if (dtype == Dtype::float32) {
    run<float>(files, comm);
  } else {
    run<double>(files, comm);
  }
}

}  // namespace emflow::cli

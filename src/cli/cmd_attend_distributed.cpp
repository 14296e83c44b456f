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
  Tensor<T> relevance, content, key_bias, offset;
  Tensor<std::int64_t> key_lengths;
  std::int64_t batch = 1, tokens = 0, dim = 0, heads = 1;
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
      outputs.declare_input("--m", a.relevance);
      outputs.declare_input("--f", a.content);
      outputs.declare_input("--key-bias", a.key_bias);
      outputs.declare_input("--offset", a.offset);
      outputs.declare_input("--key-lengths", a.key_lengths);
    }
    layout = distributed::default_layout(mask);
    cloud = naming_option(
        "--x", [&] { return distributed::read_shard<T>(a.cloud, layout, P, r, &shape); });
    batch = shape.size() == 3 ? shape[0] : 1;
    tokens = shape[shape.size() - 2];
    dim = shape[shape.size() - 1];
    segments = distributed::shard(layout, tokens, P, r);
    const std::string from_x = "(d = " + std::to_string(dim) + " from --x)";
    relevance = read_float_input<T>("--m", a.relevance, dtype, "--x", 2, 3);
    heads = relevance.rank() == 3 ? relevance.extent(0) : 1;
    if (relevance.extent(relevance.rank() - 1) != dim ||
        relevance.extent(relevance.rank() - 2) != dim) {
      fail_option("--m", "'", a.relevance, "' has shape ", to_string(relevance.shape()),
                  ", expected (", dim, ", ", dim, ") or (H, ", dim, ", ", dim, ") ", from_x);
    }
    content = read_float_input<T>("--f", a.content, dtype, "--x", 2, 3);
    expect_shape("--f", a.content, content.shape(), relevance.shape(), "(the shape of --m)");
    if (!a.key_bias.empty()) {
      key_bias = read_float_input<T>("--key-bias", a.key_bias, dtype, "--x", 1, 2);
      if (!(heads == 1 && key_bias.shape() == Shape{dim})) {
        expect_shape("--key-bias", a.key_bias, key_bias.shape(), {heads, dim},
                     "(H from --m, d from --x)");
      }
    }
    if (!a.offset.empty()) {
      offset = read_float_input<T>("--offset", a.offset, dtype, "--x", 1, 1);
      expect_shape("--offset", a.offset, offset.shape(), {dim}, from_x);
    }
    if (!a.key_lengths.empty()) {
      key_lengths = read_integer_input("--key-lengths", a.key_lengths, 1, 1);
      expect_shape("--key-lengths", a.key_lengths, key_lengths.shape(), {batch},
                   "(one length per cloud of --x)");
      for (std::int64_t b = 0; b < batch; ++b) {
        if (key_lengths[b] < 0 || key_lengths[b] > tokens) {
          fail_option("--key-lengths", "'", a.key_lengths, "' entry ", b, " is ", key_lengths[b],
                      ", expected a length in [0, ", tokens, "] (N from --x)");
        }
      }
    }
    if (a.check_finite) {
      require_finite_shard(cloud, segments, shape, batch, tokens, dim, "--x '" + a.cloud + "'");
      require_finite(relevance, "--m '" + a.relevance + "'");
      require_finite(content, "--f '" + a.content + "'");
      require_finite(key_bias, "--key-bias '" + a.key_bias + "'");
      require_finite(offset, "--offset '" + a.offset + "'");
    }
    const std::int64_t local = distributed::shard_tokens(segments);
    local_update.resize(static_cast<std::size_t>(batch * local * dim));
    if (stats) {
      local_lse.resize(static_cast<std::size_t>(batch * heads * local));
      local_entropy.resize(local_lse.size());
    }
    if (r == 0) {
      update = allocate_output<T>("--out", shape);
      if (stats) {
        lse = allocate_output<T>("--lse", Shape{batch, heads, tokens});
        entropy = allocate_output<T>("--entropy", Shape{batch, heads, tokens});
      }
    }
  });

  distributed::ShardInput<T> in;
  in.cloud = cloud.data();
  in.batch = batch;
  in.tokens = tokens;
  in.dim = dim;
  in.layer = {heads, relevance.data(), content.data(),
              key_bias.size() > 0 ? key_bias.data() : nullptr,
              offset.size() > 0 ? offset.data() : nullptr};
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
    collect(local_lse, batch * heads, 1, lse.data());
    collect(local_entropy, batch * heads, 1, entropy.data());
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

// emflow flow --distributed: the flow with every cloud's tokens spread over the ranks of an MPI
// job (emflow/distributed_flow.hpp). Every rank checks the options, reads the operators and its
// own rows of --x (offset reads) or takes its rows of the generated clouds; every step that can
// fail on one rank is agreed on, so a bad input or a failed allocation on any rank is one error
// on every rank, reported once by rank 0. Rank 0 holds the whole trajectory (the observables
// gather it at every record anyway) and writes the files of the single-process run, all or none.
#include <chrono>
#include <iomanip>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "common.hpp"
#include "distributed_commands.hpp"
#include "emflow/distributed.hpp"
#include "emflow/distributed_flow.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"
#include "emflow/sequence_parallel.hpp"
#include "flow_command.hpp"
#include "job.hpp"

namespace emflow::cli {
namespace {

using distributed::Layout;

template <class T>
void run(const FlowArguments& args, Dtype dtype, distributed::Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  const bool from_file = !args.cloud.empty();
  flow::FlowSettings settings;
  ExecutionOptions options;
  OutputFiles outputs;
  std::vector<T> rows;  // this rank's rows of every cloud, (B, n_r, d)
  std::int64_t B = 0, N = 0, d = 0, records = 0, values = 0;
  std::vector<double> betas;
  std::vector<flow::FlowLayer<T>> layers;

  distributed::agreed(comm, [&] {
    if (given(args.generate_option)) {
      fail_option("--generate", "is not available with --distributed");
    }
    settings = flow_settings(args);
    options = execution_options(args.device, args.threads);
    if (options.device == Device::automatic) options.device = Device::cpu;
    if (options.device != Device::cpu && options.device != Device::reference) {
      fail_option("--device", "with --distributed must be cpu or reference, got ", args.device);
    }
    if (r == 0) {
      declare_flow_files(outputs, args);
    }
    if (from_file) {
      Shape shape;
      std::vector<T> part = naming_option("--x", [&] {
        return distributed::read_shard<T>(args.cloud, Layout::contiguous, P, r, &shape);
      });
      const bool one_cloud = shape.size() == 2;
      N = shape[shape.size() - 2];
      d = shape[shape.size() - 1];
      if (args.check_finite) {
        require_finite_shard(part, distributed::shard(Layout::contiguous, N, P, r), shape,
                             one_cloud ? 1 : shape[0], N, d, "--x '" + args.cloud + "'");
      }
      if (one_cloud) {
        // One cloud repeated B times, e.g. to run it at B temperatures.
        B = given(args.batch_option) ? args.batch : 1;
        if (B < 1) fail_option("--batch", "must be >= 1, got ", B);
        rows.reserve(part.size() * static_cast<std::size_t>(B));
        for (std::int64_t b = 0; b < B; ++b) rows.insert(rows.end(), part.begin(), part.end());
      } else {
        B = shape[0];
        if (given(args.batch_option) && args.batch != B) {
          fail_option("--batch", "is ", args.batch, " but --x '", args.cloud, "' holds ", B,
                      " clouds");
        }
        rows = std::move(part);
      }
      if (N < 2) fail_option("--x", "'", args.cloud, "' has ", N, " tokens, expected at least 2");
    } else {
      const flow::InitialCloud init = check_generated_cloud(args);
      B = args.batch;
      N = args.tokens;
      d = args.dim;
      // Each cloud is drawn from its own stream, token after token: every rank draws the whole
      // clouds and keeps its rows (B N d values, as the records hold on every rank anyway).
      const Tensor<T> initial = flow::initial_clouds<T>(init, B, N, d, args.seed);
      rows = distributed::gather_shard(initial.data(), B, N, d,
                                       distributed::shard(Layout::contiguous, N, P, r));
    }
    if (N < P) {
      fail_option(from_file ? "--x" : "--tokens", "gives ", N, " tokens, fewer than the ", P,
                  " ranks of the job");
    }
    betas = parse_betas(args.beta, B);
    values = trajectory_values(args, settings, B, N, d, from_file, &records);
    layers = read_layers<T>(args, d, settings.layers == 0 ? 1 : settings.layers, dtype);
  });

  const auto start = std::chrono::steady_clock::now();
  flow::FlowResult<T> result;
  try {
    result = distributed::run_flow(comm, rows.data(), B, N, d, betas, layers, settings, options);
  } catch (const std::bad_alloc&) {
    // Not agreed: the job ends (main) rather than leave the other ranks waiting.
    fail(ErrorCode::out_of_memory, "flow: out of memory: the trajectory (--out) alone needs ",
         values * static_cast<std::int64_t>(sizeof(T)), " bytes on rank 0 (", records, " x ", B,
         " x ", N, " x ", d, " values of ", sizeof(T), " bytes)");
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  distributed::agreed(comm, [&] {
    if (r != 0) return;
    stage_flow_outputs(outputs, args, result, betas, settings);
    outputs.commit();
  });
  if (r != 0) return;
  const std::int64_t R = result.trajectory.extent(0);
  const flow::Observables& last = result.observables[static_cast<std::size_t>((R - 1) * B)];
  std::cout << std::setprecision(4) << "emflow flow: " << B << " cloud(s) of " << N
            << " tokens in d = " << d << ", " << flow::step_count(settings)
            << (settings.layers == 0 ? " steps" : " layers") << " on " << P << " rank(s) in "
            << seconds << " s\n"
            << "  cloud 0 at the end: clustered fraction " << last.clustered_fraction
            << ", clusters " << last.clusters << ", min <x_i,x_j> " << last.min_inner << ", energy "
            << last.energy << ", entropy " << last.entropy << ", diameter " << last.diameter
            << "\n";
}

}  // namespace

void run_flow_distributed(const FlowArguments& args) {
  distributed::Communicator& comm = job();
  const Dtype dtype = distributed::agreed(comm, [&] {
    if (!args.model.model.empty()) {
      fail_option("--model", "is not available with --distributed (a model runs in one process)");
    }
    if (!args.cloud.empty()) return float_dtype("--x", args.cloud);
    if (args.precision == "float64") return Dtype::float64;
    if (args.precision != "float32") {
      fail_option("--precision", "expects float32 or float64, got '", args.precision, "'");
    }
    return Dtype::float32;
  });
  if (dtype == Dtype::float32) {
    run<float>(args, dtype, comm);
  } else {
    run<double>(args, dtype, comm);
  }
}

}  // namespace emflow::cli

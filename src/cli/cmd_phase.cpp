// emflow phase: the phase diagram of Geshkovski, Letrouit, Polyanskiy and Rigollet
// (docs/MATH.md §4, §5): for each inverse temperature beta, many random clouds flow on the sphere
// with Q = K = V = I, and the fraction of clustered pairs is drawn over (time, beta). The
// defaults are theirs: 90 betas in [0.1, 9], n = 32, d = 2, dt = 0.1, T = 30, 2048 clouds.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/distributed.hpp"
#include "emflow/distributed_flow.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"
#include "flow_command.hpp"
#include "job.hpp"
#include "tools/plot.hpp"
#include "tools/progress.hpp"

namespace emflow::cli {
namespace {

struct PhaseArguments {
  flow::PhaseSettings settings;
  std::string betas = "0.1:9:90";
  std::string device = "auto";
  int threads = 0;
  std::string plot, out;
  bool distributed = false;
};

// "START:STOP:COUNT" with 0 < START <= STOP and COUNT >= 1.
void parse_beta_range(const std::string& text, flow::PhaseSettings& s) {
  double start = 0, stop = 0;
  long long count = 0;
  // Three fields, each read whole (strtod and strtoll with their end and range checked).
  bool parsed = false;
  const std::size_t first = text.find(':');
  const std::size_t second = first == std::string::npos ? first : text.find(':', first + 1);
  if (second != std::string::npos) {
    const std::string a = text.substr(0, first), b = text.substr(first + 1, second - first - 1);
    const std::string c = text.substr(second + 1);
    char* end = nullptr;
    errno = 0;
    start = std::strtod(a.c_str(), &end);
    parsed = !a.empty() && *end == '\0' && errno == 0;
    stop = std::strtod(b.c_str(), &end);
    parsed = parsed && !b.empty() && *end == '\0' && errno == 0;
    count = std::strtoll(c.c_str(), &end, 10);
    parsed = parsed && !c.empty() && *end == '\0' && errno == 0;
  }
  if (!parsed || !std::isfinite(start) || !std::isfinite(stop) || start <= 0 || stop < start ||
      count < 1 || (count == 1 && stop != start)) {
    fail_option("--betas",
                "expects START:STOP:COUNT with 0 < START <= STOP and COUNT >= 1 "
                "(COUNT = 1 needs START = STOP), got '",
                text, "'");
  }
  s.beta_start = start;
  s.beta_stop = stop;
  s.beta_count = count;
}

void run_phase(PhaseArguments& args) {
  // Under --distributed every rank checks the arguments and computes its share, each step that
  // can fail agreed on by all ranks; rank 0 alone writes the files and prints.
  distributed::Communicator* comm = args.distributed ? &job() : nullptr;
  const bool writer = comm == nullptr || comm->rank() == 0;
  const auto agreed = [&](const auto& body) {
    if (comm) {
      distributed::agreed(*comm, body);
    } else {
      body();
    }
  };
  flow::PhaseSettings& s = args.settings;
  ExecutionOptions options;
  Device device = Device::cpu;
  OutputFiles outputs;
  agreed([&] {
    parse_beta_range(args.betas, s);
    if (s.tokens < 2) fail_option("--tokens", "must be >= 2, got ", s.tokens);
    if (s.dim < 1) fail_option("--dim", "must be >= 1, got ", s.dim);
    if (s.clouds < 1) fail_option("--clouds", "must be >= 1, got ", s.clouds);
    if (!(std::isfinite(s.time) && s.time > 0)) {
      fail_option("--time", "must be finite and > 0, got ", s.time);
    }
    if (!(std::isfinite(s.dt) && s.dt > 0))
      fail_option("--dt", "must be finite and > 0, got ", s.dt);
    // The sweep holds every cloud at every beta at once; the library limits it too, but this
    // names the option to change.
    expect_product_at_most(
        {{"--clouds", s.clouds},
         {"--betas", s.beta_count, "--betas COUNT " + std::to_string(s.beta_count)},
         {"--tokens", s.tokens},
         {"--dim", s.dim}},
        std::int64_t{1} << 31, "values of the sweep (every cloud at every beta)");
    // The step count is limited by the library.
    flow::validate(s);
    options = execution_options(args.device, args.threads);
    if (comm && options.device == Device::automatic) options.device = Device::cpu;
    if (comm && options.device != Device::cpu) {
      fail_option("--device", "with --distributed must be cpu, got ", args.device);
    }
    // What phase_diagram runs on: the GPU when auto finds one (or cuda is named), else the CPU.
    device = naming_option("--device", [&] { return resolve_device(options.device); });
    if (writer && !args.plot.empty()) outputs.declare("--plot", args.plot);
    if (writer && !args.out.empty()) outputs.declare("--out", args.out);
  });

  tools::ProgressBar bar("emflow phase");
  const auto start = std::chrono::steady_clock::now();
  const flow::PhaseDiagram diagram =
      comm ? distributed::phase_diagram(*comm, s, options,
                                        writer ? bar.callback() : flow::Progress{})
           : flow::phase_diagram(s, options, bar.callback());
  bar.finish();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  agreed([&] {
    if (!writer) return;
    if (!args.out.empty()) {
      std::ostringstream csv;
      csv << "time,beta,clustered_fraction\n";
      const std::size_t K = diagram.betas.size();
      for (std::size_t t = 0; t < diagram.times.size(); ++t) {
        for (std::size_t k = 0; k < K; ++k) {
          csv << csv_number(diagram.times[t]) << ',' << csv_number(diagram.betas[k]) << ','
              << csv_number(diagram.clustered[t * K + k]) << '\n';
        }
      }
      outputs.stage_bytes(args.out, csv.str());
    }
    if (!args.plot.empty()) {
      std::ostringstream title;
      title << "Clustering on the sphere S" << tools::superscript(s.dim - 1) << ": n = " << s.tokens
            << ", d = " << s.dim << ", " << s.clouds << " clouds per \xCE\xB2, RK4 dt = " << s.dt;
      outputs.stage_bytes(args.plot, tools::draw_phase(diagram, title.str()));
    }
    outputs.commit();
  });
  if (!writer) return;

  const std::size_t K = diagram.betas.size(), last = diagram.times.size() - 1;
  std::cout << std::setprecision(4) << "emflow phase: " << K << " betas x " << s.clouds
            << " clouds of " << s.tokens << " tokens in d = " << s.dim << ", " << last
            << " RK4 steps to T = " << s.time << " on " << to_string(device)
            << (comm ? " x " + std::to_string(comm->size()) + " ranks" : std::string()) << " in "
            << seconds << " s\n"
            << "  clustered fraction at T: " << diagram.clustered[last * K] << " (beta "
            << diagram.betas.front() << ") .. " << diagram.clustered[last * K + K - 1] << " (beta "
            << diagram.betas.back() << ")\n";
}

}  // namespace

void add_phase_command(CLI::App& app) {
  auto args = std::make_shared<PhaseArguments>();
  flow::PhaseSettings& s = args->settings;
  CLI::App* command = add_command(
      app, "phase", "Sweep beta over random clouds on the sphere and draw the phase diagram",
      R"(Phase diagram of clustering (Geshkovski et al.): clouds of n tokens uniform on the
sphere S^{d-1} flow by dx_i/dt = P_{x_i}(sum_j p_ij x_j), p_ij = softmax_j(beta <x_i, x_j>)
(Q = K = V = I, RK4); the fraction of pairs with <x_i, x_j> > 1 - 1e-3, averaged over
the clouds, is recorded at every step for each beta. The same clouds serve every beta.)");
  command->add_option("--tokens", s.tokens, "tokens n per cloud")->capture_default_str();
  command->add_option("--dim", s.dim, "dimension d (the sphere S^{d-1})")->capture_default_str();
  command->add_option("--betas", args->betas, "START:STOP:COUNT, evenly spaced")
      ->capture_default_str();
  command->add_option("--time", s.time, "final time T")->capture_default_str();
  command->add_option("--dt", s.dt, "RK4 step")->capture_default_str();
  command->add_option("--clouds", s.clouds, "random clouds per beta")->capture_default_str();
  command->add_option("--seed", s.seed, "seed of the clouds")->capture_default_str();
  add_device_option(*command, args->device);
  add_threads_option(*command, args->threads);
  command->add_option("--plot", args->plot, "output: the phase diagram (.png)");
  command->add_option("--out", args->out,
                      "output: (.csv) time,beta,clustered_fraction, one row per step and beta");
  command->add_flag("--distributed", args->distributed,
                    "under mpirun: split the (beta, cloud) pairs over the ranks; the same "
                    "diagram bit for bit, written by rank 0");
  command->callback([args] { run_phase(*args); });
}

}  // namespace emflow::cli

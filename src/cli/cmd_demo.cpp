// emflow demo: the main job in one command. A seeded token cloud and a layer of random heads
// under a causal mask, updated in float32 on the GPU when one is present (else on the CPU),
// timed, and checked against the float64 reference.
//
// The check is exact on a subset: under a causal mask the first P queries see only the first P
// tokens, so the reference run on that P-token prefix gives their update without the cost of
// the whole cloud in float64.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/attention.hpp"
#include "tools/problem.hpp"

namespace emflow::cli {
namespace {

struct DemoArguments {
  std::int64_t tokens = 2048;
  std::int64_t dim = 64;
  std::int64_t heads = 4;
  std::string device = "auto";
  int threads = 0;
  std::uint64_t seed = 1;
};

constexpr std::int64_t kCheckedQueries = 512;
constexpr double kTolerance = 1e-3;  // the float32 paths are far inside (docs/MATH.md §6)

// Uniform values in [-1, 1) from splitmix64: the same cloud for a seed on every platform (the
// standard distributions are not specified bit for bit).
class Uniform {
 public:
  explicit Uniform(std::uint64_t seed) : state_(seed) {}
  double operator()() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
  }

 private:
  std::uint64_t state_;
};

std::vector<float> random_values(std::int64_t count, double scale, Uniform& uniform) {
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& v : values) v = static_cast<float>(scale * uniform());
  return values;
}

double norm(const float* values, std::int64_t count) {
  double sum = 0;
  for (std::int64_t i = 0; i < count; ++i) sum += double(values[i]) * values[i];
  return std::sqrt(sum);
}

void run_demo(const DemoArguments& args) {
  const ExecutionOptions options = execution_options(args.device, args.threads);
  const std::int64_t n = args.tokens, d = args.dim, h = args.heads;
  for (const auto& [option, value] :
       {std::pair<const char*, std::int64_t>{"--tokens", n}, {"--dim", d}, {"--heads", h}}) {
    if (value < 1) fail_option(option, "must be >= 1, got ", value);
  }
  const Device device = resolve_device(options.device);

  // Scales chosen so the scores spread over a few units (softmax neither flat nor one-hot:
  // with entries uniform in [-1, 1), x^T M y has standard deviation about d * scale / 5.2)
  // and the update is of the order of the cloud.
  Uniform uniform(args.seed);
  const std::vector<float> cloud = random_values(n * d, 1.0, uniform);
  const std::vector<float> relevance = random_values(h * d * d, 10.0 / double(d), uniform);
  const std::vector<float> content = random_values(h * d * d, 1.0 / std::sqrt(double(d)), uniform);

  AttentionInput<float> input =
      tools::layer_input(cloud.data(), 1, n, d, h, relevance.data(), content.data());
  input.mask = Mask::causal();
  std::vector<float> update(cloud.size());
  AttentionOutput<float> output;
  output.update = update.data();

  // One warm-up run (CUDA context, first-touch pages), then the best of up to five runs within
  // about a second.
  using Clock = std::chrono::steady_clock;
  auto timed_run = [&] {
    const auto start = Clock::now();
    attend(input, output, options);
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  const double warm_up = timed_run();
  const int runs = static_cast<int>(std::clamp(1.0 / std::max(warm_up, 1e-6), 1.0, 5.0));
  double best = timed_run();
  for (int r = 1; r < runs; ++r) best = std::min(best, timed_run());

  // Attention-equivalent FLOP (docs/MATH.md §2): 4 d per visible query-key pair and head;
  // the causal mask sees N (N + 1) / 2 pairs, about half of 4 B H N^2 d.
  const double pairs = double(n) * double(n + 1) / 2.0;
  const double flop = 4.0 * double(h) * double(d) * pairs;

  // The float64 reference on the same (float-rounded) numbers, over the first P tokens.
  const std::int64_t p = std::min(n, kCheckedQueries);
  const std::vector<double> cloud64(cloud.begin(), cloud.begin() + p * d);
  const std::vector<double> relevance64(relevance.begin(), relevance.end());
  const std::vector<double> content64(content.begin(), content.end());
  std::vector<double> expected(static_cast<std::size_t>(p * d));
  AttentionInput<double> check =
      tools::layer_input(cloud64.data(), 1, p, d, h, relevance64.data(), content64.data());
  check.mask = Mask::causal();
  AttentionOutput<double> check_output;
  check_output.update = expected.data();
  ExecutionOptions reference;
  reference.device = Device::reference;
  attend(check, check_output, reference);
  double diff = 0, ref = 0;
  for (std::int64_t i = 0; i < p * d; ++i) {
    diff += (double(update[i]) - expected[i]) * (double(update[i]) - expected[i]);
    ref += expected[i] * expected[i];
  }
  const double error = ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);

  std::ostringstream where;
  where << to_string(device);
  if (device == Device::cpu) {
    where << " (" << (options.threads > 0 ? options.threads : omp_get_max_threads()) << " threads)";
  }
  if (options.device == Device::automatic && device == Device::cpu) {
    where << ", no usable CUDA device";
  }
  std::cout << std::setprecision(3) << "emflow demo: EMF attention on a seeded token cloud\n"
            << "  cloud   N = " << n << " tokens in d = " << d << ", H = " << h
            << " heads, causal mask, float32, seed " << args.seed << "\n"
            << "  device  " << where.str() << "\n"
            << "  time    " << std::fixed << best * 1e3 << " ms (best of " << runs
            << " after a warm-up; host arrays in and out)\n"
            << "  speed   " << flop / best * 1e-9
            << " GFLOP/s attention-equivalent (4 H d x N(N+1)/2 visible pairs = " << flop * 1e-9
            << " GFLOP)\n"
            << std::defaultfloat << "  check   relative error " << error << " on the first " << p
            << " queries against the float64 reference\n"
            << "  update  |Delta| / |X| = "
            << norm(update.data(), n * d) / norm(cloud.data(), n * d) << "\n";
  if (!(error <= kTolerance)) {
    fail(ErrorCode::internal, "demo: the ", to_string(device),
         " update differs from the float64 reference by ", error, " (tolerance ", kTolerance, ")");
  }
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto args = std::make_shared<DemoArguments>();
  CLI::App* command = add_command(
      app, "demo",
      "Time and check one causal attention layer on a seeded cloud (the GPU if present)",
      R"(Updates a seeded token cloud with one causal attention layer in float32 (on the GPU when
present, else the CPU) and prints the time, the attention-equivalent GFLOP/s and the
relative error against the float64 reference on the first 512 queries.)");
  command->add_option("--tokens", args->tokens, "tokens N in the cloud")->capture_default_str();
  command->add_option("--dim", args->dim, "dimension d of the token space")->capture_default_str();
  command->add_option("--heads", args->heads, "heads H in the layer")->capture_default_str();
  add_device_option(*command, args->device);
  add_threads_option(*command, args->threads);
  command->add_option("--seed", args->seed, "seed of the cloud and the operators")
      ->capture_default_str();
  command->callback([args] { run_demo(*args); });
}

}  // namespace emflow::cli

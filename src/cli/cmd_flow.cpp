// emflow flow: the motion of token clouds under attention (docs/MATH.md §4), layer after layer
// or in continuous time, with its observables and a picture.
//
// Precision: a --x file decides it (float32 or float64, like emflow attend); generated clouds
// use --precision (float32 by default, the fast path of the CPU and CUDA backends). Every
// argument is checked and every output declared before the run; the outputs are written only
// when the whole run succeeds, all or none.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/finite.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"
#include "emflow/tensor.hpp"
#include "flow_command.hpp"
#include "flow_model.hpp"
#include "generate.hpp"
#include "tools/plot.hpp"
#include "tools/progress.hpp"

namespace emflow::cli {
namespace {

// `--generate K` runs a stack of SA layers in float32 on the CPU and records each new token's
// path: what it does not run is refused by name before anything is read.
void check_generation(const FlowArguments& args, const ExecutionOptions& options, bool float32) {
  if (args.generate < 1) fail_option("--generate", "must be >= 1, got ", args.generate);
  if (args.layers_option->count() == 0) {
    fail_option("--generate", "needs a stack of layers (--layers L)");
  }
  if (args.unnormalized) fail_option("--generate", "runs SA layers only (no --unnormalized)");
  if (args.record_every_option->count() > 0) {
    fail_option("--record-every", "does not apply to --generate (--out holds every new token)");
  }
  if (options.device == Device::cuda) {
    fail_option("--device", "cuda: --generate runs on the CPU (--device cpu or auto)");
  }
  if (!float32) {
    fail_option("--generate", "computes in float32 (--precision float32 or a float32 --x)");
  }
}

// The generation itself (emflow::generate) and its files: --out every new token at the input of
// each layer and after the last, (K, L + 1, d) or (B, K, L + 1, d); --metrics how far each layer
// moved it, and the time per token; --plot the paths.
void run_generation(const FlowArguments& args, OutputFiles& outputs, const Tensor<float>& prompts,
                    const std::vector<flow::FlowLayer<float>>& read,
                    const std::vector<double>& betas, const flow::FlowSettings& settings) {
  const std::int64_t B = prompts.extent(0), N = prompts.extent(1), d = prompts.extent(2);
  const std::int64_t K = args.generate, L = args.layers;
  const bool from_file = !args.cloud.empty();
  const auto from_x = [](const char* what, std::int64_t v) {
    return std::string(what) + " " + std::to_string(v) + " (--x)";
  };
  expect_product_at_most({{"--generate", K},
                          {"--layers", L + 1, "--layers " + std::to_string(L) + " + 1"},
                          {from_file && args.batch_option->count() == 0 ? "--x" : "--batch", B,
                           from_file && args.batch_option->count() == 0 ? from_x("B", B) : ""},
                          {from_file ? "--x" : "--dim", d, from_file ? from_x("d", d) : ""}},
                         std::int64_t{1} << 31, "values of the generated paths (--out)");
  // One layer shared by the whole stack is each of its L layers.
  const std::vector<flow::FlowLayer<float>> layers =
      read.size() == 1 ? std::vector<flow::FlowLayer<float>>(static_cast<std::size_t>(L), read[0])
                       : read;
  DecodingSettings decoding;
  decoding.norm = settings.norm;
  decoding.pre_norm = settings.pre_norm;
  decoding.norm_eps = settings.norm_eps;
  decoding.threads = args.threads;
  const Generation g =
      naming_option("--generate", [&] { return generate(prompts, layers, betas, K, decoding); });
  if (!args.out.empty()) {
    outputs.stage_npy(args.out, B == 1 ? g.paths.reshaped(Shape{K, L + 1, d}) : g.paths);
  }
  if (!args.metrics.empty()) outputs.stage_bytes(args.metrics, generation_metrics(g));
  if (!args.plot.empty()) {
    std::ostringstream title;
    title << "generation: " << K << " tokens after N = " << N << ", d = " << d << ", L = " << L
          << (args.pre_norm ? " pre-norm" : " post-norm") << ", norm " << args.norm
          << ", \xCE\xB2 = " << args.beta;
    if (B > 1) title << "  (paths: cloud 0)";
    outputs.stage_bytes(args.plot, generation_picture(g, title.str()));
  }
  outputs.commit();
  std::cout << "generated " << K << " tokens after " << N << " through " << L
            << " layers (d = " << d << (B > 1 ? ", " + std::to_string(B) + " clouds" : "") << ")"
            << std::endl;
}

template <class T>
void run_flow_command(const FlowArguments& args, Dtype dtype) {
  const bool from_file = !args.cloud.empty();
  const bool continuous = args.layers_option->count() == 0;
  const flow::FlowSettings settings = flow_settings(args);
  const ExecutionOptions options = execution_options(args.device, args.threads);
  naming_option("--device", [&] { return resolve_device(options.device); });

  const bool generating = args.generate_option->count() > 0;
  if (generating) check_generation(args, options, std::is_same_v<T, float>);
  OutputFiles outputs;
  declare_flow_files(outputs, args);

  // The initial clouds.
  Tensor<T> initial;
  if (from_file) {
    initial = read_float_input<T>("--x", args.cloud, dtype, "--x", 2, 3);
    if (args.check_finite) require_finite(initial, "--x '" + args.cloud + "'");
    if (initial.rank() == 2) {
      const std::int64_t batch = args.batch_option->count() ? args.batch : 1;
      if (batch < 1) fail_option("--batch", "must be >= 1, got ", batch);
      // One cloud repeated B times, e.g. to run it at B temperatures.
      Tensor<T> repeated(Shape{batch, initial.extent(0), initial.extent(1)});
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy(initial.values().begin(), initial.values().end(),
                  repeated.data() + b * initial.size());
      }
      initial = std::move(repeated);
    } else if (args.batch_option->count() && args.batch != initial.extent(0)) {
      fail_option("--batch", "is ", args.batch, " but --x '", args.cloud, "' holds ",
                  initial.extent(0), " clouds");
    }
    if (initial.extent(1) < 2) {
      fail_option("--x", "'", args.cloud, "' has ", initial.extent(1),
                  " tokens, expected at least 2");
    }
  } else {
    const flow::InitialCloud init = check_generated_cloud(args);
    initial = flow::initial_clouds<T>(init, args.batch, args.tokens, args.dim, args.seed);
  }
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  const std::vector<double> betas = parse_betas(args.beta, B);
  if (generating) {
    if constexpr (std::is_same_v<T, float>) {
      run_generation(args, outputs, initial, read_layers<T>(args, d, args.layers, dtype), betas,
                     settings);
    }
    return;
  }
  std::int64_t records = 0;
  const std::int64_t values = trajectory_values(args, settings, B, N, d, from_file, &records);
  const auto layers = read_layers<T>(args, d, continuous ? 1 : args.layers, dtype);

  tools::ProgressBar bar("emflow flow");
  const auto start = std::chrono::steady_clock::now();
  const flow::FlowResult<T> result = [&] {
    try {
      return flow::run_flow(initial, betas, layers, settings, options, bar.callback());
    } catch (const std::bad_alloc&) {
      fail(ErrorCode::out_of_memory, "flow: out of memory: the trajectory (--out) alone needs ",
           values * static_cast<std::int64_t>(sizeof(T)), " bytes (", records, " x ", B, " x ", N,
           " x ", d, " values of ", sizeof(T), " bytes)");
    }
  }();
  bar.finish();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::int64_t R = result.trajectory.extent(0);
  stage_flow_outputs(outputs, args, result, betas, settings);
  outputs.commit();

  const flow::Observables& last = result.observables[static_cast<std::size_t>((R - 1) * B)];
  std::cout << std::setprecision(4) << "emflow flow: " << B << " cloud(s) of " << N
            << " tokens in d = " << d << ", " << flow::step_count(settings)
            << (continuous ? " steps" : " layers") << " on "
            << to_string(resolve_device(options.device)) << " in " << seconds << " s\n"
            << "  cloud 0 at the end: clustered fraction " << last.clustered_fraction
            << ", clusters " << last.clusters << ", min <x_i,x_j> " << last.min_inner << ", energy "
            << last.energy << ", entropy " << last.entropy << ", diameter " << last.diameter
            << "\n";
}

}  // namespace

void add_flow_command(CLI::App& app) {
  auto args = std::make_shared<FlowArguments>();
  CLI::App* command = add_command(
      app, "flow", "Run the flow of token clouds (layers or continuous time); record and draw it",
      R"(The flow of a token cloud under attention (docs/MATH.md section 4): a stack of layers
  X <- N(X + Delta(X))  (post-norm)   or   X <- X + Delta(N(X))  (pre-norm),
or continuous time dx_i/dt = sum_j p_ij F x_j (SA; USA divides by N instead of Z_i),
on the sphere with --norm sphere, integrated by Euler or RK4. Records the clouds and
their observables; outputs are written only when the whole run succeeds.)");
  auto* x = command->add_option("--x,--cloud", args->cloud,
                                "initial cloud (.npy): (N, d), or a batch (B, N, d); its dtype "
                                "sets the precision");
  args->tokens_option =
      command->add_option("--tokens", args->tokens, "generated clouds: tokens N >= 2")
          ->capture_default_str();
  args->dim_option = command->add_option("--dim", args->dim, "generated clouds: dimension d")
                         ->capture_default_str();
  args->init_option = command
                          ->add_option("--init", args->init,
                                       "generated clouds: gaussian (entries N(0, 1/d)), sphere "
                                       "(uniform), cube ([-1, 1]^d) or orthonormal (N <= d)")
                          ->capture_default_str();
  command->add_option("--seed", args->seed, "seed of the clouds and random operators")
      ->capture_default_str();
  args->batch_option =
      command->add_option("--batch", args->batch, "number of clouds B")->capture_default_str();
  x->excludes(args->tokens_option)->excludes(args->dim_option)->excludes(args->init_option);
  args->layers_option = command->add_option("--layers", args->layers,
                                            "a stack of L layers (instead of continuous time)");
  args->time_option = command->add_option("--time", args->time, "continuous time: final time T")
                          ->capture_default_str();
  args->dt_option =
      command->add_option("--dt", args->dt, "continuous time: step h")->capture_default_str();
  args->integrator_option =
      command->add_option("--integrator", args->integrator, "continuous time: euler or rk4")
          ->capture_default_str();
  args->layers_option->excludes(args->time_option)
      ->excludes(args->dt_option)
      ->excludes(args->integrator_option);
  command
      ->add_option("--m", args->relevance,
                   "relevance M = Q^T K: identity, minus-identity, random (entries N(0, 1/d)) "
                   "or a .npy file (d, d), (H, d, d) or (L, H, d, d)")
      ->capture_default_str();
  command
      ->add_option("--f", args->content,
                   "content F = V: identity, minus-identity, random or a .npy file, as --m")
      ->capture_default_str();
  command
      ->add_option("--beta", args->beta,
                   "inverse temperature > 0, or one per cloud separated by commas")
      ->capture_default_str();
  command
      ->add_option("--norm", args->norm,
                   "none, layernorm, rmsnorm or sphere (layers); none or sphere (continuous "
                   "time: sphere means the dynamics on the sphere)")
      ->capture_default_str();
  command->add_option("--norm-eps", args->norm_eps, "layers: the eps of layernorm and rmsnorm")
      ->capture_default_str();
  command->add_flag("--pre-norm", args->pre_norm,
                    "layers: X <- X + Delta(N(X)) instead of N(X + Delta(X))");
  command->add_flag("--unnormalized", args->unnormalized,
                    "USA: divide the attention sums by N instead of the partition function Z_i");
  command->add_flag("--check-finite", args->check_finite,
                    "refuse --x, --m and --f files holding NaN or infinity, naming the file and "
                    "the first such element");
  args->record_every_option =
      command
          ->add_option("--record-every", args->record_every, "record every k steps (and the last)")
          ->capture_default_str();
  add_device_option(*command, args->device);
  add_threads_option(*command, args->threads);
  args->precision_option =
      command
          ->add_option("--precision", args->precision,
                       "generated clouds: float32 or float64 (a --x file sets its own)")
          ->capture_default_str();
  x->excludes(args->precision_option);
  args->generate_option =
      command
          ->add_option("--generate", args->generate,
                       "layers: grow the cloud by K tokens causally, each the last token's output "
                       "fed back, through one decode cache per layer and cloud (post- or pre-norm, "
                       "any --norm, float32, on the CPU); --out then holds each new token's path "
                       "(K, L + 1, d), or (B, K, L + 1, d) for B clouds, --metrics how far each "
                       "layer moved it, --plot draws the paths")
          ->capture_default_str();
  command->add_option("--out", args->out,
                      "output: the recorded clouds (.npy), (records, B, N, d), the initial first");
  command->add_option("--metrics", args->metrics,
                      "output: observables (.csv), one row per record and cloud");
  command->add_option("--plot", args->plot, "output: picture of the flow (.png)");
  // A converted model's own layers (emflow convert): everything of the synthetic flow above
  // comes from the model instead.
  auto* model = command->add_option("--model", args->model.model,
                                    "operator folder of a model (emflow convert): run its own "
                                    "layers on --cloud (docs/MODELS.md)");
  std::vector<CLI::Option*> model_only = {
      command->add_option("--key-lengths", args->model.key_lengths,
                          "--model: real tokens per cloud (.npy, B integers); the rest is padding"),
      command->add_option("--positions", args->model.positions,
                          "--model: the rotary position of every token (.npy, (B, N) or (N) "
                          "integers; default 0..N-1), a llama model's; the masks stay by index"),
      command->add_option("--labels", args->model.labels,
                          "--model: text file, the token strings of cloud 0, one a line (--plot)"),
      command->add_flag("--full-layer", args->full_layer,
                        "--model: attention, norms and the feed-forward block (the default)"),
      command->add_flag("--attention-only", args->model.attention_only,
                        "--model: attention, residual and norm only (the EMF flow)"),
      command->add_option("--form", args->model.form,
                          "--model: the attention from the dense operators M_h, F_h (emf, the "
                          "default) or from the per-head Q/K/V/O blocks (factored, the default "
                          "and the only form of a llama model)"),
      command->add_option("--attention-out", args->model.attention_out,
                          "--model output: each layer's attention output (.npy), (L, B, N, d)"),
      command->add_option("--logits", args->model.logits,
                          "--model output: the next-token logits of each cloud's last real "
                          "token (.npy), (B, vocab): the final norm and the unembedding (llama)"),
      command->add_option("--cosine-histogram", args->model.cosine_histogram,
                          "--model output: picture (.png) of the histogram of cloud 0's "
                          "pairwise cosines after every layer (layer x cosine bin)"),
      command->add_option("--cosine-counts", args->model.cosine_counts,
                          "--model output: the histogram's counts (.npy, int64), (L + 1, B, 40): "
                          "pairs i < j of real tokens per cosine bin of width 0.05 over [-1, 1]")};
  command->get_option("--full-layer")->excludes(command->get_option("--attention-only"));
  for (CLI::Option* option : model_only) option->needs(model);
  for (const char* name : {"--tokens",
                           "--dim",
                           "--init",
                           "--seed",
                           "--batch",
                           "--layers",
                           "--time",
                           "--dt",
                           "--integrator",
                           "--m",
                           "--f",
                           "--beta",
                           "--norm",
                           "--pre-norm",
                           "--norm-eps",
                           "--unnormalized",
                           "--record-every",
                           "--precision",
                           "--check-finite",
                           "--generate"}) {
    model->excludes(command->get_option(name));
  }
  command->add_flag("--distributed", args->distributed,
                    "under mpirun: spread the tokens of every cloud over the ranks (each rank "
                    "reads only its rows of --x; attention through the sequence-parallel ring); "
                    "the same --out, --metrics and --plot as one process, written once by rank "
                    "0. Runs on the CPU (--device cpu or reference); not with --model or "
                    "--generate");
  command->callback([args] {
    if (args->distributed) {
      run_flow_distributed(*args);
      return;
    }
    if (!args->model.model.empty()) {
      ModelFlowArguments model_args = args->model;
      model_args.cloud = args->cloud;
      model_args.out = args->out;
      model_args.metrics = args->metrics;
      model_args.plot = args->plot;
      model_args.device = args->device;
      model_args.threads = args->threads;
      run_model_flow(model_args);
      return;
    }
    Dtype dtype = Dtype::float32;
    if (!args->cloud.empty()) {
      dtype = float_dtype("--x", args->cloud);
    } else if (args->precision == "float64") {
      dtype = Dtype::float64;
    } else if (args->precision != "float32") {
      fail_option("--precision", "expects float32 or float64, got '", args->precision, "'");
    }
    if (dtype == Dtype::float32) {
      run_flow_command<float>(*args, dtype);
    } else {
      run_flow_command<double>(*args, dtype);
    }
  });
}

}  // namespace emflow::cli

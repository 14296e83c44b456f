// emflow attend: the contextual update of one layer (docs/MATH.md §1) on .npy files.
//
// The cloud's dtype decides the precision: float64 files are computed and written in float64,
// float32 in float32, and every other float input must match it. --precision bf16 rounds
// float32 inputs to bfloat16 and writes the update as float32 (numpy has no bfloat16; the values
// are exactly the stored bfloat16 ones); --precision fp16 reads float16 ('<f2') or float32
// (rounded) files and writes the update as float16. lse, entropy and weights are float32 for
// both (docs/MATH.md §7). --precision tf32 reads float32 files and permits TF32 products: the
// CPU and the reference compute them in fp32, which meets TF32's accuracy; the GPU runs the dense
// form on the tensor cores with TF32 operands (float32 products where weights are asked). Every
// input is read and
// checked, the update is computed, and only then are the outputs written, all or none.
#include <CLI/CLI.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>

#include "commands.hpp"
#include "common.hpp"
#include "distributed_commands.hpp"
#include "emflow/attention.hpp"
#include "emflow/distributed.hpp"
#include "emflow/finite.hpp"
#include "emflow/io.hpp"
#include "emflow/memory.hpp"
#include "emflow/precision.hpp"
#include "job.hpp"
#include "storage.hpp"
#include "tools/problem.hpp"

namespace emflow::cli {
namespace {

struct AttendArguments {
  std::string cloud, relevance, content, key_bias, offset, key_lengths, queries, query_lengths;
  std::string update, lse, entropy, weights;
  double beta = 1.0;
  std::string mask = "none";
  std::string device = "auto";
  std::string precision = "fp32";
  int threads = 0;
  bool check_finite = false;
  bool distributed = false;
};

template <class T>
void run_attend(const AttendArguments& args, Dtype dtype, Precision precision) {
  const Mask mask = parse_mask(args.mask, "--mask");
  if (!std::isfinite(args.beta)) fail_option("--beta", "must be finite, got ", args.beta);
  ExecutionOptions options = execution_options(args.device, args.threads);
  if (precision == Precision::tf32) options.precision = Precision::tf32;
  // Fail before reading anything when the requested device is absent.
  naming_option("--device", [&] { return resolve_device(options.device); });

  const LayerFiles layer_files{args.relevance, args.content, args.key_bias, args.offset};
  OutputFiles outputs;
  outputs.declare("--out", args.update);
  if (!args.lse.empty()) outputs.declare("--lse", args.lse);
  if (!args.entropy.empty()) outputs.declare("--entropy", args.entropy);
  if (!args.weights.empty()) outputs.declare("--weights", args.weights);
  // An output over an input would replace it at the commit: refused, as a likely mistake.
  outputs.declare_input("--x", args.cloud);
  layer_files.declare_inputs(outputs);
  outputs.declare_input("--key-lengths", args.key_lengths);
  outputs.declare_input("--queries", args.queries);
  outputs.declare_input("--query-lengths", args.query_lengths);

  // The cloud: (N, d) is one cloud, (B, N, d) a batch.
  const Tensor<T> cloud = read_float_input<T>("--x", args.cloud, dtype, "--x", 2, 3);
  const bool batched = cloud.rank() == 3;
  const std::int64_t batch = batched ? cloud.extent(0) : 1;
  const std::int64_t tokens = cloud.extent(cloud.rank() - 2);
  const std::int64_t dim = cloud.extent(cloud.rank() - 1);
  const LayerArrays<T> layer = read_layer<T>(layer_files, dtype, dim);
  const std::int64_t heads = layer.heads;
  Tensor<std::int64_t> key_lengths;
  if (!args.key_lengths.empty()) {
    key_lengths = read_lengths("--key-lengths", args.key_lengths, batch, tokens, "(N from --x)");
  }

  // Queries of their own: (Nq, d) against an (N, d) cloud, (B, Nq, d) against a batch.
  Tensor<T> queries;
  std::int64_t query_tokens = tokens;
  if (!args.queries.empty()) {
    queries = read_float_input<T>("--queries", args.queries, dtype, "--x", 2, 3);
    query_tokens = queries.extent(queries.rank() - 2);
    const Shape want = batched ? Shape{batch, query_tokens, dim} : Shape{query_tokens, dim};
    expect_shape("--queries", args.queries, queries.shape(), want,
                 batched ? "(B and d from --x)" : "(d from --x)");
  }
  Tensor<std::int64_t> query_lengths;
  if (!args.query_lengths.empty()) {
    query_lengths = read_lengths("--query-lengths", args.query_lengths, batch, query_tokens,
                                 args.queries.empty() ? "(N from --x)" : "(Nq from --queries)");
  }

  if (args.check_finite) {
    require_finite(queries, "--queries '" + args.queries + "'");
    // Refuse NaN and infinity up front, naming the file and the first offending element.
    require_finite(cloud, "--x '" + args.cloud + "'");
    require_finite_layer(layer, layer_files);
  }

  AttentionInput<T> input = tools::layer_input(cloud.data(), batch, tokens, dim, heads,
                                               layer.relevance.data(), layer.content.data());
  input.layer = layer.operators();  // with the key bias and offset, where given
  input.beta = args.beta;
  input.mask = mask;
  input.key_lengths = key_lengths.size() > 0 ? key_lengths.data() : nullptr;
  if (queries.size() > 0) {
    input.queries = queries.data();
    input.query_tokens = query_tokens;
  }
  input.query_lengths = query_lengths.size() > 0 ? query_lengths.data() : nullptr;

  // Validate before allocating the outputs (the weights can be large). The update has the
  // queries' shape (the cloud's for self-attention).
  Tensor<T> update =
                allocate_output<T>("--out", queries.size() > 0 ? queries.shape() : cloud.shape()),
            lse, entropy, weights;
  AttentionOutput<T> output;
  output.update = update.data();
  // Sizes that overflow or cannot fit in memory are refused before anything is allocated.
  const std::int64_t rows = checked_element_count({batch, heads, query_tokens}, "--lse");
  if (!args.lse.empty() || !args.entropy.empty()) {
    expect_fits_in_memory("attend", "--lse/--entropy (B H N values)", rows, sizeof(T));
  }
  if (!args.weights.empty()) {
    expect_fits_in_memory("attend", "--weights (B H N N values)",
                          checked_element_count({rows, tokens}, "--weights"), sizeof(T));
    weights = allocate_output<T>("--weights", Shape{batch, heads, query_tokens, tokens});
    output.weights = weights.data();
  }
  if (!args.lse.empty()) {
    lse = allocate_output<T>("--lse", Shape{batch, heads, query_tokens});
    output.lse = lse.data();
  }
  if (!args.entropy.empty()) {
    entropy = allocate_output<T>("--entropy", Shape{batch, heads, query_tokens});
    output.entropy = entropy.data();
  }
  const bool stored_16bit = precision == Precision::bf16 || precision == Precision::fp16;
  if constexpr (std::is_same_v<T, float>) {
    if (stored_16bit) {
      attend_stored(precision, input, output, options);
    } else {
      attend(input, output, options);
    }
  } else {
    attend(input, output, options);
  }

  if (precision == Precision::fp16) {
    Tensor<float16> half(update.shape());  // exact: the values are float16 ones
    for (std::int64_t i = 0; i < update.size(); ++i) half[i] = to_float16(update[i]);
    outputs.stage_npy(args.update, half);
  } else {
    outputs.stage_npy(args.update, update);
  }
  if (!args.lse.empty()) outputs.stage_npy(args.lse, lse);
  if (!args.entropy.empty()) outputs.stage_npy(args.entropy, entropy);
  if (!args.weights.empty()) outputs.stage_npy(args.weights, weights);
  outputs.commit();
}

}  // namespace

void add_attend_command(CLI::App& app) {
  auto args = std::make_shared<AttendArguments>();
  CLI::App* command =
      add_command(app, "attend", "Contextual update of one attention layer on .npy files",
                  R"(For each query x_i and head h:
  s_ij = beta (x_i^T M_h x_j + u_h^T x_j),  p_ij = softmax_j(s_ij),
  delta_i = sum_h sum_j p_ij F_h x_j + c.
Inputs are float32 or float64 (all alike); outputs have the cloud's dtype. --precision bf16
rounds float32 inputs to bfloat16 and writes the update as float32; --precision fp16 reads
float16 or float32 inputs and writes the update as float16; lse, entropy and weights are
float32 for both. --precision tf32 (float32 inputs) permits TF32 products: devices cpu and
reference compute in fp32, which meets TF32's accuracy; device cuda runs the tensor cores
with TF32 operands (float32 products when --weights is asked). Outputs are written only when
the whole run succeeds.)");
  command->add_option("--x", args->cloud, "cloud X (.npy): (N, d), or a batch (B, N, d)")
      ->required();
  command
      ->add_option("--m", args->relevance, "relevance M (.npy): (d, d), or (H, d, d) for H heads")
      ->required();
  command->add_option("--f", args->content, "content F (.npy): the shape of M")->required();
  command->add_option("--key-bias", args->key_bias,
                      "key bias u (.npy): (H, d), or (d) for one head; adds beta u_h^T x_j");
  command->add_option("--offset", args->offset, "content offset c (.npy): (d)");
  command->add_option("--beta", args->beta, "inverse temperature, finite")->capture_default_str();
  command
      ->add_option("--mask", args->mask,
                   "none, causal (keys j <= i) or window:W (keys i-W < j <= i)")
      ->capture_default_str();
  command->add_option("--key-lengths", args->key_lengths,
                      "key lengths L (.npy, int32 or int64): (B), one per cloud (1 for an (N, d) "
                      "cloud); keys j >= L_b are hidden and queries i >= L_b get a zero update");
  command->add_option("--queries", args->queries,
                      "queries Q (.npy): (Nq, d), or (B, Nq, d) for a batch; the cloud --x is "
                      "then the keys, masks align the last query with the last key (query i at "
                      "L_b - Lq_b + i), and every output has Nq query rows");
  command->add_option("--query-lengths", args->query_lengths,
                      "query lengths Lq (.npy, int32 or int64): (B), one per cloud; queries "
                      "i >= Lq_b get a zero update (default: Nq, or the key lengths without "
                      "--queries)");
  add_device_option(*command, args->device);
  command
      ->add_option("--precision", args->precision,
                   "fp32 (the input's own precision), bf16 or fp16 (16-bit storage, float32 "
                   "accumulation), or tf32 (float32 input; permits TF32 products on the GPU's "
                   "tensor cores: cpu and reference compute fp32)")
      ->capture_default_str();
  add_threads_option(*command, args->threads);
  command->add_flag("--check-finite", args->check_finite,
                    "refuse inputs holding NaN or infinity, naming the file and the first such "
                    "element (without it a non-finite token reaches the queries that see it)");
  command
      ->add_option("--out", args->update,
                   "output: the update Delta (.npy), X's shape (Q's with --queries)")
      ->required();
  command->add_option("--lse", args->lse,
                      "output: log-sum-exp of the scores (.npy), (B, H, N), or (B, H, Nq) with "
                      "--queries; -inf for a query with no visible key");
  command->add_option("--entropy", args->entropy,
                      "output: attention entropy in nats (.npy), (B, H, N) or (B, H, Nq)");
  command->add_option("--weights", args->weights,
                      "output: attention weights P (.npy), (B, H, N, N), or (B, H, Nq, N) with "
                      "--queries; needs B H Nq N numbers");
  command->add_flag("--distributed", args->distributed,
                    "under mpirun: spread the tokens over the ranks (sequence-parallel ring); "
                    "rank 0 writes the same files as one process would");
  command->callback([args] {
    const Precision precision = parse_precision(args->precision, "--precision");
    const bool stored_16bit = precision == Precision::bf16 || precision == Precision::fp16;
    if (args->distributed) {
      // Refused through the job like every other error of a distributed run: once, by rank 0,
      // with the rank that saw it.
      distributed::agreed(job(), [&] {
        if (precision == Precision::tf32) {
          fail_option("--precision",
                      "tf32 is not supported with --distributed (the ring computes "
                      "in fp32 or fp64: use --precision fp32)");
        }
        if (stored_16bit) {
          fail_option("--precision", to_string(precision),
                      " is not supported with --distributed (the ring computes in fp32 or fp64)");
        }
        if (!args->queries.empty() || !args->query_lengths.empty()) {
          fail_option(args->queries.empty() ? "--query-lengths" : "--queries",
                      "is not supported with --distributed (the ring runs self-attention)");
        }
      });
      run_attend_distributed({args->cloud, args->relevance, args->content, args->key_bias,
                              args->offset, args->key_lengths, args->update, args->lse,
                              args->entropy, args->weights, args->beta, args->mask, args->device,
                              args->threads, args->check_finite});
      return;
    }
    const Dtype dtype = float_dtype("--x", args->cloud, precision == Precision::fp16);
    if (precision != Precision::fp32 && dtype == Dtype::float64) {
      fail_option("--precision", to_string(precision), " reads float32",
                  precision == Precision::fp16 ? " or float16" : "", " files; --x '", args->cloud,
                  "' holds float64");
    }
    if (dtype == Dtype::float64) {
      run_attend<double>(*args, dtype, precision);
    } else {
      run_attend<float>(*args, dtype, precision);
    }
  });
}

}  // namespace emflow::cli

// emflow generate: greedy decoding of a converted llama model (emflow::model::generate_greedy):
// the prompts' token ids through every layer with one decode cache per layer, then K new tokens
// one at a time. Everything is read and checked and every output declared first; the outputs are
// written only when the whole run succeeds, all or none.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/capability.hpp"
#include "emflow/gguf.hpp"
#include "emflow/io.hpp"
#include "emflow/model.hpp"
#include "tools/progress.hpp"

namespace emflow::cli {
namespace {

struct GenerateArguments {
  std::string model, ids, lengths, out, logits;
  std::string precision = "float32";
  std::string products = "fp32";
  std::int64_t new_tokens = 0;
  int threads = 0;
};

template <class T>
void run(const GenerateArguments& args) {
  OutputFiles outputs;
  outputs.declare("--out", args.out);
  if (!args.logits.empty()) outputs.declare("--logits", args.logits);
  outputs.declare_input("--ids", args.ids);
  outputs.declare_input("--lengths", args.lengths);
  for (const std::string& file : model::operator_files(args.model)) {
    outputs.declare_input("--model", file);
  }
  if (args.new_tokens < 1) fail_option("--new", "must be >= 1, got ", args.new_tokens);
  if (args.products != "fp32" && args.products != "bf16") {
    fail_option("--products", "expects fp32 or bf16, got '", args.products, "'");
  }
  if (args.products == "bf16" && !std::is_same_v<T, float>) {
    fail_option("--products",
                "bf16 needs --precision float32 (a float64 run's products are "
                "double), got --precision ",
                args.precision);
  }
  if (args.products == "bf16" && !this_machine().avx512_bf16) {
    fail_option("--products",
                "bf16 needs AVX512-BF16, which this processor lacks (or "
                "EMFLOW_CPU_DISABLE names it): use fp32");
  }

  Tensor<std::int64_t> ids = read_integer_input("--ids", args.ids, 1, 2);
  if (ids.rank() == 1) ids = ids.reshaped({1, ids.extent(0)});
  const std::int64_t B = ids.extent(0), N = ids.extent(1);
  if (B < 1 || N < 1) {
    fail_option("--ids", "'", args.ids, "' has shape ", to_string(ids.shape()),
                ", expected (N) or (B, N) with B, N >= 1");
  }
  std::vector<std::int64_t> lengths;
  if (!args.lengths.empty()) {
    lengths = read_lengths("--lengths", args.lengths, B, N, "(N from --ids)").values();
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      if (lengths[b] < 1) {
        fail_option("--lengths", "'", args.lengths, "' holds ", lengths[b], " for prompt ", b,
                    ", expected 1..", N, " (every prompt needs a token)");
      }
    }
  }
  const model::Model m =
      naming_option("--model", [&] { return model::read_operators(args.model); });
  if (m.layout != model::Layout::llama) {
    fail_option("--model", "'", args.model, "' is of the ", to_string(m.layout),
                " layout; generate needs a llama model (emflow convert MODEL.gguf)");
  }
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t n = lengths.empty() ? N : lengths[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t id = ids[b * N + i];
      if (id < 0 || id >= m.vocab_size()) {
        fail_option("--ids", "'", args.ids, "' holds ", id, " at (", b, ", ", i,
                    "), expected an id in [0, ", m.vocab_size(), ") (the vocabulary of '",
                    args.model, "')");
      }
    }
  }

  model::GenerateSettings settings;
  settings.new_tokens = args.new_tokens;
  settings.keep_logits = !args.logits.empty();
  settings.threads = args.threads;
  settings.products = args.products == "bf16" ? Precision::bf16 : Precision::fp32;
  tools::ProgressBar bar("emflow generate");
  settings.progress = bar.callback();
  const model::Generated<T> g = model::generate_greedy<T>(m, ids, lengths, settings);
  bar.finish();

  outputs.stage_npy(args.out, g.ids);
  if (!args.logits.empty()) outputs.stage_npy(args.logits, g.logits);
  outputs.commit();

  const std::int64_t K = args.new_tokens;
  const double prefill = std::accumulate(g.prefill_seconds.begin(), g.prefill_seconds.end(), 0.0);
  const double decode = std::accumulate(g.step_seconds.begin(), g.step_seconds.end(), 0.0);
  std::cout << std::setprecision(4) << "emflow generate: model '" << args.model << "' ("
            << m.layer_count() << " layers, d = " << m.dim << ", " << args.precision
            << (args.products == "bf16" ? ", bf16 products" : "") << "), " << B
            << " prompt(s) of up to " << N << " tokens, " << K << " new tokens each\n"
            << "  prefill " << prefill << " s, decode " << decode / static_cast<double>(B * K)
            << " s per new token (" << static_cast<double>(B * K) / decode << " tokens/s)\n";
  for (std::int64_t b = 0; b < B; ++b) {
    const std::vector<std::int64_t> row(g.ids.data() + b * K, g.ids.data() + (b + 1) * K);
    std::cout << "  prompt " << b << ":";
    for (std::int64_t id : row) std::cout << ' ' << id;
    std::cout << "\n";
    if (!m.vocabulary.empty()) {
      std::cout << "    '"
                << gguf::detokenize(m.vocabulary, m.tokenizer_model, row,
                                    args.model + "/vocabulary.json")
                << "'\n";
    }
  }
}

void run_generate(const GenerateArguments& args) {
  if (args.precision == "float32") {
    run<float>(args);
  } else if (args.precision == "float64") {
    run<double>(args);
  } else {
    fail_option("--precision", "expects float32 or float64, got '", args.precision, "'");
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArguments>();
  CLI::App* command = add_command(
      app, "generate", "Greedy next tokens of a converted llama model, with a cache per layer",
      R"(Reads the operator folder OPS (emflow convert MODEL.gguf --out OPS: a llama model) and
the prompts' token ids, --ids (N) or (B, N) int32/int64, right-padded to N with --lengths
(B) (the real tokens of each prompt; default N). Each prompt runs once through every layer,
each layer keeping a decode cache of its normalised inputs (rotary keys rotated once at
their positions, only the kv heads' keys and values); then K = --new times the last token's
final norm and unembedding give the logits, their argmax the next id, whose embedding runs
through every layer against the caches: O(L N d) per new token, the prompt never rerun.
Writes the new ids to --out, (B, K) int64, and with --logits every step's logits, (B, K,
vocab) in the --precision; both all or nothing. Prints the time per new token and, when
the folder has a vocabulary, the new tokens as text. The ids come from the model's own
tokenizer (transformers' AutoTokenizer); docs/MODELS.md has an example.)");
  command->add_option("--model", args->model, "operator folder of a llama model (emflow convert)")
      ->required();
  command->add_option("--ids", args->ids, "prompt token ids: (N) or (B, N) int32/int64 .npy")
      ->required();
  command->add_option("--lengths", args->lengths,
                      "(B) int32/int64 .npy: real tokens per prompt, the rest padding "
                      "(default: N for every prompt)");
  command->add_option("--new", args->new_tokens, "K >= 1: tokens to generate per prompt")
      ->required();
  command->add_option("--out", args->out, "the new ids, (B, K) int64 .npy")->required();
  command->add_option("--logits", args->logits,
                      "every step's logits, (B, K, vocab) .npy (optional)");
  command->add_option("--precision", args->precision,
                      "float32 (default) or float64: the state and the caches' element type");
  command->add_option("--products", args->products,
                      "fp32 (default) or bf16: the feed-forward blocks' and the unembedding's "
                      "products in a float32 run; bf16 stores their weights in bfloat16 and "
                      "rounds the activations entering them (float32 sums; AVX512-BF16 only)");
  add_threads_option(*command, args->threads);
  command->callback([args] { run_generate(*args); });
}

}  // namespace emflow::cli

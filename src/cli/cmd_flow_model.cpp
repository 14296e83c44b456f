// emflow flow --model: a converted model's own layers (emflow/model.hpp) on a token cloud, with
// the clouds after every layer, each layer's attention output, the observables and a picture.
// Everything is read and checked and every output declared first; the outputs are written only
// when the whole run succeeds, all or none.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <vector>

#include "common.hpp"
#include "emflow/gguf.hpp"
#include "emflow/io.hpp"
#include "emflow/model.hpp"
#include "flow_model.hpp"
#include "tools/cloud_statistics.hpp"
#include "tools/plot.hpp"

namespace emflow::cli {
namespace {

std::vector<std::string> read_labels(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    fail_option("--labels", "'", path, "' is a folder, expected a text file (one label a line)");
  }
  std::ifstream in(path);
  if (!in) fail_option("--labels", "'", path, "' cannot be opened");
  std::vector<std::string> labels;
  for (std::string line; std::getline(in, line);) labels.push_back(line);
  return labels;
}

// The mean cosine of the pairs i < j of the cloud's rows (tokens x dim).
double mean_cosine(std::vector<double> cloud, std::int64_t tokens, std::int64_t dim) {
  for (std::int64_t i = 0; i < tokens; ++i) {
    double norm = 0;
    for (std::int64_t a = 0; a < dim; ++a) norm += cloud[i * dim + a] * cloud[i * dim + a];
    norm = norm > 0 ? std::sqrt(norm) : 1.0;
    for (std::int64_t a = 0; a < dim; ++a) cloud[i * dim + a] /= norm;
  }
  double sum = 0;
  std::int64_t pairs = 0;
  for (std::int64_t i = 0; i < tokens; ++i) {
    for (std::int64_t j = i + 1; j < tokens; ++j, ++pairs) {
      for (std::int64_t a = 0; a < dim; ++a) sum += cloud[i * dim + a] * cloud[j * dim + a];
    }
  }
  return pairs ? sum / static_cast<double>(pairs) : 1.0;
}

template <class T>
void run(const ModelFlowArguments& args, Dtype dtype) {
  const ExecutionOptions options = execution_options(args.device, args.threads);
  naming_option("--device", [&] { return resolve_device(options.device); });
  OutputFiles outputs;
  if (!args.out.empty()) outputs.declare("--out", args.out);
  if (!args.attention_out.empty()) outputs.declare("--attention-out", args.attention_out);
  if (!args.metrics.empty()) outputs.declare("--metrics", args.metrics);
  if (!args.plot.empty()) outputs.declare("--plot", args.plot);
  if (!args.logits.empty()) outputs.declare("--logits", args.logits);
  if (!args.cosine_histogram.empty()) {
    outputs.declare("--cosine-histogram", args.cosine_histogram);
  }
  if (!args.cosine_counts.empty()) outputs.declare("--cosine-counts", args.cosine_counts);
  // Every file the run reads is an input no output may replace: the cloud, the key lengths, the
  // positions, the labels and each file of the operator folder (its manifest and every file it
  // lists).
  outputs.declare_input("--cloud", args.cloud);
  outputs.declare_input("--key-lengths", args.key_lengths);
  outputs.declare_input("--positions", args.positions);
  outputs.declare_input("--labels", args.labels);
  for (const std::string& file : model::operator_files(args.model)) {
    outputs.declare_input("--model", file);
  }

  const model::Model m =
      naming_option("--model", [&] { return model::read_operators(args.model); });
  Tensor<T> cloud = read_float_input<T>("--cloud", args.cloud, dtype, "--cloud", 2, 3);
  if (cloud.rank() == 2) cloud = cloud.reshaped({1, cloud.extent(0), cloud.extent(1)});
  const std::int64_t B = cloud.extent(0), N = cloud.extent(1), d = cloud.extent(2);
  if (N < 2) {
    fail_option("--cloud", "'", args.cloud, "' has ", N,
                " token per cloud, expected at least 2 (the observables compare pairs of tokens)");
  }
  if (d != m.dim) {
    fail_option("--cloud", "'", args.cloud, "' has tokens of dimension ", d, ", but the model '",
                args.model, "' has d = ", m.dim);
  }
  std::vector<std::int64_t> lengths;
  if (!args.key_lengths.empty()) {
    const Tensor<std::int64_t> k = read_integer_input("--key-lengths", args.key_lengths, 1, 1);
    expect_shape("--key-lengths", args.key_lengths, k.shape(), {B}, "(one per cloud of --cloud)");
    lengths = k.values();
    for (std::int64_t len : lengths) {
      if (len < 2 || len > N) {
        fail_option("--key-lengths", "'", args.key_lengths, "' holds ", len, ", expected 2..", N,
                    " (the observables compare pairs of real tokens)");
      }
    }
  }
  std::vector<std::string> labels;
  if (!args.labels.empty()) {
    labels = read_labels(args.labels);
    const std::int64_t real = lengths.empty() ? N : lengths[0];
    if (static_cast<std::int64_t>(labels.size()) != real) {
      fail_option("--labels", "'", args.labels, "' holds ", labels.size(),
                  " lines, expected one per real token of cloud 0 (", real, ")");
    }
  }

  model::RunSettings settings;
  settings.full_layer = !args.attention_only;
  const bool llama = m.layout == model::Layout::llama;
  const std::string form = args.form.empty() ? (llama ? "factored" : "emf") : args.form;
  if (form != "emf" && form != "factored") {
    fail_option("--form", "expects emf or factored, got '", form, "'");
  }
  if (llama && form != "factored") {
    fail_option("--form", "is emf, but the llama model '", args.model,
                "' has rotary positions: its relevance depends on the offset of two positions "
                "and has no single dense M_h (docs/MATH.md 2.4); use --form factored");
  }
  if (!args.logits.empty() && m.vocab_size() == 0) {
    fail_option("--logits", "needs a model with an unembedding (llama), but '", args.model,
                "' is of the ", to_string(m.layout), " layout");
  }
  settings.factored = form == "factored";
  settings.cluster_eps = args.cluster_eps;
  if (!args.positions.empty()) {
    if (!llama) {
      fail_option("--positions", "gives rotary positions, but the model '", args.model,
                  "' is of the ", to_string(m.layout), " layout, which has none");
    }
    const Tensor<std::int64_t> p = read_integer_input("--positions", args.positions, 1, 2);
    if (!(p.shape() == Shape{B, N} || (B == 1 && p.shape() == Shape{N}))) {
      expect_shape("--positions", args.positions, p.shape(), {B, N},
                   "(one per token of --cloud; (N) for one cloud)");
    }
    settings.positions = p.values();
  }
  const model::ModelTrace<T> trace = model::run_model(m, cloud, lengths, settings, options);
  const std::int64_t L = m.layer_count();

  // The measurements of the cloud the library's observables leave out, on each cloud's real
  // tokens in double: the effective rank (--metrics, --plot) and the cosine histogram.
  const auto real_tokens = [&](std::int64_t b) { return lengths.empty() ? N : lengths[b]; };
  const auto record = [&](std::int64_t r, std::int64_t b) {
    const T* from = trace.trajectory.data() + (r * B + b) * N * d;
    return std::vector<double>(from, from + real_tokens(b) * d);
  };
  std::vector<double> ranks;  // (L + 1) * B, record r of cloud b at r * B + b
  if (!args.metrics.empty() || !args.plot.empty()) {
    for (std::int64_t r = 0; r <= L; ++r) {
      for (std::int64_t b = 0; b < B; ++b) {
        ranks.push_back(tools::effective_rank(record(r, b).data(), real_tokens(b), d));
      }
    }
  }
  if (!args.cosine_histogram.empty() || !args.cosine_counts.empty()) {
    Tensor<std::int64_t> counts(Shape{L + 1, B, cosine_bins});
    for (std::int64_t r = 0; r <= L; ++r) {
      for (std::int64_t b = 0; b < B; ++b) {
        const std::vector<std::int64_t> h =
            tools::cosine_histogram(record(r, b).data(), real_tokens(b), d, cosine_bins);
        std::copy(h.begin(), h.end(), counts.data() + (r * B + b) * cosine_bins);
      }
    }
    if (!args.cosine_counts.empty()) outputs.stage_npy(args.cosine_counts, counts);
    if (!args.cosine_histogram.empty()) {
      tools::CosineHistogramPicture picture;
      picture.records = L + 1;
      picture.bins = cosine_bins;
      for (std::int64_t r = 0; r <= L; ++r) {
        const std::int64_t* from = counts.data() + r * B * cosine_bins;  // cloud 0
        picture.counts.insert(picture.counts.end(), from, from + cosine_bins);
        picture.mean_cosine.push_back(mean_cosine(record(r, 0), real_tokens(0), d));
      }
      std::ostringstream title;
      title << m.model_type << ", " << L << " layers, "
            << (args.attention_only ? "attention only" : "full layers") << ": pairwise cosines of "
            << real_tokens(0) << " tokens";
      picture.title = title.str();
      outputs.stage_bytes(args.cosine_histogram, tools::draw_cosine_histogram(picture));
    }
  }
  if (!args.out.empty()) outputs.stage_npy(args.out, trace.trajectory);
  if (!args.attention_out.empty()) outputs.stage_npy(args.attention_out, trace.attention);
  // The greedy next token of each cloud, printed after the outputs are written.
  std::vector<std::int64_t> next_tokens;
  if (!args.logits.empty()) {
    const Tensor<T> last =
        Tensor<T>(Shape{B, N, d}, std::vector<T>(trace.trajectory.values().end() - B * N * d,
                                                 trace.trajectory.values().end()));
    const Tensor<T> logits = model::next_token_logits(m, last, lengths);
    const std::int64_t V = logits.extent(1);
    for (std::int64_t b = 0; b < B; ++b) {
      const T* row = logits.data() + b * V;
      next_tokens.push_back(std::max_element(row, row + V) - row);
    }
    outputs.stage_npy(args.logits, logits);
  }
  if (!args.metrics.empty()) {
    std::ostringstream csv;
    csv << std::setprecision(9)
        << "layer,cloud,min_inner,mean_inner,clustered_fraction,clusters,energy,entropy,"
           "diameter,effective_rank\n";
    for (std::int64_t r = 0; r <= L; ++r) {
      for (std::int64_t b = 0; b < B; ++b) {
        const flow::Observables& o = trace.observables[static_cast<std::size_t>(r * B + b)];
        csv << r << ',' << b << ',' << o.min_inner << ',' << o.mean_inner << ','
            << o.clustered_fraction << ',' << o.clusters << ',' << o.energy << ',' << o.entropy
            << ',' << o.diameter << ',' << ranks[static_cast<std::size_t>(r * B + b)] << '\n';
      }
    }
    outputs.stage_bytes(args.metrics, csv.str());
  }
  if (!args.plot.empty()) {
    tools::ModelPicture picture;
    picture.records = L + 1;
    picture.tokens = lengths.empty() ? N : lengths[0];
    picture.dim = d;
    for (std::int64_t r = 0; r <= L; ++r) {
      const T* from = trace.trajectory.data() + r * B * N * d;  // cloud 0, its real tokens
      picture.trajectory.insert(picture.trajectory.end(), from, from + picture.tokens * d);
      picture.entropy.push_back(trace.observables[static_cast<std::size_t>(r * B)].entropy);
      picture.clusters.push_back(trace.observables[static_cast<std::size_t>(r * B)].clusters);
      picture.effective_rank.push_back(ranks[static_cast<std::size_t>(r * B)]);
    }
    picture.labels = labels;
    std::ostringstream title;
    title << m.model_type << " (" << to_string(m.layout) << " layout), " << L << " layers, "
          << m.heads << " heads, d = " << d << ": "
          << (args.attention_only ? "attention only" : "full layers") << ", N = " << picture.tokens;
    picture.title = title.str();
    picture.cluster_eps = args.cluster_eps;
    outputs.stage_bytes(args.plot, tools::draw_model_flow(picture));
  }
  outputs.commit();
  const flow::Observables& last = trace.observables[static_cast<std::size_t>(L * B)];
  std::cout << std::setprecision(4) << "emflow flow: model '" << args.model << "' (" << L
            << " layers, " << (args.attention_only ? "attention only" : "full layers") << ") on "
            << B << " cloud(s) of " << N << " tokens in d = " << d << "\n"
            << "  cloud 0 after the last layer: clusters " << last.clusters << ", mean <x_i,x_j> "
            << last.mean_inner << ", min <x_i,x_j> " << last.min_inner << "\n";
  for (std::size_t b = 0; b < next_tokens.size(); ++b) {
    std::cout << "  cloud " << b << ": greedy next token " << next_tokens[b];
    if (next_tokens[b] < static_cast<std::int64_t>(m.vocabulary.size())) {
      std::cout << " '"
                << gguf::detokenize(m.vocabulary, m.tokenizer_model, {next_tokens[b]},
                                    args.model + "/vocabulary.json")
                << "'";
    }
    std::cout << "\n";
  }
}

}  // namespace

void run_model_flow(const ModelFlowArguments& args) {
  if (args.cloud.empty()) fail_option("--model", "needs --cloud (the cloud entering layer 0)");
  const Dtype dtype = float_dtype("--cloud", args.cloud);
  if (dtype == Dtype::float32) {
    run<float>(args, dtype);
  } else {
    run<double>(args, dtype);
  }
}

}  // namespace emflow::cli

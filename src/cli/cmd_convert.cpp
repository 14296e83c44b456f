// emflow convert: a pretrained checkpoint (config.json and model.safetensors) as EMF operators,
// one folder of .npy files and a manifest (emflow/model.hpp, docs/MODELS.md), with an optional
// report of the spectra the clustering theorems speak about, or for a rotary (llama) model of
// how each head's relevance turns with the offset of query and key.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/finite.hpp"
#include "emflow/model.hpp"
#include "tools/spectrum.hpp"

namespace emflow::cli {
namespace {

struct ConvertArguments {
  std::string model_dir, out, layout, dtype;
  std::vector<std::string> names;
  bool report = false;
};

std::string number(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

// Per layer and head: the eigenvalues of (M_h + M_h^T) / 2 and of F_h. Prints a summary line
// per head and returns the CSV (layer, head, operator, index, real, imag).
std::string spectrum_report(const model::Model& m) {
  std::ostringstream csv;
  csv << "layer,head,operator,index,real,imag\n";
  const std::int64_t d = m.dim;
  std::printf("%5s %4s | %-37s | %-50s\n", "layer", "head", "sym(M_h): min, max, #>0, #<0",
              "F_h: max |l|, max Re, min Re, #nonzero, #complex");
  for (std::int64_t l = 0; l < m.layer_count(); ++l) {
    const auto& ops = m.layers[static_cast<std::size_t>(l)].operators;
    for (std::int64_t h = 0; h < m.heads; ++h) {
      // LAPACK fails on a NaN or infinity ("dsyev failed"): say which operator holds one.
      for (const auto& [name, tensor] :
           {std::pair<const char*, const Tensor<double>*>{"M_h", &ops.relevance},
            {"F_h", &ops.content}}) {
        const std::int64_t at = find_non_finite(tensor->data() + h * d * d, d * d);
        if (at >= 0) {
          fail_option("--report", "needs finite operators, but ", name, " of layer ", l, " head ",
                      h, " holds ", tensor->data()[h * d * d + at], " at ", multi_index({d, d}, at),
                      " (the checkpoint's weights of layer ", l, " are not all finite)");
        }
      }
      const auto sym = tools::symmetric_eigenvalues(
          tools::symmetric_part(ops.relevance.data() + h * d * d, d), d);
      const std::vector<double> f(ops.content.data() + h * d * d,
                                  ops.content.data() + (h + 1) * d * d);
      const auto eig = tools::eigenvalues(f, d);
      // M_h and F_h have rank at most 2 d_k and d_v: eigenvalues below 1e-9 of the largest
      // are rounding noise of zeros, not counted.
      double sym_max = 0, radius = 0;
      for (std::int64_t k = 0; k < d; ++k) {
        sym_max = std::max(sym_max, std::abs(sym[k]));
        radius = std::max(radius, std::abs(eig[k]));
      }
      std::int64_t positive = 0, negative = 0, complex_count = 0, nonzero = 0;
      for (std::int64_t k = 0; k < d; ++k) {
        csv << l << ',' << h << ",sym_M," << k << ',' << number(sym[k]) << ",0\n";
        positive += sym[k] > 1e-9 * sym_max;
        negative += sym[k] < -1e-9 * sym_max;
      }
      for (std::int64_t k = 0; k < d; ++k) {
        csv << l << ',' << h << ",F," << k << ',' << number(eig[k].real()) << ','
            << number(eig[k].imag()) << '\n';
        if (std::abs(eig[k]) > 1e-9 * radius) {
          ++nonzero;
          complex_count += std::abs(eig[k].imag()) > 1e-9 * radius;
        }
      }
      std::printf(
          "%5lld %4lld | %10.4g %10.4g %5lld %5lld     | %10.4g %10.4g %10.4g %5lld %5lld\n",
          static_cast<long long>(l), static_cast<long long>(h), sym.front(), sym.back(),
          static_cast<long long>(positive), static_cast<long long>(negative), radius,
          eig.front().real(), eig.back().real(), static_cast<long long>(nonzero),
          static_cast<long long>(complex_count));
    }
  }
  return csv.str();
}

// Per layer and head of a llama model: how its rotary bilinear form M_h(t) = A_h^T R(-t) B_g
// turns with the offset t of query and key (emflow::rotary_drift, docs/MATH.md §2.4), at
// t = 1, 2, 4, ..., 4096. Qwen2's q and k biases take part as the extra coordinate the layer
// lifts the cloud by. Prints a line per head (the cosine at a few offsets, the relative change
// at the last, and the first offset where the cosine falls below 1/2) and returns the CSV
// (layer, head, kv_head, offset, relative_change, cosine).
std::string rotary_report(const model::Model& m) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t t = 1; t <= 4096; t *= 2) offsets.push_back(t);
  std::ostringstream csv;
  csv << "layer,head,kv_head,offset,relative_change,cosine\n";
  std::printf("%5s %4s %3s | %-44s | %-12s | %s\n", "layer", "head", "kv",
              "cos(M(t), M(0)) at t = 1, 8, 64, 512, 4096", "|dM|/|M| 4096", "cos < 1/2 from t");
  const std::int64_t d = m.dim, rank = m.head_dim, group = m.heads / m.key_heads();
  for (std::int64_t l = 0; l < m.layer_count(); ++l) {
    const MultiHeadAttentionWeights& w = m.layers[static_cast<std::size_t>(l)].attention;
    const bool biases = w.query_bias.size() > 0 || w.key_bias.size() > 0;
    const std::int64_t width = d + (biases ? 1 : 0);
    // The factor of `head` as rank x width rows, its bias (if any) as the last column.
    const auto factor = [&](const Tensor<double>& weights, const Tensor<double>& bias,
                            std::int64_t head) {
      std::vector<double> f(static_cast<std::size_t>(rank * width), 0.0);
      for (std::int64_t a = 0; a < rank; ++a) {
        const std::int64_t row = head * rank + a;
        std::copy(weights.data() + row * d, weights.data() + (row + 1) * d, f.begin() + a * width);
        if (biases && bias.size() > 0) f[static_cast<std::size_t>(a * width + d)] = bias[row];
      }
      return f;
    };
    for (std::int64_t h = 0; h < m.heads; ++h) {
      const std::int64_t g = h / group;
      const std::vector<double> a = factor(w.query, w.query_bias, h);
      const std::vector<double> b = factor(w.key, w.key_bias, g);
      for (const auto* f : {&a, &b}) {
        const std::int64_t at = find_non_finite(f->data(), static_cast<std::int64_t>(f->size()));
        if (at >= 0) {
          fail_option("--report", "needs finite weights, but the ", f == &a ? "query" : "key",
                      " factor of layer ", l, " head ", f == &a ? h : g, " holds ",
                      (*f)[static_cast<std::size_t>(at)]);
        }
      }
      const RotaryDrift drift =
          rotary_drift(a.data(), b.data(), rank, width, m.rotary_embedding(), offsets);
      std::int64_t half = -1;
      for (std::size_t k = 0; k < offsets.size(); ++k) {
        csv << l << ',' << h << ',' << g << ',' << offsets[k] << ','
            << number(drift.relative_change[k]) << ',' << number(drift.cosine[k]) << '\n';
        if (half < 0 && drift.cosine[k] < 0.5) half = offsets[k];
      }
      const auto cosine_at = [&](std::int64_t t) {
        const auto k = std::find(offsets.begin(), offsets.end(), t) - offsets.begin();
        return drift.cosine[static_cast<std::size_t>(k)];
      };
      std::printf("%5lld %4lld %3lld | %8.4f %8.4f %8.4f %8.4f %8.4f | %12.4g | %s\n",
                  static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(g),
                  cosine_at(1), cosine_at(8), cosine_at(64), cosine_at(512), cosine_at(4096),
                  drift.relative_change.back(), half < 0 ? "-" : std::to_string(half).c_str());
    }
  }
  return csv.str();
}

void run_convert(const ConvertArguments& args) {
  model::ConvertOptions options;
  options.layout = args.layout;
  for (const std::string& item : args.names) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      fail_option("--name", "expects ROLE=PATTERN (e.g. query.weight=enc.{layer}.q.weight), got '",
                  item, "'");
    }
    options.names[item.substr(0, eq)] = item.substr(eq + 1);
  }
  model::StorageType storage = model::StorageType::automatic;
  if (args.dtype == "float32") {
    storage = model::StorageType::float32;
  } else if (args.dtype == "float64") {
    storage = model::StorageType::float64;
  } else if (!args.dtype.empty()) {
    fail_option("--dtype", "expects float32 or float64, got '", args.dtype, "'");
  }
  // The target is checked before the conversion's work, and again when it is written.
  model::check_operators_target(args.out);
  const model::Model m = model::load_checkpoint(args.model_dir, options);
  const bool llama = m.layout == model::Layout::llama;
  std::map<std::string, std::string> extra;
  if (args.report && llama) {
    // No single M_h (its relevance depends on the offset of two positions): how it turns.
    extra["rotary.csv"] = rotary_report(m);
  } else if (args.report) {
    extra["spectrum.csv"] = spectrum_report(m);
  }
  model::write_operators(m, args.out, extra, storage);
  std::cout << "emflow convert: " << to_string(m.layout) << " model ('" << m.model_type << "'), "
            << m.layer_count() << " layers, " << m.heads << " heads";
  if (llama) {
    std::cout << " (" << m.key_heads() << " kv heads), rotary over " << m.rotary.dim << " of "
              << m.head_dim << " (base " << m.rotary.base << ", "
              << (m.rotary_frequencies.empty() ? to_string(m.rotary.scaling)
                                               : "per-frequency factors")
              << "), vocabulary " << m.vocab_size() << (m.unembedding.size() > 0 ? "" : " (tied)");
  }
  std::cout << ", d = " << m.dim << ", feed-forward " << m.ffn_dim << ", "
            << (m.pre_norm ? "pre" : "post") << "-norm (" << (llama ? "rms, " : "") << "eps "
            << m.norm_eps << "), " << to_string(m.activation) << (m.causal ? ", causal" : "")
            << " -> " << args.out
            << (args.report ? (llama ? " (the rotary forms' drift in rotary.csv)"
                                     : " (spectra in spectrum.csv)")
                            : "")
            << "\n";
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArguments>();
  CLI::App* command = add_command(
      app, "convert", "Turn a pretrained checkpoint's layers into EMF operators (.npy folder)",
      R"(Reads MODEL_DIR/config.json and MODEL_DIR/model.safetensors, finds the layers by
their names (BERT-style encoder.layer.N.attention.self.query, GPT-2-style h.N.attn.c_attn,
optionally prefixed bert., roberta. or transformer.), and writes per layer the exact EMF
operators M_h, F_h, u_h, c (docs/MATH.md section 3, in float64), the factored Q/K/V/O
weights, the layer norms and the feed-forward weights, plus manifest.json. A llama model
(model_type llama, or a GGUF file MODEL.gguf of the llama architecture) has rotary
positions and no dense M_h: its folder holds the factored weights, the RMSNorm gains, the
gated feed-forward, the embedding and the unembedding (float32 by default). The folder is
written all or nothing. Other models with rotary or relative position embeddings are
refused. docs/MODELS.md has the layouts, the roles of --name and the folder's files.)");
  command
      ->add_option("MODEL_DIR", args->model_dir,
                   "model folder (config.json, model.safetensors) or a GGUF file (.gguf)")
      ->required();
  command
      ->add_option("--out", args->out,
                   "operator folder to write (must not exist, or be an "
                   "earlier operator folder)")
      ->required();
  command->add_option("--layout", args->layout,
                      "bert, gpt2 or llama (default: found from the names and the model_type)");
  command->add_option("--dtype", args->dtype,
                      "float32 or float64: the files' element type (default: float64 for bert "
                      "and gpt2, float32 for llama)");
  command->add_option("--name", args->names,
                      "ROLE=PATTERN: the tensor name of a role, {layer} for the layer index "
                      "(roles: docs/MODELS.md)");
  command->add_flag("--report", args->report,
                    "print per layer and head the spectrum of sym(M_h) and of F_h, and write "
                    "every eigenvalue to OPS_DIR/spectrum.csv; for a llama model, how each "
                    "head's rotary form M_h(t) turns with the offset t = 1, 2, ..., 4096 of "
                    "query and key (cosine with M_h(0), relative change), in OPS_DIR/rotary.csv");
  command->callback([args] { run_convert(*args); });
}

}  // namespace emflow::cli

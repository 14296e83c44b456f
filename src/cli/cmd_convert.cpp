// emflow convert: a pretrained checkpoint (config.json and model.safetensors) as EMF operators,
// one folder of .npy files and a manifest (emflow/model.hpp, docs/MODELS.md), with an optional
// report of the spectra the clustering theorems speak about.
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdio>
#include <iostream>
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
  if (args.report && llama) {
    fail_option("--report", "needs the dense operators M_h, F_h, which the llama model '",
                args.model_dir,
                "' has not (its rotary relevance depends on the offset of two "
                "positions: docs/MATH.md 2.4)");
  }
  std::map<std::string, std::string> extra;
  if (args.report) extra["spectrum.csv"] = spectrum_report(m);
  model::write_operators(m, args.out, extra, storage);
  std::cout << "emflow convert: " << to_string(m.layout) << " model ('" << m.model_type << "'), "
            << m.layer_count() << " layers, " << m.heads << " heads";
  if (llama) {
    std::cout << " (" << m.key_heads() << " kv heads), rotary over " << m.rotary.dim << " of "
              << m.head_dim << " (base " << m.rotary.base << ", " << to_string(m.rotary.scaling)
              << "), vocabulary " << m.vocab_size() << (m.unembedding.size() > 0 ? "" : " (tied)");
  }
  std::cout << ", d = " << m.dim << ", feed-forward " << m.ffn_dim << ", "
            << (m.pre_norm ? "pre" : "post") << "-norm (" << (llama ? "rms, " : "") << "eps "
            << m.norm_eps << "), " << to_string(m.activation) << (m.causal ? ", causal" : "")
            << " -> " << args.out << (args.report ? " (spectra in spectrum.csv)" : "") << "\n";
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
                    "every eigenvalue to OPS_DIR/spectrum.csv");
  command->callback([args] { run_convert(*args); });
}

}  // namespace emflow::cli

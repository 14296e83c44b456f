// emflow Python module: pretrained models (emflow/model.hpp). The package's layer is
// emflow.model (python/emflow/model.py); this part holds a model::Model and hands its runs,
// logits and greedy generation the arrays, with the GIL released while they compute.
#include "emflow/model.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "emflow/gguf.hpp"
#include "operators.hpp"

namespace emflow::python {
namespace {

namespace fs = std::filesystem;

// The Model a path names: an operator folder (manifest.json), a GGUF file or a checkpoint folder.
model::Model load(const std::string& path) {
  if (fs::is_directory(path) && fs::exists(fs::path(path) / "manifest.json")) {
    return model::read_operators(path);
  }
  return model::load_checkpoint(path);  // a folder, or a .gguf file (load_gguf)
}

std::vector<std::int64_t> lengths_of(const std::optional<std::vector<std::int64_t>>& lengths) {
  return lengths ? *lengths : std::vector<std::int64_t>{};
}

template <class T>
nb::object run(const model::Model& m, const InArray& clouds,
               const std::optional<std::vector<std::int64_t>>& key_lengths, bool full_layer,
               bool factored, int threads,
               const std::optional<std::vector<std::int64_t>>& positions) {
  const Placement place{"Model.run", nb::dtype<T>(), nb::device::cpu::value, 0, "clouds", false};
  const Tensor<T> x = host_copy<T>(place, "clouds", clouds);
  model::RunSettings settings;
  settings.full_layer = full_layer;
  settings.factored = factored;
  settings.positions = lengths_of(positions);  // (B * N) or empty
  ExecutionOptions options;
  options.device = Device::cpu;
  options.threads = threads;
  model::ModelTrace<T> trace;
  {
    nb::gil_scoped_release release;
    trace = model::run_model(m, x, lengths_of(key_lengths), settings, options);
  }
  std::vector<double> entropy;
  for (const flow::Observables& o : trace.observables) entropy.push_back(o.entropy);
  const std::int64_t L = m.layer_count(), B = x.extent(0);
  return nb::make_tuple(to_numpy(std::move(trace.trajectory)), to_numpy(std::move(trace.attention)),
                        to_numpy(std::move(entropy), Shape{L + 1, B}));
}

template <class T>
nb::object logits(const model::Model& m, const InArray& clouds,
                  const std::optional<std::vector<std::int64_t>>& key_lengths) {
  const Placement place{"Model.logits", nb::dtype<T>(), nb::device::cpu::value, 0, "clouds", false};
  const Tensor<T> x = host_copy<T>(place, "clouds", clouds);
  Tensor<T> out;
  {
    nb::gil_scoped_release release;
    out = model::next_token_logits(m, x, lengths_of(key_lengths));
  }
  return to_numpy(std::move(out));
}

template <class T>
nb::object generate(const model::Model& m, const Tensor<std::int64_t>& ids,
                    const std::vector<std::int64_t>& lengths,
                    const model::GenerateSettings& settings) {
  model::Generated<T> g;
  {
    nb::gil_scoped_release release;
    g = model::generate_greedy<T>(m, ids, lengths, settings);
  }
  const auto B = static_cast<std::int64_t>(g.prefill_seconds.size());
  const std::int64_t K = settings.new_tokens;
  nb::object logits = settings.keep_logits ? to_numpy(std::move(g.logits)) : nb::none();
  return nb::make_tuple(to_numpy(std::move(g.ids)), logits,
                        to_numpy(std::move(g.prefill_seconds), Shape{B}),
                        to_numpy(std::move(g.step_seconds), Shape{B, K}));
}

}  // namespace

void bind_model(nb::module_& m) {
  nb::class_<model::Model>(m, "Model",
                           "emflow::model::Model: a pretrained transformer as EMF operators. Use "
                           "emflow.model.Model.")
      .def(
          "__init__",
          [](model::Model* self, const std::string& path) {
            model::Model loaded;
            {
              nb::gil_scoped_release release;
              loaded = load(path);
            }
            new (self) model::Model(std::move(loaded));
          },
          nb::arg("path"))
      .def_prop_ro("layout", [](const model::Model& x) { return std::string(to_string(x.layout)); })
      .def_prop_ro("layers", &model::Model::layer_count)
      .def_prop_ro("dim", [](const model::Model& x) { return x.dim; })
      .def_prop_ro("heads", [](const model::Model& x) { return x.heads; })
      .def_prop_ro("kv_heads", &model::Model::key_heads)
      .def_prop_ro("head_dim", [](const model::Model& x) { return x.head_dim; })
      .def_prop_ro("vocab_size", &model::Model::vocab_size)
      .def_prop_ro("causal", [](const model::Model& x) { return x.causal; })
      .def_prop_ro("vocabulary", [](const model::Model& x) { return x.vocabulary; })
      .def(
          "embed",
          [](const model::Model& x, const std::vector<std::int64_t>& ids) {
            const std::int64_t V = x.vocab_size(), d = x.dim;
            if (V == 0) {
              refuse("Model.embed", "self",
                     std::string("is a ") + to_string(x.layout) +
                         " model without a token embedding (only llama models keep one)");
            }
            std::vector<float> rows;
            rows.reserve(ids.size() * static_cast<std::size_t>(d));
            for (std::size_t i = 0; i < ids.size(); ++i) {
              const std::int64_t id = ids[i];
              if (id < 0 || id >= V) {
                refuse("Model.embed", "ids",
                       "holds " + std::to_string(id) + " at " + std::to_string(i) +
                           ", expected an id in [0, " + std::to_string(V) + ")");
              }
              for (std::int64_t a = 0; a < d; ++a) {
                rows.push_back(static_cast<float>(x.embedding[id * d + a]));
              }
            }
            return to_numpy(
                Tensor<float>(Shape{static_cast<std::int64_t>(ids.size()), d}, std::move(rows)));
          },
          nb::arg("ids"))
      .def(
          "run",
          [](const model::Model& x, const InArray& clouds,
             const std::optional<std::vector<std::int64_t>>& key_lengths, bool full_layer,
             bool factored, int threads,
             const std::optional<std::vector<std::int64_t>>& positions) {
            if (clouds.dtype() == nb::dtype<double>()) {
              return run<double>(x, clouds, key_lengths, full_layer, factored, threads, positions);
            }
            return run<float>(x, clouds, key_lengths, full_layer, factored, threads, positions);
          },
          nb::arg("clouds"), nb::arg("key_lengths").none(), nb::arg("full_layer"),
          nb::arg("factored"), nb::arg("threads"), nb::arg("positions").none() = nb::none())
      .def(
          "logits",
          [](const model::Model& x, const InArray& clouds,
             const std::optional<std::vector<std::int64_t>>& key_lengths) {
            if (clouds.dtype() == nb::dtype<double>())
              return logits<double>(x, clouds, key_lengths);
            return logits<float>(x, clouds, key_lengths);
          },
          nb::arg("clouds"), nb::arg("key_lengths").none())
      .def(
          "generate",
          [](const model::Model& x, const InArray& ids,
             const std::optional<std::vector<std::int64_t>>& lengths, std::int64_t new_tokens,
             bool float64, bool bf16_products, bool keep_logits, int threads) {
            const Placement place{"Model.generate",
                                  nb::dtype<std::int64_t>(),
                                  nb::device::cpu::value,
                                  0,
                                  "ids",
                                  false};
            const Tensor<std::int64_t> id_tensor = host_copy<std::int64_t>(place, "ids", ids);
            model::GenerateSettings settings;
            settings.new_tokens = new_tokens;
            settings.keep_logits = keep_logits;
            settings.threads = threads;
            settings.products = bf16_products ? Precision::bf16 : Precision::fp32;
            return float64 ? generate<double>(x, id_tensor, lengths_of(lengths), settings)
                           : generate<float>(x, id_tensor, lengths_of(lengths), settings);
          },
          nb::arg("ids"), nb::arg("lengths").none(), nb::arg("new_tokens"), nb::arg("float64"),
          nb::arg("bf16_products"), nb::arg("keep_logits"), nb::arg("threads"))
      .def(
          "detokenize",
          [](const model::Model& x, const std::vector<std::int64_t>& ids) {
            const std::string text =
                gguf::detokenize(x.vocabulary, x.tokenizer_model, ids, "the model's vocabulary");
            return nb::bytes(text.data(), text.size());
          },
          nb::arg("ids"));
}

}  // namespace emflow::python

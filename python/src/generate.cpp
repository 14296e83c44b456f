// emflow Python module: decoding through a stack of layers (emflow/generate.hpp): the class
// DecodingStack and the flow's generation. The layers come from M and F as the flow takes them
// (operators.hpp); the computation runs with the GIL released.
#include "emflow/generate.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "operators.hpp"

namespace emflow::python {
namespace {

/// The L layers of a stack in R^dim (one shared layer given L times), as emflow flow builds them.
std::vector<flow::FlowLayer<float>> stack_layers(const Placement& place,
                                                 const nb::handle& relevance,
                                                 const nb::handle& content, std::int64_t dim,
                                                 std::int64_t layers, std::uint64_t seed) {
  if (layers < 1) refuse(place.operation, "layers", "must be >= 1, got " + std::to_string(layers));
  std::vector<flow::FlowLayer<float>> stack =
      flow::layer_stack<float>(source_of<float>(place, "relevance", relevance),
                               source_of<float>(place, "content", content), dim, layers, seed);
  if (stack.size() == 1) stack.assign(static_cast<std::size_t>(layers), stack[0]);
  return stack;
}

DecodingSettings settings_of(const std::string& norm, bool pre_norm, double norm_eps, int threads) {
  DecodingSettings s;
  s.norm = flow::parse_normalization(norm, "norm");
  s.pre_norm = pre_norm;
  s.norm_eps = norm_eps;
  s.threads = threads;
  return s;
}

}  // namespace

void bind_generate(nb::module_& m) {
  nb::class_<DecodingStack>(m, "DecodingStack",
                            "emflow::DecodingStack: L layers, one decode cache each. Use "
                            "emflow.DecodingStack.")
      .def(
          "__init__",
          [](DecodingStack* self, std::int64_t dim, const nb::object& relevance,
             const nb::object& content, std::int64_t layers, std::uint64_t seed, double beta,
             const std::string& norm, bool pre_norm, double norm_eps, int threads) {
            const Placement place{"DecodingStack", nb::dtype<float>(), nb::device::cpu::value, 0};
            new (self) DecodingStack(stack_layers(place, relevance, content, dim, layers, seed),
                                     dim, beta, settings_of(norm, pre_norm, norm_eps, threads));
          },
          nb::arg("dim"), nb::arg("relevance"), nb::arg("content"), nb::arg("layers"),
          nb::arg("seed"), nb::arg("beta"), nb::arg("norm"), nb::arg("pre_norm"),
          nb::arg("norm_eps"), nb::arg("threads"))
      .def(
          "forward",
          [](DecodingStack& stack, const OutArray& tokens, const std::optional<OutArray>& paths,
             const std::optional<OutArray>& entropy) {
            const Placement place{"DecodingStack.forward", nb::dtype<float>(),
                                  nb::device::cpu::value, 0};
            if (tokens.ndim() != 2) {
              refuse(place.operation, "tokens",
                     "has shape " + shape_string(tokens) + ", expected (n, dim)");
            }
            const auto n = static_cast<std::int64_t>(tokens.shape(0));
            const std::int64_t d = stack.dim(), L = stack.layers();
            float* x = optional_output<float>(place, "tokens", tokens, Shape{n, d});
            DecodingTrace trace;
            trace.paths = optional_output<float>(place, "paths", paths, Shape{n, L + 1, d});
            trace.entropy = optional_output<double>(place, "entropy", entropy, Shape{n, L});
            nb::gil_scoped_release release;
            stack.forward(x, n, trace);
          },
          nb::arg("tokens"), nb::arg("paths").none(), nb::arg("entropy").none(),
          "Moves the float32 tokens (n, dim) through the stack in place; paths (n, L + 1, dim) "
          "float32 and entropy (n, L) float64 are written when given.")
      .def("clear", &DecodingStack::clear, "Drops every token of every cache.")
      .def_prop_ro("size", &DecodingStack::size, "Tokens moved so far: the next position.")
      .def_prop_ro("layers", &DecodingStack::layers)
      .def_prop_ro("dim", &DecodingStack::dim);

  m.def(
      "generate",
      [](const InArray& prompts, const std::vector<double>& betas, const nb::object& relevance,
         const nb::object& content, std::int64_t layers, std::uint64_t seed,
         const std::string& norm, bool pre_norm, double norm_eps, std::int64_t steps, int threads) {
        const Placement place{"generate", nb::dtype<float>(), nb::device::cpu::value, 0};
        if (prompts.ndim() != 3) {
          refuse("generate", "prompts",
                 "has shape " + shape_string(prompts) + ", expected (B, N, d)");
        }
        const Tensor<float> cloud = host_copy<float>(place, "prompts", prompts);
        const auto stack = stack_layers(place, relevance, content, cloud.extent(2), layers, seed);
        const DecodingSettings settings = settings_of(norm, pre_norm, norm_eps, threads);
        Generation g;
        {
          nb::gil_scoped_release release;
          g = generate(cloud, stack, betas, steps, settings);
        }
        const Shape per_layer{g.clouds, g.steps, g.layers};
        return nb::make_tuple(to_numpy(std::move(g.paths)),
                              to_numpy(std::move(g.entropy), per_layer),
                              to_numpy(std::move(g.seconds), Shape{g.steps}));
      },
      nb::arg("prompts"), nb::arg("betas"), nb::arg("relevance"), nb::arg("content"),
      nb::arg("layers"), nb::arg("seed"), nb::arg("norm"), nb::arg("pre_norm"), nb::arg("norm_eps"),
      nb::arg("steps"), nb::arg("threads"),
      "emflow::generate: (paths, entropy, seconds). Use emflow.generate.");
}

}  // namespace emflow::python

// emflow Python module: the capability function (emflow/capability.hpp), where a call would run
// (device, kernel, the products' precision) or why it cannot, asked from its shapes and options
// alone: the Python layer describes the call from the arrays' shapes and dtypes (emflow.route),
// so that a torch meta tensor or any object with a shape can be asked about, and the same answer
// decides how emflow.attend runs a CUDA call.
#include "emflow/capability.hpp"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "arrays.hpp"
#include "bindings.hpp"

namespace emflow::python {
namespace {

Dtype storage_of(const std::string& name) {
  if (name == "float32") return Dtype::float32;
  if (name == "float64") return Dtype::float64;
  if (name == "bfloat16") return Dtype::bfloat16;
  if (name == "float16") return Dtype::float16;
  refuse("route", "storage", "is '" + name + "', expected float32, float64, bfloat16 or float16");
}

}  // namespace

void bind_capability(nb::module_& m) {
  m.def(
      "route",
      [](bool factored, const std::string& storage, const std::string& precision,
         std::int64_t batch, std::int64_t tokens, std::int64_t dim, std::int64_t heads,
         std::int64_t rank, const std::string& mask, bool key_lengths, bool key_bias, bool offset,
         bool lse, bool entropy, bool weights, const std::string& device,
         const std::string& operation) {
        Problem p;
        p.form = factored ? Form::factored : Form::dense;
        p.storage = storage_of(storage);
        p.precision = parse_precision(precision, "precision");
        p.batch = batch;
        p.tokens = p.query_tokens = tokens;
        p.dim = dim;
        p.heads = heads;
        p.rank = rank;
        p.mask = parse_mask(mask, "mask");
        p.key_lengths = key_lengths;
        p.key_bias = key_bias;
        p.offset = offset;
        p.lse = lse;
        p.entropy = entropy;
        p.weights = weights;
        const Route r = route(p, parse_device(device), operation.c_str());
        return nb::make_tuple(r.supported, to_string(r.device), to_string(r.kernel),
                              to_string(r.computes), to_string(r.products), r.expanded, r.reason,
                              r.device_missing);
      },
      nb::arg("factored"), nb::arg("storage"), nb::arg("precision"), nb::arg("batch"),
      nb::arg("tokens"), nb::arg("dim"), nb::arg("heads"), nb::arg("rank"), nb::arg("mask"),
      nb::arg("key_lengths"), nb::arg("key_bias"), nb::arg("offset"), nb::arg("lse"),
      nb::arg("entropy"), nb::arg("weights"), nb::arg("device"), nb::arg("operation"),
      "emflow::route of the Problem these fields describe: (supported, device, kernel, "
      "computes, products, expanded, reason, device_missing). Use emflow.route.");
  m.def(
      "machine",
      [] {
        const Machine& machine = this_machine();
        nb::dict out;
        out["cpu"] = machine.cpu_name;
        out["cpu_features"] = machine.cpu_features;
        out["cpu_disabled"] = machine.cpu_disabled;
        out["cpu_paths"] = machine.cpu_paths;
        out["cpu_path"] = machine.cpu_instruction_set;
        out["cpu_path_uses"] = machine.cpu_compiled_for;
        out["cpu_missing"] = machine.cpu_missing;
        out["avx512_bf16"] = machine.avx512_bf16;
        out["cuda_built"] = machine.cuda_built;
        out["cuda_device"] = machine.cuda_device;
        out["cuda_reason"] = machine.cuda_reason;
        return out;
      },
      "emflow::this_machine(): the processor (cpu, cpu_features), the CPU engine's paths built and "
      "the one taken (cpu_paths, cpu_path and the extensions it uses; cpu_missing where none "
      "runs), and the CUDA device (cuda_built, cuda_device, cuda_reason), as a dict.");
  m.def("max_threads", &max_threads,
        "emflow::max_threads: the most CPU threads a call may ask for (4 per core).");
}

}  // namespace emflow::python

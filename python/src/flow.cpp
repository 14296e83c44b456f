// emflow Python module: the flow of token clouds (emflow/flow.hpp), the phase diagram, and .npy
// files (emflow/io.hpp). Progress callbacks run on the calling thread with the GIL held, called
// as callback(steps_done, steps_total) after each step. With or without a callback, each step
// also lets Python handle its pending signals, so Ctrl-C (KeyboardInterrupt) stops a run after the
// step it arrives in rather than after the whole run.
#include "emflow/flow.hpp"

#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "emflow/io.hpp"
#include "operators.hpp"

namespace emflow::python {
namespace {

/// The progress of a run as emflow::flow::Progress: takes the GIL after each step, raises what
/// the signal handlers raise (KeyboardInterrupt for SIGINT: the run stops, its memory released),
/// then calls the callback when there is one.
flow::Progress progress_of(const nb::object& callback) {
  const bool call = callback.is_valid() && !callback.is_none();
  return [callback, call](std::int64_t done, std::int64_t total) {
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
    if (call) callback(done, total);
  };
}

nb::dict observables_of(const std::vector<flow::Observables>& list, std::int64_t records,
                        std::int64_t batch) {
  const Shape shape{records, batch};
  std::vector<double> min_inner, mean_inner, clustered, energy, entropy, diameter;
  std::vector<std::int64_t> clusters;
  for (const flow::Observables& o : list) {
    min_inner.push_back(o.min_inner);
    mean_inner.push_back(o.mean_inner);
    clustered.push_back(o.clustered_fraction);
    clusters.push_back(o.clusters);
    energy.push_back(o.energy);
    entropy.push_back(o.entropy);
    diameter.push_back(o.diameter);
  }
  nb::dict result;
  result["min_inner"] = to_numpy(std::move(min_inner), shape);
  result["mean_inner"] = to_numpy(std::move(mean_inner), shape);
  result["clustered_fraction"] = to_numpy(std::move(clustered), shape);
  result["clusters"] = to_numpy(std::move(clusters), shape);
  result["energy"] = to_numpy(std::move(energy), shape);
  result["entropy"] = to_numpy(std::move(entropy), shape);
  result["diameter"] = to_numpy(std::move(diameter), shape);
  return result;
}

template <class T>
nb::tuple run(const Placement& place, const InArray& initial, const std::vector<double>& betas,
              const nb::handle& relevance, const nb::handle& content, std::uint64_t seed,
              const flow::FlowSettings& settings, const ExecutionOptions& options,
              const nb::object& callback) {
  if (initial.ndim() != 3) {
    refuse("flow", "initial", "has shape " + shape_string(initial) + ", expected (B, N, d)");
  }
  Tensor<T> cloud = host_copy<T>(place, "initial", initial);
  const auto dim = cloud.extent(2);
  const std::int64_t count = settings.layers > 0 ? settings.layers : 1;
  const auto layers =
      flow::layer_stack<T>(source_of<T>(place, "relevance", relevance),
                           source_of<T>(place, "content", content), dim, count, seed);
  const flow::Progress progress = progress_of(callback);
  flow::FlowResult<T> result;
  {
    nb::gil_scoped_release release;
    result = flow::run_flow(cloud, betas, layers, settings, options, progress);
  }
  const auto records = static_cast<std::int64_t>(result.times.size());
  return nb::make_tuple(to_numpy(std::move(result.trajectory)),
                        to_numpy(std::move(result.times), Shape{records}),
                        to_numpy(std::move(result.steps), Shape{records}),
                        observables_of(result.observables, records, cloud.extent(0)));
}

nb::object read_npy_file(const std::string& path) {
  const NpyHeader header = read_npy_header(path);
  switch (header.dtype) {
    case Dtype::float16:  // widened exactly
    case Dtype::float32:
      return to_numpy(read_npy<float>(path));
    case Dtype::float64:
      return to_numpy(read_npy<double>(path));
    default:
      return to_numpy(read_npy<std::int64_t>(path));
  }
}

void write_npy_file(const std::string& path, const InArray& array) {
  Placement place{"write_npy", array.dtype(), nb::device::cpu::value, 0};
  if (array.dtype() == nb::dtype<float>()) {
    write_npy(path, host_copy<float>(place, "array", array));
  } else if (array.dtype() == nb::dtype<double>()) {
    write_npy(path, host_copy<double>(place, "array", array));
  } else if (array.dtype() == nb::dtype<std::int64_t>()) {
    write_npy(path, host_copy<std::int64_t>(place, "array", array));
  } else {
    refuse("write_npy", "array",
           "has dtype " + dtype_name(array.dtype()) + ", expected float32, float64 or int64");
  }
}

}  // namespace

void bind_flow(nb::module_& m) {
  m.def(
      "flow",
      [](const InArray& initial, const std::vector<double>& betas, const nb::object& relevance,
         const nb::object& content, std::int64_t layers, std::uint64_t seed,
         const std::string& norm, bool pre_norm, double time, double dt,
         const std::string& integrator, bool unnormalized, std::int64_t record_every,
         double cluster_eps, const std::string& device, std::int64_t threads,
         const nb::object& callback) {
        flow::FlowSettings settings;
        settings.layers = layers;
        settings.norm = flow::parse_normalization(norm, "norm");
        settings.pre_norm = pre_norm;
        settings.time = time;
        settings.dt = dt;
        settings.integrator = flow::parse_integrator(integrator, "integrator");
        settings.unnormalized = unnormalized;
        settings.record_every = record_every;
        settings.cluster_eps = cluster_eps;
        const ExecutionOptions options{parse_device(device), check_threads(threads, "flow")};
        Placement place{"flow", initial.dtype(), nb::device::cpu::value, 0};
        if (initial.dtype() == nb::dtype<float>()) {
          return run<float>(place, initial, betas, relevance, content, seed, settings, options,
                            callback);
        }
        place.dtype = nb::dtype<double>();
        return run<double>(place, initial, betas, relevance, content, seed, settings, options,
                           callback);
      },
      nb::arg("initial"), nb::arg("betas"), nb::arg("relevance"), nb::arg("content"),
      nb::arg("layers"), nb::arg("seed"), nb::arg("norm"), nb::arg("pre_norm"), nb::arg("time"),
      nb::arg("dt"), nb::arg("integrator"), nb::arg("unnormalized"), nb::arg("record_every"),
      nb::arg("cluster_eps"), nb::arg("device"), nb::arg("threads"), nb::arg("callback").none(),
      "emflow::flow::run_flow: (trajectory, times, steps, observables). Use emflow.flow.");
  m.def(
      "initial_clouds",
      [](const std::string& kind, std::int64_t batch, std::int64_t tokens, std::int64_t dim,
         std::uint64_t seed, bool single) {
        const auto initial = flow::parse_initial_cloud(kind, "kind");
        return single ? to_numpy(flow::initial_clouds<float>(initial, batch, tokens, dim, seed))
                      : to_numpy(flow::initial_clouds<double>(initial, batch, tokens, dim, seed));
      },
      nb::arg("kind"), nb::arg("batch"), nb::arg("tokens"), nb::arg("dim"), nb::arg("seed"),
      nb::arg("single"), "emflow::flow::initial_clouds. Use emflow.initial_clouds.");
  m.def(
      "phase",
      [](std::int64_t tokens, std::int64_t dim, double beta_start, double beta_stop,
         std::int64_t beta_count, double time, double dt, std::int64_t clouds, std::uint64_t seed,
         double cluster_eps, const std::string& device, std::int64_t threads, bool generic,
         const nb::object& callback) {
        flow::PhaseSettings settings{tokens, dim, beta_start, beta_stop, beta_count,
                                     time,   dt,  clouds,     seed,      cluster_eps};
        settings.generic = generic;
        flow::validate(settings);
        const ExecutionOptions options{parse_device(device), check_threads(threads, "phase")};
        const flow::Progress progress = progress_of(callback);
        flow::PhaseDiagram diagram;
        {
          nb::gil_scoped_release release;
          diagram = flow::phase_diagram(settings, options, progress);
        }
        const auto steps = static_cast<std::int64_t>(diagram.times.size());
        const auto betas = static_cast<std::int64_t>(diagram.betas.size());
        return nb::make_tuple(to_numpy(std::move(diagram.times), Shape{steps}),
                              to_numpy(std::move(diagram.betas), Shape{betas}),
                              to_numpy(std::move(diagram.clustered), Shape{steps, betas}));
      },
      nb::arg("tokens"), nb::arg("dim"), nb::arg("beta_start"), nb::arg("beta_stop"),
      nb::arg("beta_count"), nb::arg("time"), nb::arg("dt"), nb::arg("clouds"), nb::arg("seed"),
      nb::arg("cluster_eps"), nb::arg("device"), nb::arg("threads"), nb::arg("generic"),
      nb::arg("callback").none(),
      "emflow::flow::phase_diagram: (times, betas, clustered). Use emflow.phase.");
  m.def("read_npy", &read_npy_file, nb::arg("path"),
        "emflow::read_npy: a .npy file (float32, float64, int32 or int64; C order, little "
        "endian, rank 1 to 4) as a NumPy array (int32 files come back as int64).");
  m.def("write_npy", &write_npy_file, nb::arg("path"), nb::arg("array"),
        "emflow::write_npy: writes a float32, float64 or int64 array (rank 1 to 4) as .npy, "
        "atomically (a temporary file beside the target, renamed into place).");
}

}  // namespace emflow::python

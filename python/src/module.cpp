// emflow Python module emflow._emflow: the extension behind the package emflow (python/emflow).
//
// emflow::Error becomes a Python exception with the same message, by its code:
//   invalid_argument  ValueError
//   out_of_memory     MemoryError
//   unsupported       NotImplementedError
//   io, device, internal  RuntimeError
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/types.hpp"
#ifdef EMFLOW_WITH_CUDA
#include "emflow/cuda.hpp"
#endif

namespace nb = nanobind;

NB_MODULE(_emflow, m) {
  m.doc() =
      "emflow: EMF attention and the flow of token clouds (the C++ extension; use the "
      "package emflow)";
  m.attr("__version__") = EMFLOW_PYTHON_VERSION;
  // A function rather than an attribute, so that the stubs are the same for every build.
  m.def(
      "built_with_cuda",
      []() {
#ifdef EMFLOW_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "True when emflow was built with the CUDA backend.");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const emflow::Error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.code()) {
        case emflow::ErrorCode::invalid_argument:
          type = PyExc_ValueError;
          break;
        case emflow::ErrorCode::out_of_memory:
          type = PyExc_MemoryError;
          break;
        case emflow::ErrorCode::unsupported:
          type = PyExc_NotImplementedError;
          break;
        default:
          break;
      }
      PyErr_SetString(type, e.what());
    }
  });

  m.def(
      "cuda_available",
      []() {
        std::string reason;
#ifdef EMFLOW_WITH_CUDA
        const bool available = emflow::cuda::device_available(&reason);
#else
        const bool available = false;
        reason = "emflow was built without CUDA";
#endif
        return nb::make_tuple(available, reason);
      },
      "(available, reason): whether a CUDA device can be used, and why not.");
  m.def(
      "resolve_device",
      [](const std::string& device) {
        const emflow::Device resolved = emflow::resolve_device(emflow::parse_device(device));
        return std::string(emflow::to_string(resolved));
      },
      nb::arg("device"),
      "The device 'auto' / 'cpu' / 'cuda' / 'reference' resolves to in this process: 'auto' is "
      "'cuda' when a device is present and emflow was built with CUDA, else 'cpu'.");

  emflow::python::bind_attend(m);
  emflow::python::bind_sdpa(m);
  emflow::python::bind_reference(m);
  emflow::python::bind_flow(m);
  emflow::python::bind_generate(m);
  emflow::python::bind_gguf(m);
  emflow::python::bind_model(m);
  emflow::python::bind_capability(m);
}

// emflow Python module: the parts of the module, each bound by its own file.
#pragma once

#include <nanobind/nanobind.h>

namespace emflow::python {

void bind_attend(nanobind::module_& m);      // attend.cpp: the layer, forward and backward
void bind_sdpa(nanobind::module_& m);        // sdpa.cpp: the SDPA-shaped operator
void bind_reference(nanobind::module_& m);   // reference.cpp: emflow::reference, MHA conversion
void bind_flow(nanobind::module_& m);        // flow.cpp: the flow, the phase diagram, .npy files
void bind_capability(nanobind::module_& m);  // capability.cpp: emflow::route, max_threads
void bind_generate(nanobind::module_& m);    // generate.cpp: the decoding stack, generation
void bind_gguf(nanobind::module_& m);        // gguf.cpp: GGUF files
void bind_model(nanobind::module_& m);       // model.cpp: pretrained models

}  // namespace emflow::python

// What `emflow --version` and the FMA peak line of `emflow bench --peak` say about this machine
// (emflow::this_machine(), capability.hpp): the processor and its extensions, what the CPU engine
// was compiled for, the GPU, and the path route() gives each storage type.
#pragma once

#include <string>

namespace emflow::cli {

/// The text of `emflow --version`, several lines, without a final newline.
std::string version_text();

/// JSON members for a bench line, starting with ", ": "cpu" (the processor's name),
/// "cpu_features" (the extensions found, a list), "cpu_compiled_for" and "paths" (an object:
/// each storage type's route on Device::automatic for a dense self-attention, as
/// emflow::to_string(Route) writes it).
std::string machine_json();

}  // namespace emflow::cli

// emflow phase: not implemented yet.
#include "commands.hpp"

namespace emflow::cli {

void add_phase_command(CLI::App&) {}

}  // namespace emflow::cli

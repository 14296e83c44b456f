// emflow demo: not implemented yet.
#include "commands.hpp"

namespace emflow::cli {

void add_demo_command(CLI::App&) {}

}  // namespace emflow::cli

// emflow flow: not implemented yet.
#include "commands.hpp"

namespace emflow::cli {

void add_flow_command(CLI::App&) {}

}  // namespace emflow::cli

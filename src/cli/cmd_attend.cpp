// emflow attend: not implemented yet.
#include "commands.hpp"

namespace emflow::cli {

void add_attend_command(CLI::App&) {}

}  // namespace emflow::cli

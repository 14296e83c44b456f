// emflow bench: not implemented yet.
#include "commands.hpp"

namespace emflow::cli {

void add_bench_command(CLI::App&) {}

}  // namespace emflow::cli

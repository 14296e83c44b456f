// Each emflow subcommand lives in its own file and registers itself on the app here.
// A command's callback throws emflow::Error on failure; main() turns that into a one-line
// message on stderr and a non-zero exit.
#pragma once

#include "cli11_fwd.hpp"

namespace emflow::cli {

void add_attend_command(CLI::App& app);    // cmd_attend.cpp
void add_demo_command(CLI::App& app);      // cmd_demo.cpp
void add_bench_command(CLI::App& app);     // cmd_bench.cpp
void add_flow_command(CLI::App& app);      // cmd_flow.cpp
void add_phase_command(CLI::App& app);     // cmd_phase.cpp
void add_convert_command(CLI::App& app);   // cmd_convert.cpp
void add_generate_command(CLI::App& app);  // cmd_generate.cpp

}  // namespace emflow::cli

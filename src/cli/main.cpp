// The emflow command-line tool: one subcommand per file (commands.hpp).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <exception>
#include <iostream>
#include <new>

#include "commands.hpp"
#include "emflow/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"emflow: EMF attention and the flow of token clouds", "emflow"};
  app.set_version_flag("--version", std::string("emflow ") + EMFLOW_CLI_VERSION);
  app.require_subcommand(1);
  // Usage errors read like every other error: one line, "emflow: error: ...".
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    return "emflow: error: " + message + " (see --help)\n";
  });
  emflow::cli::add_attend_command(app);
  emflow::cli::add_demo_command(app);
  emflow::cli::add_bench_command(app);
  emflow::cli::add_flow_command(app);
  emflow::cli::add_phase_command(app);
  emflow::cli::add_convert_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const emflow::Error& e) {
    std::cerr << "emflow: error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "emflow: error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "emflow: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

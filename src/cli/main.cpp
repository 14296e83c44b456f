// The emflow command-line tool.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <iostream>

#include "emflow/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"emflow: EMF attention and the flow of token clouds", "emflow"};
  app.set_version_flag("--version", std::string("emflow ") + EMFLOW_CLI_VERSION);
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const emflow::Error& e) {
    std::cerr << "emflow: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

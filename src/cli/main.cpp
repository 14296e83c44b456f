// The emflow command-line tool: one subcommand per file (commands.hpp).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <exception>
#include <iostream>
#include <new>

#include "commands.hpp"
#include "emflow/distributed.hpp"
#include "emflow/error.hpp"
#include "job.hpp"
#include "machine.hpp"

int main(int argc, char** argv) try {
  CLI::App app{"emflow: EMF attention and the flow of token clouds", "emflow"};
  // The version, the processor's extensions and the path of each storage type (machine.hpp).
  app.set_version_flag("--version", [] { return emflow::cli::version_text(); });
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
  emflow::cli::add_generate_command(app);
  // Under --distributed an error every rank agreed on is reported once, by rank 0, and every
  // rank ends normally; any other error on one rank ends the whole job (MPI_Abort), since its
  // partners may be waiting for it.
  const auto report = [](const std::string& message, bool agreed) {
    if (!emflow::cli::in_job()) {
      std::cerr << "emflow: error: " << message << "\n";
      return 1;
    }
    if (agreed) {
      if (emflow::cli::job_rank() == 0) std::cerr << "emflow: error: " << message << "\n";
      emflow::cli::end_job();
      return 1;
    }
    std::cerr << "emflow: error: rank " << emflow::cli::job_rank() << ": " << message
              << " (ending the job)\n";
    emflow::distributed::abort_job(1);
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const emflow::distributed::AgreedError& e) {
    return report(e.what(), true);
  } catch (const emflow::Error& e) {
    return report(e.what(), false);
  } catch (const std::bad_alloc&) {
    return report("out of memory", false);
  } catch (const std::exception& e) {
    return report(e.what(), false);
  }
  emflow::cli::end_job();
  return 0;
} catch (...) {
  // Only what fails before or after the command (making the tool's options): one line as well.
  std::cerr << "emflow: error: could not start (out of memory?)\n";
  return 1;
}

// Runs the emflow binary of the build from a test. Header-only: EMFLOW_CLI_PATH is defined for
// each test suite, not for the shared helper library.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "common/files.hpp"

namespace emflow::testing {

/// How a run of emflow ended.
struct CliRun {
  int status = -1;  // exit status, -1 when the process did not exit normally
  std::string err;  // what it wrote to stderr
};

/// The CliRun of a child whose wait status is `raw` and whose stderr went to `stderr_path`.
inline CliRun cli_outcome(int raw, const std::string& stderr_path) {
  CliRun run;
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream in(stderr_path);
  run.err.assign(std::istreambuf_iterator<char>(in), {});
  return run;
}

/// Runs emflow with `arguments` (shell words) after the shell words `prefix` (e.g. a ulimit),
/// stdout discarded and stderr written to `stderr_path`.
inline CliRun run_cli(const std::string& arguments, const std::string& stderr_path,
                      const std::string& prefix = "") {
#ifdef EMFLOW_CLI_PATH
  const std::string command =
      prefix + " '" + EMFLOW_CLI_PATH + "' " + arguments + " >/dev/null 2>'" + stderr_path + "'";
  return cli_outcome(std::system(command.c_str()), stderr_path);
#else
  (void)arguments;
  (void)stderr_path;
  (void)prefix;
  return {};
#endif
}

/// A run of emflow whose output the test reads: its exit status as pclose gives it (0 for exit 0)
/// and the lines it wrote to stdout and stderr together, without their newlines.
struct CliOutput {
  int status = -1;
  std::vector<std::string> lines;
};

/// Runs emflow with `arguments` (shell words) and collects its output lines.
inline CliOutput run_cli_output(const std::string& arguments) {
  CliOutput result;
#ifdef EMFLOW_CLI_PATH
  const std::string command = std::string(EMFLOW_CLI_PATH) + " " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer{};
  while (fgets(buffer.data(), static_cast<int>(buffer.size()), pipe) != nullptr) {
    std::string line(buffer.data());
    if (!line.empty() && line.back() == '\n') line.pop_back();
    result.lines.push_back(line);
  }
  result.status = pclose(pipe);
#else
  (void)arguments;
#endif
  return result;
}

/// The shell words that start emflow on `ranks` ranks of an MPI job with one OpenMP thread each
/// (EMFLOW_MPIEXEC, defined for the suites that run under mpirun), for run_cli's `prefix`; empty
/// without it.
inline std::string mpirun_prefix(int ranks) {
#ifdef EMFLOW_MPIEXEC
  return std::string("OMP_NUM_THREADS=1 '") + EMFLOW_MPIEXEC + "' -np " + std::to_string(ranks) +
         " --oversubscribe --allow-run-as-root";
#else
  (void)ranks;
  return "";
#endif
}

/// A FileFolder for tests of the emflow binary, with the subfolder `outputs` (none when empty)
/// made in it: skips the test when the binary is not built.
class CliFolder : public FileFolder {
 protected:
  explicit CliFolder(std::string prefix, std::string outputs = "")
      : FileFolder(std::move(prefix)), outputs_(std::move(outputs)) {}
  void SetUp() override {
#ifndef EMFLOW_CLI_PATH
    GTEST_SKIP() << "the emflow command-line tool is not built (EMFLOW_BUILD_CLI=OFF)";
#endif
    FileFolder::SetUp();
    if (!outputs_.empty()) std::filesystem::create_directories(folder_ / outputs_);
  }

  /// run_cli() with its stderr in the folder.
  CliRun emflow(const std::string& arguments, const std::string& prefix = "") const {
    return run_cli(arguments, path("stderr.txt"), prefix);
  }

 private:
  std::string outputs_;
};

}  // namespace emflow::testing

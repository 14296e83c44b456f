// libFuzzer target: `emflow attend` in process, with fuzzed arguments and fuzzed input files.
//
// An input is split at the token @@FILE@@ into up to five sections:
//   1. the arguments after `emflow attend`, one per line; "$D" stands for a private scratch
//      folder (in /dev/shm), e.g. "--x\n$D/x.npy\n--m\n$D/m.npy\n--f\n$D/f.npy\n--out\n$D/u.npy";
//   2.-5. the bytes of $D/x.npy, $D/m.npy, $D/f.npy and $D/k.npy (a missing section: no file).
// The command is built and parsed as the emflow binary does (main.cpp) and must either succeed
// or throw emflow::Error or CLI::ParseError; any other exception, crash or sanitizer report is a
// defect. After a failed run the folder must hold exactly the input files (outputs are all or
// nothing and no temporary file survives); after a successful one only inputs and files named
// by an argument.
//
// To keep each run short and local, inputs are skipped when an argument names a path outside
// the scratch folder, sets --threads (the run uses one OpenMP thread), asks for --distributed
// (an MPI run: its reading and writing are tested under mpirun, tests/distributed), or describes
// a problem of more than about 2e7 multiply-adds.
#include <dirent.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "commands.hpp"              // src/cli: the subcommands of the emflow binary
#include "distributed_commands.hpp"  // src/cli: run_attend_distributed
#include "emflow/error.hpp"
#include "emflow/io.hpp"
#include "fuzz_common.hpp"

const char* const fuzz::kTarget = "fuzz_attend_cli";

namespace {

const char kSeparator[] = "@@FILE@@";
const char* const kInputNames[] = {"x.npy", "m.npy", "f.npy", "k.npy"};
constexpr double kMaxWork = 2e7;

using fuzz::defect;

const std::string& folder() {
  static const std::string path = [] {
    const char* root = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string p = std::string(root) + "/emflow_fuzz_cli_" + std::to_string(::getpid());
    ::mkdir(p.c_str(), 0700);
    return p;
  }();
  return path;
}

std::set<std::string> files_in_folder() {
  std::set<std::string> names;
  DIR* dir = ::opendir(folder().c_str());
  if (dir == nullptr) defect("cannot list the scratch folder", folder());
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.insert(name);
  }
  ::closedir(dir);
  return names;
}

void empty_folder() {
  for (const std::string& name : files_in_folder()) {
    const std::string path = folder() + "/" + name;
    if (::unlink(path.c_str()) != 0) ::rmdir(path.c_str());
  }
}

std::vector<std::string> split(const std::string& text, const std::string& separator) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = text.find(separator, begin);
    if (end == std::string::npos) break;
    parts.push_back(text.substr(begin, end - begin));
    begin = end + separator.size();
  }
  parts.push_back(text.substr(begin));
  return parts;
}

// "$D/name" becomes a path in the scratch folder, the working directory of the run (so bare
// names land there too); false for an argument that could name anything outside it.
bool place_argument(std::string& argument) {
  if (argument.find('\0') != std::string::npos) return false;  // a real argv cannot hold one
  if (argument.find("threads") != std::string::npos) return false;
  if (argument.find("distributed") != std::string::npos) return false;
  if (argument.find("..") != std::string::npos) return false;
  const std::size_t marker = argument.find("$D");
  const std::size_t slash = argument.find('/');
  if (marker == std::string::npos) return slash == std::string::npos;
  if (argument.find("$D", marker + 2) != std::string::npos) return false;
  if (slash != std::string::npos && slash < marker + 2) return false;
  if (marker + 2 < argument.size() && argument[marker + 2] != '/') return false;
  argument.replace(marker, 2, folder());
  return true;
}

// Elements of the array in `name` per its header, or 0 when it has none (missing, malformed).
double elements(const char* name, std::int64_t* second_to_last) {
  try {
    const emflow::NpyHeader header = emflow::read_npy_header(folder() + "/" + name);
    double count = 1;
    for (std::int64_t extent : header.shape) count *= static_cast<double>(extent);
    if (second_to_last != nullptr && header.shape.size() >= 2) {
      *second_to_last = header.shape[header.shape.size() - 2];
    }
    return count;
  } catch (const emflow::Error&) {
    return 0;
  }
}

}  // namespace

// The fuzzed binary has no MPI; place_argument() keeps --distributed out of every run.
void emflow::cli::run_attend_distributed(const AttendFiles&) {
  defect("reached the distributed run", "place_argument() admits no --distributed");
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  omp_set_num_threads(1);
  // Relative output names must land in the scratch folder, never in the caller's directory.
  if (::chdir(folder().c_str()) != 0) defect("cannot enter the scratch folder", folder());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::string> sections =
      split(std::string(reinterpret_cast<const char*>(data), size), kSeparator);
  if (sections.size() > 5) return 0;

  std::vector<std::string> arguments = {"emflow", "attend"};
  for (std::string& argument : split(sections[0], "\n")) {
    if (argument.empty()) continue;
    if (!place_argument(argument)) return 0;
    arguments.push_back(argument);
  }
  if (arguments.size() > 40) return 0;

  empty_folder();
  std::set<std::string> inputs;
  for (std::size_t s = 1; s < sections.size(); ++s) {
    const std::string path = folder() + "/" + kInputNames[s - 1];
    std::FILE* file = std::fopen(path.c_str(), "wb");
    if (file == nullptr) defect("cannot write an input file", path);
    std::fwrite(sections[s].data(), 1, sections[s].size(), file);
    std::fclose(file);
    inputs.insert(kInputNames[s - 1]);
  }
  // Work estimate: cloud elements x tokens x operator elements bounds B H N^2 d and B N H d^2.
  std::int64_t tokens = 1;
  const double cloud = elements("x.npy", &tokens);
  const double work = cloud * static_cast<double>(tokens) *
                      std::max({1.0, elements("m.npy", nullptr), elements("f.npy", nullptr)});
  if (work > kMaxWork) return 0;

  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());

  bool failed = false;
  try {
    CLI::App app{"emflow", "emflow"};
    app.require_subcommand(1);
    emflow::cli::add_attend_command(app);
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    failed = true;
    if (std::getenv("EMFLOW_FUZZ_VERBOSE")) std::fprintf(stderr, "usage error: %s\n", e.what());
  } catch (const emflow::Error& e) {
    failed = true;
    if (std::getenv("EMFLOW_FUZZ_VERBOSE")) std::fprintf(stderr, "error: %s\n", e.what());
    if (std::strlen(e.what()) == 0) defect("empty error message", "");
  } catch (const std::exception& e) {
    defect("an exception other than emflow::Error escaped", e.what());
  }

  // EMFLOW_FUZZ_VERBOSE=1 shows what each input did (to check that seeds reach the computation).
  static const bool verbose = std::getenv("EMFLOW_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "fuzz_attend_cli: %s\n", failed ? "refused" : "succeeded");

  // A file may be an input or, after a successful run, an output; outputs are named by an
  // argument ("u.npy", "$D/u.npy" or "--out=u.npy"). Anything else (a temporary file of a
  // staged output) must not survive the run.
  for (const std::string& name : files_in_folder()) {
    if (inputs.count(name) != 0) continue;
    if (failed) defect("a failed run left a file", name);
    bool named = false;
    for (const std::string& argument : arguments) {
      named = named || (argument.size() >= name.size() &&
                        argument.compare(argument.size() - name.size(), name.size(), name) == 0);
    }
    if (!named) defect("a file no argument names survived the run", name);
  }
  return 0;
}

// Several outputs written all or none (emflow::OutputFiles in io.hpp): each is a StagedFile
// until commit() renames them all into place.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/io.hpp"
#include "npy_writer.hpp"
#include "staged_file.hpp"

namespace emflow {
namespace {

// Runs `body`; an emflow::Error it throws is rethrown with "<name>: " in front, so a message
// about the file also names the target's owner (an option, for the command-line tool).
template <class Body>
void naming(const std::string& name, const char* operation, const std::string& path, Body&& body) {
  try {
    detail::reporting_out_of_memory(operation, path, body);
  } catch (const Error& e) {
    throw Error(e.code(), name + ": " + e.what());
  }
}

}  // namespace

struct OutputFiles::State {
  std::vector<std::pair<std::string, std::string>> declared;  // (name, path)
  std::vector<detail::StagedFile> staged;                     // removed unless committed

  const std::string& name_of(const std::string& path) const {
    for (const auto& [name, declared_path] : declared) {
      if (declared_path == path) return name;
    }
    detail::fail(ErrorCode::invalid_argument, "OutputFiles: '", path, "' was not declared");
  }
};

OutputFiles::OutputFiles() : state_(std::make_unique<State>()) {}
OutputFiles::~OutputFiles() = default;
OutputFiles::OutputFiles(OutputFiles&&) noexcept = default;
OutputFiles& OutputFiles::operator=(OutputFiles&&) noexcept = default;

void OutputFiles::declare(const std::string& name, const std::string& path) {
  using detail::fail;
  constexpr ErrorCode kInvalid = ErrorCode::invalid_argument;
  if (path.empty()) fail(kInvalid, name, " needs a file name, got ''");
  for (const auto& [other_name, other_path] : state_->declared) {
    if (other_path == path) {
      fail(kInvalid, name, " '", path, "' is also the file of ", other_name,
           "; each output needs its own file");
    }
  }
  const std::size_t slash = path.find_last_of('/');
  const std::string folder =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    fail(kInvalid, name, " '", path, "': the folder '", folder, "' does not exist");
  }
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    fail(kInvalid, name, " '", path, "': the folder '", folder,
         "' is not writable: ", std::strerror(errno));
  }
  state_->declared.emplace_back(name, path);
}

template <class T>
void OutputFiles::stage_npy(const std::string& path, const Tensor<T>& array) {
  naming(state_->name_of(path), "write_npy", path, [&] {
    detail::StagedFile file(path, "write_npy");
    detail::write_npy_to(file, array);
    state_->staged.push_back(std::move(file));
  });
}

template void OutputFiles::stage_npy<float>(const std::string&, const Tensor<float>&);
template void OutputFiles::stage_npy<double>(const std::string&, const Tensor<double>&);
template void OutputFiles::stage_npy<std::int64_t>(const std::string&, const Tensor<std::int64_t>&);

void OutputFiles::stage_bytes(const std::string& path, const std::string& bytes) {
  naming(state_->name_of(path), "write", path, [&] {
    detail::StagedFile file(path, "write");
    file.write(bytes);
    state_->staged.push_back(std::move(file));
  });
}

void OutputFiles::commit() {
  std::vector<detail::StagedFile>& staged = state_->staged;
  std::size_t done = 0;
  try {
    for (; done < staged.size(); ++done) {
      detail::StagedFile& file = staged[done];
      naming(state_->name_of(file.target()), "write", file.target(), [&] { file.commit(); });
    }
  } catch (...) {
    // All or nothing: take back what this commit already put in place.
    for (std::size_t i = 0; i < done; ++i) std::remove(staged[i].target().c_str());
    staged.clear();
    throw;
  }
  staged.clear();
}

}  // namespace emflow

// Several outputs written all or none (emflow::OutputFiles in io.hpp): each is a StagedFile
// until commit() renames them all into place.
//
// commit() runs in three phases so that as little as possible happens once the first target is
// replaced: (1) every temporary file is flushed (fsync) and closed, the long part for a large
// output; (2) every existing target gets a backup, a hard link beside it (the target itself
// stays in place), and a target that has become a folder is refused; (3) the renames, back to
// back, then the fsync of each folder and the removal of the backups. A failure in (1) or (2)
// leaves every target as it was; a failed rename in (3) puts the backups back.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/io.hpp"
#include "npy_writer.hpp"
#include "staged_file.hpp"

namespace emflow {
namespace {

namespace fs = std::filesystem;

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

// What makes two paths the same file: the canonical path (the canonical folder plus the name
// for an output, whose last component is replaced rather than followed), and the (device, inode)
// of the entry itself and of what it resolves to, so that hard links and symbolic links to one
// file count as the same file.
// The (device, inode) of the folder plus the name also catch a folder reached by two paths
// that resolve differently (a bind mount) when the target does not exist yet.
struct Identity {
  std::string name, path;  // the option and the path as given
  std::string canonical;
  std::vector<std::pair<dev_t, ino_t>> inodes;
  bool has_folder = false;
  std::pair<dev_t, ino_t> folder{};
  std::string file;

  // "(both are 'P')", or for two names of one file on disk "('P' and 'Q' are one file)".
  std::string common_file(const Identity& other) const {
    if (canonical == other.canonical) return "(both are '" + canonical + "')";
    return "('" + canonical + "' and '" + other.canonical + "' are one file)";
  }

  bool same_as(const Identity& other) const {
    if (canonical == other.canonical) return true;
    if (has_folder && other.has_folder && folder == other.folder && file == other.file) {
      return true;
    }
    for (const auto& mine : inodes) {
      for (const auto& theirs : other.inodes) {
        if (mine == theirs) return true;
      }
    }
    return false;
  }
};

void add_inodes(Identity& identity, const std::string& path) {
  struct stat info {};
  const std::string folder = detail::folder_of(identity.canonical);
  if (::stat(folder.c_str(), &info) == 0) {
    identity.has_folder = true;
    identity.folder = {info.st_dev, info.st_ino};
    identity.file = detail::file_name_of(identity.canonical);
  }
  if (::lstat(path.c_str(), &info) == 0) identity.inodes.emplace_back(info.st_dev, info.st_ino);
  if (::stat(path.c_str(), &info) == 0) identity.inodes.emplace_back(info.st_dev, info.st_ino);
}

std::string canonical_or_absolute(const fs::path& path) {
  std::error_code error;
  fs::path result = fs::weakly_canonical(path, error);
  if (error) result = fs::absolute(path, error);
  if (error) return path.lexically_normal().string();
  return result.string();
}

}  // namespace

struct OutputFiles::State {
  std::vector<Identity> declared;  // outputs, in the order of declare()
  std::vector<Identity> inputs;
  std::vector<detail::StagedFile> staged;  // removed unless committed

  const std::string& name_of(const std::string& path) const {
    for (const Identity& target : declared) {
      if (target.path == path) return target.name;
    }
    detail::fail(ErrorCode::invalid_argument, "OutputFiles: '", path, "' was not declared");
  }

  // Refuses `output` when it is the file of another output or of an input.
  void expect_distinct(const Identity& output) const {
    for (const Identity& other : declared) {
      if (output.same_as(other)) {
        detail::fail(ErrorCode::invalid_argument, output.name, " '", output.path,
                     "' is also the file of ", other.name, " '", other.path, "' ",
                     output.common_file(other), "; each output needs its own file");
      }
    }
    for (const Identity& input : inputs) {
      if (output.same_as(input)) {
        detail::fail(ErrorCode::invalid_argument, output.name, " '", output.path,
                     "' is the input file of ", input.name, " '", input.path, "' ",
                     output.common_file(input),
                     "; an output may not replace an input of the same run");
      }
    }
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
  const std::string file = detail::file_name_of(path);
  if (file.empty() || file == "." || file == "..") {
    fail(kInvalid, name, " '", path, "' is not a file name");
  }
  const std::string folder = detail::folder_of(path);
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    fail(kInvalid, name, " '", path, "': the folder '", folder, "' does not exist");
  }
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    fail(kInvalid, name, " '", path, "': the folder '", folder,
         "' is not writable: ", std::strerror(errno));
  }
  // A folder at the target would make the last rename fail after the others were done.
  if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    fail(kInvalid, name, " '", path, "' is a folder; expected a file name");
  }
  Identity target;
  target.name = name;
  target.path = path;
  target.canonical = canonical_or_absolute(folder) + "/" + file;
  add_inodes(target, path);
  state_->expect_distinct(target);
  state_->declared.push_back(std::move(target));
}

void OutputFiles::declare_input(const std::string& name, const std::string& path) {
  if (path.empty()) return;
  // An input is read through its links, so its identity is the file they lead to.
  Identity input;
  input.name = name;
  input.path = path;
  input.canonical = canonical_or_absolute(path);
  add_inodes(input, path);
  for (const Identity& output : state_->declared) {
    if (output.same_as(input)) {
      detail::fail(ErrorCode::invalid_argument, output.name, " '", output.path,
                   "' is the input file of ", name, " '", path, "' ", output.common_file(input),
                   "; an output may not replace an input of the same run");
    }
  }
  state_->inputs.push_back(std::move(input));
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
template void OutputFiles::stage_npy<float16>(const std::string&, const Tensor<float16>&);

void OutputFiles::stage_bytes(const std::string& path, const std::string& bytes) {
  naming(state_->name_of(path), "write", path, [&] {
    detail::StagedFile file(path, "write");
    file.write(bytes);
    state_->staged.push_back(std::move(file));
  });
}

namespace {

// The old file of one target while the commit runs.
struct Backup {
  std::string path;     // beside the target
  bool exists = false;  // the target existed: `path` holds it (a hard link, or moved there)
  bool moved = false;   // link() was impossible, so the old target was renamed to `path`
};

// Puts the old file of a replaced target back (or removes the new one when there was none).
void restore(const std::string& target, const Backup& backup) noexcept {
  if (backup.exists) {
    ::rename(backup.path.c_str(), target.c_str());
  } else {
    ::unlink(target.c_str());
  }
}

// Drops the backup of a target that was not replaced: a moved old file goes back in place.
void drop(const std::string& target, const Backup& backup) noexcept {
  if (!backup.exists) return;
  if (backup.moved) {
    ::rename(backup.path.c_str(), target.c_str());
  } else {
    ::unlink(backup.path.c_str());
  }
}

}  // namespace

void OutputFiles::commit() {
  std::vector<detail::StagedFile>& staged = state_->staged;
  std::vector<Backup> backups;
  std::size_t backed_up = 0;
  try {
    // (1) Every temporary file complete on disk and closed.
    for (detail::StagedFile& file : staged) {
      naming(state_->name_of(file.target()), "write", file.target(), [&] { file.finish(); });
    }
    // Allocate everything the later phases need now: they must not fail for lack of memory.
    backups.resize(staged.size());
    std::vector<std::string> folders;
    for (std::size_t i = 0; i < staged.size(); ++i) {
      backups[i].path = detail::sibling_name(staged[i].target(), "bak");
      const std::string folder = detail::folder_of(staged[i].target());
      bool known = false;
      for (const std::string& f : folders) known = known || f == folder;
      if (!known) folders.push_back(folder);
    }
    // (2) A backup of every existing target; nothing visible changes yet.
    for (; backed_up < staged.size(); ++backed_up) {
      detail::StagedFile& file = staged[backed_up];
      Backup& backup = backups[backed_up];
      const std::string& name = state_->name_of(file.target());
      naming(name, "write", file.target(), [&] {
        struct stat info {};
        if (::lstat(file.target().c_str(), &info) != 0) {
          if (errno != ENOENT) file.fail_errno("cannot inspect the old file", errno);
          return;
        }
        if (S_ISDIR(info.st_mode)) file.fail_errno("it is a folder", EISDIR);
        if (::link(file.target().c_str(), backup.path.c_str()) == 0) {
          backup.exists = true;
        } else if (::rename(file.target().c_str(), backup.path.c_str()) == 0) {
          backup.exists = backup.moved = true;  // a file system without hard links
        } else {
          file.fail_errno("cannot keep a backup of the old file", errno);
        }
      });
    }
    // (3) The renames, back to back: the only window in which a kill leaves a mix.
    for (std::size_t i = 0; i < staged.size(); ++i) {
      const int error = staged[i].rename_into_place();
      if (error == 0) continue;
      for (std::size_t j = i; j-- > 0;) restore(staged[j].target(), backups[j]);
      for (std::size_t j = i; j < staged.size(); ++j) drop(staged[j].target(), backups[j]);
      backed_up = 0;  // every backup is dealt with
      detail::StagedFile& file = staged[i];
      naming(state_->name_of(file.target()), "write", file.target(),
             [&] { file.fail_errno("rename failed", error); });
    }
    for (const Backup& backup : backups) {
      if (backup.exists) ::unlink(backup.path.c_str());
    }
    for (const std::string& folder : folders) detail::fsync_folder(folder);
  } catch (...) {
    for (std::size_t j = 0; j < backed_up; ++j) drop(staged[j].target(), backups[j]);
    staged.clear();
    throw;
  }
  staged.clear();
}

}  // namespace emflow

// A file written beside its target and renamed into place only when complete, so that readers
// never see a half-written output and a failed run leaves nothing behind. write_file_atomic is
// one StagedFile; OutputFiles stages all of a run's outputs, finishes (flushes and closes) every
// one of them, and only then renames them into place back to back.
//
// Temporary files are named ".<target name>.emflow-tmp-<pid>-<hex>" beside the target (backups
// of old targets during OutputFiles::commit ".<target name>.emflow-bak-<pid>-<hex>"), so that a
// later write to the same target recognises the leftovers of a killed process and removes them.
#pragma once

#include <cstddef>
#include <string>

namespace emflow::detail {

/// The environment variable of StagedFile::finish's test hook.
inline constexpr const char* kStopBeforeFsync = "EMFLOW_TEST_STOP_BEFORE_FSYNC";

/// The folder of `path` as written ("." for a bare name, "/" for a file in the root).
std::string folder_of(const std::string& path);
/// The last component of `path`.
std::string file_name_of(const std::string& path);
/// ".<name>.emflow-<kind>-<pid>-<hex>" in the folder of `target`; `kind` is "tmp" or "bak".
std::string sibling_name(const std::string& target, const char* kind);
/// Removes the temporary files and backups of `target` (named as above) whose process is no
/// longer alive (kill(pid, 0) fails with ESRCH); returns how many were removed. Throws only
/// std::bad_alloc.
int remove_stale_siblings(const std::string& target);
/// fsync of a folder, so that renames in it survive a crash; failures are ignored (the renames
/// are done and cannot be undone).
void fsync_folder(const std::string& folder) noexcept;

class StagedFile {
 public:
  /// Creates a temporary file in the folder of `target` (same file system, so the final rename
  /// is atomic), after removing the leftovers of dead processes for the same target.
  /// `operation` prefixes error messages. Throws ErrorCode::io naming `target`.
  StagedFile(std::string target, std::string operation);
  /// Removes the temporary file unless it was renamed into place.
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  StagedFile(StagedFile&& other) noexcept;
  StagedFile& operator=(StagedFile&&) = delete;

  /// Appends `bytes`. Throws ErrorCode::io (the temporary file is then removed).
  void write(const char* data, std::size_t size);
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }

  /// Flushes the temporary file to disk (fsync) and closes it: after finish() only the rename
  /// is left. Throws ErrorCode::io (the temporary file is then removed, the target untouched).
  ///
  /// Test hook: when the environment variable kStopBeforeFsync names the file name of the
  /// target (its last component), the process stops itself with SIGSTOP just before the fsync,
  /// so that a test can kill it at that point (tests/reliability/output_paths_test.cpp).
  void finish();
  /// Renames the finished temporary file over the target. Returns 0, or the errno of the
  /// failed rename (the temporary file is then still there). Neither throws nor allocates.
  int rename_into_place() noexcept;
  /// Throws ErrorCode::io "<operation>: cannot write '<target>': <what>: <strerror(error)>",
  /// removing the temporary file.
  [[noreturn]] void fail_errno(const char* what, int error);
  /// finish(), rename_into_place() and an fsync of the folder. Throws ErrorCode::io (the
  /// temporary file is then removed and the target untouched).
  void commit();

  const std::string& target() const noexcept { return target_; }
  const std::string& temp_path() const noexcept { return temp_path_; }

 private:
  void discard() noexcept;

  std::string target_;
  std::string operation_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace emflow::detail

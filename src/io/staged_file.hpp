// A file written beside its target and renamed into place only when complete, so that readers
// never see a half-written output and a failed run leaves nothing behind. write_file_atomic is
// one StagedFile; the CLI stages all of a run's outputs first and commits them together.
#pragma once

#include <cstddef>
#include <string>

namespace emflow::detail {

class StagedFile {
 public:
  /// Creates a temporary file in the folder of `target` (same file system, so the final rename
  /// is atomic). `operation` prefixes error messages. Throws ErrorCode::io naming `target`.
  StagedFile(std::string target, std::string operation);
  /// Removes the temporary file unless commit() succeeded.
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  StagedFile(StagedFile&& other) noexcept;
  StagedFile& operator=(StagedFile&&) = delete;

  /// Appends `bytes`. Throws ErrorCode::io (the temporary file is then removed).
  void write(const char* data, std::size_t size);
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }
  /// Flushes to disk, closes and renames over the target. Throws ErrorCode::io (the temporary
  /// file is then removed and the target is untouched).
  void commit();

  const std::string& target() const noexcept { return target_; }

 private:
  void discard() noexcept;
  [[noreturn]] void fail_errno(const char* what, int error);

  std::string target_;
  std::string operation_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace emflow::detail

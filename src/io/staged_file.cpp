// Atomic output: temporary file in the target's folder, fsync, rename (POSIX guarantees that a
// rename within one file system replaces the target in one step).
#include "staged_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "../core/check.hpp"
#include "../core/memory.hpp"
#include "emflow/io.hpp"

namespace emflow::detail {
namespace {

std::string folder_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string name_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A name no other writer (thread or process) picks: pid, a process-wide counter and a random
// word. O_EXCL below makes a collision an error rather than a shared file.
std::string temp_name(const std::string& target) {
  static std::atomic<unsigned long> counter{0};
  static thread_local std::mt19937_64 random{std::random_device{}()};
  const std::string suffix =
      concat(".tmp.", ::getpid(), ".", counter.fetch_add(1), ".", std::hex, random() & 0xffffffu);
  // Same folder as the target: everything up to and including the last '/'.
  const std::size_t slash = target.find_last_of('/');
  const std::string prefix =
      slash == std::string::npos ? std::string() : target.substr(0, slash + 1);
  return prefix + "." + name_of(target) + suffix;
}

}  // namespace

StagedFile::StagedFile(std::string target, std::string operation)
    : target_(std::move(target)), operation_(std::move(operation)) {
  if (target_.empty() || target_.back() == '/') {
    fail(ErrorCode::io, operation_, ": cannot write '", target_, "': not a file name");
  }
  for (int attempt = 0; attempt < 8 && fd_ < 0; ++attempt) {
    temp_path_ = temp_name(target_);
    // 0666 filtered by the umask, like any file a program creates (mkstemp would force 0600).
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  if (fd_ < 0) {
    const int error = errno;
    temp_path_.clear();
    fail(ErrorCode::io, operation_, ": cannot write '", target_, "': cannot create a file in '",
         folder_of(target_), "': ", std::strerror(error));
  }
}

StagedFile::StagedFile(StagedFile&& other) noexcept
    : target_(std::move(other.target_)),
      operation_(std::move(other.operation_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      committed_(other.committed_) {
  other.temp_path_.clear();
  other.committed_ = true;
}

StagedFile::~StagedFile() {
  if (!committed_) discard();
}

void StagedFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

void StagedFile::fail_errno(const char* what, int error) {
  discard();
  fail(ErrorCode::io, operation_, ": cannot write '", target_, "': ", what, ": ",
       std::strerror(error));
}

void StagedFile::write(const char* data, std::size_t size) {
  if (fd_ < 0) fail(ErrorCode::internal, operation_, ": '", target_, "' is no longer open");
  std::size_t left = size;
  while (left > 0) {
    const ssize_t written = ::write(fd_, data, left);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_errno("write failed", errno);
    }
    data += written;
    left -= static_cast<std::size_t>(written);
  }
}

void StagedFile::commit() {
  if (fd_ < 0) fail(ErrorCode::internal, operation_, ": '", target_, "' is no longer open");
  if (::fsync(fd_) != 0) fail_errno("fsync failed", errno);
  // Everything that may throw (this allocates) happens before the rename: once the target is
  // in place, commit() must not report a failure.
  const std::string folder_path = folder_of(target_);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) fail_errno("close failed", errno);
  if (::rename(temp_path_.c_str(), target_.c_str()) != 0) fail_errno("rename failed", errno);
  committed_ = true;
  temp_path_.clear();
  // Make the rename itself durable; a failure here cannot undo it, so it is not an error.
  const int folder = ::open(folder_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder >= 0) {
    ::fsync(folder);
    ::close(folder);
  }
}

}  // namespace emflow::detail

namespace emflow {

void write_file_atomic(const std::string& path, const std::string& bytes) {
  detail::reporting_out_of_memory("write_file_atomic", path, [&] {
    detail::StagedFile file(path, "write_file_atomic");
    file.write(bytes);
    file.commit();
  });
}

}  // namespace emflow

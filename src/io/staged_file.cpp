// Atomic output: temporary file in the target's folder, fsync, rename (POSIX guarantees that a
// rename within one file system replaces the target in one step).
#include "staged_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/io.hpp"

namespace emflow::detail {
namespace {

// Parses "<digits>-<hex digits>" (the tail of a sibling's name) into the pid; 0 if malformed.
long long pid_of_tail(const char* tail) {
  long long pid = 0;
  const char* c = tail;
  for (; *c >= '0' && *c <= '9'; ++c) {
    if (pid > 100000000000LL) return 0;
    pid = pid * 10 + (*c - '0');
  }
  if (c == tail || *c != '-' || c[1] == '\0') return 0;
  for (++c; *c != '\0'; ++c) {
    const bool hex = (*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f');
    if (!hex) return 0;
  }
  return pid;
}

}  // namespace

std::string folder_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string file_name_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A name no other writer (thread or process) picks: the pid, then a random word mixed with a
// process-wide counter. O_EXCL (temporaries) and link() (backups) make a collision an error
// rather than a shared file.
std::string sibling_name(const std::string& target, const char* kind) {
  static std::atomic<unsigned long long> counter{0};
  static thread_local std::mt19937_64 random{std::random_device{}()};
  const unsigned long long word = (random() << 20) ^ counter.fetch_add(1);
  const std::size_t slash = target.find_last_of('/');
  const std::string prefix =
      slash == std::string::npos ? std::string() : target.substr(0, slash + 1);
  return concat(prefix, ".", file_name_of(target), ".emflow-", kind, "-", ::getpid(), "-", std::hex,
                word);
}

int remove_stale_siblings(const std::string& target) {
  // Everything allocated up front, so that the scan itself cannot throw with the folder open.
  const std::string folder = folder_of(target);
  const std::string stem = "." + file_name_of(target) + ".emflow-";
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return 0;
  const long long self = ::getpid();
  int removed = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const char* name = entry->d_name;
    if (std::strncmp(name, stem.c_str(), stem.size()) != 0) continue;
    const char* kind = name + stem.size();
    if (std::strncmp(kind, "tmp-", 4) != 0 && std::strncmp(kind, "bak-", 4) != 0) continue;
    const long long pid = pid_of_tail(kind + 4);
    // Only a process that is gone: a live one (or this one) may still be writing it.
    if (pid <= 0 || pid == self || pid > 0x7fffffffLL) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::unlinkat(::dirfd(dir), name, 0) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

void fsync_folder(const std::string& folder) noexcept {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

StagedFile::StagedFile(std::string target, std::string operation)
    : target_(std::move(target)), operation_(std::move(operation)) {
  if (target_.empty() || target_.back() == '/') {
    fail(ErrorCode::io, operation_, ": cannot write '", target_, "': not a file name");
  }
  remove_stale_siblings(target_);
  for (int attempt = 0; attempt < 8 && fd_ < 0; ++attempt) {
    temp_path_ = sibling_name(target_, "tmp");
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

void StagedFile::finish() {
  if (fd_ < 0) fail(ErrorCode::internal, operation_, ": '", target_, "' is no longer open");
  const char* stop = std::getenv(kStopBeforeFsync);
  if (stop != nullptr && *stop != '\0' && file_name_of(target_) == stop) ::raise(SIGSTOP);
  if (::fsync(fd_) != 0) fail_errno("fsync failed", errno);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) fail_errno("close failed", errno);
}

int StagedFile::rename_into_place() noexcept {
  if (committed_ || temp_path_.empty()) return EINVAL;
  if (::rename(temp_path_.c_str(), target_.c_str()) != 0) return errno;
  committed_ = true;
  return 0;
}

void StagedFile::commit() {
  finish();
  // Everything that may throw (this allocates) happens before the rename: once the target is
  // in place, commit() must not report a failure.
  const std::string folder = folder_of(target_);
  const int error = rename_into_place();
  if (error != 0) fail_errno("rename failed", error);
  temp_path_.clear();
  // Make the rename itself durable; a failure here cannot undo it, so it is not an error.
  fsync_folder(folder);
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

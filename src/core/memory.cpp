#include "memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>

#include "check.hpp"
#include "emflow/memory.hpp"

namespace emflow::detail {
namespace {

// A cgroup memory limit ("max" or a byte count), or INT64_MAX when there is none.
std::int64_t cgroup_limit(const char* file) {
  std::ifstream in(file);
  std::int64_t bytes = 0;
  if (in >> bytes && bytes > 0) return bytes;
  return std::numeric_limits<std::int64_t>::max();
}

}  // namespace

std::int64_t memory_limit_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  std::int64_t limit = std::numeric_limits<std::int64_t>::max();
  if (pages > 0 && page_size > 0 &&
      !__builtin_mul_overflow(static_cast<std::int64_t>(pages), page_size, &limit)) {
    // limit holds the physical memory
  } else {
    limit = std::numeric_limits<std::int64_t>::max();
  }
  limit = std::min(limit, cgroup_limit("/sys/fs/cgroup/memory.max"));
  limit = std::min(limit, cgroup_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  return limit;
}

void expect_fits_in_memory(const char* operation, const std::string& what, std::int64_t count,
                           std::int64_t item_size) {
  std::int64_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(count, item_size, &bytes)) {
    fail(ErrorCode::out_of_memory, operation, ": ", what, " needs ", count, " x ", item_size,
         " bytes, which overflows 64 bits");
  }
  const std::int64_t limit = memory_limit_bytes();
  if (bytes > limit) {
    fail(ErrorCode::out_of_memory, operation, ": ", what, " needs ", bytes, " bytes (", count,
         " x ", item_size, "), more than the ", limit, " bytes of memory available");
  }
}

void fail_out_of_memory(const char* operation, const std::string& file) {
  if (file.empty()) fail(ErrorCode::out_of_memory, operation, ": out of host memory");
  fail(ErrorCode::out_of_memory, operation, ": '", file, "': out of host memory");
}

}  // namespace emflow::detail

namespace emflow {

std::int64_t memory_limit_bytes() { return detail::memory_limit_bytes(); }

void expect_fits_in_memory(const std::string& operation, const std::string& what,
                           std::int64_t count, std::int64_t item_size) {
  detail::expect_fits_in_memory(operation.c_str(), what, count, item_size);
}

}  // namespace emflow

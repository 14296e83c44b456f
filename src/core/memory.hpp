// Private: refusing allocations that cannot fit before making them. On Linux an allocation far
// beyond the memory present may still succeed (overcommit) and the process is killed later when
// the pages are touched, so sizes computed from user input are checked here first.
#pragma once

#include <cstdint>
#include <new>
#include <string>

namespace emflow::detail {

/// Bytes this process may use at most: the physical memory, or the cgroup limit when lower.
std::int64_t memory_limit_bytes();

/// Throws emflow::Error (ErrorCode::out_of_memory) unless `count` items of `item_size` bytes fit
/// in memory_limit_bytes(); also when the byte count overflows 64 bits. The message reads
/// "<operation>: <what> needs <bytes> bytes (<count> x <item_size>), more than the <limit> bytes
/// of memory available".
void expect_fits_in_memory(const char* operation, const std::string& what, std::int64_t count,
                           std::int64_t item_size);

/// Throws emflow::Error(ErrorCode::out_of_memory): "<operation>: '<file>': out of host memory",
/// or "<operation>: out of host memory" when `file` is empty.
[[noreturn]] void fail_out_of_memory(const char* operation, const std::string& file = "");

/// Runs `body` (which works on `file`, or on no file when empty), turning a std::bad_alloc it
/// throws into emflow::Error(out_of_memory): the policy at every public entry point
/// (docs/RELIABILITY.md). Everything `body` allocated has been released by then (RAII), so the
/// caller may carry on or retry.
template <class Body>
auto reporting_out_of_memory(const char* operation, const std::string& file, Body&& body)
    -> decltype(body()) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    fail_out_of_memory(operation, file);
  }
}

}  // namespace emflow::detail

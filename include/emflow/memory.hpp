// emflow: how much memory this process may use, so that a size computed from user input can be
// refused before it is allocated. On Linux an allocation far beyond the memory present may still
// succeed (overcommit) and the process is killed later when the pages are touched; emflow's own
// calls check their allocations this way, and these are the same checks for a caller's.
#pragma once

#include <cstdint>
#include <string>

namespace emflow {

/// Bytes this process may use at most: the physical memory, or the cgroup limit when lower.
std::int64_t memory_limit_bytes();

/// Throws emflow::Error (ErrorCode::out_of_memory) unless `count` items of `item_size` bytes fit
/// in memory_limit_bytes(); also when the byte count overflows 64 bits or `count` is negative.
/// The message reads "<operation>: <what> needs <bytes> bytes (<count> x <item_size>), more than
/// the <limit> bytes of memory available".
void expect_fits_in_memory(const std::string& operation, const std::string& what,
                           std::int64_t count, std::int64_t item_size);

}  // namespace emflow

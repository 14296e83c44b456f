// What the rings of sequence_parallel.hpp share: their clock, the visibility tests of a block
// of queries against a block of keys, and the steps of passing shards around.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/distributed.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::distributed::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// May any query of [q.position, q.position + q.count) see any key of `keys` under the mask and
/// the key lengths? (A conservative test: false only when no pair is visible.)
inline bool any_visible(const Mask& mask, const Segment& q, const Segment& keys,
                        const std::vector<std::int64_t>* lengths) {
  if (lengths) {
    bool any = false;
    for (const std::int64_t length : *lengths) any |= length > keys.position && length > q.position;
    if (!any) return false;
  }
  const KeyRange first = mask.visible_keys_at(q.position, keys.position, keys.count);
  const KeyRange last = mask.visible_keys_at(q.position + q.count - 1, keys.position, keys.count);
  return first.first < last.last;
}

/// Per-cloud lengths of the run `s` when the whole cloud's first lengths[b] tokens are real.
inline std::vector<std::int64_t> local_lengths(const std::vector<std::int64_t>& lengths,
                                               const Segment& s) {
  std::vector<std::int64_t> out(lengths.size());
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    out[b] = std::clamp<std::int64_t>(lengths[b] - s.position, 0, s.count);
  }
  return out;
}

/// Runs the P steps of a ring: at step t the rank holds the shard of owner (r - t) mod P; it
/// starts passing that shard on to r + 1 (but at the last step) while it receives the next from
/// r - 1, calls step(owner, transfer, failed) (transfer: the shift in flight, to poll, or null;
/// failed: an earlier step threw) and waits for the shift. `ring` has P, r, the buffers held
/// and next, and shard_bytes(owner). A rank whose step fails keeps passing shards on to the end
/// (its partners would wait for them forever): the first failure is returned, for the caller
/// to agree on.
template <class Ring, class Step>
std::exception_ptr run_steps(Communicator& comm, Ring& ring, RingTimes& times, Step&& step) {
  std::exception_ptr error;
  const int P = ring.P, r = ring.r;
  for (int t = 0; t < P; ++t) {
    const int owner = (r - t + P) % P;
    std::unique_ptr<Transfer> transfer;
    if (t + 1 < P) {
      const std::size_t send = ring.shard_bytes(owner);
      transfer = comm.start_shift(ring.held.data(), send, ring.next.data(),
                                  ring.shard_bytes((owner - 1 + P) % P));
      times.bytes_sent += static_cast<std::int64_t>(send);
    }
    try {
      step(owner, transfer.get(), error != nullptr);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    if (transfer) {
      const auto wait_start = Clock::now();
      comm.wait(*transfer);
      times.exposed_wait += seconds_since(wait_start);
      ring.held.swap(ring.next);
    }
  }
  return error;
}

}  // namespace emflow::distributed::detail

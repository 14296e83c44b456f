// The communicator seam: ring shifts, reductions in rank order, broadcast, gather and error
// agreement, on every rank of the job (and on the single-process communicator).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <numeric>
#include <vector>

#include "comm.hpp"
#include "common/testing.hpp"
#include "emflow/distributed.hpp"
#include "emflow/error.hpp"

namespace emflow::testing {
namespace {

using distributed::Communicator;

// A rank's own bytes: their count and values depend on the rank, so a misrouted or truncated
// message shows.
std::vector<std::uint8_t> stamp(int rank, std::size_t extra) {
  std::vector<std::uint8_t> bytes(1000 + 37 * static_cast<std::size_t>(rank) + extra);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<std::uint8_t>((i * 7 + static_cast<std::size_t>(rank) * 31) & 0xff);
  }
  return bytes;
}

void shift_around(Communicator& c) {
  const int P = c.size(), r = c.rank();
  // Each rank passes on what it holds; after step t it holds the bytes of rank r - t - 1.
  std::vector<std::uint8_t> held = stamp(r, 0);
  for (int t = 0; t < P; ++t) {
    const int from = ((r - t - 1) % P + P) % P;
    std::vector<std::uint8_t> next(stamp(from, 0).size());
    auto transfer = c.start_shift(held.data(), held.size(), next.data(), next.size());
    c.poll(*transfer);
    c.wait(*transfer);
    EXPECT_EQ(next, stamp(from, 0)) << "step " << t;
    held.swap(next);
  }
  EXPECT_EQ(held, stamp(r, 0));
}

TEST(Communicator, RingShiftDeliversEachNeighboursBytes) { shift_around(comm()); }

TEST(Communicator, SingleProcessShiftCopiesToItself) {
  distributed::SingleProcess one;
  EXPECT_EQ(one.rank(), 0);
  EXPECT_EQ(one.size(), 1);
  shift_around(one);
}

TEST(Communicator, DoubleSumIsInRankOrderAndTheSameOnEveryRank) {
  Communicator& c = comm();
  const int P = c.size(), r = c.rank();
  // Values whose sum depends on the order of the additions.
  auto value = [](int rank, int i) {
    return (rank % 2 == 0 ? 1e16 : -1e16) * (i + 1) + 0.5 * rank + 0.1 * i;
  };
  std::vector<double> values(5);
  for (int i = 0; i < 5; ++i) values[static_cast<std::size_t>(i)] = value(r, i);
  c.allreduce_sum(values.data(), 5);
  for (int i = 0; i < 5; ++i) {
    double expected = value(0, i);
    for (int k = 1; k < P; ++k) expected += value(k, i);
    EXPECT_EQ(values[static_cast<std::size_t>(i)], expected) << i;  // bit for bit
  }
  // Every rank holds rank 0's bits.
  std::vector<std::int64_t> bits(5), first(5);
  std::memcpy(bits.data(), values.data(), 40);
  first = bits;
  c.broadcast(first.data(), 40, 0);
  EXPECT_EQ(bits, first);
}

TEST(Communicator, IntegerSumAndMinimumAreExact) {
  Communicator& c = comm();
  const int P = c.size(), r = c.rank();
  std::vector<std::int64_t> sum = {r, std::int64_t{1} << 53, -r * 3, 1};
  c.allreduce_sum(sum.data(), 4);
  const std::int64_t ranks = P * (P - 1) / 2;
  EXPECT_EQ(sum, (std::vector<std::int64_t>{ranks, (std::int64_t{1} << 53) * P, -3 * ranks, P}));
  std::vector<std::int64_t> low = {10 - r, r};
  c.allreduce_min(low.data(), 2);
  EXPECT_EQ(low, (std::vector<std::int64_t>{10 - (P - 1), 0}));
}

TEST(Communicator, BroadcastFromTheLastRank) {
  Communicator& c = comm();
  const int root = c.size() - 1;
  std::vector<std::uint8_t> bytes =
      c.rank() == root ? stamp(root, 5) : std::vector<std::uint8_t>(stamp(root, 5).size());
  c.broadcast(bytes.data(), bytes.size(), root);
  EXPECT_EQ(bytes, stamp(root, 5));
}

TEST(Communicator, GatherConcatenatesInRankOrder) {
  Communicator& c = comm();
  const int P = c.size();
  std::vector<std::size_t> counts;
  std::vector<std::uint8_t> expected;
  for (int k = 0; k < P; ++k) {
    const std::vector<std::uint8_t> own = stamp(k, 3);
    counts.push_back(own.size());
    expected.insert(expected.end(), own.begin(), own.end());
  }
  const std::vector<std::uint8_t> own = stamp(c.rank(), 3);
  std::vector<std::uint8_t> all(c.rank() == 0 ? expected.size() : 0);
  c.gather(own.data(), all.data(), counts, 0);
  if (c.rank() == 0) {
    EXPECT_EQ(all, expected);
  }
}

TEST(Communicator, AgreementReturnsWhenNoRankFailed) {
  EXPECT_NO_THROW(distributed::agree(comm(), nullptr));
  EXPECT_EQ(distributed::agreed(comm(), [] { return 42; }), 42);
}

TEST(Communicator, OneRanksErrorReachesEveryRank) {
  Communicator& c = comm();
  const int failing = c.size() - 1;
  const auto body = [&] {
    distributed::agreed(c, [&] {
      if (c.rank() == failing) {
        throw Error(ErrorCode::invalid_argument, "attend: argument 'dim' must be >= 1, got 0");
      }
    });
  };
  const std::string prefix = c.size() > 1 ? "rank " + std::to_string(failing) + ": " : "";
  EXPECT_TRUE(throws_error(body, ErrorCode::invalid_argument,
                           {prefix + "attend: argument 'dim' must be >= 1, got 0"}));
}

TEST(Communicator, TheLowestFailingRankIsReportedAndOutOfMemoryKeepsItsCode) {
  Communicator& c = comm();
  // Every rank from 1 on (rank 0 alone when there is one rank) runs out of memory.
  const int lowest = c.size() > 1 ? 1 : 0;
  const auto body = [&] {
    distributed::agreed(c, [&] {
      if (c.rank() >= lowest) throw std::bad_alloc();
    });
  };
  EXPECT_TRUE(
      throws_error(body, ErrorCode::out_of_memory, {c.size() > 1 ? "rank 1: out of memory" : ""}));
  // The job goes on: the communicator still works after an agreed failure.
  std::int64_t one = 1;
  c.allreduce_sum(&one, 1);
  EXPECT_EQ(one, c.size());
}

}  // namespace
}  // namespace emflow::testing

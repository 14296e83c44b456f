// The `--distributed` runs of the subcommands (mpirun -np P emflow <command> ... --distributed):
// the same files as a run in one process, each rank computing its share.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.hpp"
#include "emflow/finite.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::cli {

/// What `emflow attend` was given.
struct AttendFiles {
  std::string cloud, relevance, content, key_bias, offset, key_lengths;
  std::string update, lse, entropy, weights;
  double beta = 1.0;
  std::string mask = "none";
  std::string device = "auto";
  int threads = 0;
  bool check_finite = false;
};

/// Sequence-parallel `emflow attend` (cmd_attend_distributed.cpp): each rank reads its shard of
/// --x (offset reads) and the operators, the ring computes, rank 0 gathers and writes the
/// outputs once, all or none.
void run_attend_distributed(const AttendFiles& files);

// Refuses a NaN or infinity in this rank's rows, naming the element by its index in the file.
template <class T>
void require_finite_shard(const std::vector<T>& rows,
                          const std::vector<distributed::Segment>& segments, const Shape& shape,
                          std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                          const std::string& what) {
  const std::int64_t bad = find_non_finite(rows.data(), static_cast<std::int64_t>(rows.size()));
  if (bad < 0) return;
  std::int64_t rest = bad;
  for (const distributed::Segment& s : segments) {
    if (rest < batch * s.count * dim) {
      const std::int64_t b = rest / (s.count * dim), i = rest / dim % s.count, a = rest % dim;
      const std::int64_t global = (b * tokens + s.position + i) * dim + a;
      fail_option(what, "element ", multi_index(shape, global), " is ", rows[bad],
                  "; --check-finite refuses NaN and infinity");
    }
    rest -= batch * s.count * dim;
  }
}

}  // namespace emflow::cli

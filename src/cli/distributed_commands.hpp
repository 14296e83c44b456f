// The `--distributed` runs of the subcommands (mpirun -np P emflow <command> ... --distributed):
// the same files as a run in one process, each rank computing its share.
#pragma once

#include <string>

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

}  // namespace emflow::cli

// The MPI job of `--distributed` runs (job.hpp).
#include "job.hpp"

#include <memory>

namespace emflow::cli {
namespace {

std::unique_ptr<distributed::Communicator>& slot() {
  static std::unique_ptr<distributed::Communicator> world;
  return world;
}

}  // namespace

distributed::Communicator& job() {
  if (!slot()) slot() = distributed::world(nullptr, nullptr);
  return *slot();
}

bool in_job() noexcept { return slot() != nullptr; }

int job_rank() noexcept { return slot() ? slot()->rank() : 0; }

void end_job() noexcept { slot().reset(); }

}  // namespace emflow::cli

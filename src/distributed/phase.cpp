// The phase sweep across ranks (emflow/distributed_flow.hpp).
#include <cstdint>
#include <vector>

#include "emflow/distributed_flow.hpp"

namespace emflow::distributed {

flow::PhaseDiagram phase_diagram(Communicator& comm, const flow::PhaseSettings& settings,
                                 const ExecutionOptions& options, const flow::Progress& progress) {
  const std::int64_t total = settings.clouds * settings.beta_count;
  const std::int64_t P = comm.size(), r = comm.rank();
  // Near-equal runs: [r T / P, (r + 1) T / P) without overflow for any T below 2^62 / P.
  const auto bound = [&](std::int64_t k) { return total / P * k + total % P * k / P; };
  ExecutionOptions cpu = options;
  if (cpu.device == Device::automatic) cpu.device = Device::cpu;
  std::vector<std::int64_t> counts = agreed(comm, [&] {
    flow::validate(settings);
    return flow::phase_counts(settings, bound(r), bound(r + 1), cpu, progress);
  });
  comm.allreduce_sum(counts.data(), static_cast<std::int64_t>(counts.size()));
  return flow::phase_from_counts(settings, counts);
}

}  // namespace emflow::distributed

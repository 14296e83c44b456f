// The flow of two clouds through emflow::distributed::run_flow on the single-process
// communicator equals flow::run_flow in one process: a program against an installed emflow
// (tests/consumer/distributed/CMakeLists.txt builds it twice, against the installed
// emflow::distributed and against src/distributed built from its sources).
#include <cmath>
#include <cstdio>
#include <emflow/distributed.hpp>
#include <emflow/distributed_flow.hpp>
#include <emflow/flow.hpp>
#include <vector>

int main() {
  namespace flow = emflow::flow;
  emflow::distributed::SingleProcess comm;
  const emflow::Tensor<double> initial =
      flow::initial_clouds<double>(flow::InitialCloud::sphere, 2, 16, 3, 7);
  const std::vector<flow::FlowLayer<double>> layers = {
      flow::make_layer<double>(3, flow::OperatorKind::random, flow::OperatorKind::identity, 1)};
  flow::FlowSettings settings;
  settings.norm = flow::Normalization::sphere;
  settings.time = 2.0;
  settings.dt = 0.1;
  const std::vector<double> betas = {1.0, 4.0};
  const emflow::ExecutionOptions cpu{emflow::Device::cpu};

  const flow::FlowResult<double> one = flow::run_flow(initial, betas, layers, settings, cpu);
  const flow::FlowResult<double> ranks =
      emflow::distributed::run_flow(comm, initial.data(), 2, 16, 3, betas, layers, settings, cpu);

  double worst = 0.0;
  for (std::int64_t e = 0; e < one.trajectory.size(); ++e) {
    worst = std::fmax(worst, std::abs(ranks.trajectory[e] - one.trajectory[e]));
  }
  int wrong = worst < 1e-12 ? 0 : 1;
  for (std::size_t r = 0; r < one.observables.size(); ++r) {
    wrong += ranks.observables[r].clusters != one.observables[r].clusters;
  }
  const auto& last = ranks.observables.back();
  std::printf(
      "distributed run_flow: %zu records, largest difference %.3g, cloud 1 at t = 2: "
      "%lld clusters\n",
      ranks.times.size(), worst, static_cast<long long>(last.clusters));
  return wrong == 0 && ranks.times.size() == 21 ? 0 : 1;
}

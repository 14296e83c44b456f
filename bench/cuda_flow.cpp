// GPU benchmarks of the flow (targets in docs/PERF.md, section Flow), wall-clock timed through the
// blocking library calls, as a user runs them (uploads, kernels, downloads and observables all
// included):
//   BM_PhaseDefault     flow::phase_diagram with its defaults (90 betas in [0.1, 9], 2048 clouds
//                       of 32 tokens in d = 2, dt = 0.1, T = 30, RK4 on the sphere) on the GPU;
//                       target: under 2 s on an H200
//   BM_FlowRk4          run_flow, n = 128, d = 128, Q = K = V = I on the sphere, 150 RK4 steps,
//                       observables recorded every 10 steps; target: under 1 s (met on the CPU)
// One warm-up run precedes the timed ones (CUDA context, cuBLAS handle, module loading).
// This file is one translation unit of emflow_bench_cuda with cuda_attention.cpp, whose main()
// reports a missing device.
#include <benchmark/benchmark.h>

#include <cstdint>

#include "emflow/flow.hpp"

namespace {

using namespace emflow;

ExecutionOptions on_gpu() {
  ExecutionOptions options;
  options.device = Device::cuda;
  return options;
}

void BM_PhaseDefault(benchmark::State& state) {
  const flow::PhaseSettings settings;  // the published defaults
  flow::phase_diagram(settings, on_gpu());
  double clustered_at_end = 0;
  for (auto _ : state) {
    const flow::PhaseDiagram diagram = flow::phase_diagram(settings, on_gpu());
    clustered_at_end = diagram.clustered.back();
    benchmark::DoNotOptimize(diagram.clustered.data());
  }
  // A sanity figure beside the time: at beta = 9 and T = 30 most pairs have clustered.
  state.counters["clustered_at_T_beta_max"] = clustered_at_end;
  state.counters["cloud_steps_per_s"] = benchmark::Counter(
      static_cast<double>(settings.clouds * settings.beta_count) * (settings.time / settings.dt),
      benchmark::Counter::kIsIterationInvariantRate);
}

void BM_FlowRk4(benchmark::State& state) {
  const std::int64_t tokens = state.range(0), dim = state.range(1);
  const auto initial = flow::initial_clouds<float>(flow::InitialCloud::sphere, 1, tokens, dim, 7);
  const std::vector<flow::FlowLayer<float>> layers = {
      flow::make_layer<float>(dim, flow::OperatorKind::identity, flow::OperatorKind::identity, 0)};
  flow::FlowSettings settings;
  settings.norm = flow::Normalization::sphere;
  settings.integrator = flow::Integrator::rk4;
  settings.dt = 0.1;
  settings.time = 15.0;  // 150 steps
  settings.record_every = 10;
  flow::run_flow(initial, {1.0}, layers, settings, on_gpu());
  for (auto _ : state) {
    const auto result = flow::run_flow(initial, {1.0}, layers, settings, on_gpu());
    benchmark::DoNotOptimize(result.trajectory.data());
  }
  state.counters["steps"] = static_cast<double>(flow::step_count(settings));
}

BENCHMARK(BM_PhaseDefault)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_FlowRk4)
    ->Args({128, 128})
    ->ArgNames({"N", "d"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(5);

}  // namespace

// tools::CudaTiming (src/tools/include/tools/cuda_timing.hpp), the device timing behind `emflow
// bench --device cuda` and the GPU benchmarks: the work enqueued on its stream has run when
// seconds() returns, and the time is a finite, non-negative number; and `emflow bench --device
// cuda` itself. Under the CPU emulation of CUDA the events' times are host times, so only these
// properties are checked, not a duration.
#include <gtest/gtest.h>

#if defined(EMFLOW_WITH_CUDA)
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "emflow/cuda.hpp"
#include "tools/cuda_timing.hpp"

namespace emflow::testing {
namespace {

TEST(CudaTiming, TheTimedWorkHasRunWhenSecondsReturns) {
  std::string reason;
  if (!cuda::device_available(&reason)) GTEST_SKIP() << "no CUDA device: " << reason;
  tools::CudaTiming timing;
  constexpr std::size_t kCount = 4099;
  cuda::DeviceBuffer<std::uint32_t> buffer(kCount);
  int enqueued = 0;
  double total = 0.0;
  // Twice on one timing: its events are recorded again for the second measurement.
  for (const int byte : {0x3f, 0x5a}) {
    const double seconds = timing.seconds([&] {
      ASSERT_EQ(
          cudaMemsetAsync(buffer.data(), byte, kCount * sizeof(std::uint32_t), timing.stream()),
          cudaSuccess);
      ++enqueued;
    });
    // Nothing of the stream's is left: seconds() waited for the work it timed.
    EXPECT_EQ(cudaStreamQuery(timing.stream()), cudaSuccess);
    EXPECT_TRUE(std::isfinite(seconds)) << seconds;
    EXPECT_GE(seconds, 0.0);
    total += seconds;
    // The memset wrote what it was asked to: the copy after it reads its bytes.
    std::vector<std::uint32_t> host(kCount, 0u);
    buffer.copy_to_host(host.data(), kCount, timing.stream());
    ASSERT_EQ(cudaStreamSynchronize(timing.stream()), cudaSuccess);
    std::uint32_t expected = 0;
    std::memset(&expected, byte, sizeof(expected));
    for (std::size_t i = 0; i < kCount; ++i) ASSERT_EQ(host[i], expected) << "element " << i;
  }
  EXPECT_EQ(enqueued, 2);
  EXPECT_LT(total, 60.0) << "two memsets of 16 KiB timed at over a minute";
}

#if defined(EMFLOW_CLI_PATH)
// The tool's GPU line: attend_async timed on the device, and no CPU line (--device cuda times
// the device alone).
TEST(CudaBenchCommand, TimesAttendOnTheDevice) {
  std::string reason;
  if (!cuda::device_available(&reason)) GTEST_SKIP() << "no CUDA device: " << reason;
  const CliOutput run = run_cli_output(
      "bench --device cuda --tokens 70 --dim 5 --heads 2 --batch 2 --mask causal --repeats 2 "
      "--threads 1");
  std::string all;
  for (const std::string& line : run.lines) all += line + "\n";
  ASSERT_EQ(run.status, 0) << all;
  int cuda_lines = 0, cpu_lines = 0;
  for (const std::string& line : run.lines) {
    if (line.find("\"op\": \"attend\"") == std::string::npos) continue;
    if (line.find("\"device\": \"cpu\"") != std::string::npos) ++cpu_lines;
    if (line.find("\"device\": \"cuda\"") == std::string::npos) continue;
    ++cuda_lines;
    EXPECT_NE(line.find("\"tokens\": 70"), std::string::npos) << line;
    const std::size_t at = line.find("\"ms_median\": ");
    ASSERT_NE(at, std::string::npos) << line;
    const double ms = std::strtod(line.c_str() + at + 14, nullptr);
    EXPECT_TRUE(std::isfinite(ms) && ms >= 0.0) << line;
  }
  EXPECT_EQ(cuda_lines, 1) << all;
  EXPECT_EQ(cpu_lines, 0) << all;
}
#endif

}  // namespace
}  // namespace emflow::testing
#endif

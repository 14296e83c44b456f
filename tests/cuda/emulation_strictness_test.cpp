// The CPU emulation of CUDA (tests/cuda/emulation) is the only execution the kernels get without
// a GPU, so each rule of the hardware it enforces has a kernel here that breaks the rule and must
// be caught: shared memory poisoned at every block start, the per-kernel dynamic shared-memory
// limit, devices that keep their streams, events, memory and kernel attributes apart, shuffle
// masks, barriers reached by part of a block, the shuffled order of the blocks, asynchronous
// copies (cp.async) that land only at their thread's wait and are checked when issued, ldmatrix
// rows that must be aligned and in shared memory, and asynchronous work deferred until the host
// synchronises (a host source freed early is a use-after-free). Built into the emulated test binary
// only.
#if defined(EMFLOW_CUDA_EMULATION)

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/launch.cuh"
#include "kernels/mma.cuh"

namespace {

constexpr unsigned kThreads = 64;

// Runs `grid` blocks of `threads` of `kernel` on a fresh stream and synchronises.
template <class... P, class... A>
cudaError_t run(unsigned grid, unsigned threads, std::size_t shared, void (*kernel)(P...),
                A... args) {
  cudaGetLastError();  // an expected violation of an earlier test left its error
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  emu_launch("test kernel", kernel, grid, threads, shared, s, args...);
  cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) status = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  cudaGetLastError();  // the next test's launches start clean
  return status;
}

// Every message recorded for an expected violation, one per line, for the assertions' output.
std::string joined(const std::vector<std::string>& messages) {
  std::string all;
  for (const std::string& m : messages) all += m + "\n";
  return all;
}

bool any_contains(const std::vector<std::string>& messages, const std::string& part) {
  return std::any_of(messages.begin(), messages.end(),
                     [&](const std::string& m) { return m.find(part) != std::string::npos; });
}

template <class T>
struct DeviceArray {
  T* data = nullptr;
  explicit DeviceArray(std::size_t n) {
    cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(T));
  }
  ~DeviceArray() { cudaFree(data); }
};

// --- Shared memory -----------------------------------------------------------------------------

// Reads its slot before writing it: what a block finds in shared memory when it starts.
__global__ void read_static_shared(std::int32_t* seen) {
  EMFLOW_SHARED(std::int32_t, slots, [kThreads]);
  const unsigned t = threadIdx.x;
  seen[blockIdx.x * kThreads + t] = slots[t];
  slots[t] = static_cast<std::int32_t>(blockIdx.x);
  __syncthreads();
}

__global__ void read_dynamic_shared(std::int32_t* seen) {
  EMFLOW_DYNAMIC_SHARED(raw);
  auto* slots = reinterpret_cast<std::int32_t*>(raw);
  const unsigned t = threadIdx.x;
  seen[blockIdx.x * kThreads + t] = slots[t];
  slots[t] = static_cast<std::int32_t>(blockIdx.x);
  __syncthreads();
}

TEST(EmulationStrictness, StaticSharedMemoryIsPoisonedAtEveryBlockStart) {
  constexpr unsigned grid = 4;
  DeviceArray<std::int32_t> seen(grid * kThreads);
  ASSERT_EQ(run(grid, kThreads, 0, read_static_shared, seen.data), cudaSuccess);
  // Every block, not only the first, finds all bits set (not the last block's writes, not 0).
  for (unsigned e = 0; e < grid * kThreads; ++e) ASSERT_EQ(seen.data[e], -1) << "slot " << e;
}

TEST(EmulationStrictness, DynamicSharedMemoryIsPoisonedAtEveryBlockStart) {
  constexpr unsigned grid = 4;
  DeviceArray<std::int32_t> seen(grid * kThreads);
  ASSERT_EQ(run(grid, kThreads, kThreads * sizeof(std::int32_t), read_dynamic_shared, seen.data),
            cudaSuccess);
  for (unsigned e = 0; e < grid * kThreads; ++e) ASSERT_EQ(seen.data[e], -1) << "slot " << e;
}

__global__ void touch_dynamic_shared(std::int32_t* seen) {
  EMFLOW_DYNAMIC_SHARED(raw);
  if (threadIdx.x == 0) seen[0] = static_cast<std::int32_t>(raw[0].x != raw[0].x);
}
__global__ void other_dynamic_shared_kernel(std::int32_t* seen) {
  EMFLOW_DYNAMIC_SHARED(raw);
  if (threadIdx.x == 0) seen[0] = static_cast<std::int32_t>(raw[0].x != raw[0].x);
}

TEST(EmulationStrictness, DynamicSharedMemoryIs48KiBPerKernelUnlessRaised) {
  DeviceArray<std::int32_t> seen(1);
  constexpr std::size_t kib = 1024;
  EXPECT_EQ(run(1, 32, 48 * kib, touch_dynamic_shared, seen.data), cudaSuccess);
  EXPECT_EQ(seen.data[0], 1);  // the poison is NaN as float
  EXPECT_NE(run(1, 32, 48 * kib + 16, touch_dynamic_shared, seen.data), cudaSuccess);
  ASSERT_EQ(cudaFuncSetAttribute(touch_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(100 * kib)),
            cudaSuccess);
  EXPECT_EQ(run(1, 32, 100 * kib, touch_dynamic_shared, seen.data), cudaSuccess);
  EXPECT_NE(run(1, 32, 100 * kib + 16, touch_dynamic_shared, seen.data), cudaSuccess);
  // The attribute is the kernel's: another kernel keeps 48 KiB.
  EXPECT_NE(run(1, 32, 64 * kib, other_dynamic_shared_kernel, seen.data), cudaSuccess);
  // 227 KiB at most.
  EXPECT_NE(cudaFuncSetAttribute(touch_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(227 * kib + 1)),
            cudaSuccess);
  cudaGetLastError();
  ASSERT_EQ(cudaFuncSetAttribute(touch_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(227 * kib)),
            cudaSuccess);
  EXPECT_EQ(run(1, 32, 227 * kib, touch_dynamic_shared, seen.data), cudaSuccess);
  EXPECT_NE(run(1, 32, 228 * kib, touch_dynamic_shared, seen.data), cudaSuccess);
  // More than 1024 threads is refused as well.
  EXPECT_NE(run(1, 1025, 0, touch_dynamic_shared, seen.data), cudaSuccess);
  cudaGetLastError();
}

// --- Devices -------------------------------------------------------------------------------------

// Two devices, the second with 64 KiB of opt-in shared memory per block.
TEST(EmulationStrictness, StreamsEventsMemoryAndKernelAttributesBelongToOneDevice) {
  constexpr std::size_t kib = 1024;
  emu::present_devices({emu::DeviceModel{}, emu::DeviceModel{64 * kib}});
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 2);
  EXPECT_EQ(cudaSetDevice(2), cudaErrorInvalidDevice);
  cudaGetLastError();
  int limit = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, 1),
            cudaSuccess);
  EXPECT_EQ(limit, static_cast<int>(64 * kib));
  EXPECT_EQ(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, 2),
            cudaErrorInvalidDevice);
  cudaGetLastError();

  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  cudaStream_t one = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&one, cudaStreamNonBlocking), cudaSuccess);
  int owner = -1;
  ASSERT_EQ(cudaStreamGetDevice(one, &owner), cudaSuccess);
  EXPECT_EQ(owner, 1);
  {
    DeviceArray<std::int32_t> seen(1);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, seen.data), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
    EXPECT_EQ(attributes.device, 1);
    // The attribute stops at this device's limit, and is this device's.
    EXPECT_NE(
        cudaFuncSetAttribute(touch_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(64 * kib + 16)),
        cudaSuccess);
    cudaGetLastError();
    ASSERT_EQ(
        cudaFuncSetAttribute(touch_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(64 * kib)),
        cudaSuccess);
    emu_launch("test kernel", touch_dynamic_shared, 1, 32, 64 * kib, one, seen.data);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(one), cudaSuccess);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(run(1, 32, 64 * kib, touch_dynamic_shared, seen.data), cudaErrorInvalidValue);
    // A launch into a stream of another device, and an event recorded on one, fail.
    emu_launch("test kernel", touch_dynamic_shared, 1, 32, 0, one, seen.data);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    cudaEvent_t event = nullptr;
    ASSERT_EQ(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(event, one), cudaErrorInvalidResourceHandle);
    cudaGetLastError();
    cudaEventDestroy(event);
    // A reset clears that device's attributes.
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
    EXPECT_EQ(run(1, 32, 64 * kib, touch_dynamic_shared, seen.data), cudaErrorInvalidValue);
  }
  cudaStreamDestroy(one);
  emu::present_devices({emu::DeviceModel{}});
}

// --- Shuffles ----------------------------------------------------------------------------------

// Each case: a mask, the xor of the lane read, and how many lanes return before the shuffle.
__global__ void shuffle_kernel(unsigned mask, int lane_mask, unsigned exited, int* out) {
  const unsigned lane = threadIdx.x % 32;
  if (lane >= 32 - exited) return;
  out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<int>(threadIdx.x), lane_mask);
}

TEST(EmulationStrictness, AFullMaskShuffleExchangesLanes) {
  DeviceArray<int> out(64);
  ASSERT_EQ(run(1, 64, 0, shuffle_kernel, 0xffffffffu, 5, 0u, out.data), cudaSuccess);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out.data[t], (t & ~31) | ((t % 32) ^ 5));
  // Half a warp among itself: lanes 16..31 have returned and the mask names lanes 0..15 only.
  ASSERT_EQ(run(1, 32, 0, shuffle_kernel, 0x0000ffffu, 3, 16u, out.data), cudaSuccess);
  for (int t = 0; t < 16; ++t) EXPECT_EQ(out.data[t], t ^ 3);
}

TEST(EmulationStrictness, AShuffleByALaneOutsideItsMaskIsCaught) {
  DeviceArray<int> out(32);
  emu::ExpectViolation expect;
  EXPECT_NE(run(1, 32, 0, shuffle_kernel, 0x7fffffffu, 0, 0u, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "which the mask leaves out"))
      << joined(expect.messages());
}

TEST(EmulationStrictness, AShuffleReadingALaneOutsideItsMaskIsCaught) {
  DeviceArray<int> out(32);
  emu::ExpectViolation expect;
  EXPECT_NE(run(1, 32, 0, shuffle_kernel, 0x0000ffffu, 16, 16u, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "outside the mask")) << joined(expect.messages());
}

TEST(EmulationStrictness, AShuffleWhoseMaskNamesExitedLanesIsCaught) {
  DeviceArray<int> out(32);
  emu::ExpectViolation expect;
  EXPECT_NE(run(1, 32, 0, shuffle_kernel, 0xffffffffu, 1, 8u, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "exited lanes") ||
              any_contains(expect.messages(), "returned while its warp waits"))
      << joined(expect.messages());
}

// --- Barriers ----------------------------------------------------------------------------------

// Threads at and past `stop` return first; the rest reach a barrier.
__global__ void partial_barrier_kernel(unsigned stop, int* out) {
  if (threadIdx.x >= stop) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Lane 0 of warp 1 waits at a barrier that the other lanes of its warp, waiting in a shuffle
// that names it, never reach.
__global__ void shuffle_against_barrier_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x > 32) v = __shfl_xor_sync(0xffffffffu, v, 1);
  __syncthreads();
  out[threadIdx.x] = v;
}

TEST(EmulationStrictness, ABarrierReachedByTheWholeBlockPasses) {
  DeviceArray<int> out(kThreads);
  ASSERT_EQ(run(2, kThreads, 0, partial_barrier_kernel, kThreads, out.data), cudaSuccess);
  for (unsigned t = 0; t < kThreads; ++t) EXPECT_EQ(out.data[t], 1);
}

TEST(EmulationStrictness, ABarrierReachedByPartOfTheBlockIsCaughtNotAHang) {
  DeviceArray<int> out(kThreads);
  emu::ExpectViolation expect;
  EXPECT_NE(run(2, kThreads, 0, partial_barrier_kernel, kThreads / 2, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "a barrier reached by part of the block"))
      << joined(expect.messages());
}

TEST(EmulationStrictness, BarriersAtTwoPlacesAreCaught) {
  DeviceArray<int> out(kThreads);
  emu::ExpectViolation expect;
  EXPECT_NE(run(1, kThreads, 0, divergent_barrier_kernel, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "divergent barriers")) << joined(expect.messages());
}

TEST(EmulationStrictness, AShuffleWaitingForALaneAtABarrierIsADeadlockCaught) {
  DeviceArray<int> out(kThreads);
  emu::ExpectViolation expect;
  EXPECT_NE(run(1, kThreads, 0, shuffle_against_barrier_kernel, out.data), cudaSuccess);
  EXPECT_TRUE(any_contains(expect.messages(), "every live thread of the block waits"))
      << joined(expect.messages());
}

// A violation stops only its own launch: the next one runs.
TEST(EmulationStrictness, ALaunchAfterAViolationRuns) {
  DeviceArray<int> out(kThreads);
  {
    emu::ExpectViolation expect;
    EXPECT_NE(run(1, kThreads, 0, partial_barrier_kernel, 3u, out.data), cudaSuccess);
  }
  cudaGetLastError();
  EXPECT_EQ(run(1, kThreads, 0, partial_barrier_kernel, kThreads, out.data), cudaSuccess);
}

// --- Order of the blocks -----------------------------------------------------------------------

__global__ void record_order_kernel(int* counter, int* order) {
  if (threadIdx.x == 0) order[atomicAdd(counter, 1)] = static_cast<int>(blockIdx.x);
}

TEST(EmulationStrictness, BlocksRunInAShuffledOrder) {
  constexpr int grid = 64;
  DeviceArray<int> counter(1), order(grid);
  counter.data[0] = 0;
  ASSERT_EQ(run(grid, 32, 0, record_order_kernel, counter.data, order.data), cudaSuccess);
  std::vector<int> seen(order.data, order.data + grid), sorted = seen;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> identity(grid);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);  // every block ran once
  EXPECT_NE(seen, identity);    // but not in index order
  // A second launch draws another order.
  counter.data[0] = 0;
  ASSERT_EQ(run(grid, 32, 0, record_order_kernel, counter.data, order.data), cudaSuccess);
  EXPECT_NE(std::vector<int>(order.data, order.data + grid), seen);
}

// --- Deferred work -----------------------------------------------------------------------------

__global__ void fill_kernel(int* out, int value) { out[threadIdx.x] = value; }

TEST(EmulationStrictness, LaunchesAndCopiesWaitForTheHostToSynchronise) {
  DeviceArray<int> device(32);
  std::vector<int> host(32, 7);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  emu_launch("fill_kernel", fill_kernel, 1, 32, 0, s, device.data, 5);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  cudaMemcpyAsync(host.data(), device.data, 32 * sizeof(int), cudaMemcpyDeviceToHost, s);
  cudaEvent_t copied = nullptr;
  cudaEventCreate(&copied);
  cudaEventRecord(copied, s);
  EXPECT_EQ(device.data[0], -1);  // fresh device memory is poisoned, and nothing has run yet
  EXPECT_EQ(host[0], 7);
  EXPECT_EQ(cudaEventQuery(copied), cudaErrorNotReady);
  ASSERT_EQ(cudaEventSynchronize(copied), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(copied), cudaSuccess);
  EXPECT_EQ(host[0], 5);
  EXPECT_EQ(host[31], 5);
  cudaEventDestroy(copied);
  cudaStreamDestroy(s);
}

// --- Asynchronous copies and ldmatrix (kernels/mma.cuh) -----------------------------------------

// Each thread copies 16 bytes of `src` into shared memory by cp.async and records what its own
// destination holds right after the issue (before any wait), after a wait that leaves the group
// pending (wait_group 1 with one group: nothing need land) and after wait_group 0.
__global__ void async_copy_visibility_kernel(const std::int32_t* src, std::int32_t* seen) {
  EMFLOW_DYNAMIC_SHARED(raw);
  auto* const slots = reinterpret_cast<std::int32_t*>(raw);
  const unsigned t = threadIdx.x;
  slots[4 * t] = 7;  // an old value the copy replaces
  emflow::detail::mma::cp_async<16>(slots + 4 * t, src + 4 * t, 16);
  seen[3 * t] = slots[4 * t];
  emflow::detail::mma::cp_async_commit();
  emflow::detail::mma::cp_async_wait<1>();
  seen[3 * t + 1] = slots[4 * t];
  emflow::detail::mma::cp_async_wait<0>();
  seen[3 * t + 2] = slots[4 * t];
}

TEST(EmulationStrictness, AnAsyncCopyIsPoisonUntilItsThreadWaitsForItsGroup) {
  DeviceArray<std::int32_t> src(4 * 32), seen(3 * 32);
  for (int i = 0; i < 4 * 32; ++i) src.data[i] = 1000 + i;
  ASSERT_EQ(run(1, 32, 16 * 32, async_copy_visibility_kernel, src.data, seen.data), cudaSuccess);
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(seen.data[3 * t], -1) << "thread " << t << " read its copy before waiting";
    EXPECT_EQ(seen.data[3 * t + 1], -1) << "thread " << t << ": wait_group 1 with one group";
    EXPECT_EQ(seen.data[3 * t + 2], 1000 + 4 * t) << "thread " << t << " after wait_group 0";
  }
}

// One copy that breaks a rule of cp.async: `rule` 0 a misaligned destination, 1 a misaligned
// source, 2 a destination outside shared memory, 3 more source bytes than the copy holds.
__global__ void bad_async_copy_kernel(const std::int32_t* src, std::int32_t* global, int rule) {
  EMFLOW_DYNAMIC_SHARED(raw);
  auto* const bytes = reinterpret_cast<unsigned char*>(raw);
  const auto* const from = reinterpret_cast<const unsigned char*>(src);
  if (rule == 0) emflow::detail::mma::cp_async<16>(bytes + 8, from, 16);
  if (rule == 1) emflow::detail::mma::cp_async<16>(bytes, from + 4, 16);
  if (rule == 2) emflow::detail::mma::cp_async<16>(global, from, 16);
  if (rule == 3) emflow::detail::mma::cp_async<8>(bytes, from, 12);
  emflow::detail::mma::cp_async_commit();
  emflow::detail::mma::cp_async_wait<0>();
}

TEST(EmulationStrictness, AnAsyncCopyThatBreaksItsRulesIsCaught) {
  DeviceArray<std::int32_t> src(64), global(64);
  const char* const expected[] = {"not aligned", "not aligned", "not shared", "source bytes"};
  for (int rule = 0; rule < 4; ++rule) {
    emu::ExpectViolation expect;
    EXPECT_NE(run(1, 32, 1024, bad_async_copy_kernel, src.data, global.data, rule), cudaSuccess)
        << "rule " << rule;
    EXPECT_TRUE(any_contains(expect.messages(), expected[rule])) << "rule " << rule << ":\n"
                                                                 << joined(expect.messages());
  }
}

// ldmatrix with lane 5's row address 8 bytes off (misaligned: `misaligned`), or every row in
// global memory.
__global__ void bad_ldmatrix_kernel(const std::uint16_t* global, bool misaligned) {
  EMFLOW_DYNAMIC_SHARED(raw);
  auto* const rows = reinterpret_cast<std::uint16_t*>(raw);
  const unsigned lane = threadIdx.x;
  const std::uint16_t* row = misaligned ? rows + 8 * lane + (lane == 5 ? 4 : 0) : global;
  std::uint32_t r[4];
  emflow::detail::mma::ldmatrix_x4<false>(r, row);
}

TEST(EmulationStrictness, AnLdmatrixRowThatIsMisalignedOrNotSharedIsCaught) {
  DeviceArray<std::uint16_t> global(256);
  for (const bool misaligned : {true, false}) {
    emu::ExpectViolation expect;
    EXPECT_NE(run(1, 32, 1024, bad_ldmatrix_kernel, global.data, misaligned), cudaSuccess);
    EXPECT_TRUE(any_contains(expect.messages(),
                             misaligned ? "not 16-byte aligned" : "outside shared memory"))
        << joined(expect.messages());
  }
}

#if defined(__SANITIZE_ADDRESS__)
TEST(EmulationStrictnessDeathTest, AHostSourceFreedBeforeItsCopyRanIsAUseAfterFree) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DeviceArray<float> device(256);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  EXPECT_DEATH(
      {
        {
          std::vector<float> host(256, 1.0f);
          cudaMemcpyAsync(device.data, host.data(), 256 * sizeof(float), cudaMemcpyHostToDevice, s);
        }
        cudaStreamSynchronize(s);
      },
      "use-after-free");
  cudaStreamDestroy(s);
}
#endif

}  // namespace

#endif  // EMFLOW_CUDA_EMULATION

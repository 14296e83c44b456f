// CPU emulation of the part of the CUDA runtime that emflow uses (tests/cuda/emulation/run.sh),
// for checking kernel logic without a GPU. Each CUDA thread of a launch is a std::thread, blocks
// run one after another; __syncthreads is a block barrier and
// warp shuffles go through a per-warp exchange with barriers.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct CUstream_st {};
using cudaStream_t = CUstream_st*;
enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInvalidValue = 1 };
enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
constexpr unsigned cudaStreamNonBlocking = 1;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {
inline thread_local dim3 thread_index, block_index;
inline dim3 block_dim, grid_dim;
inline std::vector<float4> dynamic_shared;
// Dynamic shared memory each kernel may use: 48 KiB unless cudaFuncSetAttribute raised it (the
// attribute belongs to the kernel, as on a GPU).
inline std::map<const void*, std::size_t> dynamic_limits;
inline std::size_t dynamic_limit(const void* kernel) {
  const auto it = dynamic_limits.find(kernel);
  return it == dynamic_limits.end() ? 48 * 1024 : it->second;
}
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<double> exchange;  // one slot per thread
inline std::map<const char*, std::size_t, std::less<>> allocations;
inline std::mutex allocation_mutex;
inline cudaError_t last_error = cudaSuccess;
inline long launches = 0;
}  // namespace emu

#define threadIdx (emu::thread_index)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
// A barrier that also tells every thread whether `predicate` held for any thread of the block.
inline int __syncthreads_or(int predicate) {
  emu::exchange[emu::thread_index.x] = predicate != 0 ? 1.0 : 0.0;
  emu::block_barrier->arrive_and_wait();
  int any = 0;
  for (unsigned u = 0; u < emu::block_dim.x; ++u) any |= emu::exchange[u] != 0.0 ? 1 : 0;
  emu::block_barrier->arrive_and_wait();  // every thread has read before the slots are reused
  return any;
}

template <class T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  const unsigned t = emu::thread_index.x;
  const unsigned warp = t / 32, lane = t % 32;
  emu::warp_barriers[warp]->arrive_and_wait();
  emu::exchange[t] = static_cast<double>(value);
  emu::warp_barriers[warp]->arrive_and_wait();
  const T other =
      static_cast<T>(emu::exchange[warp * 32 + (lane ^ static_cast<unsigned>(lane_mask))]);
  emu::warp_barriers[warp]->arrive_and_wait();
  return other;
}

inline float4* emu_dynamic_shared() { return emu::dynamic_shared.data(); }

template <class... P, class... A>
void emu_launch(void (*kernel)(P...), unsigned grid, unsigned block, std::size_t shared,
                cudaStream_t, A&&... args) {
  ++emu::launches;
  if (shared > emu::dynamic_limit(reinterpret_cast<const void*>(kernel))) {
    emu::last_error = cudaErrorInvalidValue;
    return;
  }
  if (block > 1024 || grid == 0) {
    emu::last_error = cudaErrorInvalidValue;
    return;
  }
  emu::block_dim = {block, 1, 1};
  emu::grid_dim = {grid, 1, 1};
  emu::exchange.assign(block, 0.0);
  emu::warp_barriers.clear();
  for (unsigned w = 0; w < (block + 31) / 32; ++w)
    emu::warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, block - w * 32)));
  emu::block_barrier = std::make_unique<std::barrier<>>(block);
  emu::dynamic_shared.assign((shared + sizeof(float4) - 1) / sizeof(float4),
                             float4{NAN, NAN, NAN, NAN});
  // One thread per CUDA thread for the whole launch; blocks run one after another, and shared
  // memory is re-poisoned between blocks.
  std::barrier between_blocks(static_cast<std::ptrdiff_t>(block), []() noexcept {
    std::fill(emu::dynamic_shared.begin(), emu::dynamic_shared.end(), float4{NAN, NAN, NAN, NAN});
  });
  std::vector<std::thread> threads;
  threads.reserve(block);
  for (unsigned t = 0; t < block; ++t) {
    threads.emplace_back([&, t] {
      for (unsigned b = 0; b < grid; ++b) {
        emu::thread_index = {t, 0, 0};
        emu::block_index = {b, 0, 0};
        kernel(static_cast<P>(args)...);
        between_blocks.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
}

inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "emulated error";
}
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated";
}
inline cudaError_t cudaGetLastError() {
  auto e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = std::getenv("EMU_NO_DEVICE") ? 0 : 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  *v = 232448;
  return cudaSuccess;
}
template <class F>
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute, int bytes) {
  if (bytes > 232448) return cudaErrorInvalidValue;
  emu::dynamic_limits[reinterpret_cast<const void*>(kernel)] = static_cast<std::size_t>(bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = new CUstream_st;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = bytes > (std::size_t{1} << 40) ? nullptr : std::malloc(bytes);
  if (!*p) return emu::last_error = cudaErrorMemoryAllocation;
  // Poison fresh device memory so reads of unwritten workspace show up as NaN.
  std::memset(*p, 0xff, bytes);
  std::lock_guard<std::mutex> lock(emu::allocation_mutex);
  emu::allocations[static_cast<const char*>(*p)] = bytes;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  std::lock_guard<std::mutex> lock(emu::allocation_mutex);
  emu::allocations.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, std::size_t n, cudaMemcpyKind,
                                   cudaStream_t) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::lock_guard<std::mutex> lock(emu::allocation_mutex);
  *a = {};
  const char* c = static_cast<const char*>(p);
  auto it = emu::allocations.upper_bound(c);
  if (it != emu::allocations.begin()) {
    --it;
    if (c < it->first + it->second) {
      a->type = cudaMemoryTypeDevice;
      a->device = 0;
      return cudaSuccess;
    }
  }
  a->type = cudaMemoryTypeUnregistered;
  return cudaSuccess;
}

inline cudaError_t cudaEventCreate(void**) { return cudaSuccess; }

// Pending-error checks at every GPU entry point, and the phase kernel's zeroed counts.
inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }
inline cudaError_t cudaMemsetAsync(void* d, int value, std::size_t n, cudaStream_t = nullptr) {
  std::memset(d, value, n);
  return cudaSuccess;
}

// Atomics (phase counts, the flow's cluster union-find): one global lock (blocks run one after
// another; threads of a block are host threads).
namespace emu {
inline std::mutex atomic_mutex;  // one for every address and operation
}
template <class T, class Combine>
T emu_atomic(T* address, Combine combine) {
  std::lock_guard<std::mutex> lock(emu::atomic_mutex);
  const T old = *address;
  *address = combine(old);
  return old;
}
template <class T>
T atomicAdd(T* address, T value) {
  return emu_atomic(address, [&](T old) { return old + value; });
}
template <class T>
T atomicMin(T* address, T value) {
  return emu_atomic(address, [&](T old) { return value < old ? value : old; });
}
// The flow's union-find also reads and halves paths without the lock (relaxed __atomic loads and
// stores in kernels/flow_kernels.cu), so the compare-and-swap reads and writes the word
// atomically as well as under the lock.
template <class T>
T atomicCAS(T* address, T compare, T value) {
  std::lock_guard<std::mutex> lock(emu::atomic_mutex);
  const T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  if (old == compare) __atomic_store_n(address, value, __ATOMIC_RELAXED);
  return old;
}

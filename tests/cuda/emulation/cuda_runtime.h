// CPU emulation of the part of the CUDA runtime that emflow uses (tests/cuda/emulation/run.sh),
// for checking kernel logic without a GPU. Kernels run as fibers (or host threads), block by
// block in a shuffled order, with the hardware's rules checked (emu_block.h). What is stricter
// than a GPU usually is, on purpose:
//   * asynchronous work (kernel launches, cudaMemcpyAsync, cudaMemsetAsync, cuBLAS calls) is
//     only queued; it runs when the host synchronises with it (cudaStreamSynchronize, an
//     event's cudaEventSynchronize, cudaDeviceSynchronize, cudaFree / cudaFreeHost, which
//     synchronise on a GPU too), so host memory freed before its copy completes is a
//     use-after-free for AddressSanitizer, and results read too early are stale;
//   * a launch is checked as the hardware checks it: at most 1024 threads, and at most 48 KiB
//     of dynamic shared memory unless cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raised
//     that kernel's limit (227 KiB at most);
//   * fresh device memory and shared memory at every block start hold all bits set (NaN);
//   * devices are distinct (emu::present_devices makes more than one, each with its own opt-in
//     shared-memory limit): the current device is per host thread (cudaSetDevice), streams,
//     events, allocations and cuBLAS handles belong to the device current when they were made,
//     a kernel launched into a stream of another device fails (cudaErrorInvalidResourceHandle),
//     as does an event recorded on one, and a kernel's dynamic shared-memory attribute is set
//     per device (cudaDeviceReset clears that device's).
// Queued work runs in the order it was queued, whatever its stream: one order a GPU may choose.
#pragma once
#include <sys/mman.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "emu_block.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct CUstream_st {
  unsigned pending = 0;  // queued operations not yet run
  int device = 0;        // the device current when it was created
};
using cudaStream_t = CUstream_st*;
struct CUevent_st {
  unsigned long long at = 0;  // the queue position it completes at (0: never recorded)
  int device = 0;             // the device current when it was created
  bool timing = true;         // not made with cudaEventDisableTiming
  // Host milliseconds (steady clock) at which the last record's queued work ran; shared with
  // that work, which may run after the event is destroyed, as on a GPU. Negative until it ran.
  std::shared_ptr<double> completed_ms;
};
using cudaEvent_t = CUevent_st*;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719
};
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
constexpr unsigned cudaEventDisableTiming = 2;

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {

constexpr std::size_t kMaxOptinShared = 232448;  // 227 KiB, as an H100 / H200 reports
constexpr std::size_t kDefaultShared = 48 * 1024;

// The devices presented: one with an H200's limits, unless a test presents others
// (present_devices); none when EMU_NO_DEVICE is set.
struct DeviceModel {
  std::size_t optin_shared = kMaxOptinShared;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};
inline std::vector<DeviceModel> devices(1);
inline int device_count() {
  return std::getenv("EMU_NO_DEVICE") ? 0 : static_cast<int>(devices.size());
}
// The current device of each host thread, as the runtime keeps it.
inline thread_local int current_device = 0;

// Dynamic shared memory each kernel may use on each device: 48 KiB unless cudaFuncSetAttribute
// raised it there (the attribute belongs to the kernel on the device that was current, as on a
// GPU).
inline std::map<std::pair<int, const void*>, std::size_t> dynamic_limits;
inline std::size_t dynamic_limit(int device, const void* kernel) {
  const auto it = dynamic_limits.find({device, kernel});
  return it == dynamic_limits.end() ? kDefaultShared : it->second;
}

// Presents `models` as the devices (for tests of multi-device use): the current device of this
// thread becomes 0 and every kernel attribute is cleared. Call with one DeviceModel{} to restore
// the default.
inline void present_devices(std::vector<DeviceModel> models) {
  devices = std::move(models);
  current_device = 0;
  dynamic_limits.clear();
}

struct Allocation {
  std::size_t bytes;
  bool mapped;  // a large allocation, mmap'ed without reserving memory
  cudaMemoryType type;
  int device;  // the device current when it was allocated
};
inline std::map<const char*, Allocation, std::less<>> allocations;
inline std::mutex allocation_mutex;
inline cudaError_t last_error = cudaSuccess;

// The queue of asynchronous work, run in order when the host synchronises.
struct Operation {
  cudaStream_t stream;
  std::function<bool()> run;  // false: the operation failed (a violation stopped a kernel)
};
inline std::recursive_mutex queue_mutex;
inline std::deque<Operation> queue;
inline unsigned long long queued = 0, done = 0;  // operations queued and run, ever
inline unsigned null_stream_pending = 0;

// What the host did, for tests of how a caller uses the stream.
struct Counters {
  long launches = 0;
  long allocations = 0;              // cudaMalloc calls
  long pageable_device_to_host = 0;  // cudaMemcpyAsync into pageable host memory
  long pageable_host_to_device = 0;
};
inline Counters counters;

inline unsigned& pending_of(cudaStream_t s) {
  return s != nullptr ? s->pending : null_stream_pending;
}

inline void enqueue(cudaStream_t s, std::function<bool()> run) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex);
  queue.push_back({s, std::move(run)});
  ++queued;
  ++pending_of(s);
}

// Runs queued work until `until` operations have run in all; an operation that failed makes the
// call report cudaErrorLaunchFailure (also left as the last error, as a GPU's would be).
inline cudaError_t run_until(unsigned long long until) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex);
  cudaError_t status = cudaSuccess;
  while (done < until && !queue.empty()) {
    Operation op = std::move(queue.front());
    queue.pop_front();
    ++done;
    --pending_of(op.stream);
    if (!op.run()) status = last_error = cudaErrorLaunchFailure;
  }
  return status;
}
inline cudaError_t run_all() { return run_until(queued); }
// Runs queued work until nothing of stream `s` is left.
inline cudaError_t run_stream(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex);
  cudaError_t status = cudaSuccess;
  while (pending_of(s) > 0) {
    const cudaError_t one = run_until(done + 1);
    if (one != cudaSuccess) status = one;
  }
  return status;
}

// The allocation holding `p`; for memory the emulation did not allocate, one of type
// cudaMemoryTypeUnregistered on device -2 (what the runtime reports for it).
inline Allocation allocation_of(const void* p) {
  std::lock_guard<std::mutex> lock(allocation_mutex);
  const char* c = static_cast<const char*>(p);
  auto it = allocations.upper_bound(c);
  if (it != allocations.begin()) {
    --it;
    if (c < it->first + it->second.bytes) return it->second;
  }
  return {0, false, cudaMemoryTypeUnregistered, -2};
}
inline cudaMemoryType memory_type(const void* p) { return allocation_of(p).type; }

}  // namespace emu

template <class... P, class... A>
void emu_launch(const char* name, void (*kernel)(P...), unsigned grid, unsigned block,
                std::size_t shared, cudaStream_t stream, A&&... args) {
  ++emu::counters.launches;
  // A launch into a stream of another device fails, as the runtime's does.
  if (stream != nullptr && stream->device != emu::current_device) {
    emu::last_error = cudaErrorInvalidResourceHandle;
    return;
  }
  if (shared > emu::dynamic_limit(emu::current_device, reinterpret_cast<const void*>(kernel))) {
    emu::last_error = cudaErrorInvalidValue;
    return;
  }
  if (block == 0 || block > 1024 || grid == 0 || grid > 0x7fffffffu) {
    emu::last_error = cudaErrorInvalidConfiguration;
    return;
  }
  // The arguments as the kernel takes them, copied now, as a launch copies them.
  std::tuple<std::decay_t<P>...> params(static_cast<P>(std::forward<A>(args))...);
  emu::enqueue(stream, [=]() {
    return emu::run_blocks(name, grid, block, shared,
                           [&params, kernel]() { std::apply(kernel, params); });
  });
}

inline float4* emu_dynamic_shared() { return emu::dynamic_shared.data(); }

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    default:
      return "unspecified launch failure (emulated: a violation stopped a kernel)";
  }
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorLaunchFailure";
  }
}
inline cudaError_t cudaGetLastError() {
  auto e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
// Pending-error checks at every GPU entry point.
inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = emu::device_count();
  return cudaSuccess;
}
// The emulated driver and runtime are the toolkit's own version (13.0): never a driver mismatch.
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = emu::current_device;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= emu::device_count()) return emu::last_error = cudaErrorInvalidDevice;
  emu::current_device = d;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int device) {
  if (device < 0 || device >= emu::device_count()) return emu::last_error = cudaErrorInvalidDevice;
  *v = static_cast<int>(emu::devices[static_cast<std::size_t>(device)].optin_shared);
  return cudaSuccess;
}
template <class F>
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute, int bytes) {
  const int device = emu::current_device;
  if (bytes < 0 || device >= emu::device_count() ||
      static_cast<std::size_t>(bytes) >
          emu::devices[static_cast<std::size_t>(device)].optin_shared) {
    return emu::last_error = cudaErrorInvalidValue;
  }
  emu::dynamic_limits[{device, reinterpret_cast<const void*>(kernel)}] =
      static_cast<std::size_t>(bytes);
  return cudaSuccess;
}
// The current device's queued work completes and its kernel attributes return to their defaults.
// Not modelled: its allocations, streams, events and cuBLAS handles stay usable (on a GPU they
// are destroyed with the context).
inline cudaError_t cudaDeviceReset() {
  emu::run_all();
  for (auto it = emu::dynamic_limits.begin(); it != emu::dynamic_limits.end();) {
    it = it->first.first == emu::current_device ? emu::dynamic_limits.erase(it) : std::next(it);
  }
  return cudaSuccess;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = new CUstream_st;
  (*s)->device = emu::current_device;
  return cudaSuccess;
}
// The legacy default stream (nullptr) is the current device's.
inline cudaError_t cudaStreamGetDevice(cudaStream_t s, int* device) {
  *device = s != nullptr ? s->device : emu::current_device;
  return cudaSuccess;
}
// The stream's queued work still completes, as on a GPU.
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  emu::run_stream(s);
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) { return emu::run_stream(s); }
// Whether everything queued on `s` has run (queued work runs only when the host synchronises).
inline cudaError_t cudaStreamQuery(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lock(emu::queue_mutex);
  return emu::pending_of(s) == 0 ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaDeviceSynchronize() { return emu::run_all(); }

inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  (*e)->device = emu::current_device;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  const cudaError_t made = cudaEventCreate(e);
  if (made == cudaSuccess) (*e)->timing = (flags & cudaEventDisableTiming) == 0;
  return made;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  // An event and the stream it is recorded on must belong to one device.
  if ((s != nullptr ? s->device : emu::current_device) != e->device) {
    return emu::last_error = cudaErrorInvalidResourceHandle;
  }
  std::lock_guard<std::recursive_mutex> lock(emu::queue_mutex);
  e->completed_ms = std::make_shared<double>(-1.0);
  emu::enqueue(s, [when = e->completed_ms] {
    *when = std::chrono::duration<double, std::milli>(
                std::chrono::steady_clock::now().time_since_epoch())
                .count();
    return true;
  });
  e->at = emu::queued;
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) { return emu::run_until(e->at); }
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  return emu::done >= e->at ? cudaSuccess : cudaErrorNotReady;
}
// Host time between the two events' queued work (the emulation's time, not a GPU's). As on a GPU:
// both must have been recorded with timing on (else cudaErrorInvalidResourceHandle) and have
// completed (else cudaErrorNotReady).
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr || start == nullptr || end == nullptr) {
    return emu::last_error = cudaErrorInvalidValue;
  }
  if (!start->timing || !end->timing || start->at == 0 || end->at == 0) {
    return emu::last_error = cudaErrorInvalidResourceHandle;
  }
  std::lock_guard<std::recursive_mutex> lock(emu::queue_mutex);
  if (emu::done < start->at || emu::done < end->at) return cudaErrorNotReady;
  *ms = static_cast<float>(*end->completed_ms - *start->completed_ms);
  return cudaSuccess;
}
// Work is run in the order it was queued, so a later operation of `s` already follows `e`.
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0) {
  return cudaSuccess;
}

inline cudaError_t emu_allocate(void** p, std::size_t bytes, cudaMemoryType type) {
  // Past 1 GiB the memory is mapped without being reserved (pages are committed as touched) and
  // not poisoned: room for tests of the indexing of arrays of 2^31 elements.
  const bool mapped = bytes > (std::size_t{1} << 30);
  if (bytes > (std::size_t{1} << 40)) {
    *p = nullptr;
  } else if (mapped) {
    *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
              -1, 0);
    if (*p == MAP_FAILED) *p = nullptr;
  } else {
    // cudaMalloc's alignment (256 bytes), which the workspace checks require.
    if (posix_memalign(p, 256, bytes == 0 ? 1 : bytes) != 0) *p = nullptr;
    // Fresh memory is poisoned, so reads of unwritten workspace show up as NaN.
    if (*p != nullptr) std::memset(*p, 0xff, bytes);
  }
  if (*p == nullptr) return emu::last_error = cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> lock(emu::allocation_mutex);
  emu::allocations[static_cast<const char*>(*p)] = {bytes, mapped, type, emu::current_device};
  return cudaSuccess;
}
inline cudaError_t emu_release(void* p) {
  if (p == nullptr) return cudaSuccess;
  emu::run_all();  // cudaFree and cudaFreeHost wait for the device
  std::lock_guard<std::mutex> lock(emu::allocation_mutex);
  const auto it = emu::allocations.find(static_cast<const char*>(p));
  if (it == emu::allocations.end()) return cudaErrorInvalidValue;
  if (it->second.mapped) {
    munmap(p, it->second.bytes);
  } else {
    std::free(p);
  }
  emu::allocations.erase(it);
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  ++emu::counters.allocations;
  return emu_allocate(p, bytes, cudaMemoryTypeDevice);
}
inline cudaError_t cudaFree(void* p) { return emu_release(p); }
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  return emu_allocate(p, bytes, cudaMemoryTypeHost);
}
inline cudaError_t cudaFreeHost(void* p) { return emu_release(p); }

inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = {};
  const emu::Allocation allocation = emu::allocation_of(p);
  a->type = allocation.type;
  a->device = allocation.device;
  return cudaSuccess;
}

inline cudaError_t cudaMemcpyAsync(void* d, const void* s, std::size_t n, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  if (n == 0) return cudaSuccess;
  if (kind == cudaMemcpyDeviceToHost && emu::memory_type(d) != cudaMemoryTypeHost) {
    ++emu::counters.pageable_device_to_host;
  }
  if (kind == cudaMemcpyHostToDevice && emu::memory_type(s) != cudaMemoryTypeHost) {
    ++emu::counters.pageable_host_to_device;
  }
  emu::enqueue(stream, [=] {
    std::memcpy(d, s, n);
    return true;
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int value, std::size_t n, cudaStream_t s = nullptr) {
  emu::enqueue(s, [=] {
    std::memset(d, value, n);
    return true;
  });
  return cudaSuccess;
}

// Atomics (phase counts, the flow's union-find): one global lock (blocks run one after another;
// the threads of a block are fibers or host threads).
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

// cuBLAS handles: one per (host thread, device) while the thread uses it. A handle is created
// once (cublasCreate allocates and synchronises) and, when its thread exits, goes back to a
// process-wide pool for the next thread instead of being destroyed: a thread_local destructor
// may run at process exit after the CUDA runtime has torn the context down, where cublasDestroy
// is unsafe. Pooled handles are released with the process, so the number of handles is bounded
// by the number of threads that used cuBLAS at the same time.
#include "cublas_handles.hpp"

#include <map>
#include <mutex>
#include <vector>

#include "core/check.hpp"

namespace emflow::detail {

void check_cublas(const CublasApi& api, cublasStatus_t status, const char* operation,
                  const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail(status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::out_of_memory : ErrorCode::device,
       operation, ": ", call, " failed: ", api.status_string(status), " (", api.status_name(status),
       ")");
}

namespace {

class CublasPool {
 public:
  static CublasPool& instance() {
    static CublasPool* const pool = new CublasPool;  // never destroyed: see above
    return *pool;
  }
  cublasHandle_t take(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[device];
    if (free.empty()) return nullptr;
    cublasHandle_t handle = free.back();
    free.pop_back();
    return handle;
  }
  void give_back(int device, cublasHandle_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[device].push_back(handle);
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<cublasHandle_t>> free_;
};

struct ThreadHandles {
  std::vector<cublasHandle_t> by_device;
  ~ThreadHandles() {
    try {
      for (std::size_t device = 0; device < by_device.size(); ++device) {
        if (by_device[device] != nullptr) {
          CublasPool::instance().give_back(static_cast<int>(device), by_device[device]);
        }
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to do but not reuse the handle
      // Out of memory while pooling: the handle is then simply not reused.
    }
  }
};

}  // namespace

cublasHandle_t cublas_for_stream(const CublasApi& api, int device, cudaStream_t stream,
                                 void* workspace, std::size_t bytes, const char* operation) {
  thread_local ThreadHandles cache;
  const auto slot = static_cast<std::size_t>(device);
  if (cache.by_device.size() <= slot) cache.by_device.resize(slot + 1, nullptr);
  if (cache.by_device[slot] == nullptr) {
    cublasHandle_t handle = CublasPool::instance().take(device);
    if (handle == nullptr) {
      check_cublas(api, api.create(&handle), operation, "cublasCreate");
      // Full fp32 products: no TF32 (the accuracy contract is fp32 relative error < 1e-5).
      const cublasStatus_t status = api.set_math_mode(handle, CUBLAS_DEFAULT_MATH);
      if (status != CUBLAS_STATUS_SUCCESS) {
        api.destroy(handle);
        check_cublas(api, status, operation, "cublasSetMathMode");
      }
    }
    cache.by_device[slot] = handle;
  }
  cublasHandle_t handle = cache.by_device[slot];
  // cublasSetStream resets the workspace to cuBLAS's default pool, so the workspace comes after.
  check_cublas(api, api.set_stream(handle, stream), operation, "cublasSetStream");
  check_cublas(api, api.set_workspace(handle, workspace, bytes), operation, "cublasSetWorkspace");
  return handle;
}

}  // namespace emflow::detail

// CUDA device discovery for the backend choice (Device::automatic / Device::cuda).
#include <cuda_runtime.h>

#include <string>

#include "core/backends.hpp"

namespace emflow::detail {

bool cuda_device_available(std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (reason) *reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return false;
  }
  if (count == 0) {
    if (reason) *reason = "no CUDA device is present";
    return false;
  }
  return true;
}

}  // namespace emflow::detail

// CUDA device discovery for the backend choice (Device::automatic / Device::cuda).
#include <cuda_runtime.h>

#include <string>

#include "core/backends.hpp"

namespace emflow::detail {
namespace {

std::string cuda_version_name(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

}  // namespace

bool cuda_device_available(std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (reason) {
      // The runtime says "CUDA driver version is insufficient for CUDA runtime version" both when
      // the driver is too old and when there is none at all (every machine without an NVIDIA
      // GPU): the driver's version tells the two apart.
      const std::string error = cudaGetErrorString(status);
      int driver = 0;
      int runtime = 0;
      const bool versions = cudaDriverGetVersion(&driver) == cudaSuccess &&
                            cudaRuntimeGetVersion(&runtime) == cudaSuccess;
      if (versions && driver == 0) {
        *reason = "no NVIDIA driver is installed, so cudaGetDeviceCount fails: " + error;
      } else if (versions && driver < runtime) {
        *reason = "the NVIDIA driver supports CUDA " + cuda_version_name(driver) +
                  ", older than the CUDA " + cuda_version_name(runtime) +
                  " runtime emflow was built with, so cudaGetDeviceCount fails: " + error;
      } else {
        *reason = "cudaGetDeviceCount: " + error;
      }
    }
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

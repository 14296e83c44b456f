// cuBLAS is loaded on first use (src/cuda/cublas_loader.hpp), not linked: a process maps it only
// once a call needs it. Under ctest every test runs in a process of its own, so the library is
// not mapped before this test asks for it; run in one process after GPU tests, it may be, and
// then only the loaded functions are checked. Needs no device.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#if defined(EMFLOW_WITH_CUDA) && !defined(EMFLOW_CUDA_EMULATION)
#include "cuda/cublas_loader.hpp"

namespace emflow::testing {
namespace {

bool cublas_mapped() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("libcublas.so") != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLoader, LoadsTheToolkitLibraryOnFirstUse) {
  const bool mapped_before = cublas_mapped();
  const detail::CublasApi& api = detail::cublas_api("cublas_loader_test");
  if (!mapped_before) {
    EXPECT_TRUE(cublas_mapped()) << "cublas_api returned without loading cuBLAS";
  }
  // Real cuBLAS functions, callable without a device.
  ASSERT_NE(api.status_name, nullptr);
  EXPECT_EQ(std::string(api.status_name(CUBLAS_STATUS_SUCCESS)), "CUBLAS_STATUS_SUCCESS");
  EXPECT_EQ(std::string(api.status_name(CUBLAS_STATUS_ALLOC_FAILED)), "CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_NE(api.create, nullptr);
  EXPECT_NE(api.sgemm_strided_batched, nullptr);
  EXPECT_NE(api.dgemm_strided_batched, nullptr);
  // Loaded once: the second call hands out the same functions.
  EXPECT_EQ(&detail::cublas_api("cublas_loader_test"), &api);
}

}  // namespace
}  // namespace emflow::testing

#endif

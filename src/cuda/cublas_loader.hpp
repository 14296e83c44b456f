// cuBLAS, loaded on first use: emflow does not link it, so a process that never touches a GPU
// never maps it (libcublas and libcublasLt together are over 200 MB of address space). The first
// call dlopens the library the toolkit emflow was built with (its versioned soname) and looks up
// the few functions the backend calls, with their types from cublas_v2.h. Under the CPU
// emulation of CUDA (EMFLOW_CUDA_EMULATION) the functions are the emulation's, called directly.
#pragma once

#include <cublas_v2.h>

namespace emflow::detail {

/// The cuBLAS functions the CUDA backend calls (cublas_v2.h maps the short names to the _v2
/// entry points; the loader looks those up).
struct CublasApi {
  decltype(&cublasCreate) create;
  decltype(&cublasDestroy) destroy;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasSetStream) set_stream;
  decltype(&cublasSetWorkspace) set_workspace;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
  decltype(&cublasDgemmStridedBatched) dgemm_strided_batched;
  decltype(&cublasGetStatusString) status_string;
  decltype(&cublasGetStatusName) status_name;
};

/// The loaded functions. The first call loads the library (thread-safe, once per process); when
/// that fails, every call throws ErrorCode::unsupported naming `operation`, the library and
/// dlerror()'s reason.
const CublasApi& cublas_api(const char* operation);

}  // namespace emflow::detail

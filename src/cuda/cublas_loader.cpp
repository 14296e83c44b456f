// See cublas_loader.hpp. The library name comes from the build: EMFLOW_CUBLAS_LIBRARY is the
// soname of the toolkit's cuBLAS (e.g. libcublas.so.13) and EMFLOW_CUBLAS_FALLBACK the same file
// in the toolkit's library folder, tried when the loader's search path does not reach it.
#include "cublas_loader.hpp"

#include <string>

#include "core/check.hpp"

#if !defined(EMFLOW_CUDA_EMULATION)
#include <dlfcn.h>
#endif

namespace emflow::detail {

namespace {

struct Loaded {
  CublasApi api{};
  std::string error;  // empty when loaded
};

#if defined(EMFLOW_CUDA_EMULATION)

Loaded load() {
  Loaded loaded;
  loaded.api = {&cublasCreate,
                &cublasDestroy,
                &cublasSetMathMode,
                &cublasSetStream,
                &cublasSetWorkspace,
                &cublasSgemmStridedBatched,
                &cublasDgemmStridedBatched,
                &cublasGetStatusString,
                &cublasGetStatusName};
  return loaded;
}

#else

#if !defined(EMFLOW_CUBLAS_LIBRARY)
#error "EMFLOW_CUBLAS_LIBRARY (the soname of the toolkit's cuBLAS) must be defined by the build"
#endif

// The exported name of a cuBLAS function: the short names of cublas_v2.h are macros for the _v2
// entry points, so the name is taken after macro expansion.
#define EMFLOW_CUBLAS_NAME(function) EMFLOW_CUBLAS_STRING(function)
#define EMFLOW_CUBLAS_STRING(function) #function

template <class Function>
bool find(void* library, const char* name, Function* function, std::string* error) {
  dlerror();
  void* const symbol = dlsym(library, name);
  if (symbol == nullptr) {
    const char* const why = dlerror();
    *error = concat("cuBLAS (", EMFLOW_CUBLAS_LIBRARY, ") has no function ", name, ": ",
                    why != nullptr ? why : "null symbol");
    return false;
  }
  *function = reinterpret_cast<Function>(symbol);
  return true;
}

Loaded load() {
  Loaded loaded;
  // Never closed: handles made from it live until the process ends.
  void* library = dlopen(EMFLOW_CUBLAS_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* const why = dlerror();
    loaded.error = concat("could not load cuBLAS (", EMFLOW_CUBLAS_LIBRARY,
                          "): ", why != nullptr ? why : "unknown reason");
#if defined(EMFLOW_CUBLAS_FALLBACK)
    library = dlopen(EMFLOW_CUBLAS_FALLBACK, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* const fallback_why = dlerror();
      loaded.error += concat("; nor ", EMFLOW_CUBLAS_FALLBACK, ": ",
                             fallback_why != nullptr ? fallback_why : "unknown reason");
      return loaded;
    }
    loaded.error.clear();
#else
    return loaded;
#endif
  }
  CublasApi& api = loaded.api;
  std::string& error = loaded.error;
  const bool found =
      find(library, EMFLOW_CUBLAS_NAME(cublasCreate), &api.create, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasDestroy), &api.destroy, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasSetMathMode), &api.set_math_mode, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasSetStream), &api.set_stream, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasSetWorkspace), &api.set_workspace, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasSgemmStridedBatched), &api.sgemm_strided_batched,
           &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasDgemmStridedBatched), &api.dgemm_strided_batched,
           &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasGetStatusString), &api.status_string, &error) &&
      find(library, EMFLOW_CUBLAS_NAME(cublasGetStatusName), &api.status_name, &error);
  if (!found) api = CublasApi{};
  return loaded;
}

#endif

}  // namespace

const CublasApi& cublas_api(const char* operation) {
  static const Loaded loaded = load();  // once; a failure is remembered, not retried
  if (!loaded.error.empty()) fail(ErrorCode::unsupported, operation, ": ", loaded.error);
  return loaded.api;
}

}  // namespace emflow::detail

// libFuzzer target: the safetensors reader on arbitrary bytes.
//
// Each input is written to a file in /dev/shm and opened with SafetensorsFile; every tensor the
// header accepts is read as float and as double. Every outcome must be either tensors consistent
// with their entries or an emflow::Error of kind io (malformed file) or out_of_memory; anything
// else, and any sanitizer report, is a crash.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "emflow/error.hpp"
#include "emflow/safetensors.hpp"

namespace {

[[noreturn]] void defect(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_safetensors: %s: %s\n", what, detail.c_str());
  std::abort();
}

void expect_file_error(const emflow::Error& e) {
  if (e.code() != emflow::ErrorCode::io && e.code() != emflow::ErrorCode::out_of_memory) {
    defect("unexpected error kind", std::string(emflow::to_string(e.code())) + ": " + e.what());
  }
  if (std::strlen(e.what()) == 0) defect("empty error message", "");
}

template <class T>
void read_all(const emflow::SafetensorsFile& file) {
  std::int64_t end = 0;
  for (const emflow::TensorEntry& entry : file.header().tensors) {
    if (entry.begin != end) defect("ranges do not tile the buffer", entry.name);
    end = entry.end;
    emflow::Tensor<T> tensor;
    try {
      tensor = file.read<T>(entry.name);
    } catch (const emflow::Error& e) {
      expect_file_error(e);
      continue;
    }
    if (tensor.shape() != entry.shape) defect("shape differs from the entry", entry.name);
    if (tensor.size() * emflow::item_size(entry.dtype) != entry.end - entry.begin) {
      defect("element count differs from the byte range", entry.name);
    }
  }
  if (end != file.header().data_size) defect("ranges do not cover the buffer", "");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = [] {
    const char* folder = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(folder) + "/emflow_fuzz_safetensors_" + std::to_string(::getpid()) +
           "_input.safetensors";
  }();
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) defect("cannot write the input file", path);
  if (size > 0 && std::fwrite(data, 1, size, file) != size) defect("short write", path);
  std::fclose(file);

  try {
    const emflow::SafetensorsFile checkpoint(path);
    read_all<float>(checkpoint);
    read_all<double>(checkpoint);
  } catch (const emflow::Error& e) {
    expect_file_error(e);
  }
  std::remove(path.c_str());
  return 0;
}

// libFuzzer target: the safetensors reader on arbitrary bytes.
//
// Each input is written to a file in /dev/shm and opened with SafetensorsFile; every tensor the
// header accepts is read as float and as double. Every outcome must be either tensors consistent
// with their entries or an emflow::Error of kind io (malformed file) or out_of_memory; anything
// else, and any sanitizer report, is a crash.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "emflow/error.hpp"
#include "emflow/safetensors.hpp"
#include "fuzz_common.hpp"

const char* const fuzz::kTarget = "fuzz_safetensors";

namespace {

using fuzz::defect;
using fuzz::expect_file_error;

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
  static const std::string path = fuzz::scratch_path("input.safetensors");
  fuzz::write_input(path, data, size);

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

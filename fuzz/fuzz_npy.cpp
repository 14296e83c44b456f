// libFuzzer target: the .npy reader on arbitrary bytes.
//
// Each input is written to a file in /dev/shm (memory, so the run is not disk-bound) and read
// back with read_npy_header and read_npy as float, double and int64. Every outcome must be
// either a Tensor consistent with the header or an emflow::Error of kind io (malformed file) or
// out_of_memory (a payload larger than memory); anything else, and any sanitizer report, is a
// crash. A file the reader accepts is written again with write_npy and must read back bitwise
// equal.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "emflow/error.hpp"
#include "emflow/io.hpp"
#include "fuzz_common.hpp"

const char* const fuzz::kTarget = "fuzz_npy";

namespace {

using fuzz::defect;
using fuzz::expect_file_error;

template <class T>
void read_as(const std::string& path, const std::string& copy) {
  emflow::Tensor<T> array;
  try {
    array = emflow::read_npy<T>(path);
  } catch (const emflow::Error& e) {
    expect_file_error(e);
    return;
  }
  const emflow::NpyHeader header = emflow::read_npy_header(path);
  if (header.shape != array.shape()) defect("shape differs from the header", "");
  std::int64_t count = 1;
  for (std::int64_t extent : array.shape()) count *= extent;
  if (count != array.size()) defect("element count differs from the shape", "");

  emflow::write_npy(copy, array);
  const emflow::Tensor<T> again = emflow::read_npy<T>(copy);
  if (again.shape() != array.shape() ||
      (array.size() > 0 && std::memcmp(again.data(), array.data(),
                                       static_cast<std::size_t>(array.size()) * sizeof(T)) != 0)) {
    defect("write_npy then read_npy changed the array", "");
  }
  std::remove(copy.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = fuzz::scratch_path("input.npy");
  static const std::string copy = fuzz::scratch_path("copy.npy");
  fuzz::write_input(path, data, size);

  try {
    emflow::read_npy_header(path);
  } catch (const emflow::Error& e) {
    expect_file_error(e);
  }
  read_as<float>(path, copy);
  read_as<double>(path, copy);
  read_as<std::int64_t>(path, copy);
  std::remove(path.c_str());
  return 0;
}

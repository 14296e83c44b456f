// Limits: sizes whose products overflow 64 bits, or that cannot fit in memory, are refused
// before anything is allocated, with an error naming what was asked for.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>

#include "common/testing.hpp"
#include "core/memory.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"

namespace emflow {
namespace {

namespace fs = std::filesystem;

class NpyLimits : public testing::ScratchFolder {
 protected:
  NpyLimits() : ScratchFolder("emflow_limits_") {}

  // A .npy file (format 1.0) with this header dict and `payload` bytes after it.
  std::string write(const std::string& name, const std::string& dict_text, std::uint64_t payload) {
    std::string dict = dict_text;
    dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
    dict.push_back('\n');
    std::string bytes("\x93NUMPY\x01\x00", 8);
    bytes.push_back(static_cast<char>(dict.size() & 0xff));
    bytes.push_back(static_cast<char>(dict.size() >> 8));
    bytes += dict;
    const std::string path = (folder_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    // Extending with truncate makes a sparse file: no disk space is used for the payload.
    std::error_code error;
    fs::resize_file(path, bytes.size() + payload, error);
    return error ? std::string() : path;
  }
};

void expect_error(const std::function<void()>& call, ErrorCode code, const std::string& words) {
  EXPECT_TRUE(testing::throws_error(call, code, {words}));
}

TEST_F(NpyLimits, ShapesWhoseSizesOverflowAreRefused) {
  const std::string count =
      write("count.npy",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0);
  expect_error([&] { read_npy_header(count); }, ErrorCode::io, "element count overflows 64 bits");
  const std::string bytes =
      write("bytes.npy",
            "{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }", 0);
  expect_error([&] { read_npy<double>(bytes); }, ErrorCode::io, "byte size overflows 64 bits");
  const std::string extent =
      write("extent.npy",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 0);
  expect_error([&] { read_npy<float>(extent); }, ErrorCode::io, "does not fit in 64 bits");
}

TEST_F(NpyLimits, PayloadLargerThanTheFileIsRefused) {
  // Claims 10^12 floats but holds 16 bytes: refused from the file size, nothing allocated.
  const std::string path = write(
      "short.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000000), }", 16);
  expect_error([&] { read_npy<float>(path); }, ErrorCode::io, "is truncated");
}

TEST_F(NpyLimits, SparseFileLargerThanMemoryIsRefusedBeforeAllocating) {
  // A sparse file really holds 8 TiB of (zero) payload; reading it must not try to allocate.
  const std::int64_t count = std::int64_t{1} << 41;
  const std::string path =
      write("sparse.npy",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(count) + ",), }",
            static_cast<std::uint64_t>(count) * 4);
  if (path.empty()) GTEST_SKIP() << "this file system cannot hold an 8 TiB sparse file";
  if (detail::memory_limit_bytes() >= count * 8) GTEST_SKIP() << "this machine has 16 TiB";
  EXPECT_EQ(read_npy_header(path).shape, Shape{count});  // the header alone is fine
  expect_error([&] { read_npy<float>(path); }, ErrorCode::out_of_memory,
               "bytes of memory available");
  expect_error([&] { read_npy<double>(path); }, ErrorCode::out_of_memory,
               "bytes of memory available");
}

TEST(MemoryLimit, RefusesWhatCannotFit) {
  const std::int64_t limit = detail::memory_limit_bytes();
  EXPECT_GT(limit, std::int64_t{1} << 26);  // some memory is present
  EXPECT_NO_THROW(detail::expect_fits_in_memory("op", "small", 1000, 8));
  EXPECT_NO_THROW(detail::expect_fits_in_memory("op", "exact", limit, 1));
  expect_error([&] { detail::expect_fits_in_memory("op", "one more", limit + 1, 1); },
               ErrorCode::out_of_memory, "op: one more needs");
  expect_error([&] { detail::expect_fits_in_memory("op", "huge", std::int64_t{1} << 62, 4); },
               ErrorCode::out_of_memory, "overflows 64 bits");
  expect_error([&] { detail::expect_fits_in_memory("op", "negative", -1, 4); },
               ErrorCode::out_of_memory, "overflows 64 bits");
}

TEST(AttendLimits, SizeProductsThatOverflowAreRefusedBeforeTouchingMemory) {
  // The pointers are never dereferenced: validation refuses the sizes first.
  float dummy = 0.0f;
  AttentionInput<float> input;
  input.cloud = input.layer.relevance = input.layer.content = &dummy;
  AttentionOutput<float> output;
  output.update = output.weights = &dummy;
  input.dim = 1;
  input.tokens = std::int64_t{1} << 32;
  input.batch = 1;
  input.layer.heads = 1;
  // N N = 2^64 weights: too many to index.
  expect_error([&] { attend(input, output); }, ErrorCode::invalid_argument, "weights");
  input.tokens = 1;
  input.batch = std::int64_t{1} << 40;
  input.dim = std::int64_t{1} << 30;
  expect_error([&] { attend(input, output); }, ErrorCode::invalid_argument, "cloud");
}

}  // namespace
}  // namespace emflow

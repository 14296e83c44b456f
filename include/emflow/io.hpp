// emflow: files. NumPy .npy arrays (float32 / float64, C order, little endian, rank 1 to 4)
// and atomic output: every file emflow writes is written to a temporary file beside the target
// and renamed into place, so a failed run never leaves a half-written or stale output.
#pragma once

#include <cstdint>
#include <string>

#include "emflow/tensor.hpp"

namespace emflow {

/// Element type of an array file.
enum class Dtype { float32, float64, int64, int32 };
const char* to_string(Dtype dtype) noexcept;

/// What a .npy header declares.
struct NpyHeader {
  Dtype dtype = Dtype::float64;
  Shape shape;
  std::int64_t data_offset = 0;  ///< bytes from the start of the file to the payload
};

/// Reads and checks the header of `path` (magic, version, dtype, order, shape, payload size).
/// Throws emflow::Error (ErrorCode::io) naming the file and the problem.
NpyHeader read_npy_header(const std::string& path);

/// Reads `path` as T. float32 and float64 files are read as either T (converted exactly for
/// float -> double; double -> float rounds); int32/int64 files only as std::int64_t.
/// Fortran order, big endian, other dtypes, ranks outside 1..4, truncated or oversized
/// headers or payloads are refused with ErrorCode::io.
template <class T>
Tensor<T> read_npy(const std::string& path);

/// Writes `array` (rank 1 to 4) as a little-endian C-order .npy file, atomically.
template <class T>
void write_npy(const std::string& path, const Tensor<T>& array);

/// Writes `bytes` to `path` atomically (temporary file in the same folder, fsync, rename).
/// Throws ErrorCode::io naming the path on failure and leaves no temporary file behind.
void write_file_atomic(const std::string& path, const std::string& bytes);

extern template Tensor<float> read_npy<float>(const std::string&);
extern template Tensor<double> read_npy<double>(const std::string&);
extern template Tensor<std::int64_t> read_npy<std::int64_t>(const std::string&);
extern template void write_npy<float>(const std::string&, const Tensor<float>&);
extern template void write_npy<double>(const std::string&, const Tensor<double>&);
extern template void write_npy<std::int64_t>(const std::string&, const Tensor<std::int64_t>&);

}  // namespace emflow

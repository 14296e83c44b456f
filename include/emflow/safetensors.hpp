// emflow: safetensors checkpoints (the format pretrained transformers ship their weights in),
// read strictly.
//
// Layout: an 8-byte little-endian header length n, then n bytes of JSON (an object; trailing
// spaces allowed), then the data buffer. Each key of the object but "__metadata__" names a
// tensor: {"dtype": "F32", "shape": [768, 768], "data_offsets": [begin, end]}, the offsets in
// bytes from the start of the data buffer, the payload little endian in C order.
// "__metadata__", if present, maps strings to strings.
//
// The reader accepts exactly that. It refuses, with emflow::Error (ErrorCode::io) naming the
// file and, where there is one, the tensor: a file shorter than 8 bytes, a header length
// beyond the file or above 100,000,000 bytes, a header that is not valid JSON or not an object,
// duplicate names, an entry whose keys, dtype, shape or offsets are malformed, an unknown
// dtype, a byte range that does not match its shape and dtype, ranges that overlap,
// leave a gap, or do not cover the data buffer exactly.
//
// Element types: F32, F64, F16 and BF16 are read as float or double. F16 and BF16 convert exactly
// (every half and bfloat16 value is a float: precision.hpp's to_float, the one 16-bit conversion);
// F64 read as float rounds. Reading a tensor of another dtype of the format (integers, 8-bit
// floats) is refused naming it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "emflow/tensor.hpp"

namespace emflow {

/// The element types of the format are emflow::Dtype's (types.hpp): F16 float16, BF16 bfloat16,
/// F32 float32, F64 float64, BOOL boolean, U8 uint8, I8 int8, I16 int16, U16 uint16, I32 int32,
/// U32 uint32, I64 int64, U64 uint64, F8_E4M3 float8_e4m3, F8_E5M2 float8_e5m2. Only the four
/// floating types of 16 bits and more can be read (as float or double); the others (integer
/// buffers such as BERT's position_ids, 8-bit floats) are accepted in a header, so a checkpoint
/// that holds them opens, but reading one is refused.

/// The name the file spells for `dtype`, e.g. "F16", "BF16", "I64" ("" for none).
const char* safetensors_name(Dtype dtype) noexcept;

/// One tensor of a safetensors file, as its header declares it.
struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::float32;
  Shape shape;             ///< may be empty (a scalar: one element)
  std::int64_t begin = 0;  ///< byte offset in the data buffer
  std::int64_t end = 0;    ///< one past the last byte
};

/// A parsed and checked safetensors header.
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;             ///< in file order (by begin offset)
  std::map<std::string, std::string> metadata;  ///< "__metadata__", empty if absent
  std::int64_t data_offset = 0;                 ///< 8 + header length
  std::int64_t data_size = 0;                   ///< bytes of the data buffer
};

/// Reads and checks the header of `path` (see the file comment).
SafetensorsHeader read_safetensors_header(const std::string& path);

/// A safetensors file opened for reading tensors by name: the header is read and checked once.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);

  const std::string& path() const noexcept { return path_; }
  const SafetensorsHeader& header() const noexcept { return header_; }
  bool contains(const std::string& name) const;
  /// The entry `name`; throws ErrorCode::io naming the file and the tensor when absent.
  const TensorEntry& entry(const std::string& name) const;
  /// The names, in file order.
  std::vector<std::string> names() const;

  /// Reads tensor `name` as T (float or double); a tensor of another dtype than F16, BF16, F32
  /// or F64 is refused (ErrorCode::io naming the file, the tensor and its dtype).
  template <class T>
  Tensor<T> read(const std::string& name) const;

 private:
  std::string path_;
  SafetensorsHeader header_;
  std::map<std::string, std::size_t> index_;
};

extern template Tensor<float> SafetensorsFile::read<float>(const std::string&) const;
extern template Tensor<double> SafetensorsFile::read<double>(const std::string&) const;

}  // namespace emflow

// emflow::gguf: GGUF files (the single-file format of llama.cpp, in which most quantized LLMs are
// distributed), read strictly, their tensors dequantized to float32 exactly as the `gguf` Python
// package computes them.
//
// Layout (versions 2 and 3, little endian): the magic "GGUF", a uint32 version, a uint64 tensor
// count and a uint64 metadata count; the metadata, each entry a key (a string: uint64 length,
// then its bytes), a uint32 value type and the value; the tensor infos, each a name (a string),
// a uint32 dimension count n <= 4, n uint64 extents (innermost first, ggml's ne[0], ne[1], ...),
// a uint32 tensor type and a uint64 offset; padding to the alignment (metadata key
// general.alignment, a uint32 power of two, default 32); then the data section, in which each
// tensor's data starts at its offset (a multiple of the alignment). Values are numbers
// (uint8 .. int64, float32, float64), bools (one byte, 0 or 1), strings, or arrays (a uint32
// element type, a uint64 count, the elements) of any of them, arrays of arrays included.
//
// The reader accepts exactly that. It refuses, with emflow::Error (ErrorCode::io) naming the
// file and the key or tensor: a bad magic, another version (1, or a big-endian file: only
// little-endian files are read), any length, count or extent that runs past the end of the file
// (each is checked against the bytes left before anything is allocated), an unknown value type
// or tensor type, a bool other than 0 or 1, arrays nested deeper than 64, keys or tensor names
// given twice, an empty key or one longer than 65535 bytes, a tensor name longer than 64 bytes
// (the format's limit), more than 4 dimensions, extents whose product (of the non-zero ones, so
// also beside a 0) or byte size overflows 64 bits, a block-quantized tensor whose innermost
// extent is not a multiple of its block, a general.alignment that is not a uint32 power of two,
// an offset that is not a multiple of the alignment, data that runs past the end of the file,
// and tensors whose data overlap. Metadata and tensors larger than the memory of the process are
// refused with ErrorCode::out_of_memory before they are allocated. Gaps between tensors and bytes
// after the last one are allowed, as the format allows them. Messages write the control bytes
// and backslashes of keys and names as \xNN (a NUL would cut what() short).
//
// Tensors are read as float32 in row-major order: TensorInfo::shape is the file's extents
// reversed (token_embd.weight of SmolLM2, extents 576 x 49152 in the file, is shape
// {49152, 576}: one row per token), the layout numpy and the gguf package give. F32, F16, BF16,
// Q8_0, Q4_0 and Q4_1 are dequantized, exactly as the package's gguf.quants.dequantize computes
// them (the bits of every value equal, NaNs included):
//
//   F32   the value as stored            BF16  the 16 bits as the upper half of a float32
//   F16   the half widened to float32 exactly (a NaN keeps its payload, as numpy's astype does)
//   Q8_0  blocks of 32: a half scale d, then 32 int8 q:           x = q * d
//   Q4_0  blocks of 32: a half d, 16 bytes of nibbles q in 0..15: x = d * (q - 8)
//   Q4_1  blocks of 32: a half d, a half m, 16 bytes of nibbles:  x = d * q + m
//
// with d and m widened to float32 first and every operation rounded to float32 on its own (no
// fused multiply-add), in the package's order. Nibbles: byte j of a block holds element j in
// its low four bits and element j + 16 in its high four. Every other tensor type opens (its
// info is checked with its block size), but reading it is refused naming the type and the
// tensor.
//
// A File is immutable once opened: its const members may be called from several threads at once
// (each read opens the file anew).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "emflow/tensor.hpp"

namespace emflow::gguf {

/// The tensor types of the format (ggml's type numbers, as the file stores them).
enum class Type : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
  nvfp4 = 40,
  q1_0 = 41,
};
/// The name ggml gives the type: "F32", "Q4_1", "Q6_K", "BF16", ...; "unknown" for a value
/// outside the enumeration.
const char* to_string(Type type) noexcept;
/// Elements per block (1 for the plain types F32, F16, BF16, I8 ... F64); 0 for an unknown type.
std::int64_t block_size(Type type) noexcept;
/// Bytes per block; 0 for an unknown type.
std::int64_t block_bytes(Type type) noexcept;
/// True for the types emflow dequantizes: F32, F16, BF16, Q8_0, Q4_0 and Q4_1.
bool dequantizes(Type type) noexcept;

/// Dequantizes `count` elements of `type` stored at `blocks` (count / block_size(type) blocks,
/// little endian, as in the file) into `out`, as the file comment says. Throws
/// ErrorCode::invalid_argument when the type is not one that dequantizes(), when `count` is
/// negative or not a multiple of the block size, or when a pointer is null with count > 0.
void dequantize(Type type, const void* blocks, std::int64_t count, float* out);

/// The value types of metadata (the file's numbers).
enum class ValueType : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};
/// "uint8", "int8", ..., "float32", "bool", "string", "array", "uint64", "int64", "float64";
/// "unknown" for a value outside the enumeration.
const char* to_string(ValueType type) noexcept;
/// Bytes of one stored number or bool of `type` (1 for bool); 0 for string, array and unknown.
std::int64_t value_size(ValueType type) noexcept;

/// One metadata value: a number, a bool, a string, or an array whose elements all have one type.
///
/// The accessors throw emflow::Error (ErrorCode::invalid_argument) naming the value's type when
/// asked for another kind (as_string() of a uint32, strings() of an array of int32, ...);
/// File's get_* functions check first and name the file and the key instead.
class Value {
 public:
  /// uint8 0.
  Value() = default;

  ValueType type() const noexcept { return type_; }
  /// uint8 .. int64 (not bool, not float).
  bool is_integer() const noexcept;
  /// float32 or float64.
  bool is_float() const noexcept;

  /// An integer's value; a uint64 above INT64_MAX is refused (read it with as_uint64()).
  std::int64_t as_int64() const;
  /// An integer's value when it is not negative.
  std::uint64_t as_uint64() const;
  /// A float32 (widened exactly) or float64; also an integer that a double holds exactly
  /// (|value| <= 2^53).
  double as_double() const;
  bool as_bool() const;
  /// A string's bytes as stored (GGUF strings are UTF-8; not checked).
  const std::string& as_string() const;

  /// An array's element type.
  ValueType element_type() const;
  /// An array's element count.
  std::int64_t size() const;
  /// An array of numbers or bools: its elements as stored, size() little-endian items of
  /// value_size(element_type()) bytes each.
  const std::vector<unsigned char>& bytes() const;
  /// An array of strings.
  const std::vector<std::string>& strings() const;
  /// An array of arrays (each with its own element type and size).
  const std::vector<Value>& arrays() const;
  /// Element i (0 <= i < size()) of an array of numbers or bools, as a value of element_type().
  Value element(std::int64_t i) const;

  /// A number or bool of `type` from its stored bits, zero-extended to 64 (a bool is 0 or 1).
  static Value from_bits(ValueType type, std::uint64_t bits);
  static Value from_string(std::string text);
  /// An array of numbers or bools of `element_type`, `bytes` holding them as stored.
  static Value from_bytes(ValueType element_type, std::vector<unsigned char> bytes);
  static Value from_strings(std::vector<std::string> strings);
  static Value from_arrays(std::vector<Value> arrays);

  /// The stored bits of a number or bool, zero-extended to 64.
  std::uint64_t bits() const;

 private:
  ValueType type_ = ValueType::uint8;
  ValueType element_type_ = ValueType::uint8;  // arrays only
  std::uint64_t bits_ = 0;                     // numbers and bools
  std::string text_;
  std::vector<unsigned char> bytes_;  // arrays of numbers and bools
  std::vector<std::string> strings_;  // arrays of strings
  std::vector<Value> arrays_;         // arrays of arrays
};

/// One metadata entry.
struct KeyValue {
  std::string key;
  Value value;
};

/// One tensor, as its info declares it.
struct TensorInfo {
  std::string name;
  Type type = Type::f32;
  Shape shape;                ///< row-major: the file's extents reversed; {} for no extent
  std::int64_t elements = 0;  ///< product of the extents (1 for shape {})
  std::int64_t offset = 0;    ///< bytes from the start of the data section; aligned
  std::int64_t bytes = 0;     ///< bytes of its data: elements / block_size * block_bytes
};

/// A GGUF file opened for reading: the metadata and tensor infos are read and checked once (see
/// the file comment); tensor data is read on demand.
class File {
 public:
  /// Reads and checks everything but the tensor data. Throws ErrorCode::io (the file cannot be
  /// read or is malformed: the message names the file and the key or tensor) or
  /// ErrorCode::out_of_memory.
  explicit File(const std::string& path);

  const std::string& path() const noexcept { return path_; }
  /// 2 or 3.
  std::uint32_t version() const noexcept { return version_; }
  /// general.alignment, or 32.
  std::int64_t alignment() const noexcept { return alignment_; }
  /// Bytes from the start of the file to the data section.
  std::int64_t data_offset() const noexcept { return data_offset_; }
  /// Bytes of the file when it was opened.
  std::int64_t file_size() const noexcept { return file_size_; }

  /// The metadata, in file order.
  const std::vector<KeyValue>& metadata() const noexcept { return metadata_; }
  bool contains(const std::string& key) const;
  /// The value of `key`; throws ErrorCode::io naming the file and the key when absent.
  const Value& value(const std::string& key) const;
  /// The value of `key` of the kind asked. Each throws ErrorCode::io naming the file, the key,
  /// what was asked and the value's type when the key is absent or of another kind, or when the
  /// value does not fit (a uint64 above INT64_MAX as an integer, an integer beyond 2^53 as a
  /// double).
  std::int64_t get_integer(const std::string& key) const;  ///< uint8 .. int64
  double get_number(const std::string& key) const;         ///< float32, float64 or an integer
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  const std::vector<std::string>& get_strings(const std::string& key) const;  ///< string array
  std::vector<std::int64_t> get_integers(const std::string& key) const;       ///< integer array
  std::vector<double> get_numbers(const std::string& key) const;              ///< number array

  /// The vocabulary: tokenizer.ggml.tokens (token id i is element i), the token strings as
  /// stored (GPT-2 style vocabularies spell a leading space as "Ġ", SentencePiece ones as "▁");
  /// an empty list when the file has none. Throws ErrorCode::io when the key is there but is not
  /// an array of strings.
  const std::vector<std::string>& tokens() const;
  /// The text of token ids (UTF-8 bytes; a token may hold part of a character), as the
  /// vocabulary's tokenizer (tokenizer.ggml.model) spells its tokens: "gpt2" (byte-level BPE)
  /// maps each character of a token back to the byte it stands for (GPT-2's bytes_to_unicode:
  /// "Ġ" is a space, "Ċ" a newline); "llama" (SentencePiece) writes "▁" as a space and a token
  /// "<0xNN>" as the byte NN; any other model, or none, joins the tokens as stored. Special
  /// tokens ("<|im_end|>") come out as they are spelled. Throws ErrorCode::invalid_argument
  /// naming an id outside [0, tokens().size()), and what tokens() throws.
  std::string detokenize(const std::vector<std::int64_t>& ids) const;

  /// The tensors, in file order.
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  bool has_tensor(const std::string& name) const;
  /// The info of tensor `name`; throws ErrorCode::io naming the file and the tensor when absent.
  const TensorInfo& tensor(const std::string& name) const;

  /// Reads tensor `name` dequantized to float32, of shape tensor(name).shape. Throws
  /// ErrorCode::io naming the file and the tensor when it is absent, of a type that does not
  /// dequantize (naming the type), or cannot be read (the file changed size since it was
  /// opened, or a read fails); ErrorCode::out_of_memory when it cannot fit.
  Tensor<float> read(const std::string& name) const;

 private:
  std::string path_;
  std::uint32_t version_ = 0;
  std::int64_t alignment_ = 32;
  std::int64_t data_offset_ = 0;
  std::int64_t file_size_ = 0;
  std::vector<KeyValue> metadata_;
  std::map<std::string, std::size_t> keys_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> names_;
};

/// File::detokenize on a vocabulary held elsewhere (e.g. an operator folder's): the token
/// strings, the tokenizer's name (tokenizer.ggml.model: "gpt2", "llama" or any other) and the
/// ids; `source` names the vocabulary's file in errors. Throws ErrorCode::invalid_argument
/// naming an id outside [0, vocabulary.size()).
std::string detokenize(const std::vector<std::string>& vocabulary, const std::string& model,
                       const std::vector<std::int64_t>& ids, const std::string& source);

}  // namespace emflow::gguf

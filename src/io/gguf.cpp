// GGUF files, read strictly, and the dequantization of their tensors (the format, every check and
// the arithmetic: emflow/gguf.hpp).
//
// The header is read front to back by a HeaderReader that knows how many bytes the file has
// left: each length and count is checked against them before anything is allocated or read (an
// array of n strings needs at least 8 n bytes, of n arrays 12 n), and the memory the metadata
// takes is counted as it grows, so a small file cannot ask for more than a small multiple of its
// size. Tensor data is read in chunks of whole blocks and dequantized chunk by chunk: a read
// needs its output and one chunk.
#include "emflow/gguf.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <utility>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/precision.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "emflow's GGUF reader copies little-endian values as they are: little-endian hosts only"
#endif

// Dequantization rounds every product and sum on its own, as numpy does: no fused multiply-add.
// (The products are exact anyway, an 11-bit scale times a 4- or 8-bit integer fitting the 24
// bits of a float32, so only Q4_1's sum rounds; this makes it hold by rule, whatever the flags.)
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace emflow::gguf {
namespace {

using emflow::to_string;  // of a Shape, hidden by this namespace's to_string(Type)

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr std::int64_t kDefaultAlignment = 32;
constexpr std::int64_t kMaxDimensions = 4;     // ggml's GGML_MAX_DIMS
constexpr std::int64_t kMaxNameBytes = 64;     // the format's limit on tensor names
constexpr std::int64_t kMaxKeyBytes = 65535;   // the format's limit on keys
constexpr int kMaxArrayDepth = 64;             // arrays of arrays: bounds the recursion
constexpr std::int64_t kChunkBytes = 1 << 20;  // tensor data is read this much at a time
// The fewest bytes an entry can take: a metadata entry (key length, type, a one-byte value) and
// a tensor info (name length, dimension count, type, offset).
constexpr std::int64_t kMinEntryBytes = 8 + 4 + 1;
constexpr std::int64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;

struct TypeInfo {
  Type type;
  const char* name;
  std::int64_t block;  // elements per block
  std::int64_t bytes;  // bytes per block
};
// ggml's table (ggml.c type_traits; gguf-py GGML_QUANT_SIZES).
constexpr TypeInfo kTypes[] = {{Type::f32, "F32", 1, 4},
                               {Type::f16, "F16", 1, 2},
                               {Type::q4_0, "Q4_0", 32, 18},
                               {Type::q4_1, "Q4_1", 32, 20},
                               {Type::q5_0, "Q5_0", 32, 22},
                               {Type::q5_1, "Q5_1", 32, 24},
                               {Type::q8_0, "Q8_0", 32, 34},
                               {Type::q8_1, "Q8_1", 32, 40},
                               {Type::q2_k, "Q2_K", 256, 84},
                               {Type::q3_k, "Q3_K", 256, 110},
                               {Type::q4_k, "Q4_K", 256, 144},
                               {Type::q5_k, "Q5_K", 256, 176},
                               {Type::q6_k, "Q6_K", 256, 210},
                               {Type::q8_k, "Q8_K", 256, 292},
                               {Type::iq2_xxs, "IQ2_XXS", 256, 66},
                               {Type::iq2_xs, "IQ2_XS", 256, 74},
                               {Type::iq3_xxs, "IQ3_XXS", 256, 98},
                               {Type::iq1_s, "IQ1_S", 256, 50},
                               {Type::iq4_nl, "IQ4_NL", 32, 18},
                               {Type::iq3_s, "IQ3_S", 256, 110},
                               {Type::iq2_s, "IQ2_S", 256, 82},
                               {Type::iq4_xs, "IQ4_XS", 256, 136},
                               {Type::i8, "I8", 1, 1},
                               {Type::i16, "I16", 1, 2},
                               {Type::i32, "I32", 1, 4},
                               {Type::i64, "I64", 1, 8},
                               {Type::f64, "F64", 1, 8},
                               {Type::iq1_m, "IQ1_M", 256, 56},
                               {Type::bf16, "BF16", 1, 2},
                               {Type::tq1_0, "TQ1_0", 256, 54},
                               {Type::tq2_0, "TQ2_0", 256, 66},
                               {Type::mxfp4, "MXFP4", 32, 17},
                               {Type::nvfp4, "NVFP4", 64, 36},
                               {Type::q1_0, "Q1_0", 128, 18}};

const TypeInfo* info_of(Type type) noexcept {
  for (const TypeInfo& info : kTypes) {
    if (info.type == type) return &info;
  }
  return nullptr;
}

constexpr const char* kDequantized = "F32, F16, BF16, Q8_0, Q4_0 and Q4_1";

constexpr const char* kValueTypeNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                           "int32",  "float32", "bool",   "string", "array",
                                           "uint64", "int64",   "float64"};
constexpr std::int64_t kValueSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

bool known(ValueType type) noexcept { return static_cast<std::uint32_t>(type) <= 12; }

bool is_signed(ValueType type) noexcept {
  return type == ValueType::int8 || type == ValueType::int16 || type == ValueType::int32 ||
         type == ValueType::int64;
}

bool is_integer_type(ValueType type) noexcept {
  return is_signed(type) || type == ValueType::uint8 || type == ValueType::uint16 ||
         type == ValueType::uint32 || type == ValueType::uint64;
}

bool is_float_type(ValueType type) noexcept {
  return type == ValueType::float32 || type == ValueType::float64;
}

// "a uint32", "an int8", "an array of 3 string": what a value is, for messages.
std::string describe(const Value& value) {
  if (value.type() == ValueType::array) {
    return detail::concat("an array of ", value.size(), " ", to_string(value.element_type()));
  }
  const char* name = to_string(value.type());
  return detail::concat(name[0] == 'i' ? "an " : "a ", name);
}

// A key or tensor name as messages show it: control bytes (a NUL among them, which would end the
// message for every reader of what()) and backslashes written as \xNN, the rest as stored.
std::string printable(const std::string& name) {
  std::string text;
  text.reserve(name.size());
  for (const char c : name) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f || byte == '\\') {
      constexpr char kHex[] = "0123456789abcdef";
      text += "\\x";
      text += kHex[byte >> 4];
      text += kHex[byte & 0xf];
    } else {
      text += c;
    }
  }
  return text;
}

// An integer's value, sign-extended from its stored bits.
std::int64_t signed_value(ValueType type, std::uint64_t bits) noexcept {
  switch (type) {
    case ValueType::int8:
      return static_cast<std::int8_t>(bits);
    case ValueType::int16:
      return static_cast<std::int16_t>(bits);
    case ValueType::int32:
      return static_cast<std::int32_t>(bits);
    default:
      return static_cast<std::int64_t>(bits);
  }
}

std::uint16_t load16(const unsigned char* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | p[1] << 8);
}

std::uint64_t load_little_endian(const unsigned char* p, std::int64_t size) noexcept {
  std::uint64_t bits = 0;
  for (std::int64_t i = size - 1; i >= 0; --i) bits = bits << 8 | p[i];
  return bits;
}

// --- Dequantization (gguf/quants.py of the gguf package, in its order of operations) ----------

// A half widened to float32 exactly, as numpy's float16 -> float32 conversion does it: a NaN keeps
// its payload bits (a signalling NaN stays signalling, where emflow::to_float quiets it).
float widen_half(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return detail::bits_float(sign | 0x7f800000u | mantissa << 13);
  if (exponent != 0) return detail::bits_float(sign | (exponent + 112u) << 23 | mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24, a normal float32 (or zero), exact.
  return detail::bits_float(sign | detail::float_bits(static_cast<float>(mantissa) * 0x1p-24f));
}

// Q8_0 (34 bytes): d, then 32 int8. The package computes x * d.
void q8_0_block(const unsigned char* block, float* out) noexcept {
  const float d = widen_half(load16(block));
  for (int j = 0; j < 32; ++j) {
    out[j] = static_cast<float>(static_cast<std::int8_t>(block[2 + j])) * d;
  }
}

// Q4_0 (18 bytes): d, then 16 bytes of nibbles. The package computes d * (q - 8).
void q4_0_block(const unsigned char* block, float* out) noexcept {
  const float d = widen_half(load16(block));
  for (int j = 0; j < 16; ++j) {
    const int q = block[2 + j];
    out[j] = d * static_cast<float>((q & 0x0f) - 8);
    out[j + 16] = d * static_cast<float>((q >> 4) - 8);
  }
}

// (d * q) + m as numpy adds: when both terms are NaN its sum is the first one's NaN, which is what
// x86's addss gives for its first operand; the compiler may swap the operands of `+`, so the NaN
// case is spelled out (the product is never a signalling NaN, so it is returned as it is).
float q4_1_value(float d, int q, float m) noexcept {
  const float product = d * static_cast<float>(q);
  return std::isnan(product) ? product : product + m;
}

// Q4_1 (20 bytes): d, m, then 16 bytes of nibbles. The package computes (d * q) + m.
void q4_1_block(const unsigned char* block, float* out) noexcept {
  const float d = widen_half(load16(block));
  const float m = widen_half(load16(block + 2));
  for (int j = 0; j < 16; ++j) {
    const int q = block[4 + j];
    out[j] = q4_1_value(d, q & 0x0f, m);
    out[j + 16] = q4_1_value(d, q >> 4, m);
  }
}

// `blocks` whole blocks of a type that dequantizes().
void dequantize_blocks(Type type, const unsigned char* data, std::int64_t blocks, float* out) {
  switch (type) {
    case Type::f32:
      std::memcpy(out, data, static_cast<std::size_t>(blocks) * 4);
      break;
    case Type::f16:
      for (std::int64_t i = 0; i < blocks; ++i) out[i] = widen_half(load16(data + 2 * i));
      break;
    case Type::bf16:
      for (std::int64_t i = 0; i < blocks; ++i) {
        out[i] = detail::bits_float(static_cast<std::uint32_t>(load16(data + 2 * i)) << 16);
      }
      break;
    case Type::q8_0:
      for (std::int64_t b = 0; b < blocks; ++b) q8_0_block(data + 34 * b, out + 32 * b);
      break;
    case Type::q4_0:
      for (std::int64_t b = 0; b < blocks; ++b) q4_0_block(data + 18 * b, out + 32 * b);
      break;
    case Type::q4_1:
      for (std::int64_t b = 0; b < blocks; ++b) q4_1_block(data + 20 * b, out + 32 * b);
      break;
    default:
      detail::fail(ErrorCode::internal, "gguf: dequantize_blocks reached with type ",
                   to_string(type));
  }
}

// --- The header ------------------------------------------------------------------------------

template <class... Parts>
[[noreturn]] void fail_file(const std::string& path, Parts&&... parts) {
  detail::fail(ErrorCode::io, "read_gguf: '", path, "': ", std::forward<Parts>(parts)...);
}

// What a File holds once its header is read.
struct Header {
  std::uint32_t version = 0;
  std::int64_t alignment = kDefaultAlignment;
  std::int64_t data_offset = 0;
  std::int64_t file_size = 0;
  std::vector<KeyValue> metadata;
  std::map<std::string, std::size_t> keys;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::size_t> names;
};

// Reads the header front to back. Every failure names the file and where it is: the metadata
// entry or tensor info (by its key or name once that is read, and the element of an array).
class HeaderReader {
 public:
  explicit HeaderReader(const std::string& path) : path_(path) {}

  Header read() {
    open();
    Header header;
    header.file_size = size_;
    read_preamble(header);
    const std::uint64_t tensor_count = u64("the tensor count");
    const std::uint64_t entry_count = u64("the metadata entry count");
    // Both counts against the bytes left, before reserving anything for them.
    const std::int64_t room = left();
    if (tensor_count > static_cast<std::uint64_t>(room / kMinTensorInfoBytes) ||
        entry_count > static_cast<std::uint64_t>(room / kMinEntryBytes) ||
        static_cast<std::int64_t>(tensor_count) * kMinTensorInfoBytes +
                static_cast<std::int64_t>(entry_count) * kMinEntryBytes >
            room) {
      fail("declares ", tensor_count, " tensors and ", entry_count,
           " metadata entries, which need at least ", kMinTensorInfoBytes, " and ", kMinEntryBytes,
           " bytes each, but only ", room, " bytes follow the counts");
    }
    read_metadata(header, static_cast<std::int64_t>(entry_count));
    read_alignment(header);
    read_tensor_infos(header, static_cast<std::int64_t>(tensor_count));
    // The data section starts at the next multiple of the alignment (the padding may be absent
    // when there is no tensor data at all).
    header.data_offset = (position_ + header.alignment - 1) / header.alignment * header.alignment;
    check_data(header);
    return header;
  }

 private:
  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    fail_file(path_, where(), std::forward<Parts>(parts)...);
  }

  // "key 'general.name': ", "tensor 'blk.0.attn_q.weight': ", "metadata entry 3 of 20: ",
  // "key 'tokenizer.ggml.tokens' element [17]: ", or "" for the preamble.
  std::string where() const {
    std::string text;
    if (name_ != nullptr) {
      text = detail::concat(kind_, " '", printable(*name_), "'");
    } else if (kind_ != nullptr) {
      text = detail::concat(kind_, " ", index_, " of ", count_);
    } else {
      return text;
    }
    if (!elements_.empty()) {
      // The element of nested arrays, its first indices when it is deep.
      text += " element ";
      const std::size_t shown = std::min<std::size_t>(elements_.size(), 8);
      for (std::size_t k = 0; k < shown; ++k) text += detail::concat("[", elements_[k], "]");
      if (shown < elements_.size()) text += detail::concat("... (", elements_.size(), " deep)");
    }
    return text + ": ";
  }

  void open() {
    struct stat info {};
    if (::stat(path_.c_str(), &info) != 0) fail("cannot open: ", std::strerror(errno));
    if (S_ISDIR(info.st_mode)) fail("is a folder, not a file");
    in_.open(path_, std::ios::binary);
    if (!in_) fail("cannot open: ", std::strerror(errno));
    in_.seekg(0, std::ios::end);
    size_ = static_cast<std::int64_t>(in_.tellg());
    in_.seekg(0);
    if (size_ < 0 || !in_) fail("cannot be read: its size is unknown");
    memory_limit_ = detail::memory_limit_bytes();
  }

  std::int64_t left() const noexcept { return size_ - position_; }

  // Reads `n` bytes of `what` into `out`, after checking the file has them.
  void take(void* out, std::int64_t n, const char* what) {
    if (n > left()) {
      fail(what, " needs ", n, " bytes at byte ", position_, ", but the file ends ", left(),
           " bytes later (at ", size_, ")");
    }
    in_.read(static_cast<char*>(out), static_cast<std::streamsize>(n));
    if (in_.gcount() != static_cast<std::streamsize>(n)) {
      fail("could not read ", what, " at byte ", position_, " (the file changed?)");
    }
    position_ += n;
  }

  std::uint32_t u32(const char* what) {
    unsigned char raw[4];
    take(raw, 4, what);
    return static_cast<std::uint32_t>(load_little_endian(raw, 4));
  }

  std::uint64_t u64(const char* what) {
    unsigned char raw[8];
    take(raw, 8, what);
    return load_little_endian(raw, 8);
  }

  // Counts `count` more items of `size` bytes of metadata in memory, refusing what cannot fit.
  void charge(std::int64_t count, std::int64_t size = 1) {
    std::int64_t bytes = 0;
    if (__builtin_mul_overflow(count, size, &bytes) || bytes > INT64_MAX - memory_) {
      memory_ = INT64_MAX;
    } else {
      memory_ += bytes;
    }
    if (memory_ > memory_limit_) {
      detail::expect_fits_in_memory("read_gguf", "the metadata of '" + path_ + "'", memory_, 1);
    }
  }

  // A string: its uint64 length (at most `max_length` when >= 0), then its bytes.
  std::string string(const char* what, std::int64_t max_length = -1) {
    const std::uint64_t length = u64(what);
    if (max_length >= 0 && length > static_cast<std::uint64_t>(max_length)) {
      fail(what, " is ", length, " bytes long; the format allows at most ", max_length);
    }
    if (length > static_cast<std::uint64_t>(left())) {
      fail(what, " is ", length, " bytes long, but the file ends ", left(), " bytes later (at ",
           size_, ")");
    }
    charge(static_cast<std::int64_t>(length));
    std::string text(static_cast<std::size_t>(length), '\0');
    take(text.data(), static_cast<std::int64_t>(length), what);
    return text;
  }

  void read_preamble(Header& header) {
    if (size_ < 4) fail("has ", size_, " bytes, fewer than the 4 of the magic 'GGUF'");
    if (u32("the magic") != kMagic) fail("does not start with the magic 'GGUF': not a GGUF file");
    const std::uint32_t version = u32("the version");
    const std::uint32_t swapped = __builtin_bswap32(version);
    if (version == 1) {
      fail("has GGUF version 1 (32-bit lengths), which is not read; versions 2 and 3 are");
    }
    if ((version & 0xffffu) == 0 && swapped >= 1 && swapped <= 3) {
      fail("is a big-endian GGUF file (version ", swapped,
           " byte-swapped); only little-endian files are read");
    }
    if (version != 2 && version != 3) {
      fail("has GGUF version ", version, "; versions 2 and 3 are read");
    }
    header.version = version;
  }

  void read_metadata(Header& header, std::int64_t count) {
    charge(count, sizeof(KeyValue));
    header.metadata.reserve(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) {
      locate("metadata entry", i, count);
      KeyValue entry;
      entry.key = string("its key", kMaxKeyBytes);
      if (entry.key.empty()) fail("has an empty key");
      const auto [at, fresh] = header.keys.emplace(entry.key, header.metadata.size());
      name_ = &at->first;
      kind_ = "key";
      if (!fresh) fail("is given twice (metadata entries ", at->second, " and ", i, ")");
      const auto type = static_cast<ValueType>(u32("its value type"));
      entry.value = value(type, 0);
      header.metadata.push_back(std::move(entry));
    }
    locate(nullptr, 0, 0);
  }

  // Where the next failure is: entry `index` of `count` of `kind` (no name read yet).
  void locate(const char* kind, std::int64_t index, std::int64_t count) {
    kind_ = kind;
    name_ = nullptr;
    index_ = index;
    count_ = count;
    elements_.clear();
  }

  Value value(ValueType type, int depth) {
    if (!known(type)) {
      fail("has the unknown value type ", static_cast<std::uint32_t>(type),
           " (the types are 0 to 12)");
    }
    if (type == ValueType::string) return Value::from_string(string("the string"));
    if (type == ValueType::array) return array(depth);
    unsigned char raw[8];
    const std::int64_t size = value_size(type);
    take(raw, size, "the value");
    const std::uint64_t bits = load_little_endian(raw, size);
    if (type == ValueType::boolean && bits > 1) {
      fail("holds the bool byte ", bits, "; a bool is 0 or 1");
    }
    return Value::from_bits(type, bits);
  }

  Value array(int depth) {
    if (depth >= kMaxArrayDepth) fail("nests arrays more than ", kMaxArrayDepth, " deep");
    const auto element = static_cast<ValueType>(u32("the array's element type"));
    if (!known(element)) {
      fail("is an array of the unknown value type ", static_cast<std::uint32_t>(element),
           " (the types are 0 to 12)");
    }
    const std::uint64_t count = u64("the array's element count");
    // The fewest bytes an element takes: a string's length, an array's type and count.
    const std::int64_t least = element == ValueType::string  ? 8
                               : element == ValueType::array ? 12
                                                             : value_size(element);
    if (count > static_cast<std::uint64_t>(left() / least)) {
      fail("is an array of ", count, " ", to_string(element), " elements, which need at least ",
           least, " bytes each, but the file ends ", left(), " bytes later (at ", size_, ")");
    }
    const auto n = static_cast<std::int64_t>(count);
    if (element == ValueType::string) {
      charge(n, sizeof(std::string));
      std::vector<std::string> strings;
      strings.reserve(static_cast<std::size_t>(n));
      elements_.push_back(0);
      for (std::int64_t i = 0; i < n; ++i) {
        elements_.back() = i;
        strings.push_back(string("the string"));
      }
      elements_.pop_back();
      return Value::from_strings(std::move(strings));
    }
    if (element == ValueType::array) {
      charge(n, sizeof(Value));
      std::vector<Value> arrays;
      arrays.reserve(static_cast<std::size_t>(n));
      elements_.push_back(0);
      for (std::int64_t i = 0; i < n; ++i) {
        elements_.back() = i;
        arrays.push_back(array(depth + 1));
      }
      elements_.pop_back();
      return Value::from_arrays(std::move(arrays));
    }
    charge(n, least);
    std::vector<unsigned char> bytes(static_cast<std::size_t>(n * least));
    take(bytes.data(), n * least, "the array's elements");
    if (element == ValueType::boolean) {
      for (std::int64_t i = 0; i < n; ++i) {
        if (bytes[static_cast<std::size_t>(i)] > 1) {
          elements_.push_back(i);
          fail("holds the bool byte ", static_cast<int>(bytes[static_cast<std::size_t>(i)]),
               "; a bool is 0 or 1");
        }
      }
    }
    return Value::from_bytes(element, std::move(bytes));
  }

  void read_alignment(Header& header) {
    const auto found = header.keys.find("general.alignment");
    if (found == header.keys.end()) return;
    const Value& value = header.metadata[found->second].value;
    name_ = &found->first;
    kind_ = "key";
    if (value.type() != ValueType::uint32) {
      fail("is ", describe(value), "; the alignment must be a uint32");
    }
    const std::uint64_t alignment = value.as_uint64();
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      fail("is ", alignment, "; the alignment must be a power of two");
    }
    header.alignment = static_cast<std::int64_t>(alignment);
    locate(nullptr, 0, 0);
  }

  void read_tensor_infos(Header& header, std::int64_t count) {
    charge(count, sizeof(TensorInfo));
    header.tensors.reserve(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) {
      locate("tensor info", i, count);
      TensorInfo t;
      t.name = string("its name", kMaxNameBytes);
      const auto [at, fresh] = header.names.emplace(t.name, header.tensors.size());
      name_ = &at->first;
      kind_ = "tensor";
      if (!fresh) fail("is given twice (tensor infos ", at->second, " and ", i, ")");
      const std::uint32_t dimensions = u32("its dimension count");
      if (dimensions > kMaxDimensions) {
        fail("has ", dimensions, " dimensions; at most ", kMaxDimensions, " are allowed");
      }
      std::vector<std::int64_t> extents;  // innermost first, as stored
      // The product of the non-zero extents must fit in 64 bits even when another extent is 0
      // (then the tensor is empty), so that any product of the extents does.
      bool overflow = false, empty = false;
      std::int64_t product = 1;
      for (std::uint32_t k = 0; k < dimensions; ++k) {
        const std::uint64_t extent = u64("its extent");
        if (extent > static_cast<std::uint64_t>(INT64_MAX)) {
          fail("has the extent ", extent, " (dimension ", k, "), beyond the int64 range");
        }
        extents.push_back(static_cast<std::int64_t>(extent));
        if (extent == 0) {
          empty = true;
        } else if (__builtin_mul_overflow(product, static_cast<std::int64_t>(extent), &product)) {
          overflow = true;
        }
      }
      t.shape.assign(extents.rbegin(), extents.rend());
      const std::uint32_t raw_type = u32("its type");
      t.type = static_cast<Type>(raw_type);
      const TypeInfo* type = info_of(t.type);
      if (type == nullptr) fail("has the unknown tensor type ", raw_type);
      const std::uint64_t offset = u64("its offset");
      if (overflow) {
        fail("has the shape ", to_string(t.shape), ", whose extents multiply past 64 bits");
      }
      t.elements = empty ? 0 : product;
      // Blocks run along the innermost extent (ggml's ne[0]; 1 without extents).
      const std::int64_t innermost = extents.empty() ? 1 : extents.front();
      if (innermost % type->block != 0) {
        fail("of type ", type->name, " has the shape ", to_string(t.shape), ": its last extent ",
             innermost, " is not a multiple of the ", type->name, " block of ", type->block,
             " elements");
      }
      const std::int64_t blocks = t.elements / type->block;
      if (blocks > INT64_MAX / type->bytes) {
        fail("of type ", type->name, " and shape ", to_string(t.shape),
             " needs more bytes than 64 bits count");
      }
      t.bytes = blocks * type->bytes;
      if (offset > static_cast<std::uint64_t>(INT64_MAX)) {
        fail("has the offset ", offset, ", beyond the int64 range");
      }
      t.offset = static_cast<std::int64_t>(offset);
      if (t.offset % header.alignment != 0) {
        fail("has the offset ", t.offset, ", which is not a multiple of the alignment ",
             header.alignment);
      }
      header.tensors.push_back(std::move(t));
    }
    locate(nullptr, 0, 0);
  }

  // Every tensor's data lies in the file and no two overlap.
  void check_data(const Header& header) {
    const std::int64_t data_size = std::max<std::int64_t>(0, size_ - header.data_offset);
    for (const TensorInfo& t : header.tensors) {
      if (t.offset > data_size || t.bytes > data_size - t.offset) {
        fail_file(path_, "tensor '", printable(t.name), "' (", to_string(t.type), ", shape ",
                  to_string(t.shape), ") has its ", t.bytes, " bytes at offset ", t.offset,
                  " of the data section, past the end of the file: the data section has ",
                  data_size, " bytes (from byte ", header.data_offset, ")");
      }
    }
    std::vector<std::size_t> order(header.tensors.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return header.tensors[a].offset < header.tensors[b].offset;
    });
    const TensorInfo* last = nullptr;  // the tensor with data that ends the furthest so far
    for (const std::size_t i : order) {
      const TensorInfo& t = header.tensors[i];
      if (t.bytes == 0) continue;
      if (last != nullptr && t.offset < last->offset + last->bytes) {
        fail_file(path_, "tensor '", printable(t.name), "' has its data at [", t.offset, ", ",
                  t.offset + t.bytes, ") of the data section, which overlaps that of tensor '",
                  printable(last->name), "' at [", last->offset, ", ", last->offset + last->bytes,
                  ")");
      }
      if (last == nullptr || t.offset + t.bytes > last->offset + last->bytes) last = &t;
    }
  }

  const std::string& path_;
  std::ifstream in_;
  std::int64_t size_ = 0;
  std::int64_t position_ = 0;
  std::int64_t memory_ = 0;
  std::int64_t memory_limit_ = INT64_MAX;
  // Where the reader is, for messages.
  const char* kind_ = nullptr;          // "metadata entry", "key", "tensor info", "tensor"
  const std::string* name_ = nullptr;   // the key or tensor name, once read
  std::int64_t index_ = 0, count_ = 0;  // the entry, before its name is read
  std::vector<std::int64_t> elements_;  // the element of (nested) arrays being read
};

[[noreturn]] void fail_value(ValueType type, const char* asked) {
  detail::fail(ErrorCode::invalid_argument, "gguf::Value: a ", to_string(type), " value read as ",
               asked);
}

}  // namespace

// --- Types -----------------------------------------------------------------------------------

const char* to_string(Type type) noexcept {
  const TypeInfo* info = info_of(type);
  return info != nullptr ? info->name : "unknown";
}

std::int64_t block_size(Type type) noexcept {
  const TypeInfo* info = info_of(type);
  return info != nullptr ? info->block : 0;
}

std::int64_t block_bytes(Type type) noexcept {
  const TypeInfo* info = info_of(type);
  return info != nullptr ? info->bytes : 0;
}

bool dequantizes(Type type) noexcept {
  return type == Type::f32 || type == Type::f16 || type == Type::bf16 || type == Type::q8_0 ||
         type == Type::q4_0 || type == Type::q4_1;
}

void dequantize(Type type, const void* blocks, std::int64_t count, float* out) {
  if (!dequantizes(type)) {
    detail::fail_argument("dequantize", "type", "is ", to_string(type), "; emflow dequantizes ",
                          kDequantized);
  }
  const std::int64_t block = block_size(type);
  if (count < 0 || count % block != 0) {
    detail::fail_argument("dequantize", "count", "is ", count, "; it must be a multiple of the ",
                          to_string(type), " block of ", block, " elements, >= 0");
  }
  if (count == 0) return;
  detail::expect_not_null("dequantize", "blocks", blocks);
  detail::expect_not_null("dequantize", "out", out);
  dequantize_blocks(type, static_cast<const unsigned char*>(blocks), count / block, out);
}

const char* to_string(ValueType type) noexcept {
  return known(type) ? kValueTypeNames[static_cast<std::uint32_t>(type)] : "unknown";
}

std::int64_t value_size(ValueType type) noexcept {
  return known(type) ? kValueSizes[static_cast<std::uint32_t>(type)] : 0;
}

// --- Value -----------------------------------------------------------------------------------

bool Value::is_integer() const noexcept { return is_integer_type(type_); }

bool Value::is_float() const noexcept { return is_float_type(type_); }

std::int64_t Value::as_int64() const {
  if (!is_integer()) fail_value(type_, "an integer");
  if (type_ == ValueType::uint64 && bits_ > static_cast<std::uint64_t>(INT64_MAX)) {
    detail::fail(ErrorCode::invalid_argument, "gguf::Value: the uint64 ", bits_,
                 " is beyond the int64 range");
  }
  return is_signed(type_) ? signed_value(type_, bits_) : static_cast<std::int64_t>(bits_);
}

std::uint64_t Value::as_uint64() const {
  if (!is_integer()) fail_value(type_, "an integer");
  if (is_signed(type_)) {
    const std::int64_t value = signed_value(type_, bits_);
    if (value < 0) {
      detail::fail(ErrorCode::invalid_argument, "gguf::Value: the ", to_string(type_), " ", value,
                   " is negative");
    }
    return static_cast<std::uint64_t>(value);
  }
  return bits_;
}

double Value::as_double() const {
  if (type_ == ValueType::float32) return detail::bits_float(static_cast<std::uint32_t>(bits_));
  if (type_ == ValueType::float64) {
    double value;
    std::memcpy(&value, &bits_, sizeof value);
    return value;
  }
  if (!is_integer()) fail_value(type_, "a number");
  constexpr std::uint64_t kExact = std::uint64_t{1} << 53;
  if (is_signed(type_)) {
    const std::int64_t value = signed_value(type_, bits_);
    if (value >= -static_cast<std::int64_t>(kExact) && value <= static_cast<std::int64_t>(kExact))
      return static_cast<double>(value);
  } else if (bits_ <= kExact) {
    return static_cast<double>(bits_);
  }
  detail::fail(
      ErrorCode::invalid_argument, "gguf::Value: the ", to_string(type_), " ",
      is_signed(type_) ? std::to_string(signed_value(type_, bits_)) : std::to_string(bits_),
      " is beyond 2^53, so a double cannot hold it exactly");
}

bool Value::as_bool() const {
  if (type_ != ValueType::boolean) fail_value(type_, "a bool");
  return bits_ != 0;
}

const std::string& Value::as_string() const {
  if (type_ != ValueType::string) fail_value(type_, "a string");
  return text_;
}

ValueType Value::element_type() const {
  if (type_ != ValueType::array) fail_value(type_, "an array");
  return element_type_;
}

std::int64_t Value::size() const {
  if (type_ != ValueType::array) fail_value(type_, "an array");
  if (element_type_ == ValueType::string) return static_cast<std::int64_t>(strings_.size());
  if (element_type_ == ValueType::array) return static_cast<std::int64_t>(arrays_.size());
  return static_cast<std::int64_t>(bytes_.size()) / value_size(element_type_);
}

const std::vector<unsigned char>& Value::bytes() const {
  if (type_ != ValueType::array || value_size(element_type_) == 0) {
    fail_value(type_ == ValueType::array ? element_type_ : type_, "an array of numbers");
  }
  return bytes_;
}

const std::vector<std::string>& Value::strings() const {
  if (type_ != ValueType::array || element_type_ != ValueType::string) {
    fail_value(type_ == ValueType::array ? element_type_ : type_, "an array of strings");
  }
  return strings_;
}

const std::vector<Value>& Value::arrays() const {
  if (type_ != ValueType::array || element_type_ != ValueType::array) {
    fail_value(type_ == ValueType::array ? element_type_ : type_, "an array of arrays");
  }
  return arrays_;
}

Value Value::element(std::int64_t i) const {
  const std::vector<unsigned char>& all = bytes();
  const std::int64_t size = value_size(element_type_);
  const std::int64_t count = static_cast<std::int64_t>(all.size()) / size;
  if (i < 0 || i >= count) {
    detail::fail_argument("gguf::Value::element", "i", "is ", i, "; the array has ", count,
                          " elements");
  }
  return from_bits(element_type_, load_little_endian(all.data() + i * size, size));
}

std::uint64_t Value::bits() const {
  if (value_size(type_) == 0) fail_value(type_, "a number");
  return bits_;
}

Value Value::from_bits(ValueType type, std::uint64_t bits) {
  const std::int64_t size = value_size(type);
  if (size == 0) fail_value(type, "a number");
  if ((size < 8 && bits >> (8 * size) != 0) || (type == ValueType::boolean && bits > 1)) {
    detail::fail_argument("gguf::Value::from_bits", "bits", "is ", bits, ", more than a ",
                          to_string(type), " holds");
  }
  Value value;
  value.type_ = type;
  value.bits_ = bits;
  return value;
}

Value Value::from_string(std::string text) {
  Value value;
  value.type_ = ValueType::string;
  value.text_ = std::move(text);
  return value;
}

Value Value::from_bytes(ValueType element_type, std::vector<unsigned char> bytes) {
  const std::int64_t size = value_size(element_type);
  if (size == 0) fail_value(element_type, "the element of an array of numbers");
  if (static_cast<std::int64_t>(bytes.size()) % size != 0) {
    detail::fail_argument("gguf::Value::from_bytes", "bytes", "has ", bytes.size(),
                          " bytes, not a multiple of the ", size, " of a ",
                          to_string(element_type));
  }
  Value value;
  value.type_ = ValueType::array;
  value.element_type_ = element_type;
  value.bytes_ = std::move(bytes);
  return value;
}

Value Value::from_strings(std::vector<std::string> strings) {
  Value value;
  value.type_ = ValueType::array;
  value.element_type_ = ValueType::string;
  value.strings_ = std::move(strings);
  return value;
}

Value Value::from_arrays(std::vector<Value> arrays) {
  for (const Value& a : arrays) {
    if (a.type() != ValueType::array) fail_value(a.type(), "the element of an array of arrays");
  }
  Value value;
  value.type_ = ValueType::array;
  value.element_type_ = ValueType::array;
  value.arrays_ = std::move(arrays);
  return value;
}

// --- File ------------------------------------------------------------------------------------

File::File(const std::string& path) {
  // The path is copied inside, so that a failed copy is reported like any other allocation.
  Header header = detail::reporting_out_of_memory("read_gguf", path, [&] {
    path_ = path;
    return HeaderReader(path_).read();
  });
  version_ = header.version;
  alignment_ = header.alignment;
  data_offset_ = header.data_offset;
  file_size_ = header.file_size;
  metadata_ = std::move(header.metadata);
  keys_ = std::move(header.keys);
  tensors_ = std::move(header.tensors);
  names_ = std::move(header.names);
}

bool File::contains(const std::string& key) const { return keys_.count(key) != 0; }

const Value& File::value(const std::string& key) const {
  const auto found = keys_.find(key);
  if (found == keys_.end()) fail_file(path_, "has no metadata key '", printable(key), "'");
  return metadata_[found->second].value;
}

namespace {

template <class... Parts>
[[noreturn]] void fail_key(const std::string& path, const std::string& key, Parts&&... parts) {
  fail_file(path, "key '", printable(key), "' ", std::forward<Parts>(parts)...);
}

// Element i of an integer array as int64 (a uint64 above INT64_MAX refused).
std::int64_t integer_element(const std::string& path, const std::string& key, const Value& array,
                             std::int64_t i) {
  const Value element = array.element(i);
  if (element.type() == ValueType::uint64 && element.bits() > std::uint64_t{INT64_MAX}) {
    fail_key(path, key, "element ", i, " is the uint64 ", element.bits(),
             ", beyond the int64 range");
  }
  return element.as_int64();
}

bool exact_in_double(const Value& v) {
  if (v.is_float()) return true;
  constexpr std::uint64_t kExact = std::uint64_t{1} << 53;
  if (v.type() == ValueType::int64) {
    const auto value = static_cast<std::int64_t>(v.bits());
    return value >= -static_cast<std::int64_t>(kExact) &&
           value <= static_cast<std::int64_t>(kExact);
  }
  return v.type() != ValueType::uint64 || v.bits() <= kExact;
}

}  // namespace

std::int64_t File::get_integer(const std::string& key) const {
  const Value& v = value(key);
  if (!v.is_integer()) fail_key(path_, key, "is ", describe(v), ", not an integer");
  if (v.type() == ValueType::uint64 && v.bits() > std::uint64_t{INT64_MAX}) {
    fail_key(path_, key, "is the uint64 ", v.bits(), ", beyond the int64 range");
  }
  return v.as_int64();
}

double File::get_number(const std::string& key) const {
  const Value& v = value(key);
  if (!v.is_integer() && !v.is_float()) fail_key(path_, key, "is ", describe(v), ", not a number");
  if (!exact_in_double(v)) {
    fail_key(
        path_, key, "is the ", to_string(v.type()), " ",
        v.type() == ValueType::uint64 ? std::to_string(v.bits()) : std::to_string(v.as_int64()),
        ", which a double does not hold exactly");
  }
  return v.as_double();
}

bool File::get_bool(const std::string& key) const {
  const Value& v = value(key);
  if (v.type() != ValueType::boolean) fail_key(path_, key, "is ", describe(v), ", not a bool");
  return v.as_bool();
}

const std::string& File::get_string(const std::string& key) const {
  const Value& v = value(key);
  if (v.type() != ValueType::string) fail_key(path_, key, "is ", describe(v), ", not a string");
  return v.as_string();
}

const std::vector<std::string>& File::get_strings(const std::string& key) const {
  const Value& v = value(key);
  if (v.type() != ValueType::array || v.element_type() != ValueType::string) {
    fail_key(path_, key, "is ", describe(v), ", not an array of strings");
  }
  return v.strings();
}

std::vector<std::int64_t> File::get_integers(const std::string& key) const {
  const Value& v = value(key);
  if (v.type() != ValueType::array || !is_integer_type(v.element_type())) {
    fail_key(path_, key, "is ", describe(v), ", not an array of integers");
  }
  return detail::reporting_out_of_memory("read_gguf", path_, [&] {
    std::vector<std::int64_t> values(static_cast<std::size_t>(v.size()));
    for (std::int64_t i = 0; i < v.size(); ++i) {
      values[static_cast<std::size_t>(i)] = integer_element(path_, key, v, i);
    }
    return values;
  });
}

std::vector<double> File::get_numbers(const std::string& key) const {
  const Value& v = value(key);
  if (v.type() != ValueType::array ||
      (!is_integer_type(v.element_type()) && !is_float_type(v.element_type()))) {
    fail_key(path_, key, "is ", describe(v), ", not an array of numbers");
  }
  return detail::reporting_out_of_memory("read_gguf", path_, [&] {
    std::vector<double> values(static_cast<std::size_t>(v.size()));
    for (std::int64_t i = 0; i < v.size(); ++i) {
      const Value element = v.element(i);
      if (!exact_in_double(element)) {
        fail_key(path_, key, "element ", i, " is the ", to_string(element.type()), " ",
                 element.type() == ValueType::uint64 ? std::to_string(element.bits())
                                                     : std::to_string(element.as_int64()),
                 ", which a double does not hold exactly");
      }
      values[static_cast<std::size_t>(i)] = element.as_double();
    }
    return values;
  });
}

const std::vector<std::string>& File::tokens() const {
  static const std::vector<std::string> kNone;
  return contains("tokenizer.ggml.tokens") ? get_strings("tokenizer.ggml.tokens") : kNone;
}

namespace {

// GPT-2's bytes_to_unicode, inverted: the printable bytes ('!' to '~', U+00A1 to U+00AC, U+00AE
// to U+00FF) stand for themselves, the other 68 for U+0100 + n, n counting them in byte order.
// The byte of code point c, or -1.
int gpt2_byte(std::uint32_t c) {
  static const std::vector<int> bytes = [] {
    std::vector<int> table(256 + 68, -1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      table[static_cast<std::size_t>(printable ? b : 256 + n++)] = b;
    }
    return table;
  }();
  return c < bytes.size() ? bytes[c] : -1;
}

// The code point at text[at] (UTF-8) and its length in bytes; a byte that does not start a valid
// sequence is taken alone, as code point 0xFFFFFFFF.
std::pair<std::uint32_t, std::size_t> code_point(const std::string& text, std::size_t at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  const std::size_t length = lead < 0x80         ? 1
                             : lead >> 5 == 0x6  ? 2
                             : lead >> 4 == 0xe  ? 3
                             : lead >> 3 == 0x1e ? 4
                                                 : 0;
  if (length == 0 || at + length > text.size()) return {0xffffffffu, 1};
  std::uint32_t c = length == 1 ? lead : lead & (0x7fu >> length);
  for (std::size_t k = 1; k < length; ++k) {
    const auto next = static_cast<unsigned char>(text[at + k]);
    if (next >> 6 != 0x2) return {0xffffffffu, 1};
    c = c << 6 | (next & 0x3fu);
  }
  return {c, length};
}

// A SentencePiece byte token "<0xNN>": its byte, or -1.
int byte_token(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  int value = 0;
  for (std::size_t k = 3; k < 5; ++k) {
    const char c = token[k];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace

std::string detokenize(const std::vector<std::string>& vocabulary, const std::string& model,
                       const std::vector<std::int64_t>& ids, const std::string& source) {
  return detail::reporting_out_of_memory("detokenize", source, [&] {
    std::string text;
    for (const std::int64_t id : ids) {
      if (id < 0 || id >= static_cast<std::int64_t>(vocabulary.size())) {
        detail::fail_argument("detokenize", "ids", "holds the id ", id, "; the vocabulary of '",
                              source, "' has ", vocabulary.size(), " tokens");
      }
      const std::string& token = vocabulary[static_cast<std::size_t>(id)];
      if (model == "gpt2") {
        for (std::size_t at = 0; at < token.size();) {
          const auto [c, length] = code_point(token, at);
          const int byte = gpt2_byte(c);
          if (byte >= 0) {
            text.push_back(static_cast<char>(byte));
          } else {
            text.append(token, at, length);  // not a byte's character: kept as stored
          }
          at += length;
        }
      } else if (model == "llama") {
        const int byte = byte_token(token);
        if (byte >= 0) {
          text.push_back(static_cast<char>(byte));
          continue;
        }
        for (std::size_t at = 0; at < token.size(); ++at) {
          if (token.compare(at, 3, "\xe2\x96\x81") == 0) {  // U+2581, the word boundary
            text.push_back(' ');
            at += 2;
          } else {
            text.push_back(token[at]);
          }
        }
      } else {
        text += token;
      }
    }
    return text;
  });
}

std::string File::detokenize(const std::vector<std::int64_t>& ids) const {
  const std::string model =
      contains("tokenizer.ggml.model") && value("tokenizer.ggml.model").type() == ValueType::string
          ? value("tokenizer.ggml.model").as_string()
          : std::string();
  return gguf::detokenize(tokens(), model, ids, path_);
}

bool File::has_tensor(const std::string& name) const { return names_.count(name) != 0; }

const TensorInfo& File::tensor(const std::string& name) const {
  const auto found = names_.find(name);
  if (found == names_.end()) fail_file(path_, "has no tensor '", printable(name), "'");
  return tensors_[found->second];
}

Tensor<float> File::read(const std::string& name) const {
  const TensorInfo& t = tensor(name);
  if (!dequantizes(t.type)) {
    fail_file(path_, "tensor '", printable(name), "' has type ", to_string(t.type),
              ", which emflow does not dequantize (it reads ", kDequantized, ")");
  }
  return detail::reporting_out_of_memory("read_gguf", path_, [&] {
    detail::expect_fits_in_memory("read_gguf",
                                  "tensor '" + printable(name) + "' of '" + path_ + "'", t.elements,
                                  static_cast<std::int64_t>(sizeof(float)));
    std::ifstream in(path_, std::ios::binary);
    if (!in) {
      fail_file(path_, "tensor '", printable(name), "' cannot be read: ", std::strerror(errno));
    }
    // The file may have changed since its header was read: check its size again.
    in.seekg(0, std::ios::end);
    if (static_cast<std::int64_t>(in.tellg()) != file_size_) {
      fail_file(path_, "tensor '", printable(name),
                "' cannot be read: the file changed size since it was opened");
    }
    Tensor<float> out(t.shape);
    const std::int64_t block = block_size(t.type);
    const std::int64_t bytes_per_block = block_bytes(t.type);
    const std::int64_t chunk = std::min(
        t.bytes, std::max<std::int64_t>(1, kChunkBytes / bytes_per_block) * bytes_per_block);
    std::vector<unsigned char> buffer(static_cast<std::size_t>(chunk));
    in.seekg(data_offset_ + t.offset);
    for (std::int64_t done = 0; done < t.bytes;) {
      const std::int64_t n = std::min(chunk, t.bytes - done);
      in.read(reinterpret_cast<char*>(buffer.data()), static_cast<std::streamsize>(n));
      if (in.gcount() != static_cast<std::streamsize>(n)) {
        fail_file(path_, "tensor '", printable(name), "' could not be read in full");
      }
      dequantize_blocks(t.type, buffer.data(), n / bytes_per_block,
                        out.data() + done / bytes_per_block * block);
      done += n;
    }
    return out;
  });
}

}  // namespace emflow::gguf

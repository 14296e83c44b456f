// NumPy .npy files (format versions 1.0, 2.0 and 3.0), read strictly and written atomically.
//
// Layout: the magic "\x93NUMPY", a major and a minor version byte, the header length (uint16
// little endian for 1.0, uint32 for 2.0 and 3.0), then the header: a Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// padded with spaces and ended by '\n', then the payload in C order. The parser accepts exactly
// this grammar (the three keys once each, in any order); anything else is refused, so a file
// that is not what it claims never reaches the numbers.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/io.hpp"
#include "npy_writer.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "emflow's .npy reader copies payloads as they are and assumes a little-endian host"
#endif

namespace emflow {
namespace {

// The element types of .npy files: each with its name and its descr.
struct DtypeInfo {
  Dtype dtype;
  const char* name;
  const char* descr;
};
constexpr DtypeInfo kDtypes[] = {{Dtype::float32, "float32", "<f4"},
                                 {Dtype::float64, "float64", "<f8"},
                                 {Dtype::int64, "int64", "<i8"},
                                 {Dtype::int32, "int32", "<i4"},
                                 {Dtype::float16, "float16", "<f2"}};

const DtypeInfo* info_of(Dtype dtype) noexcept {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == dtype) return &info;
  }
  return nullptr;
}

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicSize = 6;
// numpy.load refuses headers above 10000 bytes by default (max_header_size) for the same
// reason: a rank <= 4 header needs well under 200 bytes, and a huge one is a malformed file.
constexpr std::uint32_t kMaxHeaderSize = 10000;
constexpr std::int64_t kMaxRank = 4;

const char* descr_of(Dtype dtype) { return info_of(dtype)->descr; }

template <class... Parts>
[[noreturn]] void fail_file(const char* op, const std::string& path, Parts&&... parts) {
  detail::fail(ErrorCode::io, op, ": '", path, "': ", std::forward<Parts>(parts)...);
}

// Recursive-descent parser for the header dict; `fail` names the file and the offending text.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  NpyHeader parse() {
    bool have_descr = false, have_order = false, have_shape = false;
    NpyHeader header;
    skip_space();
    expect('{');
    skip_space();
    while (peek() != '}') {
      const std::string key = parse_string();
      skip_space();
      expect(':');
      skip_space();
      if (key == "descr") {
        if (have_descr) bad("repeats the key 'descr'");
        have_descr = true;
        header.dtype = parse_descr(parse_string());
      } else if (key == "fortran_order") {
        if (have_order) bad("repeats the key 'fortran_order'");
        have_order = true;
        if (parse_bool()) {
          fail_file("read_npy", path_,
                    "is stored in Fortran (column-major) order; only C order is supported "
                    "(save with numpy.ascontiguousarray)");
        }
      } else if (key == "shape") {
        if (have_shape) bad("repeats the key 'shape'");
        have_shape = true;
        header.shape = parse_shape();
      } else {
        bad("has an unexpected key '", key, "' (expected descr, fortran_order, shape)");
      }
      after_item('}', "");
    }
    ++pos_;  // '}'
    if (!have_descr) bad("lacks the key 'descr'");
    if (!have_order) bad("lacks the key 'fortran_order'");
    if (!have_shape) bad("lacks the key 'shape'");
    // Padding: spaces only, then exactly one final newline.
    while (pos_ + 1 < text_.size() && text_[pos_] == ' ') ++pos_;
    if (pos_ + 1 != text_.size() || text_[pos_] != '\n') {
      bad("must end with spaces and a newline after the dict");
    }
    return header;
  }

 private:
  template <class... Parts>
  [[noreturn]] void bad(Parts&&... parts) {
    fail_file("read_npy", path_, "malformed header: ", std::forward<Parts>(parts)...);
  }

  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }

  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t')) ++pos_;
  }

  // After an item of a list that `close` ends: a comma and spaces, or (left for the caller)
  // `close` itself.
  void after_item(char close, const char* where) {
    skip_space();
    if (peek() == ',') {
      ++pos_;
      skip_space();
    } else if (peek() != close) {
      bad("expects ',' or '", close, "'", where, " at byte ", pos_);
    }
  }

  void expect(char c) {
    if (peek() != c) bad("expects '", c, "' at byte ", pos_);
    ++pos_;
  }

  std::string parse_string() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') bad("expects a quoted string at byte ", pos_);
    ++pos_;
    const std::size_t end = text_.find(quote, pos_);
    if (end == std::string::npos) bad("has an unterminated string");
    std::string value = text_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return value;
  }

  bool parse_bool() {
    if (text_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (text_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    bad("expects True or False for 'fortran_order'");
  }

  Dtype parse_descr(const std::string& descr) {
    for (const DtypeInfo& info : kDtypes) {
      if (descr == info.descr) return info.dtype;
    }
    if (!descr.empty() && descr[0] == '>') {
      fail_file("read_npy", path_, "is big endian (dtype '", descr,
                "'); only little-endian '<f2', '<f4', '<f8', '<i4', '<i8' are supported");
    }
    fail_file("read_npy", path_, "has unsupported dtype '", descr,
              "'; expected '<f2' (float16), '<f4' (float32), '<f8' (float64), '<i4' or '<i8'");
  }

  Shape parse_shape() {
    expect('(');
    Shape shape;
    skip_space();
    while (peek() != ')') {
      if (peek() < '0' || peek() > '9') bad("expects a non-negative integer in 'shape'");
      std::int64_t extent = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = peek() - '0';
        if (extent > (std::numeric_limits<std::int64_t>::max() - digit) / 10) {
          bad("has a shape extent that does not fit in 64 bits");
        }
        extent = extent * 10 + digit;
        ++pos_;
      }
      shape.push_back(extent);
      after_item(')', " in 'shape'");
    }
    ++pos_;  // ')'
    return shape;
  }

  const std::string& text_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

std::uint32_t read_le(const unsigned char* bytes, int count) {
  std::uint32_t value = 0;
  for (int i = count - 1; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// Opens `path` and parses its header; leaves `file` positioned at the payload.
NpyHeader read_header(std::ifstream& file, const std::string& path, std::int64_t* file_size) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    fail_file("read_npy", path, "cannot open: ", std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) fail_file("read_npy", path, "is not a regular file");
  file.open(path, std::ios::binary);
  if (!file) fail_file("read_npy", path, "cannot open: ", std::strerror(errno));
  *file_size = static_cast<std::int64_t>(info.st_size);

  unsigned char prefix[12] = {};
  file.read(reinterpret_cast<char*>(prefix), 8);
  if (file.gcount() != 8 || std::memcmp(prefix, kMagic, kMagicSize) != 0) {
    fail_file("read_npy", path, "is not a .npy file (no \\x93NUMPY magic)");
  }
  const int major = prefix[6], minor = prefix[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    fail_file("read_npy", path, "has unsupported .npy format version ", major, ".", minor,
              " (supported: 1.0, 2.0, 3.0)");
  }
  // Version 1.0 stores the header length in 2 bytes; 2.0 and 3.0 (UTF-8 header) in 4.
  const int length_bytes = major == 1 ? 2 : 4;
  file.read(reinterpret_cast<char*>(prefix) + 8, length_bytes);
  if (file.gcount() != length_bytes) {
    fail_file("read_npy", path, "is truncated inside its header length field");
  }
  const std::int64_t prefix_size = 8 + length_bytes;
  const std::uint32_t header_size = read_le(prefix + 8, length_bytes);
  if (header_size > kMaxHeaderSize) {
    fail_file("read_npy", path, "declares a header of ", header_size,
              " bytes, more than the limit of ", kMaxHeaderSize);
  }
  if (header_size == 0) fail_file("read_npy", path, "has an empty header");
  if (*file_size < prefix_size + header_size) {
    fail_file("read_npy", path, "is truncated: its header declares ", header_size,
              " bytes but the file ends after ", *file_size - prefix_size);
  }
  std::string text(header_size, '\0');
  file.read(&text[0], header_size);
  if (static_cast<std::uint32_t>(file.gcount()) != header_size) {
    fail_file("read_npy", path, "is truncated inside its header");
  }

  NpyHeader header = HeaderParser(text, path).parse();
  const auto rank = static_cast<std::int64_t>(header.shape.size());
  if (rank < 1 || rank > kMaxRank) {
    fail_file("read_npy", path, "has rank ", rank, " (shape ", to_string(header.shape),
              "); expected rank 1 to ", kMaxRank);
  }
  header.data_offset = prefix_size + header_size;

  std::int64_t count = 1, payload = 0;
  for (std::int64_t extent : header.shape) {
    if (__builtin_mul_overflow(count, extent, &count)) {
      fail_file("read_npy", path, "has shape ", to_string(header.shape),
                " whose element count overflows 64 bits");
    }
  }
  if (__builtin_mul_overflow(count, item_size(header.dtype), &payload)) {
    fail_file("read_npy", path, "has shape ", to_string(header.shape),
              " whose byte size overflows 64 bits");
  }
  const std::int64_t found = *file_size - header.data_offset;
  if (found < payload) {
    fail_file("read_npy", path, "is truncated: shape ", to_string(header.shape), " of ",
              to_string(header.dtype), " needs ", payload, " payload bytes, found ", found);
  }
  if (found > payload) {
    fail_file("read_npy", path, "has ", found - payload, " bytes after the payload of shape ",
              to_string(header.shape), " (", payload, " bytes of ", to_string(header.dtype), ")");
  }
  return header;
}

template <class Stored, class T>
void convert_payload(std::ifstream& file, const std::string& path, std::int64_t count, T* out) {
  // Read in blocks so a float file read as double needs no second full-size buffer.
  constexpr std::int64_t kBlock = 1 << 16;
  std::vector<Stored> block(static_cast<std::size_t>(std::min(count, kBlock)));
  for (std::int64_t done = 0; done < count;) {
    const std::int64_t n = std::min(kBlock, count - done);
    const auto bytes = static_cast<std::streamsize>(n * static_cast<std::int64_t>(sizeof(Stored)));
    file.read(reinterpret_cast<char*>(block.data()), bytes);
    if (file.gcount() != bytes) fail_file("read_npy", path, "could not read its payload");
    for (std::int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<Stored, float16>) {
        out[done + i] = static_cast<T>(to_float(block[i]));  // exact
      } else {
        out[done + i] = static_cast<T>(block[i]);
      }
    }
    done += n;
  }
}

template <class T>
constexpr Dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return Dtype::float32;
  if constexpr (std::is_same_v<T, double>) return Dtype::float64;
  if constexpr (std::is_same_v<T, float16>) return Dtype::float16;
  return Dtype::int64;
}

template <class T>
Tensor<T> read_npy_payload(const std::string& path) {
  std::ifstream file;
  std::int64_t size = 0;
  const NpyHeader header = read_header(file, path, &size);
  constexpr bool wants_float = !std::is_same_v<T, std::int64_t>;
  const bool holds_float = header.dtype == Dtype::float16 || header.dtype == Dtype::float32 ||
                           header.dtype == Dtype::float64;
  if (wants_float != holds_float) {
    fail_file("read_npy", path, "holds ", to_string(header.dtype), " data; expected ",
              wants_float ? "float32 or float64 (or float16)" : "int32 or int64");
  }
  // The payload size was matched to the file size, so this allocation is bounded by the file;
  // a sparse file can still declare more than the memory holds, so that is refused first.
  detail::expect_fits_in_memory("read_npy", "the array in '" + path + "'",
                                detail::checked_product("read_npy", "shape", header.shape),
                                static_cast<std::int64_t>(sizeof(T)));
  Tensor<T> array(header.shape);
  const std::int64_t count = array.size();
  switch (header.dtype) {
    case Dtype::float32:
      convert_payload<float>(file, path, count, array.data());
      break;
    case Dtype::float64:
      convert_payload<double>(file, path, count, array.data());
      break;
    case Dtype::int64:
      convert_payload<std::int64_t>(file, path, count, array.data());
      break;
    case Dtype::int32:
      convert_payload<std::int32_t>(file, path, count, array.data());
      break;
    case Dtype::float16:
      convert_payload<float16>(file, path, count, array.data());
      break;
    default:  // not a NumPy dtype of kDtypes: read_header never gives it
      fail_file("read_npy", path, "holds ", to_string(header.dtype),
                " data, which emflow's .npy files cannot");
  }
  return array;
}

}  // namespace

NpyHeader read_npy_header(const std::string& path) {
  return detail::reporting_out_of_memory("read_npy", path, [&] {
    std::ifstream file;
    std::int64_t size = 0;
    return read_header(file, path, &size);
  });
}

template <class T>
Tensor<T> read_npy(const std::string& path) {
  return detail::reporting_out_of_memory("read_npy", path,
                                         [&] { return read_npy_payload<T>(path); });
}

namespace detail {

template <class T>
void write_npy_to(StagedFile& file, const Tensor<T>& array) {
  const std::int64_t rank = array.rank();
  if (rank < 1 || rank > kMaxRank) {
    fail_argument("write_npy", "array", "must have rank 1 to ", kMaxRank, ", got ", rank,
                  " (writing '", file.target(), "')");
  }
  std::string dict =
      concat("{'descr': '", descr_of(dtype_of<T>()),
             "', 'fortran_order': False, 'shape': ", to_string(array.shape()), ", }");
  // Pad so the payload starts on a 64-byte boundary, as numpy writes it (the total counts the
  // 10-byte prefix of version 1.0 and the final newline).
  const std::size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string header(kMagic, kMagicSize);
  header.push_back('\x01');
  header.push_back('\x00');
  header.push_back(static_cast<char>(dict.size() & 0xff));
  header.push_back(static_cast<char>(dict.size() >> 8));
  header += dict;
  file.write(header.data(), header.size());
  file.write(reinterpret_cast<const char*>(array.data()),
             static_cast<std::size_t>(array.size()) * sizeof(T));
}

template void write_npy_to<float>(StagedFile&, const Tensor<float>&);
template void write_npy_to<double>(StagedFile&, const Tensor<double>&);
template void write_npy_to<std::int64_t>(StagedFile&, const Tensor<std::int64_t>&);
template void write_npy_to<float16>(StagedFile&, const Tensor<float16>&);

}  // namespace detail

template <class T>
void write_npy(const std::string& path, const Tensor<T>& array) {
  // Check the rank before creating anything on disk.
  if (array.rank() < 1 || array.rank() > kMaxRank) {
    detail::fail_argument("write_npy", "array", "must have rank 1 to ", kMaxRank, ", got ",
                          array.rank(), " (writing '", path, "')");
  }
  detail::reporting_out_of_memory("write_npy", path, [&] {
    detail::StagedFile file(path, "write_npy");
    detail::write_npy_to(file, array);
    file.commit();
  });
}

template Tensor<float> read_npy<float>(const std::string&);
template Tensor<double> read_npy<double>(const std::string&);
template Tensor<std::int64_t> read_npy<std::int64_t>(const std::string&);
template void write_npy<float>(const std::string&, const Tensor<float>&);
template void write_npy<double>(const std::string&, const Tensor<double>&);
template void write_npy<std::int64_t>(const std::string&, const Tensor<std::int64_t>&);
template void write_npy<float16>(const std::string&, const Tensor<float16>&);

}  // namespace emflow

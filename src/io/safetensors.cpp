// safetensors files, read strictly (the format and every check: emflow/safetensors.hpp). The
// JSON header is parsed by nlohmann-json; what it accepts is then checked entry by entry, and
// the byte ranges together, before any payload is touched.
#include "emflow/safetensors.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/precision.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "emflow's safetensors reader reinterprets payloads as they are: little-endian hosts only"
#endif

namespace emflow {
namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB for the same reason: a header
// that large is a malformed or hostile file, not a checkpoint.
constexpr std::uint64_t kMaxHeaderSize = 100000000;

template <class... Parts>
[[noreturn]] void fail_file(const std::string& path, Parts&&... parts) {
  detail::fail(ErrorCode::io, "read_safetensors: '", path, "': ", std::forward<Parts>(parts)...);
}

template <class... Parts>
[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, Parts&&... parts) {
  fail_file(path, "tensor '", name, "' ", std::forward<Parts>(parts)...);
}

struct DtypeName {
  Dtype dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {Dtype::float16, "F16"}, {Dtype::bfloat16, "BF16"},       {Dtype::float32, "F32"},
    {Dtype::float64, "F64"}, {Dtype::boolean, "BOOL"},        {Dtype::uint8, "U8"},
    {Dtype::int8, "I8"},     {Dtype::int16, "I16"},           {Dtype::uint16, "U16"},
    {Dtype::int32, "I32"},   {Dtype::uint32, "U32"},          {Dtype::int64, "I64"},
    {Dtype::uint64, "U64"},  {Dtype::float8_e4m3, "F8_E4M3"}, {Dtype::float8_e5m2, "F8_E5M2"}};

bool is_readable(Dtype dtype) {
  return dtype == Dtype::float16 || dtype == Dtype::bfloat16 || dtype == Dtype::float32 ||
         dtype == Dtype::float64;
}

Dtype parse_dtype(const std::string& path, const std::string& name, const json& value) {
  if (!value.is_string()) fail_tensor(path, name, "has a 'dtype' that is not a string");
  const std::string text = value.get<std::string>();
  for (const DtypeName& d : kDtypes) {
    if (text == d.name) return d.dtype;
  }
  fail_tensor(path, name, "has an unknown dtype '", text, "'");
}

// A non-negative integer that fits int64 (JSON numbers like 3.0 or -1 are refused).
std::int64_t parse_count(const std::string& path, const std::string& name, const char* field,
                         const json& value) {
  if (!value.is_number_unsigned() ||
      value.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    fail_tensor(path, name, "has a '", field,
                "' entry that is not a non-negative integer: ", value.dump());
  }
  return static_cast<std::int64_t>(value.get<std::uint64_t>());
}

TensorEntry parse_entry(const std::string& path, const std::string& name, const json& value,
                        std::int64_t data_size) {
  if (!value.is_object()) fail_tensor(path, name, "is not an object");
  for (const auto& item : value.items()) {
    if (item.key() != "dtype" && item.key() != "shape" && item.key() != "data_offsets") {
      fail_tensor(path, name, "has an unexpected key '", item.key(),
                  "' (expected dtype, shape, data_offsets)");
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) fail_tensor(path, name, "lacks the key '", key, "'");
  }
  TensorEntry entry;
  entry.name = name;
  entry.dtype = parse_dtype(path, name, value["dtype"]);
  const json& shape = value["shape"];
  if (!shape.is_array()) fail_tensor(path, name, "has a 'shape' that is not an array");
  std::int64_t count = 1;
  for (const json& extent : shape) {
    const std::int64_t n = parse_count(path, name, "shape", extent);
    entry.shape.push_back(n);
    // Bounded by the data buffer, so the product never needs more than 64 bits.
    if (n != 0 && count > data_size / n)
      count = data_size + 1;
    else
      count *= n;
  }
  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    fail_tensor(path, name, "has 'data_offsets' that are not a pair [begin, end]");
  }
  entry.begin = parse_count(path, name, "data_offsets", offsets[0]);
  entry.end = parse_count(path, name, "data_offsets", offsets[1]);
  if (entry.end < entry.begin) {
    fail_tensor(path, name, "has data_offsets [", entry.begin, ", ", entry.end,
                "] that end before they begin");
  }
  if (entry.end > data_size) {
    fail_tensor(path, name, "has data_offsets [", entry.begin, ", ", entry.end,
                "] beyond the data buffer of ", data_size, " bytes");
  }
  const std::int64_t expected = count > data_size ? -1 : count * item_size(entry.dtype);
  if (expected != entry.end - entry.begin) {
    fail_tensor(path, name, "of shape ", to_string(entry.shape), " and dtype ",
                safetensors_name(entry.dtype), " needs ",
                expected < 0 ? std::string("more than the whole data buffer")
                             : std::to_string(expected) + " bytes",
                ", but its data_offsets [", entry.begin, ", ", entry.end, "] hold ",
                entry.end - entry.begin);
  }
  return entry;
}

// Parses `text`, refusing duplicate keys in any object (nlohmann-json would keep the last).
json parse_json(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const json::parser_callback_t callback = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!keys.back().insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, callback);
  } catch (const json::exception& e) {
    fail_file(path, "malformed JSON header: ", e.what());
  }
  if (!duplicate.empty()) fail_file(path, "names '", duplicate, "' twice in its header");
  return header;
}

SafetensorsHeader read_header(std::ifstream& file, const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) fail_file(path, "cannot open: ", std::strerror(errno));
  if (S_ISDIR(info.st_mode)) fail_file(path, "is a folder, not a file");
  file.open(path, std::ios::binary);
  if (!file) fail_file(path, "cannot open: ", std::strerror(errno));
  file.seekg(0, std::ios::end);
  const auto file_size = static_cast<std::int64_t>(file.tellg());
  file.seekg(0);
  if (file_size < 8) {
    fail_file(path, "has ", file_size, " bytes, fewer than the 8 of the header length");
  }
  unsigned char prefix[8];
  file.read(reinterpret_cast<char*>(prefix), 8);
  if (file.gcount() != 8) fail_file(path, "could not read its header length");
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | prefix[i];
  if (length > kMaxHeaderSize) {
    fail_file(path, "declares a header of ", length, " bytes, more than the limit of ",
              kMaxHeaderSize);
  }
  if (static_cast<std::int64_t>(length) > file_size - 8) {
    fail_file(path, "declares a header of ", length, " bytes but has only ", file_size - 8,
              " after the header length");
  }
  if (length < 2) fail_file(path, "has a header of ", length, " bytes, too short for JSON");
  std::string text(static_cast<std::size_t>(length), '\0');
  file.read(text.data(), static_cast<std::streamsize>(length));
  if (file.gcount() != static_cast<std::streamsize>(length)) {
    fail_file(path, "could not read its header");
  }
  if (text[0] != '{') fail_file(path, "has a header that does not start with '{'");

  SafetensorsHeader header;
  header.data_offset = 8 + static_cast<std::int64_t>(length);
  header.data_size = file_size - header.data_offset;
  const json parsed = parse_json(path, text);
  if (!parsed.is_object()) fail_file(path, "has a header that is not a JSON object");
  for (const auto& item : parsed.items()) {
    if (item.key() == "__metadata__") {
      if (!item.value().is_object()) fail_file(path, "has a '__metadata__' that is not an object");
      for (const auto& meta : item.value().items()) {
        if (!meta.value().is_string()) {
          fail_file(path, "has a '__metadata__' entry '", meta.key(), "' that is not a string");
        }
        header.metadata[meta.key()] = meta.value().get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parse_entry(path, item.key(), item.value(), header.data_size));
  }
  // The ranges must tile the data buffer: sorted by begin, each starts where the last ended.
  std::stable_sort(header.tensors.begin(), header.tensors.end(),
                   [](const TensorEntry& a, const TensorEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  std::int64_t at = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& t : header.tensors) {
    if (t.begin < at) {
      fail_tensor(path, t.name, "has data_offsets [", t.begin, ", ", t.end,
                  "] that overlap those of '", previous->name, "' [", previous->begin, ", ",
                  previous->end, "]");
    }
    if (t.begin > at) {
      fail_tensor(path, t.name, "begins at byte ", t.begin, " of the data buffer, leaving ",
                  t.begin - at, " bytes unused after ",
                  previous ? "'" + previous->name + "'" : std::string("its start"));
    }
    at = t.end;
    previous = &t;
  }
  if (at != header.data_size) {
    fail_file(path, "has ", header.data_size - at, " bytes after its last tensor",
              previous ? " '" + previous->name + "'" : std::string(),
              " that no tensor covers (data buffer ", header.data_size, " bytes)");
  }
  return header;
}

template <class T>
void convert(Dtype dtype, const unsigned char* bytes, std::int64_t count, T* out) {
  const std::int64_t size = item_size(dtype);
  for (std::int64_t i = 0; i < count; ++i) {
    const unsigned char* p = bytes + i * size;
    switch (dtype) {
      case Dtype::float16:
      case Dtype::bfloat16: {
        const auto bits = static_cast<std::uint16_t>(p[0] | p[1] << 8);
        out[i] = static_cast<T>(dtype == Dtype::float16 ? to_float(float16{bits})
                                                        : to_float(bfloat16{bits}));
        break;
      }
      case Dtype::float32: {
        float v;
        std::memcpy(&v, p, 4);
        out[i] = static_cast<T>(v);
        break;
      }
      case Dtype::float64: {
        double v;
        std::memcpy(&v, p, 8);
        out[i] = static_cast<T>(v);
        break;
      }
      default:
        break;  // refused by read() before
    }
  }
}

}  // namespace

const char* safetensors_name(Dtype dtype) noexcept {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "";
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  return detail::reporting_out_of_memory("read_safetensors", path, [&] {
    std::ifstream file;
    return read_header(file, path);
  });
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  header_ = read_safetensors_header(path_);
  for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const TensorEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto found = index_.find(name);
  if (found == index_.end()) fail_tensor(path_, name, "is not in the file");
  return header_.tensors[found->second];
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(header_.tensors.size());
  for (const TensorEntry& t : header_.tensors) names.push_back(t.name);
  return names;
}

template <class T>
Tensor<T> SafetensorsFile::read(const std::string& name) const {
  static_assert(std::is_floating_point_v<T>, "read as float or double");
  const TensorEntry& t = entry(name);
  if (!is_readable(t.dtype)) {
    fail_tensor(path_, name, "has dtype ", safetensors_name(t.dtype),
                "; only F16, BF16, F32 and F64 tensors are read as floating point");
  }
  return detail::reporting_out_of_memory("read_safetensors", path_, [&] {
    const std::int64_t bytes = t.end - t.begin;
    const std::int64_t count = bytes / item_size(t.dtype);
    detail::expect_fits_in_memory("read_safetensors", "tensor '" + name + "' of '" + path_ + "'",
                                  count, static_cast<std::int64_t>(sizeof(T)));
    std::ifstream file(path_, std::ios::binary);
    if (!file) fail_tensor(path_, name, "cannot be read: ", std::strerror(errno));
    // The file may have changed since the header was read: check its size again.
    file.seekg(0, std::ios::end);
    if (static_cast<std::int64_t>(file.tellg()) != header_.data_offset + header_.data_size) {
      fail_tensor(path_, name, "cannot be read: the file changed size since it was opened");
    }
    std::vector<unsigned char> raw(static_cast<std::size_t>(bytes));
    file.seekg(header_.data_offset + t.begin);
    file.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(bytes));
    if (file.gcount() != static_cast<std::streamsize>(bytes)) {
      fail_tensor(path_, name, "could not be read in full");
    }
    Tensor<T> out(t.shape);
    convert(t.dtype, raw.data(), count, out.data());
    return out;
  });
}

template Tensor<float> SafetensorsFile::read<float>(const std::string&) const;
template Tensor<double> SafetensorsFile::read<double>(const std::string&) const;

}  // namespace emflow

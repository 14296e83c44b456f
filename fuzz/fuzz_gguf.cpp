// libFuzzer target: the GGUF reader on arbitrary bytes.
//
// Each input is written to a file in /dev/shm and opened with gguf::File. Every outcome must be
// either a file whose every promise holds or an emflow::Error of kind io (malformed) or
// out_of_memory. The promises checked: each tensor's element count is the product of its shape,
// its byte count its blocks' bytes, its offset aligned and its data inside the data section,
// no two tensors' data overlap; every metadata value answers its accessors consistently, the
// typed getters refuse only with io, and every id of the vocabulary detokenizes; each tensor of a
// dequantized type reads back with its shape and the bits gguf::dequantize gives for its bytes
// taken straight from the input; any other type is refused naming it. Anything else, and any
// sanitizer report, is a crash.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "emflow/error.hpp"
#include "emflow/gguf.hpp"
#include "fuzz_common.hpp"

const char* const fuzz::kTarget = "fuzz_gguf";

namespace {

namespace gguf = emflow::gguf;
using fuzz::defect;
using fuzz::expect_file_error;

// Calls `call`, which may succeed or refuse only with io; returns whether it succeeded.
template <class Call>
bool io_or_success(Call&& call) {
  try {
    call();
    return true;
  } catch (const emflow::Error& e) {
    if (e.code() != emflow::ErrorCode::io) {
      defect("a getter refused with another kind than io", e.what());
    }
    return false;
  }
}

void check_value(const gguf::Value& value, int depth) {
  if (depth > 64) defect("arrays nested deeper than the limit", "");
  if (value.type() != gguf::ValueType::array) {
    if (gguf::value_size(value.type()) == 0 && value.type() != gguf::ValueType::string) {
      defect("a scalar of an unknown type", gguf::to_string(value.type()));
    }
    if (value.type() == gguf::ValueType::boolean && value.bits() > 1) {
      defect("a bool that is not 0 or 1", std::to_string(value.bits()));
    }
    return;
  }
  const gguf::ValueType element = value.element_type();
  if (element == gguf::ValueType::string) {
    if (static_cast<std::int64_t>(value.strings().size()) != value.size()) {
      defect("an array of strings whose size differs", "");
    }
  } else if (element == gguf::ValueType::array) {
    if (static_cast<std::int64_t>(value.arrays().size()) != value.size()) {
      defect("an array of arrays whose size differs", "");
    }
    for (const gguf::Value& a : value.arrays()) check_value(a, depth + 1);
  } else {
    const std::int64_t size = gguf::value_size(element);
    if (size == 0) defect("an array of an unknown type", gguf::to_string(element));
    if (static_cast<std::int64_t>(value.bytes().size()) != value.size() * size) {
      defect("an array whose bytes do not match its size", "");
    }
    for (std::int64_t i = 0; i < value.size(); ++i) check_value(value.element(i), depth + 1);
  }
}

void check_metadata(const gguf::File& file) {
  for (const gguf::KeyValue& entry : file.metadata()) {
    if (entry.key.empty()) defect("an empty key", "");
    if (&file.value(entry.key) != &entry.value) defect("a key found at another entry", entry.key);
    check_value(entry.value, 0);
    const std::string& key = entry.key;
    io_or_success([&] { file.get_integer(key); });
    io_or_success([&] { file.get_number(key); });
    io_or_success([&] { file.get_bool(key); });
    io_or_success([&] { file.get_string(key); });
    io_or_success([&] { file.get_strings(key); });
    io_or_success([&] { file.get_integers(key); });
    io_or_success([&] { file.get_numbers(key); });
  }
  // Every id of the vocabulary has a text (whatever bytes its tokens hold).
  io_or_success([&] {
    std::vector<std::int64_t> ids(file.tokens().size());
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i);
    file.detokenize(ids);
  });
  if (file.alignment() <= 0 || (file.alignment() & (file.alignment() - 1)) != 0) {
    defect("an alignment that is not a power of two", std::to_string(file.alignment()));
  }
}

void check_tensors(const gguf::File& file, const std::uint8_t* data, std::size_t size) {
  const std::int64_t data_size =
      std::max<std::int64_t>(0, static_cast<std::int64_t>(size) - file.data_offset());
  if (file.data_offset() % file.alignment() != 0) defect("a misaligned data section", "");
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (const gguf::TensorInfo& t : file.tensors()) {
    // The reader refuses shapes whose non-zero extents multiply past 64 bits (also beside a 0),
    // so that every product of the extents fits.
    bool empty = false;
    std::int64_t product = 1;
    for (const std::int64_t e : t.shape) {
      if (e < 0) defect("a negative extent", t.name);
      if (e == 0) {
        empty = true;
      } else if (__builtin_mul_overflow(product, e, &product)) {
        defect("a shape whose extents multiply past 64 bits", t.name);
      }
    }
    const std::int64_t elements = empty ? 0 : product;
    if (elements != t.elements) defect("an element count that is not the shape's", t.name);
    const std::int64_t block = gguf::block_size(t.type);
    if (block == 0) defect("a tensor of an unknown type", t.name);
    if (t.bytes != t.elements / block * gguf::block_bytes(t.type)) {
      defect("a byte count that is not the blocks'", t.name);
    }
    if (t.offset % file.alignment() != 0) defect("a misaligned offset", t.name);
    if (t.offset < 0 || t.offset > data_size || t.bytes > data_size - t.offset) {
      defect("data outside the data section", t.name);
    }
    if (t.bytes > 0) ranges.emplace_back(t.offset, t.offset + t.bytes);

    emflow::Tensor<float> tensor;
    try {
      tensor = file.read(t.name);
    } catch (const emflow::Error& e) {
      expect_file_error(e);
      if (gguf::dequantizes(t.type) && e.code() == emflow::ErrorCode::io) {
        defect("a tensor of a dequantized type refused", e.what());
      }
      if (!gguf::dequantizes(t.type) &&
          std::string(e.what()).find(gguf::to_string(t.type)) == std::string::npos) {
        defect("a refusal that does not name the type", e.what());
      }
      continue;
    }
    if (!gguf::dequantizes(t.type)) defect("a tensor of another type read", t.name);
    if (tensor.shape() != t.shape) defect("a tensor of another shape than its info's", t.name);
    std::vector<float> expected(static_cast<std::size_t>(t.elements));
    gguf::dequantize(t.type, data + file.data_offset() + t.offset, t.elements, expected.data());
    if (t.elements > 0 &&
        std::memcmp(expected.data(), tensor.data(), expected.size() * sizeof(float)) != 0) {
      defect("a tensor whose bits differ from dequantize() of its bytes", t.name);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) defect("tensors whose data overlap", "");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = fuzz::scratch_path("input.gguf");
  fuzz::write_input(path, data, size);

  try {
    const gguf::File file(path);
    if (file.version() != 2 && file.version() != 3) defect("a version other than 2 or 3", "");
    if (file.file_size() != static_cast<std::int64_t>(size)) defect("a wrong file size", "");
    check_metadata(file);
    check_tensors(file, data, size);
  } catch (const emflow::Error& e) {
    expect_file_error(e);
  }
  std::remove(path.c_str());
  return 0;
}

// safetensors files: every supported dtype read exactly, the metadata kept, and every malformed
// file refused with an io error that names the file and, where there is one, the tensor.
#include "emflow/safetensors.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/files.hpp"
#include "emflow/error.hpp"
#include "emflow/precision.hpp"

namespace {

using emflow::ErrorCode;
using emflow::SafetensorsFile;
using emflow::testing::error_of;

class Safetensors : public emflow::testing::FileFolder {
 protected:
  Safetensors() : FileFolder("emflow_safetensors") {}

  // Writes the file `name` from a header text and a data buffer; returns its path.
  std::string file(const std::string& name, const std::string& header, const std::string& data) {
    std::string bytes;
    const std::uint64_t length = header.size();
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(length >> (8 * i)));
    put(name, bytes + header + data);
    return path(name);
  }

  // An io error naming the file and containing each of `parts`.
  void expect_refused(const std::string& path, const std::vector<std::string>& parts) {
    const std::string message = error_of(ErrorCode::io, [&] {
      const SafetensorsFile f(path);
      for (const auto& name : f.names()) f.read<double>(name);
    });
    EXPECT_NE(message.find(path), std::string::npos) << message;
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << message;
  }
};

template <class T>
std::string raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  std::int64_t begin, std::int64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// The reader widens F16 and BF16 with precision.hpp's conversions, the one 16-bit conversion of
// the library (tested against the compiler's binary16 in tests/core/precision_test.cpp): every bit
// pattern read from a file is that conversion's float, bit for bit (NaN payloads included).
TEST_F(Safetensors, SixteenBitTensorsAreWidenedByTheOneConversion) {
  std::vector<std::uint16_t> every(65536);
  for (std::uint32_t bits = 0; bits < 65536; ++bits) every[bits] = static_cast<std::uint16_t>(bits);
  const std::string header = "{" + entry("h", "F16", "[65536]", 0, 131072) + "," +
                             entry("b", "BF16", "[65536]", 131072, 262144) + "}";
  const SafetensorsFile f(file("every.safetensors", header, raw(every) + raw(every)));
  EXPECT_EQ(f.entry("h").dtype, emflow::Dtype::float16);
  EXPECT_EQ(f.entry("b").dtype, emflow::Dtype::bfloat16);
  const auto h = f.read<float>("h");
  const auto b = f.read<float>("b");
  int wrong = 0;
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const auto pattern = static_cast<std::uint16_t>(bits);
    const float want_h = emflow::to_float(emflow::float16{pattern});
    const float want_b = emflow::to_float(emflow::bfloat16{pattern});
    wrong += std::memcmp(&want_h, &h.values()[bits], 4) != 0;
    wrong += std::memcmp(&want_b, &b.values()[bits], 4) != 0;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(h.values()[0x3c00], 1.0f);  // not vacuous: the patterns hold real values
  EXPECT_EQ(b.values()[0xc0a0], -5.0f);
}

// The format's names of the one Dtype enum, and the sizes its header checks use.
TEST(SafetensorsNames, EveryDtypeHasItsFileNameAndSize) {
  using emflow::Dtype;
  const struct {
    Dtype dtype;
    const char* name;
    std::int64_t size;
  } names[] = {{Dtype::float16, "F16", 2},
               {Dtype::bfloat16, "BF16", 2},
               {Dtype::float32, "F32", 4},
               {Dtype::float64, "F64", 8},
               {Dtype::boolean, "BOOL", 1},
               {Dtype::uint8, "U8", 1},
               {Dtype::int8, "I8", 1},
               {Dtype::int16, "I16", 2},
               {Dtype::uint16, "U16", 2},
               {Dtype::int32, "I32", 4},
               {Dtype::uint32, "U32", 4},
               {Dtype::int64, "I64", 8},
               {Dtype::uint64, "U64", 8},
               {Dtype::float8_e4m3, "F8_E4M3", 1},
               {Dtype::float8_e5m2, "F8_E5M2", 1}};
  for (const auto& n : names) {
    EXPECT_STREQ(emflow::safetensors_name(n.dtype), n.name) << emflow::to_string(n.dtype);
    EXPECT_EQ(emflow::item_size(n.dtype), n.size) << emflow::to_string(n.dtype);
  }
  EXPECT_STREQ(emflow::to_string(Dtype::float8_e4m3), "float8_e4m3");
  EXPECT_STREQ(emflow::to_string(Dtype::boolean), "bool");
}

TEST_F(Safetensors, ReadsEveryDtypeExactly) {
  const std::vector<std::uint16_t> half = {0x3c00, 0xc000, 0x0001, 0x7bff};
  const std::vector<std::uint16_t> bf = {0x3f80, 0xc0a0, 0x4049, 0x0000};
  const std::vector<float> f32 = {1.5f, -2.25f, 1e-30f, 3.0f, 4.0f, 5.0f};
  const std::vector<double> f64 = {0.1, -1e300};
  const std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"}," + entry("h", "F16", "[2,2]", 0, 8) + "," +
      entry("b", "BF16", "[4]", 8, 16) + "," + entry("f", "F32", "[2,1,3]", 16, 40) + "," +
      entry("d", "F64", "[2]", 40, 56) + "," + entry("s", "F32", "[0,5]", 56, 56) + "}   ";
  const std::string p = file("all.safetensors", header, raw(half) + raw(bf) + raw(f32) + raw(f64));
  const SafetensorsFile f(p);
  EXPECT_EQ(f.header().metadata.at("format"), "pt");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"h", "b", "f", "d", "s"}));
  EXPECT_EQ(f.entry("b").dtype, emflow::Dtype::bfloat16);

  const auto h = f.read<float>("h");
  EXPECT_EQ(h.shape(), (emflow::Shape{2, 2}));
  EXPECT_EQ(h.values(), (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24), 65504.0f}));
  const auto b = f.read<double>("b");
  EXPECT_EQ(b.values(), (std::vector<double>{1.0, -5.0, 3.140625, 0.0}));
  const auto x = f.read<double>("f");
  EXPECT_EQ(x.shape(), (emflow::Shape{2, 1, 3}));
  for (std::size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(x.values()[i], double(f32[i]));
  EXPECT_EQ(f.read<double>("d").values(), f64);
  EXPECT_EQ(f.read<float>("d").values()[0], 0.1f);  // F64 read as float rounds
  EXPECT_EQ(f.read<float>("s").size(), 0);
}

TEST_F(Safetensors, IntegerBuffersOpenButAreNotReadAsFloat) {
  const std::string p =
      file("ids.safetensors",
           "{" + entry("ids", "I64", "[2]", 0, 16) + "," + entry("w", "F32", "[1]", 16, 20) + "}",
           raw(std::vector<std::int64_t>{0, 1}) + raw(std::vector{0.5f}));
  const SafetensorsFile f(p);
  EXPECT_EQ(f.entry("ids").dtype, emflow::Dtype::int64);
  EXPECT_EQ(f.read<float>("w")[0], 0.5f);
  const std::string message = error_of(ErrorCode::io, [&] { f.read<double>("ids"); });
  EXPECT_NE(message.find("tensor 'ids' has dtype I64"), std::string::npos) << message;
}

TEST_F(Safetensors, ScalarsHaveOneElement) {
  const std::string p =
      file("s.safetensors", "{" + entry("s", "F64", "[]", 0, 8) + "}", raw(std::vector{2.5}));
  const auto s = SafetensorsFile(p).read<double>("s");
  EXPECT_EQ(s.rank(), 0);
  ASSERT_EQ(s.size(), 1);
  EXPECT_EQ(s[0], 2.5);
}

TEST_F(Safetensors, RefusesMalformedFiles) {
  const std::string four(4, '\0'), eight(8, '\0');
  put("tiny.safetensors", "abc");
  expect_refused(path("tiny.safetensors"), {"fewer than the 8"});
  {
    std::string bytes(8, '\0');
    bytes[7] = 0x7f;  // 2^62-ish
    put("huge.safetensors", bytes + "{}");
    expect_refused(path("huge.safetensors"), {"more than the limit"});
  }
  {
    std::string bytes(8, '\0');
    bytes[0] = 100;  // 100 bytes declared, 2 present
    put("long.safetensors", bytes + "{}");
    expect_refused(path("long.safetensors"), {"declares a header of 100 bytes"});
  }
  expect_refused(file("json.safetensors", "{\"a\": [1,", ""), {"malformed JSON"});
  expect_refused(file("array.safetensors", "[1, 2]", ""), {"does not start with '{'"});
  expect_refused(
      file("dup.safetensors",
           "{" + entry("w", "F32", "[1]", 0, 4) + "," + entry("w", "F32", "[1]", 0, 4) + "}", four),
      {"'w' twice"});
  expect_refused(file("dtype.safetensors", "{" + entry("w", "Q9", "[1]", 0, 4) + "}", four),
                 {"tensor 'w'", "unknown dtype 'Q9'"});
  expect_refused(file("int.safetensors", "{" + entry("w", "I32", "[1]", 0, 4) + "}", four),
                 {"tensor 'w'", "has dtype I32; only F16, BF16, F32 and F64"});
  expect_refused(file("size.safetensors", "{" + entry("w", "F32", "[3]", 0, 8) + "}", eight),
                 {"tensor 'w'", "needs 12 bytes"});
  expect_refused(file("range.safetensors", "{" + entry("w", "F32", "[3]", 0, 12) + "}", eight),
                 {"tensor 'w'", "beyond the data buffer of 8 bytes"});
  expect_refused(file("order.safetensors", "{" + entry("w", "F32", "[0]", 4, 0) + "}", four),
                 {"tensor 'w'", "end before they begin"});
  expect_refused(
      file("overlap.safetensors",
           "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[1]", 4, 8) + "}",
           eight),
      {"tensor 'b'", "overlap those of 'a'"});
  expect_refused(file("gap.safetensors", "{" + entry("a", "F32", "[1]", 4, 8) + "}", eight),
                 {"tensor 'a'", "4 bytes unused"});
  expect_refused(file("tail.safetensors", "{" + entry("a", "F32", "[1]", 0, 4) + "}", eight),
                 {"4 bytes after its last tensor 'a'"});
  expect_refused(file("neg.safetensors", "{" + entry("a", "F32", "[-1]", 0, 4) + "}", four),
                 {"tensor 'a'", "not a non-negative integer"});
  expect_refused(file("float.safetensors", "{" + entry("a", "F32", "[1.0]", 0, 4) + "}", four),
                 {"tensor 'a'", "not a non-negative integer"});
  expect_refused(
      file("keys.safetensors",
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", four),
      {"tensor 'a'", "unexpected key 'x'"});
  expect_refused(file("lack.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", four),
                 {"tensor 'a'", "lacks the key 'data_offsets'"});
  expect_refused(file("meta.safetensors", "{\"__metadata__\":{\"k\":1}}", ""),
                 {"'__metadata__' entry 'k'"});
  // A shape whose element count overflows 64 bits is a size mismatch, not a wrap-around.
  expect_refused(file("overflow.safetensors",
                      "{" + entry("a", "F32", "[4294967296,4294967296,16]", 0, 4) + "}", four),
                 {"tensor 'a'", "more than the whole data buffer"});
}

TEST_F(Safetensors, NamesTheMissingTensor) {
  const std::string p =
      file("w.safetensors", "{" + entry("w", "F32", "[1]", 0, 4) + "}", raw(std::vector{1.0f}));
  const SafetensorsFile f(p);
  EXPECT_FALSE(f.contains("v"));
  const std::string message = error_of(ErrorCode::io, [&] { f.read<float>("v"); });
  EXPECT_NE(message.find("tensor 'v' is not in the file"), std::string::npos) << message;
  EXPECT_NE(message.find(p), std::string::npos) << message;
  const std::string missing = error_of(ErrorCode::io, [&] { SafetensorsFile(path("none")); });
  EXPECT_NE(missing.find("cannot open"), std::string::npos) << missing;
}

}  // namespace

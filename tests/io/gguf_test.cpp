// GGUF files: versions 2 and 3 with metadata of every type, alignments other than 32, every
// dequantized tensor type against values computed by hand (the scales' subnormals, zeros,
// infinities and NaNs included), and every malformed file refused with an io error that names
// the file and the key or tensor at fault. The files are written by the tests.
#include "emflow/gguf.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/files.hpp"
#include "core/memory.hpp"
#include "emflow/error.hpp"

namespace {

namespace gguf = emflow::gguf;
using emflow::ErrorCode;
using emflow::Shape;
using emflow::testing::error_of;
using gguf::Type;
using gguf::ValueType;

// --- Building files ----------------------------------------------------------------------------

template <class T>
std::string le(T value) {
  std::string bytes(sizeof(T), '\0');
  std::memcpy(bytes.data(), &value, sizeof(T));
  return bytes;
}

std::string u16(std::uint16_t v) { return le(v); }
std::string u32(std::uint32_t v) { return le(v); }
std::string u64(std::uint64_t v) { return le(v); }

// A GGUF string: its uint64 length, then its bytes.
std::string str(const std::string& s) { return u64(s.size()) + s; }

// An array value (after its entry's type): element type, count, the elements' bytes.
std::string array(ValueType element, std::uint64_t count, const std::string& elements) {
  return u32(static_cast<std::uint32_t>(element)) + u64(count) + elements;
}

std::uint32_t code(ValueType type) { return static_cast<std::uint32_t>(type); }
std::uint32_t code(Type type) { return static_cast<std::uint32_t>(type); }

// The pieces of a GGUF file; build() lays them out with the padding the alignment asks for.
struct Builder {
  std::uint32_t version = 3;
  std::int64_t alignment = 32;
  std::vector<std::string> entries;  // key, value type, value
  std::vector<std::string> infos;    // name, dimension count, extents, type, offset
  std::string data;                  // the data section

  Builder& entry(const std::string& key, ValueType type, const std::string& value) {
    entries.push_back(str(key) + u32(code(type)) + value);
    return *this;
  }
  // A tensor info with extents as the file lists them (innermost first).
  Builder& info(const std::string& name, const std::vector<std::uint64_t>& extents,
                std::uint32_t type, std::uint64_t offset) {
    std::string bytes = str(name) + u32(static_cast<std::uint32_t>(extents.size()));
    for (const std::uint64_t e : extents) bytes += u64(e);
    infos.push_back(bytes + u32(type) + u64(offset));
    return *this;
  }
  // A tensor whose data is appended at the next aligned offset of the data section.
  Builder& tensor(const std::string& name, const std::vector<std::uint64_t>& extents, Type type,
                  const std::string& payload) {
    data.append(padding(static_cast<std::int64_t>(data.size())), '\0');
    info(name, extents, code(type), data.size());
    data += payload;
    return *this;
  }
  std::int64_t padding(std::int64_t at) const { return (alignment - at % alignment) % alignment; }

  std::string header() const {
    std::string bytes = "GGUF" + u32(version) + u64(infos.size()) + u64(entries.size());
    for (const std::string& e : entries) bytes += e;
    for (const std::string& i : infos) bytes += i;
    return bytes;
  }
  std::string build() const {
    std::string bytes = header();
    bytes.append(padding(static_cast<std::int64_t>(bytes.size())), '\0');
    return bytes + data;
  }
};

class Gguf : public emflow::testing::FileFolder {
 protected:
  Gguf() : FileFolder("emflow_gguf") {}

  std::string file(const std::string& name, const std::string& bytes) {
    put(name, bytes);
    return path(name);
  }

  // Opening (and reading every tensor of) `bytes` is refused with an io error that names the
  // file and holds each of `parts`; returns the message.
  std::string refused(const std::string& name, const std::string& bytes,
                      const std::vector<std::string>& parts) {
    const std::string p = file(name, bytes);
    const std::string message = error_of(ErrorCode::io, [&] {
      const gguf::File f(p);
      for (const gguf::TensorInfo& t : f.tensors()) f.read(t.name);
    });
    EXPECT_NE(message.find("read_gguf: '" + p + "': "), std::string::npos) << message;
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "expected '" << part << "' in\n"
                                                       << message;
    }
    return message;
  }
};

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

float float_of(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Expects the values of `t` from element `first` on to be `expected` bit for bit (so -0 differs
// from +0, and each NaN must be the one expected).
void expect_bits(const emflow::Tensor<float>& t, std::int64_t first,
                 const std::vector<float>& expected) {
  ASSERT_LE(first + static_cast<std::int64_t>(expected.size()), t.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const float got = t.values()[static_cast<std::size_t>(first) + i];
    EXPECT_EQ(bits_of(got), bits_of(expected[i]))
        << "element " << first + static_cast<std::int64_t>(i) << ": " << got << ", expected "
        << expected[i];
  }
}

void expect_bits(const emflow::Tensor<float>& t, const std::vector<float>& expected) {
  ASSERT_EQ(t.size(), static_cast<std::int64_t>(expected.size()));
  expect_bits(t, 0, expected);
}

// --- Metadata --------------------------------------------------------------------------------

// Every value type, scalar and array, arrays of arrays, and an empty array.
Builder every_type(std::uint32_t version) {
  Builder b;
  b.version = version;
  b.entry("general.architecture", ValueType::string, str("llama"))
      .entry("t.u8", ValueType::uint8, le<std::uint8_t>(200))
      .entry("t.i8", ValueType::int8, le<std::int8_t>(-5))
      .entry("t.u16", ValueType::uint16, le<std::uint16_t>(60000))
      .entry("t.i16", ValueType::int16, le<std::int16_t>(-30000))
      .entry("t.u32", ValueType::uint32, le<std::uint32_t>(4000000000u))
      .entry("t.i32", ValueType::int32, le<std::int32_t>(-2000000000))
      .entry("t.f32", ValueType::float32, le(0.1f))
      .entry("t.bool", ValueType::boolean, le<std::uint8_t>(1))
      .entry("t.str", ValueType::string, str("h\xc3\xa9llo"))
      .entry("t.u64", ValueType::uint64, le<std::uint64_t>(UINT64_MAX))
      .entry("t.i64", ValueType::int64, le<std::int64_t>(INT64_MIN))
      .entry("t.f64", ValueType::float64, le(1e300))
      .entry("a.u8", ValueType::array, array(ValueType::uint8, 3, "\x01\x02\xff"))
      .entry("a.i8", ValueType::array, array(ValueType::int8, 2, "\x80\x7f"))
      .entry("a.u16", ValueType::array, array(ValueType::uint16, 1, u16(65535)))
      .entry("a.i16", ValueType::array,
             array(ValueType::int16, 2, le<std::int16_t>(-1) + le<std::int16_t>(2)))
      .entry("a.u32", ValueType::array, array(ValueType::uint32, 1, u32(7)))
      .entry("a.i32", ValueType::array, array(ValueType::int32, 1, le<std::int32_t>(-7)))
      .entry("a.f32", ValueType::array, array(ValueType::float32, 2, le(1.5f) + le(-0.25f)))
      .entry("a.bool", ValueType::array, array(ValueType::boolean, 3, std::string("\1\0\1", 3)))
      .entry("a.str", ValueType::array,
             array(ValueType::string, 3, str("a") + str("") + str("\xc4\xa0the")))
      .entry("a.u64", ValueType::array, array(ValueType::uint64, 1, u64(UINT64_MAX)))
      .entry("a.i64", ValueType::array, array(ValueType::int64, 1, le<std::int64_t>(-3)))
      .entry("a.f64", ValueType::array, array(ValueType::float64, 1, le(-2.5)))
      .entry("a.empty", ValueType::array, array(ValueType::int32, 0, ""))
      .entry("a.nested", ValueType::array,
             array(ValueType::array, 2,
                   array(ValueType::int32, 2, le<std::int32_t>(1) + le<std::int32_t>(2)) +
                       array(ValueType::string, 1, str("x"))))
      .entry("a.deep", ValueType::array,
             array(ValueType::array, 1,
                   array(ValueType::array, 1, array(ValueType::uint8, 1, "\x07"))));
  return b;
}

TEST_F(Gguf, MetadataOfEveryTypeInVersionsTwoAndThree) {
  for (const std::uint32_t version : {2u, 3u}) {
    SCOPED_TRACE(version);
    const gguf::File f(file("meta.gguf", every_type(version).build()));
    EXPECT_EQ(f.version(), version);
    EXPECT_EQ(f.alignment(), 32);
    EXPECT_TRUE(f.tensors().empty());
    ASSERT_EQ(f.metadata().size(), 28u);
    EXPECT_EQ(f.metadata()[0].key, "general.architecture");  // file order
    EXPECT_EQ(f.metadata()[27].key, "a.deep");

    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_EQ(f.get_integer("t.u8"), 200);
    EXPECT_EQ(f.get_integer("t.i8"), -5);
    EXPECT_EQ(f.get_integer("t.u16"), 60000);
    EXPECT_EQ(f.get_integer("t.i16"), -30000);
    EXPECT_EQ(f.get_integer("t.u32"), 4000000000);
    EXPECT_EQ(f.get_integer("t.i32"), -2000000000);
    EXPECT_EQ(f.get_number("t.f32"), static_cast<double>(0.1f));  // widened exactly
    EXPECT_EQ(f.get_number("t.u32"), 4e9);
    EXPECT_TRUE(f.get_bool("t.bool"));
    EXPECT_EQ(f.get_string("t.str"), "h\xc3\xa9llo");
    EXPECT_EQ(f.value("t.u64").as_uint64(), UINT64_MAX);
    EXPECT_EQ(f.get_integer("t.i64"), INT64_MIN);
    EXPECT_EQ(f.get_number("t.f64"), 1e300);
    for (const auto& [key, type] :
         std::vector<std::pair<std::string, ValueType>>{{"t.u8", ValueType::uint8},
                                                        {"t.i8", ValueType::int8},
                                                        {"t.u16", ValueType::uint16},
                                                        {"t.i16", ValueType::int16},
                                                        {"t.u32", ValueType::uint32},
                                                        {"t.i32", ValueType::int32},
                                                        {"t.f32", ValueType::float32},
                                                        {"t.bool", ValueType::boolean},
                                                        {"t.str", ValueType::string},
                                                        {"t.u64", ValueType::uint64},
                                                        {"t.i64", ValueType::int64},
                                                        {"t.f64", ValueType::float64},
                                                        {"a.u8", ValueType::array}}) {
      EXPECT_EQ(f.value(key).type(), type) << key;
    }

    EXPECT_EQ(f.get_integers("a.u8"), (std::vector<std::int64_t>{1, 2, 255}));
    EXPECT_EQ(f.get_integers("a.i8"), (std::vector<std::int64_t>{-128, 127}));
    EXPECT_EQ(f.get_integers("a.u16"), (std::vector<std::int64_t>{65535}));
    EXPECT_EQ(f.get_integers("a.i16"), (std::vector<std::int64_t>{-1, 2}));
    EXPECT_EQ(f.get_integers("a.u32"), (std::vector<std::int64_t>{7}));
    EXPECT_EQ(f.get_integers("a.i32"), (std::vector<std::int64_t>{-7}));
    EXPECT_EQ(f.get_numbers("a.f32"), (std::vector<double>{1.5, -0.25}));
    EXPECT_EQ(f.get_numbers("a.i16"), (std::vector<double>{-1.0, 2.0}));
    EXPECT_EQ(f.get_integers("a.i64"), (std::vector<std::int64_t>{-3}));
    EXPECT_EQ(f.get_numbers("a.f64"), (std::vector<double>{-2.5}));
    EXPECT_EQ(f.value("a.u64").element(0).as_uint64(), UINT64_MAX);
    const gguf::Value& flags = f.value("a.bool");
    EXPECT_EQ(flags.element_type(), ValueType::boolean);
    ASSERT_EQ(flags.size(), 3);
    EXPECT_TRUE(flags.element(0).as_bool());
    EXPECT_FALSE(flags.element(1).as_bool());
    EXPECT_EQ(flags.bytes(), (std::vector<unsigned char>{1, 0, 1}));
    EXPECT_EQ(f.get_strings("a.str"), (std::vector<std::string>{"a", "", "\xc4\xa0the"}));
    EXPECT_EQ(f.value("a.empty").element_type(), ValueType::int32);
    EXPECT_EQ(f.value("a.empty").size(), 0);
    EXPECT_TRUE(f.get_integers("a.empty").empty());

    const gguf::Value& nested = f.value("a.nested");
    EXPECT_EQ(nested.element_type(), ValueType::array);
    ASSERT_EQ(nested.size(), 2);
    EXPECT_EQ(nested.arrays()[0].element_type(), ValueType::int32);
    EXPECT_EQ(nested.arrays()[0].element(1).as_int64(), 2);
    EXPECT_EQ(nested.arrays()[1].strings(), std::vector<std::string>{"x"});
    const gguf::Value& deep = f.value("a.deep").arrays()[0].arrays()[0];
    EXPECT_EQ(deep.element(0).as_int64(), 7);
  }
}

TEST_F(Gguf, GettersNameTheFileTheKeyAndTheType) {
  const std::string p = file("meta.gguf", every_type(3).build());
  const gguf::File f(p);
  auto expect = [&](auto&& call, const std::string& part) {
    const std::string message = error_of(ErrorCode::io, call);
    EXPECT_NE(message.find("read_gguf: '" + p + "': "), std::string::npos) << message;
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  expect([&] { f.value("llama.block_count"); }, "has no metadata key 'llama.block_count'");
  expect([&] { f.get_integer("t.str"); }, "key 't.str' is a string, not an integer");
  expect([&] { f.get_integer("t.f32"); }, "key 't.f32' is a float32, not an integer");
  expect([&] { f.get_integer("t.u64"); },
         "key 't.u64' is the uint64 18446744073709551615, beyond the int64 range");
  expect([&] { f.get_number("t.u64"); }, "which a double does not hold exactly");
  expect([&] { f.get_number("t.i64"); }, "which a double does not hold exactly");
  expect([&] { f.get_number("a.u8"); }, "key 'a.u8' is an array of 3 uint8, not a number");
  expect([&] { f.get_bool("t.u8"); }, "key 't.u8' is a uint8, not a bool");
  expect([&] { f.get_string("t.i8"); }, "key 't.i8' is an int8, not a string");
  expect([&] { f.get_strings("a.u8"); }, "is an array of 3 uint8, not an array of strings");
  expect([&] { f.get_integers("a.f32"); }, "is an array of 2 float32, not an array of integers");
  expect([&] { f.get_integers("a.u64"); }, "element 0 is the uint64 18446744073709551615");
  expect([&] { f.get_numbers("a.str"); }, "not an array of numbers");
  expect([&] { f.get_integers("t.u8"); }, "is a uint8, not an array of integers");
  EXPECT_TRUE(f.tokens().empty());  // no vocabulary
  // Value's own accessors refuse other kinds with invalid_argument.
  error_of(ErrorCode::invalid_argument, [&] { f.value("t.u8").as_string(); });
  error_of(ErrorCode::invalid_argument, [&] { f.value("t.i8").as_uint64(); });
  error_of(ErrorCode::invalid_argument, [&] { f.value("a.str").bytes(); });
  error_of(ErrorCode::invalid_argument, [&] { f.value("a.u8").element(3); });
  error_of(ErrorCode::invalid_argument, [&] { f.value("t.str").size(); });
  error_of(ErrorCode::invalid_argument, [] { gguf::Value::from_bits(ValueType::uint8, 256); });
  error_of(ErrorCode::invalid_argument, [] { gguf::Value::from_bits(ValueType::boolean, 2); });
  error_of(ErrorCode::invalid_argument, [] { gguf::Value::from_bits(ValueType::string, 0); });
  error_of(ErrorCode::invalid_argument, [] {
    gguf::Value::from_bytes(ValueType::int32, {1, 2, 3});
  });
}

TEST_F(Gguf, TheVocabularyIsKept) {
  Builder b;
  b.entry("tokenizer.ggml.model", ValueType::string, str("gpt2"))
      .entry("tokenizer.ggml.tokens", ValueType::array,
             array(ValueType::string, 4,
                   str("<|endoftext|>") + str("\xc4\xa0Paris") + str(".") + str("\xc4\x8a")));
  const gguf::File f(file("vocab.gguf", b.build()));
  EXPECT_EQ(f.tokens(),
            (std::vector<std::string>{"<|endoftext|>", "\xc4\xa0Paris", ".", "\xc4\x8a"}));
  // GPT-2's byte-level spelling: "Ġ" is a space, "Ċ" a newline.
  EXPECT_EQ(f.detokenize({1, 2, 3, 0}), " Paris.\n<|endoftext|>");
  EXPECT_EQ(f.detokenize({}), "");
  const std::string bad_id = error_of(ErrorCode::invalid_argument, [&] { f.detokenize({4}); });
  EXPECT_NE(bad_id.find("argument 'ids' holds the id 4; the vocabulary of '" + path("vocab.gguf") +
                        "' has 4 tokens"),
            std::string::npos)
      << bad_id;
  error_of(ErrorCode::invalid_argument, [&] { f.detokenize({-1}); });
  {
    Builder bytes;
    bytes.entry("tokenizer.ggml.model", ValueType::string, str("gpt2"))
        .entry("tokenizer.ggml.tokens", ValueType::array,
               array(ValueType::string, 3,
                     str("caf\xc3\x83\xc2\xa9") + str("\xc4\xa0\xc4\x80") + str("\xe6\x97\xa5")));
    const gguf::File g(file("bytes.gguf", bytes.build()));
    // "Ã©" gives the bytes C3 A9 of "é"; "Ġ" (U+0120) the byte 0x20 and "Ā" (U+0100) 0x00; "日"
    // stands for no byte and is kept as stored.
    EXPECT_EQ(g.detokenize({0, 1, 2}), std::string("caf\xc3\xa9 \0\xe6\x97\xa5", 10));
  }
  {
    Builder sp;
    sp.entry("tokenizer.ggml.model", ValueType::string, str("llama"))
        .entry(
            "tokenizer.ggml.tokens", ValueType::array,
            array(ValueType::string, 4,
                  str("\xe2\x96\x81Paris") + str("<0x0A>") + str("\xe2\x96\x81") + str("<0xZZ>")));
    const gguf::File g(file("sp.gguf", sp.build()));
    EXPECT_EQ(g.detokenize({0, 1, 2, 3}), " Paris\n <0xZZ>");
  }
  {
    Builder plain;
    plain.entry("tokenizer.ggml.tokens", ValueType::array,
                array(ValueType::string, 2,
                      str("\xc4\xa0"
                          "a") +
                          str("b")));
    EXPECT_EQ(gguf::File(file("plain.gguf", plain.build())).detokenize({0, 1}),
              "\xc4\xa0"
              "ab");
  }
  Builder wrong;
  wrong.entry("tokenizer.ggml.tokens", ValueType::array, array(ValueType::int32, 1, u32(5)));
  const gguf::File w(file("wrong.gguf", wrong.build()));
  const std::string message = error_of(ErrorCode::io, [&] { w.tokens(); });
  EXPECT_NE(message.find("key 'tokenizer.ggml.tokens' is an array of 1 int32, not an array of "
                         "strings"),
            std::string::npos)
      << message;
}

// --- Tensors ---------------------------------------------------------------------------------

std::string floats(const std::vector<std::uint32_t>& bits) {
  std::string bytes;
  for (const std::uint32_t b : bits) bytes += u32(b);
  return bytes;
}

std::string halves(const std::vector<std::uint16_t>& bits) {
  std::string bytes;
  for (const std::uint16_t b : bits) bytes += u16(b);
  return bytes;
}

// Half bit patterns used as scales.
constexpr std::uint16_t kHalfOne = 0x3c00, kHalfMinusOne = 0xbc00, kHalfTwo = 0x4000;
constexpr std::uint16_t kHalfHalf = 0x3800, kHalf2048 = 0x6800;
constexpr std::uint16_t kHalfTiny = 0x0001;         // 2^-24, the smallest subnormal
constexpr std::uint16_t kHalfMinusNormal = 0x8400;  // -2^-14, the smallest normal, negative
constexpr std::uint16_t kHalfInf = 0x7c00, kHalfMinusInf = 0xfc00;
constexpr std::uint16_t kHalfNaN = 0x7e00, kHalfOtherNaN = 0x7d00;

const float kInf = std::numeric_limits<float>::infinity();
const float kTiny = std::ldexp(1.0f, -24);

TEST_F(Gguf, PlainTypesAreReadBitForBit) {
  Builder b;
  // F32 as stored, a signalling NaN's payload and -0 included; a scalar; an empty tensor.
  b.tensor("f32", {3}, Type::f32, floats({bits_of(1.5f), 0x80000000u, 0x7fa00001u}));
  b.tensor("scalar", {}, Type::f32, floats({bits_of(-2.5f)}));
  b.tensor("empty", {0, 5}, Type::f32, "");
  // BF16: the upper half of a float32, NaN payloads kept.
  b.tensor("bf16", {2, 2}, Type::bf16, halves({0x3f80, 0xc0a0, 0x0001, 0x7f81}));
  const gguf::File f(file("plain.gguf", b.build()));
  ASSERT_EQ(f.tensors().size(), 4u);

  const auto x = f.read("f32");
  EXPECT_EQ(x.shape(), Shape{3});
  expect_bits(x, {1.5f, -0.0f, float_of(0x7fa00001u)});
  const auto s = f.read("scalar");
  EXPECT_EQ(s.shape(), Shape{});
  EXPECT_EQ(f.tensor("scalar").elements, 1);
  expect_bits(s, {-2.5f});
  const auto e = f.read("empty");
  EXPECT_EQ(e.shape(), (Shape{5, 0}));
  EXPECT_EQ(e.size(), 0);
  EXPECT_EQ(f.tensor("empty").bytes, 0);
  const auto h = f.read("bf16");
  EXPECT_EQ(h.shape(), (Shape{2, 2}));
  expect_bits(h, {1.0f, -5.0f, std::ldexp(1.0f, -133), float_of(0x7f810000u)});
}

TEST_F(Gguf, EveryHalfIsWidenedExactlyWithItsNaNPayload) {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  Builder b;
  b.tensor("f16", {256, 256}, Type::f16, halves(all));
  const gguf::File f(file("f16.gguf", b.build()));
  const auto t = f.read("f16");
  ASSERT_EQ(t.shape(), (Shape{256, 256}));
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const bool negative = (i & 0x8000u) != 0;
    const int exponent = static_cast<int>(i >> 10) & 0x1f;
    const int mantissa = static_cast<int>(i & 0x3ffu);
    const float got = t.values()[i];
    if (exponent == 31 && mantissa != 0) {
      // NaN: the payload moves up 13 bits, quiet or signalling as it was (numpy's widening).
      ASSERT_EQ(bits_of(got), (negative ? 0x80000000u : 0u) | 0x7f800000u |
                                  static_cast<std::uint32_t>(mantissa) << 13)
          << i;
      continue;
    }
    const double magnitude = exponent == 31  ? std::numeric_limits<double>::infinity()
                             : exponent == 0 ? std::ldexp(mantissa, -24)
                                             : std::ldexp(1024 + mantissa, exponent - 25);
    const float expected = static_cast<float>(negative ? -magnitude : magnitude);
    ASSERT_EQ(bits_of(got), bits_of(expected)) << i << ": " << got << " vs " << expected;
  }
}

TEST_F(Gguf, Q8_0IsScaleTimesInteger) {
  std::string blocks;
  // Block 0: d = 0.5, q = j - 16.
  blocks += u16(kHalfHalf);
  for (int j = 0; j < 32; ++j) blocks.push_back(static_cast<char>(j - 16));
  // Block 1: d = 2^-24 (a subnormal half): q = 127, -128, 1, then 0.
  blocks += u16(kHalfTiny) + std::string("\x7f\x80\x01", 3) + std::string(29, '\0');
  // Block 2: d = +inf: q = 1, -1, then 0 (inf * 0 is NaN).
  blocks += u16(kHalfInf) + std::string("\x01\xff", 2) + std::string(30, '\0');
  // Block 3: d = -0: q = 3 gives -0, q = -3 gives +0.
  blocks += u16(0x8000) + std::string("\x03\xfd", 2) + std::string(30, '\x03');
  Builder b;
  b.tensor("q8", {32, 4}, Type::q8_0, blocks);
  const gguf::File f(file("q8.gguf", b.build()));
  EXPECT_EQ(f.tensor("q8").bytes, 4 * 34);
  const auto t = f.read("q8");
  ASSERT_EQ(t.shape(), (Shape{4, 32}));
  std::vector<float> expected;
  for (int j = 0; j < 32; ++j) expected.push_back(static_cast<float>((j - 16) / 2.0));
  expected.insert(expected.end(), {127 * kTiny, -128 * kTiny, kTiny});
  expected.resize(64, 0.0f);
  expect_bits(t, 0, expected);
  EXPECT_EQ(t.values()[64], kInf);
  EXPECT_EQ(t.values()[65], -kInf);
  for (int j = 66; j < 96; ++j) EXPECT_TRUE(std::isnan(t.values()[j])) << j;
  expected.assign({-0.0f, 0.0f});
  expected.resize(32, -0.0f);
  expect_bits(t, 96, expected);
}

TEST_F(Gguf, Q4_0IsScaleTimesNibbleLessEight) {
  std::string blocks;
  // Block 0: d = 2; byte j holds j (element j) and 15 - j (element j + 16).
  blocks += u16(kHalfTwo);
  for (int j = 0; j < 16; ++j) blocks.push_back(static_cast<char>(j | (15 - j) << 4));
  // Block 1: d = -2^-14: low nibbles 0 (q - 8 = -8), high nibbles 8 (q - 8 = 0, giving -0).
  blocks += u16(kHalfMinusNormal) + std::string(16, '\x80');
  Builder b;
  b.tensor("q4", {64}, Type::q4_0, blocks);
  const gguf::File f(file("q4.gguf", b.build()));
  EXPECT_EQ(f.tensor("q4").bytes, 36);
  std::vector<float> expected;
  for (int j = 0; j < 16; ++j) expected.push_back(2.0f * (j - 8));
  for (int j = 0; j < 16; ++j) expected.push_back(2.0f * (7 - j));
  expected.resize(48, std::ldexp(1.0f, -11));  // -2^-14 * -8
  expected.resize(64, -0.0f);                  // -2^-14 * 0
  expect_bits(f.read("q4"), expected);
}

TEST_F(Gguf, Q4_1IsScaleTimesNibblePlusMinimumRoundedOnce) {
  std::string blocks;
  // Block 0: d = 1, m = -1; byte j holds j and 15 - j: x = q - 1.
  blocks += u16(kHalfOne) + u16(kHalfMinusOne);
  for (int j = 0; j < 16; ++j) blocks.push_back(static_cast<char>(j | (15 - j) << 4));
  // Block 1: d = 2048, m = 3 * 2^-24: q = 0 gives m exactly; q = 15 gives 30720 + 3 * 2^-24,
  // which rounds to 30720 in float32 (its spacing there is 2^-9).
  blocks += u16(kHalf2048) + u16(0x0003) + std::string(16, '\xf0');
  // Block 2: subnormal d = 2^-24 and m = -2^-24: x = (q - 1) 2^-24; high nibbles 0.
  blocks += u16(kHalfTiny) + u16(0x8001);
  for (int j = 0; j < 16; ++j) blocks.push_back(static_cast<char>(j));
  // Block 3: d = +inf, m = 1: q = 0 gives NaN (inf * 0), q = 1 gives inf.
  blocks += u16(kHalfInf) + u16(kHalfOne) + std::string(16, '\x10');
  // Block 4: d = 1, m = -inf: every element -inf.
  blocks += u16(kHalfOne) + u16(kHalfMinusInf) + std::string(16, '\x5a');
  // Block 5: d and m two different NaNs: the product's NaN (d's, quiet) is the sum.
  blocks += u16(kHalfNaN) + u16(kHalfOtherNaN) + std::string(16, '\x21');
  Builder b;
  b.tensor("q41", {32, 6}, Type::q4_1, blocks);
  const gguf::File f(file("q41.gguf", b.build()));
  EXPECT_EQ(f.tensor("q41").bytes, 6 * 20);
  const auto t = f.read("q41");
  ASSERT_EQ(t.shape(), (Shape{6, 32}));
  std::vector<float> expected;
  for (int j = 0; j < 16; ++j) expected.push_back(static_cast<float>(j - 1));
  for (int j = 0; j < 16; ++j) expected.push_back(static_cast<float>(14 - j));
  expected.resize(48, 3 * kTiny);
  expected.resize(64, 30720.0f);
  for (int j = 0; j < 16; ++j) expected.push_back((j - 1) * kTiny);
  expected.resize(96, -kTiny);
  expect_bits(t, 0, expected);
  for (int j = 0; j < 16; ++j) {
    EXPECT_TRUE(std::isnan(t.values()[96 + j])) << j;
    EXPECT_EQ(t.values()[112 + j], kInf) << j;
  }
  for (int j = 128; j < 160; ++j) EXPECT_EQ(t.values()[j], -kInf) << j;
  for (int j = 160; j < 192; ++j) EXPECT_EQ(bits_of(t.values()[j]), 0x7fc00000u) << j;
}

TEST_F(Gguf, OtherAlignmentsPlaceTheDataSectionAndTheTensors) {
  for (const std::uint32_t alignment : {1u, 8u, 64u, 4096u}) {
    SCOPED_TRACE(alignment);
    Builder b;
    b.alignment = alignment;
    b.entry("general.alignment", ValueType::uint32, u32(alignment));
    b.tensor("a", {3}, Type::f32, floats({bits_of(1.0f), bits_of(2.0f), bits_of(3.0f)}));
    b.tensor("b", {2}, Type::f16, halves({kHalfTwo, kHalfMinusOne}));
    b.tensor("c", {1}, Type::f32, floats({bits_of(-4.0f)}));
    const gguf::File f(file("aligned.gguf", b.build()));
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.data_offset() % alignment, 0);
    EXPECT_EQ(f.data_offset(),
              static_cast<std::int64_t>(b.header().size() + b.padding(b.header().size())));
    EXPECT_EQ(f.tensor("b").offset, (12 + alignment - 1) / alignment * alignment);
    expect_bits(f.read("a"), {1.0f, 2.0f, 3.0f});
    expect_bits(f.read("b"), {2.0f, -1.0f});
    expect_bits(f.read("c"), {-4.0f});
  }
}

TEST_F(Gguf, GapsTrailingBytesAndAnyOrderOfTheDataAreAllowed) {
  Builder b;
  b.info("late", {1}, code(Type::f32), 64).info("early", {1}, code(Type::f32), 0);
  b.data = floats({bits_of(1.0f)}) + std::string(60, '\0') + floats({bits_of(2.0f)}) +
           std::string(100, '\0');
  const gguf::File f(file("gaps.gguf", b.build()));
  EXPECT_EQ(f.tensors()[0].name, "late");  // file order
  expect_bits(f.read("late"), {2.0f});
  expect_bits(f.read("early"), {1.0f});
}

TEST_F(Gguf, TypesThatDoNotDequantizeOpenButAreNotRead) {
  Builder b;
  b.tensor("q6", {256, 2}, Type::q6_k, std::string(2 * 210, '\0'));
  b.tensor("ids", {3}, Type::i32, std::string(12, '\0'));
  b.tensor("w", {2}, Type::f32, floats({bits_of(0.5f), bits_of(0.25f)}));
  const std::string p = file("mixed.gguf", b.build());
  const gguf::File f(p);
  EXPECT_EQ(f.tensor("q6").type, Type::q6_k);
  EXPECT_EQ(f.tensor("q6").shape, (Shape{2, 256}));
  EXPECT_EQ(f.tensor("q6").bytes, 420);
  expect_bits(f.read("w"), {0.5f, 0.25f});
  std::string message = error_of(ErrorCode::io, [&] { f.read("q6"); });
  EXPECT_NE(message.find("read_gguf: '" + p +
                         "': tensor 'q6' has type Q6_K, which emflow does "
                         "not dequantize (it reads F32, F16, BF16, Q8_0, Q4_0 and Q4_1)"),
            std::string::npos)
      << message;
  message = error_of(ErrorCode::io, [&] { f.read("ids"); });
  EXPECT_NE(message.find("tensor 'ids' has type I32"), std::string::npos) << message;
  message = error_of(ErrorCode::io, [&] { f.read("absent"); });
  EXPECT_NE(message.find("has no tensor 'absent'"), std::string::npos) << message;
}

TEST(GgufTypes, NamesAndBlocksAreGgmls) {
  EXPECT_STREQ(gguf::to_string(Type::q4_1), "Q4_1");
  EXPECT_STREQ(gguf::to_string(Type::iq2_xxs), "IQ2_XXS");
  EXPECT_STREQ(gguf::to_string(static_cast<Type>(4)), "unknown");  // the removed Q4_2
  EXPECT_EQ(gguf::block_size(Type::q8_0), 32);
  EXPECT_EQ(gguf::block_bytes(Type::q8_0), 34);
  EXPECT_EQ(gguf::block_bytes(Type::q4_0), 18);
  EXPECT_EQ(gguf::block_bytes(Type::q4_1), 20);
  EXPECT_EQ(gguf::block_size(Type::q6_k), 256);
  EXPECT_EQ(gguf::block_bytes(Type::q6_k), 210);
  EXPECT_EQ(gguf::block_size(Type::bf16), 1);
  EXPECT_EQ(gguf::block_bytes(Type::bf16), 2);
  EXPECT_EQ(gguf::block_size(static_cast<Type>(99)), 0);
  EXPECT_TRUE(gguf::dequantizes(Type::q4_1));
  EXPECT_FALSE(gguf::dequantizes(Type::q5_0));
  EXPECT_FALSE(gguf::dequantizes(Type::f64));
  EXPECT_STREQ(gguf::to_string(ValueType::boolean), "bool");
  EXPECT_STREQ(gguf::to_string(static_cast<ValueType>(13)), "unknown");
  EXPECT_EQ(gguf::value_size(ValueType::float64), 8);
  EXPECT_EQ(gguf::value_size(ValueType::string), 0);
}

TEST(GgufDequantize, RefusesWhatItCannotDo) {
  const std::string block = u16(kHalfOne) + std::string(32, '\x02');
  std::vector<float> out(32, std::nanf(""));
  gguf::dequantize(Type::q8_0, block.data(), 32, out.data());
  for (const float v : out) EXPECT_EQ(v, 2.0f);
  auto refused = [](auto&& call, const std::string& part) {
    const std::string message = error_of(ErrorCode::invalid_argument, call);
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  refused([&] { gguf::dequantize(Type::q8_0, block.data(), 31, out.data()); },
          "argument 'count' is 31; it must be a multiple of the Q8_0 block of 32");
  refused([&] { gguf::dequantize(Type::q6_k, block.data(), 256, out.data()); },
          "argument 'type' is Q6_K");
  refused([&] { gguf::dequantize(Type::f32, nullptr, 1, out.data()); }, "'blocks'");
  refused([&] { gguf::dequantize(Type::f32, block.data(), 1, nullptr); }, "'out'");
  EXPECT_NO_THROW(gguf::dequantize(Type::f32, nullptr, 0, nullptr));
}

// --- Malformed files ---------------------------------------------------------------------------

// A small valid file whose last tensor ends the file, so that every shorter prefix is refused.
Builder small_model() {
  Builder b;
  b.entry("general.architecture", ValueType::string, str("llama"))
      .entry("llama.block_count", ValueType::uint32, u32(1))
      .entry("tokenizer.ggml.tokens", ValueType::array,
             array(ValueType::string, 2, str("a") + str("b")))
      .entry("n", ValueType::array,
             array(ValueType::array, 1, array(ValueType::float32, 1, le(1.0f))));
  b.tensor("token_embd.weight", {32}, Type::q8_0, u16(kHalfOne) + std::string(32, '\x01'));
  b.tensor("norm", {2}, Type::f32, floats({bits_of(1.0f), bits_of(2.0f)}));
  return b;
}

TEST_F(Gguf, ATruncatedFileIsRefusedWhereverItIsCut) {
  const std::string whole = small_model().build();
  {
    const gguf::File f(file("whole.gguf", whole));
    expect_bits(f.read("norm"), {1.0f, 2.0f});
  }
  for (std::size_t size = 0; size < whole.size(); ++size) {
    SCOPED_TRACE(size);
    const std::string message = refused("cut.gguf", whole.substr(0, size), {});
    // Past the tensor infos the cut is in the data, which names its tensor.
    if (size >= small_model().header().size()) {
      EXPECT_NE(message.find("past the end of the file"), std::string::npos) << message;
    }
  }
}

TEST_F(Gguf, APreambleThatIsNotGgufVersionTwoOrThreeIsRefused) {
  refused("empty.gguf", "", {"has 0 bytes, fewer than the 4 of the magic 'GGUF'"});
  refused("magic.gguf", "GGML" + u32(3) + u64(0) + u64(0), {"does not start with the magic"});
  refused("v1.gguf", "GGUF" + u32(1) + u32(0) + u32(0), {"version 1 (32-bit lengths)"});
  refused("v4.gguf", "GGUF" + u32(4) + u64(0) + u64(0), {"has GGUF version 4"});
  refused("big.gguf", "GGUF" + u32(0x03000000) + u64(0) + u64(0),
          {"is a big-endian GGUF file (version 3 byte-swapped)"});
  refused("counts.gguf", "GGUF" + u32(3) + u64(0),
          {"the metadata entry count needs 8 bytes at byte 16, but the file ends 0 bytes later"});
  refused("many.gguf", "GGUF" + u32(3) + u64(1) + u64(uint64_t{1} << 62),
          {"declares 1 tensors and 4611686018427387904 metadata entries"});
  refused("huge.gguf", "GGUF" + u32(3) + u64(UINT64_MAX) + u64(0),
          {"declares 18446744073709551615 tensors"});
}

TEST_F(Gguf, MalformedMetadataIsRefusedNamingTheKey) {
  // Files of one metadata entry and nothing after it (no padding), so that a value cut short
  // meets the end of the file.
  auto one = [](const std::string& key, ValueType type, const std::string& value) {
    Builder b;
    b.entry(key, type, value);
    return b.header();
  };
  auto with_raw = [](const std::string& entry_bytes) {
    Builder b;
    b.entries.push_back(entry_bytes + std::string(8, 'x'));
    return b.header();
  };
  refused("keylen.gguf", with_raw(u64(std::uint64_t{1} << 40)),
          {"metadata entry 0 of 1: its key is 1099511627776 bytes long; the format allows at most "
           "65535"});
  refused("keyshort.gguf", with_raw(u64(100)),
          {"metadata entry 0 of 1: its key is 100 bytes long, but the file ends 8 bytes later"});
  refused("keymax.gguf", with_raw(u64(70000)),
          {"its key is 70000 bytes long; the format allows at most 65535"});
  refused("keyempty.gguf", one("", ValueType::uint8, "\1"),
          {"metadata entry 0 of 1: has an "
           "empty key"});
  {
    Builder b;
    b.entry("k", ValueType::uint8, "\1").entry("j", ValueType::uint8, "\1");
    b.entry("k", ValueType::uint8, "\2");
    refused("dup.gguf", b.build(), {"key 'k': is given twice (metadata entries 0 and 2)"});
  }
  {
    // Control bytes and backslashes in names are escaped: a NUL would end what() for its readers.
    Builder b;
    const std::string key("a\0b\n\\c", 6);
    b.entry(key, ValueType::uint8, "\1").entry(key, ValueType::uint8, "\1");
    const std::string message = refused("nul.gguf", b.build(), {});
    EXPECT_NE(message.find("key 'a\\x00b\\x0a\\x5cc': is given twice (metadata entries 0 and 1)"),
              std::string::npos)
        << message;
  }
  refused("type.gguf", one("k", static_cast<ValueType>(13), "\1"),
          {"key 'k': has the unknown value type 13 (the types are 0 to 12)"});
  refused("short.gguf", one("k", ValueType::uint32, "\1\2"),
          {"key 'k': the value needs 4 bytes at byte"});
  refused("bool.gguf", one("k", ValueType::boolean, "\2"),
          {"key 'k': holds the bool byte 2; a bool is 0 or 1"});
  refused("boolarray.gguf",
          one("k", ValueType::array, array(ValueType::boolean, 3, std::string("\1\0\7", 3))),
          {"key 'k' element [2]: holds the bool byte 7"});
  refused("strlen.gguf", one("k", ValueType::string, u64(uint64_t{1} << 50) + "ab"),
          {"key 'k': the string is 1125899906842624 bytes long, but the file ends 2 bytes later"});
  refused("elemtype.gguf", one("k", ValueType::array, array(static_cast<ValueType>(99), 1, "")),
          {"key 'k': is an array of the unknown value type 99"});
  refused("count.gguf",
          one("k", ValueType::array, array(ValueType::uint64, uint64_t{1} << 61, u64(1))),
          {"key 'k': is an array of 2305843009213693952 uint64 elements, which need at least 8 "
           "bytes each"});
  refused("strings.gguf",
          one("k", ValueType::array, array(ValueType::string, uint64_t{1} << 40, str("a"))),
          {"is an array of 1099511627776 string elements"});
  refused("arrays.gguf",
          one("k", ValueType::array, array(ValueType::array, 1000, std::string(12, '\0'))),
          {"is an array of 1000 array elements, which need at least 12 bytes each"});
  refused("element.gguf",
          one("tokenizer.ggml.tokens", ValueType::array,
              array(ValueType::string, 3, str("a") + str("b") + u64(5) + "cd")),
          {"key 'tokenizer.ggml.tokens' element [2]: the string is 5 bytes long"});
  refused(
      "nestedshort.gguf",
      one("k", ValueType::array,
          array(ValueType::array, 2,
                array(ValueType::int8, 1, "\1") + array(ValueType::int16, 2, "\1\2\3"))),
      {"key 'k' element [1]: is an array of 2 int16 elements, which need at least 2 bytes each, "
       "but the file ends 3 bytes later"});
  {
    // 65 arrays deep: refused at the 65th, whatever the file holds after it.
    std::string deep = array(ValueType::uint8, 0, "");
    for (int i = 0; i < 64; ++i) deep = array(ValueType::array, 1, deep);
    refused("deep.gguf", one("k", ValueType::array, deep),
            {"key 'k' element [0][0][0]", "nests arrays more than 64 deep"});
    std::string ok = array(ValueType::uint8, 1, "\5");
    for (int i = 0; i < 63; ++i) ok = array(ValueType::array, 1, ok);
    const gguf::File f(file("deep_ok.gguf", one("k", ValueType::array, ok)));
    const gguf::Value* v = &f.value("k");
    for (int i = 0; i < 63; ++i) v = &v->arrays()[0];
    EXPECT_EQ(v->element(0).as_int64(), 5);
  }
  refused("aligntype.gguf", one("general.alignment", ValueType::int32, u32(64)),
          {"key 'general.alignment': is an int32; the alignment must be a uint32"});
  refused("alignpow.gguf", one("general.alignment", ValueType::uint32, u32(48)),
          {"key 'general.alignment': is 48; the alignment must be a power of two"});
  refused("alignzero.gguf", one("general.alignment", ValueType::uint32, u32(0)),
          {"is 0; the alignment must be a power of two"});
}

TEST_F(Gguf, MalformedTensorInfosAreRefusedNamingTheTensor) {
  auto one = [](const std::string& name, const std::vector<std::uint64_t>& extents,
                std::uint32_t type, std::uint64_t offset, const std::string& data) {
    Builder b;
    b.info(name, extents, type, offset);
    b.data = data;
    return b.build();
  };
  const std::string eight(8, '\0');
  const std::uint32_t f32 = code(Type::f32), q4_0 = code(Type::q4_0), q8_0 = code(Type::q8_0);
  refused("name.gguf", one(std::string(65, 'n'), {1}, f32, 0, eight),
          {"tensor info 0 of 1: its name is 65 bytes long; the format allows at most 64"});
  {
    const std::string name(64, 'n');  // the longest name allowed
    EXPECT_EQ(gguf::File(file("name64.gguf", one(name, {1}, f32, 0, eight))).tensors()[0].name,
              name);
  }
  {
    Builder b;
    b.info("w", {1}, f32, 0).info("v", {1}, f32, 32).info("w", {1}, f32, 64);
    b.data = std::string(68, '\0');
    refused("dup.gguf", b.build(), {"tensor 'w': is given twice (tensor infos 0 and 2)"});
  }
  refused("dims.gguf", one("w", {1, 1, 1, 1, 1}, f32, 0, eight),
          {"tensor 'w': has 5 dimensions; at most 4 are allowed"});
  refused("extent.gguf", one("w", {uint64_t{1} << 63}, f32, 0, eight),
          {"tensor 'w': has the extent 9223372036854775808 (dimension 0), beyond the int64"});
  refused("product.gguf",
          one("w", {uint64_t{1} << 32, uint64_t{1} << 32, uint64_t{1} << 32}, f32, 0, eight),
          {"tensor 'w': has the shape (4294967296, 4294967296, 4294967296), whose extents "
           "multiply past 64 bits"});
  // Also beside an extent of 0 (no element, but no product of the extents may overflow).
  refused("zeroproduct.gguf", one("w", {0, uint64_t{1} << 62, uint64_t{1} << 2}, f32, 0, eight),
          {"tensor 'w': has the shape (4, 4611686018427387904, 0), whose extents multiply past 64 "
           "bits"});
  {
    const gguf::File f(file("zero.gguf", one("w", {0, uint64_t{1} << 62, 1}, f32, 0, eight)));
    EXPECT_EQ(f.tensor("w").elements, 0);
    EXPECT_EQ(f.read("w").shape(), (Shape{1, std::int64_t{1} << 62, 0}));
  }
  refused("bytes.gguf", one("w", {32, 280000000000000000}, q8_0, 0, eight),
          {"tensor 'w': of type Q8_0 and shape (280000000000000000, 32) needs more bytes than 64 "
           "bits count"});
  refused("block.gguf", one("w", {33, 2}, q4_0, 0, eight),
          {"tensor 'w': of type Q4_0 has the shape (2, 33): its last extent 33 is not a multiple "
           "of the Q4_0 block of 32 elements"});
  refused("scalarblock.gguf", one("w", {}, q4_0, 0, eight),
          {"its last extent 1 is not a multiple"});
  refused("type.gguf", one("w", {1}, 4, 0, eight), {"tensor 'w': has the unknown tensor type 4"});
  refused("type99.gguf", one("w", {1}, 99, 0, eight), {"has the unknown tensor type 99"});
  refused("misaligned.gguf", one("w", {1}, f32, 4, eight),
          {"tensor 'w': has the offset 4, which is not a multiple of the alignment 32"});
  refused("offset.gguf", one("w", {1}, f32, uint64_t{1} << 63, eight),
          {"tensor 'w': has the offset 9223372036854775808, beyond the int64 range"});
  refused("past.gguf", one("w", {4}, f32, 0, eight),
          {"tensor 'w' (F32, shape (4,)) has its 16 bytes at offset 0 of the data section, past "
           "the end of the file: the data section has 8 bytes"});
  refused("far.gguf", one("w", {1}, f32, uint64_t{1} << 40, eight),
          {"has its 4 bytes at offset 1099511627776 of the data section, past the end"});
  {
    Builder b;
    b.info("a", {4}, f32, 0).info("b", {2}, f32, 0).info("z", {0}, f32, 0);
    b.data = std::string(16, '\0');
    refused("overlap.gguf", b.build(),
            {"tensor 'b' has its data at [0, 8) of the data section, which overlaps that of "
             "tensor 'a' at [0, 16)"});
  }
  {
    Builder b;
    b.alignment = 8;
    b.entry("general.alignment", ValueType::uint32, u32(8));
    b.info("a", {8}, f32, 0).info("b", {1}, f32, 8).info("c", {2}, f32, 24);
    b.data = std::string(32, '\0');
    refused("overlap2.gguf", b.build(), {"tensor 'b'", "overlaps that of tensor 'a' at [0, 32)"});
  }
  {
    Builder b;
    b.info("w", {1}, f32, 0);
    b.infos.push_back(str("v") + u32(3) + u64(1));  // a second info cut in its extents
    refused("infos.gguf", b.header(), {"tensor 'v': its extent needs 8 bytes at byte"});
    b.infos.back() = u64(100) + std::string(16, 'x');
    refused("infoname.gguf", b.header(),
            {"tensor info 1 of 2: its name is 100 bytes long; the format allows at most 64"});
  }
}

TEST_F(Gguf, MetadataLargerThanMemoryIsRefusedBeforeAllocating) {
  // A sparse file holding an array of 2^42 bytes (4 TiB of zeros): the count fits in the file,
  // the memory does not.
  const std::int64_t count = std::int64_t{1} << 42;
  if (emflow::detail::memory_limit_bytes() >= count) GTEST_SKIP() << "this machine has 4 TiB";
  Builder b;
  b.entry("k", ValueType::array, array(ValueType::uint8, count, ""));
  const std::string p = file("sparse.gguf", b.build());
  std::error_code error;
  std::filesystem::resize_file(p, b.build().size() + count, error);
  if (error) GTEST_SKIP() << "this file system cannot hold a 4 TiB sparse file";
  const std::string message = error_of(ErrorCode::out_of_memory, [&] { gguf::File f(p); });
  EXPECT_NE(message.find("the metadata of '" + p + "' needs"), std::string::npos) << message;
  EXPECT_NE(message.find("bytes of memory available"), std::string::npos) << message;
}

TEST_F(Gguf, ATensorLargerThanMemoryIsRefusedBeforeAllocating) {
  const std::int64_t count = std::int64_t{1} << 41;  // 8 TiB of float32
  if (emflow::detail::memory_limit_bytes() >= count * 4) GTEST_SKIP() << "this machine has 8 TiB";
  Builder b;
  b.info("w", {static_cast<std::uint64_t>(count)}, code(Type::f32), 0);
  const std::string p = file("sparse.gguf", b.build());
  std::error_code error;
  std::filesystem::resize_file(p, b.build().size() + count * 4, error);
  if (error) GTEST_SKIP() << "this file system cannot hold an 8 TiB sparse file";
  const gguf::File f(p);  // the header alone is fine
  EXPECT_EQ(f.tensor("w").shape, Shape{count});
  const std::string message = error_of(ErrorCode::out_of_memory, [&] { f.read("w"); });
  EXPECT_NE(message.find("tensor 'w' of '" + p + "' needs"), std::string::npos) << message;
}

TEST_F(Gguf, AFileThatChangedSinceItWasOpenedIsNotRead) {
  const std::string whole = small_model().build();
  const std::string p = file("model.gguf", whole);
  const gguf::File f(p);
  put("model.gguf", whole.substr(0, whole.size() - 4));
  const std::string message = error_of(ErrorCode::io, [&] { f.read("norm"); });
  EXPECT_NE(message.find("tensor 'norm' cannot be read: the file changed size since it was "
                         "opened"),
            std::string::npos)
      << message;
  std::filesystem::remove(p);
  error_of(ErrorCode::io, [&] { f.read("norm"); });
  error_of(ErrorCode::io, [&] { gguf::File missing(p); });
  error_of(ErrorCode::io, [&] { gguf::File folder(folder_.string()); });
}

}  // namespace

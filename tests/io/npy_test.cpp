// .npy files: exact round trips, the numpy byte layout, and every malformed file refused with an
// io error that names the file and the problem.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"

namespace fs = std::filesystem;

namespace {

// A fresh folder per test, removed afterwards.
class NpyFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / (std::string("emflow_io_") + info->name() + "_" +
                                        std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(dir_, ignored);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_bytes(const std::string& name, const std::string& bytes) const {
    std::ofstream out(path(name), std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  std::string read_bytes(const std::string& name) const {
    std::ifstream in(path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // Names in the folder (to prove no temporary file was left behind).
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    return names;
  }

  fs::path dir_;
};

// A .npy file from its parts: version, raw header text (padding and newline included when the
// caller wants them) and raw payload bytes.
std::string npy_file(const std::string& header, const std::string& payload, int major = 1) {
  std::string bytes("\x93NUMPY", 6);
  bytes.push_back(static_cast<char>(major));
  bytes.push_back('\0');
  const auto length = static_cast<std::uint32_t>(header.size());
  const int length_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < length_bytes; ++i) bytes.push_back(static_cast<char>(length >> (8 * i)));
  return bytes + header + payload;
}

std::string dict(const std::string& descr, const std::string& shape, bool fortran = false) {
  return "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
         ", 'shape': " + shape + ", }\n";
}

template <class T>
std::string raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Runs `read`, expecting an io error whose message names the file and contains `problem`.
template <class Read>
void expect_io_error(Read read, const std::string& file, const std::string& problem) {
  try {
    read();
    ADD_FAILURE() << "no error for " << file << " (expected '" << problem << "')";
  } catch (const emflow::Error& e) {
    EXPECT_EQ(e.code(), emflow::ErrorCode::io) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find(problem), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one-line message: " << message;
  }
}

template <class T>
emflow::Tensor<T> distinct_tensor(emflow::Shape shape) {
  emflow::Tensor<T> t(std::move(shape));
  for (std::int64_t i = 0; i < t.size(); ++i) {
    t[i] = static_cast<T>(0.5 * static_cast<double>(i) - 3.25 + 1.0 / (i + 3.0));
  }
  return t;
}

template <class T>
class NpyRoundTrip : public NpyFiles {};
TYPED_TEST_SUITE(NpyRoundTrip, emflow::testing::FloatTypes);

TYPED_TEST(NpyRoundTrip, RanksOneToFourAreBitExact) {
  using T = TypeParam;
  const std::vector<emflow::Shape> shapes = {{7}, {3, 5}, {2, 3, 4}, {2, 1, 3, 5}, {1}, {0, 3}};
  for (const auto& shape : shapes) {
    emflow::Tensor<T> original = distinct_tensor<T>(shape);
    if (original.size() > 2) {
      // Special values survive unchanged too.
      original[0] = -0.0;
      original[1] = std::numeric_limits<T>::infinity();
      original[2] = std::numeric_limits<T>::denorm_min();
    }
    const std::string file = this->path("a.npy");
    emflow::write_npy(file, original);
    const emflow::NpyHeader header = emflow::read_npy_header(file);
    const emflow::Dtype expected =
        std::is_same_v<T, float> ? emflow::Dtype::float32 : emflow::Dtype::float64;
    EXPECT_EQ(header.dtype, expected);
    EXPECT_EQ(header.shape, shape);
    EXPECT_EQ(header.data_offset % 64, 0);
    const emflow::Tensor<T> back = emflow::read_npy<T>(file);
    ASSERT_EQ(back.shape(), shape);
    ASSERT_EQ(back.size(), original.size());
    // memcmp may not be handed the null data pointer of an empty tensor, even for 0 bytes.
    if (original.size() > 0) {
      EXPECT_EQ(std::memcmp(back.data(), original.data(), sizeof(T) * original.values().size()), 0)
          << emflow::to_string(shape);
    }
  }
  EXPECT_EQ(this->entries(), std::vector<std::string>{"a.npy"});
}

TEST_F(NpyFiles, WritesNumpysExactLayout) {
  // What numpy.save(np.array([[1, 2, 3], [4, 5, 6]], dtype='<f8')) writes: version 1.0 and this
  // 59-byte dict padded with spaces and a newline so that the payload starts at byte 128.
  const std::vector<double> values = {1, 2, 3, 4, 5, 6};
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }";
  ASSERT_EQ(header.size(), 59u);
  header.append(128 - 10 - 59 - 1, ' ');
  header += '\n';
  emflow::write_npy(path("a.npy"), emflow::Tensor<double>({2, 3}, values));
  EXPECT_EQ(read_bytes("a.npy"), npy_file(header, raw(values)));
  // A rank-1 shape is written as a one-element Python tuple.
  emflow::write_npy(path("b.npy"), emflow::Tensor<float>({3}, {1.f, 2.f, 3.f}));
  EXPECT_NE(read_bytes("b.npy").find("'shape': (3,), }"), std::string::npos);
}

TEST_F(NpyFiles, ReadsAndWritesFloat16Exactly) {
  // '<f2' as numpy writes it: 1, -2.5, the largest finite 65504, the smallest subnormal 2^-24.
  const std::vector<std::uint16_t> bits = {0x3c00, 0xc100, 0x7bff, 0x0001};
  write_bytes("h.npy", npy_file(dict("<f2", "(2, 2)"), raw(bits)));
  EXPECT_EQ(emflow::read_npy_header(path("h.npy")).dtype, emflow::Dtype::float16);
  const std::vector<double> want = {1.0, -2.5, 65504.0, std::ldexp(1.0, -24)};
  EXPECT_EQ(emflow::read_npy<double>(path("h.npy")).values(), want);
  const auto as_float = emflow::read_npy<float>(path("h.npy"));
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(as_float.values()[i], float(want[i]));
  emflow::Tensor<emflow::float16> half(emflow::Shape{2, 2});
  for (std::size_t i = 0; i < bits.size(); ++i) half.values()[i].bits = bits[i];
  emflow::write_npy(path("h2.npy"), half);
  const std::string written = read_bytes("h2.npy");
  EXPECT_NE(written.find("'descr': '<f2'"), std::string::npos);
  EXPECT_EQ(written.substr(written.size() - 8), raw(bits));
  EXPECT_THROW(emflow::read_npy<std::int64_t>(path("h.npy")), emflow::Error);
}

TEST_F(NpyFiles, ConvertsBetweenFloatWidthsAndReadsIntegers) {
  const std::vector<float> f = {0.1f, -2.5f, 3.0e30f};
  write_bytes("f.npy", npy_file(dict("<f4", "(3,)"), raw(f)));
  const auto as_double = emflow::read_npy<double>(path("f.npy"));
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_EQ(as_double.values()[i], double(f[i]));

  const std::vector<double> d = {0.1, -2.5, 1.0 / 3.0};
  write_bytes("d.npy", npy_file(dict("<f8", "(3,)"), raw(d)));
  const auto as_float = emflow::read_npy<float>(path("d.npy"));
  for (std::size_t i = 0; i < d.size(); ++i) EXPECT_EQ(as_float.values()[i], float(d[i]));

  const std::vector<std::int32_t> i32 = {0, -7, 2147483647};
  write_bytes("i4.npy", npy_file(dict("<i4", "(3,)"), raw(i32)));
  EXPECT_EQ(emflow::read_npy<std::int64_t>(path("i4.npy")).values(),
            (std::vector<std::int64_t>{0, -7, 2147483647}));

  const emflow::Tensor<std::int64_t> i64({2, 2}, {5, -1, std::int64_t(1) << 40, 0});
  emflow::write_npy(path("i8.npy"), i64);
  EXPECT_EQ(emflow::read_npy_header(path("i8.npy")).dtype, emflow::Dtype::int64);
  EXPECT_EQ(emflow::read_npy<std::int64_t>(path("i8.npy")).values(), i64.values());
}

TEST_F(NpyFiles, AcceptsVersionsTwoAndThreeAndHeaderVariants) {
  const std::vector<double> values = {1.5, -2.0};
  write_bytes("v2.npy", npy_file(dict("<f8", "(2,)"), raw(values), 2));
  write_bytes("v3.npy", npy_file(dict("<f8", "(1, 2)"), raw(values), 3));
  // Keys in another order, double quotes, no trailing comma, no padding: still a valid dict.
  write_bytes(
      "order.npy",
      npy_file("{\"shape\": (2, 1), \"fortran_order\": False, \"descr\": \"<f8\"}\n", raw(values)));
  EXPECT_EQ(emflow::read_npy<double>(path("v2.npy")).values(), values);
  EXPECT_EQ(emflow::read_npy<double>(path("v3.npy")).shape(), (emflow::Shape{1, 2}));
  EXPECT_EQ(emflow::read_npy<double>(path("order.npy")).shape(), (emflow::Shape{2, 1}));
}

struct Malformed {
  const char* name;
  std::string bytes;
  const char* problem;
};

TEST_F(NpyFiles, RefusesEveryMalformedFile) {
  const std::string four = raw(std::vector<double>{1, 2, 3, 4});
  const std::string good = dict("<f8", "(2, 2)");
  std::string wrong_magic = npy_file(good, four);
  wrong_magic[1] = 'X';
  std::string minor_one = npy_file(good, four);
  minor_one[7] = 1;
  std::string huge_header("\x93NUMPY\x02\x00", 8);
  huge_header += std::string("\x00\x00\x01\x00", 4);  // 65536 bytes declared
  huge_header += good + four;
  std::string header_past_end = npy_file(good, "");
  header_past_end[8] = static_cast<char>(200);  // declares 200 header bytes; the file has fewer

  const std::vector<Malformed> cases = {
      {"empty.npy", "", "not a .npy file"},
      {"magic.npy", wrong_magic, "not a .npy file"},
      {"version4.npy", npy_file(good, four, 4), "version 4.0"},
      {"version1_1.npy", minor_one, "version 1.1"},
      {"length_field.npy", std::string("\x93NUMPY\x02\x00\x10", 9), "header length field"},
      {"huge_header.npy", huge_header, "more than the limit"},
      {"header_past_end.npy", header_past_end, "truncated"},
      {"empty_header.npy", npy_file("", four), "empty header"},
      {"fortran.npy", npy_file(dict("<f8", "(2, 2)", true), four), "Fortran"},
      {"big_endian.npy", npy_file(dict(">f8", "(2, 2)"), four), "big endian"},
      {"quad.npy", npy_file(dict("<f16", "(2,)"), four), "unsupported dtype '<f16'"},
      {"complex.npy", npy_file(dict("<c16", "(2,)"), four), "unsupported dtype '<c16'"},
      {"bytes.npy", npy_file(dict("|u1", "(32,)"), four), "unsupported dtype '|u1'"},
      {"native.npy", npy_file(dict("=f8", "(2, 2)"), four), "unsupported dtype '=f8'"},
      {"rank0.npy", npy_file(dict("<f8", "()"), four.substr(0, 8)), "rank 0"},
      {"rank5.npy", npy_file(dict("<f8", "(1, 1, 2, 1, 2)"), four), "rank 5"},
      {"short.npy", npy_file(good, four.substr(0, 31)), "truncated"},
      {"long.npy", npy_file(good, four + "x"), "1 bytes after the payload"},
      {"overflow.npy", npy_file(dict("<f8", "(4294967296, 4294967296)"), four), "overflows"},
      {"bytes_overflow.npy", npy_file(dict("<f8", "(2305843009213693952,)"), four), "overflows"},
      {"extent_digits.npy", npy_file(dict("<f8", "(99999999999999999999,)"), four), "64 bits"},
      {"negative.npy", npy_file(dict("<f8", "(-4,)"), four), "non-negative integer"},
      {"no_newline.npy",
       npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }", four), "newline"},
      {"trailing.npy",
       npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), } x\n", four),
       "newline"},
      {"missing_key.npy", npy_file("{'descr': '<f8', 'shape': (2, 2), }\n", four),
       "lacks the key 'fortran_order'"},
      {"repeated_key.npy",
       npy_file("{'descr': '<f8', 'descr': '<f8', 'fortran_order': False, 'shape': (4,)}\n", four),
       "repeats the key 'descr'"},
      {"extra_key.npy",
       npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (4,), 'x': 1}\n", four),
       "unexpected key 'x'"},
      {"order_value.npy", npy_file("{'descr': '<f8', 'fortran_order': 0, 'shape': (4,)}\n", four),
       "True or False"},
      {"not_a_dict.npy", npy_file("[1, 2]\n", four), "expects '{'"},
      {"unterminated.npy", npy_file("{'descr: <f8}\n", four), "unterminated string"},
  };
  for (const Malformed& c : cases) {
    SCOPED_TRACE(c.name);
    write_bytes(c.name, c.bytes);
    const std::string file = path(c.name);
    expect_io_error([&] { emflow::read_npy<double>(file); }, file, c.problem);
    expect_io_error([&] { emflow::read_npy<float>(file); }, file, c.problem);
    expect_io_error([&] { emflow::read_npy_header(file); }, file, c.problem);
  }
}

TEST_F(NpyFiles, RefusesTheWrongKindOfNumbersAndMissingFiles) {
  write_bytes("ints.npy", npy_file(dict("<i8", "(2,)"), raw(std::vector<std::int64_t>{1, 2})));
  write_bytes("floats.npy", npy_file(dict("<f4", "(2,)"), raw(std::vector<float>{1, 2})));
  expect_io_error([&] { emflow::read_npy<double>(path("ints.npy")); }, path("ints.npy"),
                  "holds int64 data; expected float32 or float64");
  expect_io_error([&] { emflow::read_npy<std::int64_t>(path("floats.npy")); }, path("floats.npy"),
                  "holds float32 data; expected int32 or int64");
  expect_io_error([&] { emflow::read_npy<double>(path("absent.npy")); }, path("absent.npy"),
                  "cannot open");
  expect_io_error([&] { emflow::read_npy<double>(dir_.string()); }, dir_.string(),
                  "not a regular file");
}

TEST_F(NpyFiles, WriteRefusesRanksOutsideOneToFour) {
  for (const emflow::Shape& shape : {emflow::Shape{}, emflow::Shape{1, 1, 1, 1, 2}}) {
    emflow::Tensor<double> t(shape);
    try {
      emflow::write_npy(path("bad.npy"), t);
      ADD_FAILURE() << "rank " << shape.size() << " accepted";
    } catch (const emflow::Error& e) {
      EXPECT_EQ(e.code(), emflow::ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("rank 1 to 4"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(entries().empty());
}

TEST_F(NpyFiles, AtomicWriteReplacesTheTargetAndLeavesNoTemporaryFile) {
  emflow::write_file_atomic(path("out.txt"), "first");
  emflow::write_file_atomic(path("out.txt"), "second, longer");
  EXPECT_EQ(read_bytes("out.txt"), "second, longer");
  EXPECT_EQ(entries(), std::vector<std::string>{"out.txt"});
  // A bare file name goes to the working directory.
  const fs::path previous = fs::current_path();
  fs::current_path(dir_);
  emflow::write_file_atomic("bare.txt", "x");
  fs::current_path(previous);
  EXPECT_EQ(read_bytes("bare.txt"), "x");
}

TEST_F(NpyFiles, FailedAtomicWritesLeaveNothingBehind) {
  // Missing folder: nothing can be created.
  const std::string missing = path("no/such/folder/out.npy");
  expect_io_error([&] { emflow::write_file_atomic(missing, "data"); }, missing, "cannot create");
  expect_io_error(
      [&] {
        emflow::write_npy(missing, emflow::Tensor<double>({2}, {1.0, 2.0}));
      },
      missing, "cannot create");
  EXPECT_TRUE(entries().empty());

  // The target is a folder: the temporary file is written, the rename fails, and the temporary
  // file must be removed again (this fails even for root, unlike permissions).
  fs::create_directory(path("taken"));
  expect_io_error([&] { emflow::write_file_atomic(path("taken"), "data"); }, path("taken"),
                  "rename failed");
  expect_io_error(
      [&] {
        emflow::write_npy(path("taken"), distinct_tensor<float>({3, 3}));
      },
      path("taken"), "rename failed");
  EXPECT_EQ(entries(), std::vector<std::string>{"taken"});
  EXPECT_TRUE(fs::is_directory(path("taken")));
  EXPECT_TRUE(fs::is_empty(path("taken")));
}

TEST_F(NpyFiles, FailedAtomicWriteIntoReadOnlyFolderKeepsTheOldFile) {
  emflow::write_file_atomic(path("keep.txt"), "old");
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
  if (::access(dir_.c_str(), W_OK) == 0) {
    fs::permissions(dir_, fs::perms::owner_all);
    GTEST_SKIP() << "permissions are not enforced for this user (root); covered by the "
                    "missing-folder and folder-target cases";
  }
  expect_io_error([&] { emflow::write_file_atomic(path("keep.txt"), "new"); }, path("keep.txt"),
                  "cannot create");
  fs::permissions(dir_, fs::perms::owner_all);
  EXPECT_EQ(read_bytes("keep.txt"), "old");
  EXPECT_EQ(entries(), std::vector<std::string>{"keep.txt"});
}

}  // namespace

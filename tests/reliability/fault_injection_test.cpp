// Out-of-memory handling on the host. This executable replaces the global operator new (and
// std::aligned_alloc) with one that can be armed to fail the k-th allocation; for k = 1, 2, ...
// each operation must report the failure as emflow::Error(ErrorCode::out_of_memory), never crash or
// swallow it, and must give back every allocation it made (the count of live allocations is
// unchanged).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/gguf.hpp"
#include "emflow/io.hpp"

namespace {

std::atomic<long> live_allocations{0};
std::atomic<bool> armed{false};
std::atomic<long> allocations_seen{0};  // since arming
std::atomic<long> fail_at{0};           // the allocation (1-based, since arming) to fail
std::atomic<bool> injected{false};

// True when this allocation is the one chosen to fail.
bool inject_failure() {
  if (!armed.load(std::memory_order_relaxed)) return false;
  if (allocations_seen.fetch_add(1) + 1 != fail_at.load()) return false;
  injected.store(true);
  return true;
}

void* allocate(std::size_t size, std::size_t alignment) {
  if (inject_failure()) return nullptr;
  if (size == 0) size = 1;
  void* p = nullptr;
  if (alignment <= alignof(std::max_align_t)) {
    p = std::malloc(size);
  } else if (::posix_memalign(&p, alignment, size) != 0) {
    p = nullptr;
  }
  if (p != nullptr) live_allocations.fetch_add(1);
  return p;
}

void release(void* p) noexcept {
  if (p == nullptr) return;
  live_allocations.fetch_sub(1);
  std::free(p);
}

// Suspends the injection for test bookkeeping inside an operation (listing a folder, ...).
class Unarmed {
 public:
  Unarmed() : was_armed_(armed.exchange(false)) {}
  ~Unarmed() { armed = was_armed_; }
  Unarmed(const Unarmed&) = delete;
  Unarmed& operator=(const Unarmed&) = delete;

 private:
  bool was_armed_;
};

void* allocate_or_throw(std::size_t size, std::size_t alignment) {
  void* p = allocate(size, alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

// The CPU backend's aligned working memory comes from std::aligned_alloc, not operator new; this
// definition takes the place of the C library's in this executable so those allocations can
// fail too. They are released with free(), which is not replaced, so they are not in the live
// count; the sanitizer build (scripts/sanitize.sh) checks them for leaks instead.
extern "C" void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  if (inject_failure()) return nullptr;
  void* p = nullptr;
  if (alignment < sizeof(void*)) alignment = sizeof(void*);
  return ::posix_memalign(&p, alignment, size == 0 ? 1 : size) == 0 ? p : nullptr;
}

// The replaceable global allocation functions ([new.delete]); every form routes through
// allocate/release so nothing escapes the count.
void* operator new(std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new[](std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }

namespace emflow {
namespace {

namespace fs = std::filesystem;
using emflow::testing::Buffers;
using emflow::testing::Problem;

struct Sweep {
  long allocations = 0;  // allocations the operation makes when nothing fails
  long failures = 0;     // injected failures, each reported as out_of_memory
};

// Runs `operation` once to warm up (lazy one-time allocations of the C++ runtime), then once for
// each k failing its k-th allocation, until a run makes fewer than k allocations.
Sweep sweep(const std::function<void()>& operation) {
  operation();
  Sweep result;
  for (long k = 1;; ++k) {
    const long live_before = live_allocations.load();
    allocations_seen = 0;
    injected = false;
    fail_at = k;
    armed = true;
    // The outcome goes to a fixed buffer: a std::string would itself be a live allocation.
    char error[512] = "";
    bool reported = false;
    try {
      operation();
    } catch (const Error& e) {
      reported = e.code() == ErrorCode::out_of_memory;
      std::snprintf(error, sizeof(error), "%s: %s", to_string(e.code()), e.what());
    } catch (const std::bad_alloc&) {
      std::snprintf(error, sizeof(error), "std::bad_alloc escaped");
    } catch (const std::exception& e) {
      std::snprintf(error, sizeof(error), "std::exception escaped: %s", e.what());
    }
    armed = false;
    const long leaked = live_allocations.load() - live_before;
    EXPECT_EQ(leaked, 0) << "failing allocation " << k << " leaked " << leaked << " allocations";
    if (!injected) {
      EXPECT_EQ(error[0], '\0') << "run " << k << " injected nothing but failed: " << error;
      result.allocations = k - 1;
      std::printf("[ sweep    ] %ld allocations, each failed once and reported\n",
                  result.allocations);
      return result;
    }
    EXPECT_TRUE(reported) << "failing allocation " << k << " of the operation gave: "
                          << (error[0] == '\0' ? "success (the failure was swallowed)" : error);
    ++result.failures;
    if (::testing::Test::HasFailure() || k > 200000) return result;
  }
}

Problem full_problem() {
  Problem p = Problem::random(2, 37, 5, 2, 11);
  p.key_bias = p.offset = true;
  p.mask = Mask::causal();
  p.key_lengths = {37, 20};
  return p;
}

template <class T>
void expect_attend_reports(Device device) {
  const Problem p = full_problem();
  Buffers<T> buffers(p, /*with_weights=*/true);
  ExecutionOptions options;
  options.device = device;
  options.threads = 2;
  const Sweep s = sweep([&] { attend(buffers.input, buffers.output, options); });
  EXPECT_GT(s.failures, 0);
  ::testing::Test::RecordProperty(std::string("allocations_") + to_string(device),
                                  std::to_string(s.allocations));
}

TEST(FaultInjection, ReferenceAttendReportsEveryFailedAllocation) {
  expect_attend_reports<float>(Device::reference);
  expect_attend_reports<double>(Device::reference);
}

TEST(FaultInjection, CpuAttendReportsEveryFailedAllocation) {
  expect_attend_reports<float>(Device::cpu);
  expect_attend_reports<double>(Device::cpu);
}

TEST(FaultInjection, InvalidInputIsReportedWithoutLeaking) {
  // The validation error (and its message) is all the call leaves behind, and it is freed.
  const Problem p = Problem::random(1, 4, 3, 1, 3);
  Buffers<float> buffers(p);
  buffers.input.beta = 0.0 / 0.0;
  const long live_before = live_allocations.load();
  try {
    attend(buffers.input, buffers.output);
    ADD_FAILURE() << "a NaN beta was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  }
  EXPECT_EQ(live_allocations.load(), live_before);
}

class FileFaults : public testing::ScratchFolder {
 protected:
  FileFaults() : ScratchFolder("emflow_faults_") {}
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& entry : fs::directory_iterator(folder_))
      out.push_back(entry.path().filename());
    return out;
  }
};

TEST_F(FileFaults, ReadNpyReportsEveryFailedAllocation) {
  const std::string f32 = folder_ / "a.npy";
  write_npy(f32, Tensor<float>(Shape{3, 70000}));  // more than one read block
  const std::string i32 = folder_ / "i.npy";
  {
    // int32 files are only written by other programs: build one by hand.
    std::string dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }";
    dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
    dict.push_back('\n');
    std::string bytes("\x93NUMPY\x01\x00", 8);
    bytes.push_back(static_cast<char>(dict.size()));
    bytes.push_back('\0');
    bytes += dict;
    const std::int32_t values[3] = {1, -2, 3};
    bytes.append(reinterpret_cast<const char*>(values), sizeof(values));
    write_file_atomic(i32, bytes);
  }
  EXPECT_GT(sweep([&] { read_npy_header(f32); }).failures, 0);
  EXPECT_GT(sweep([&] { read_npy<float>(f32); }).failures, 0);
  EXPECT_GT(sweep([&] { read_npy<double>(f32); }).failures, 0);
  EXPECT_GT(sweep([&] { read_npy<std::int64_t>(i32); }).failures, 0);
}

TEST_F(FileFaults, WriteNpyReportsEveryFailedAllocationAndLeavesNoFile) {
  Tensor<double> array(Shape{2, 3, 4});
  for (std::int64_t i = 0; i < array.size(); ++i) array[i] = 0.5 * static_cast<double>(i);
  const std::string target = folder_ / "out.npy";
  const Sweep s = sweep([&] {
    {
      Unarmed bookkeeping;
      std::error_code ignored;
      fs::remove(target, ignored);
    }
    try {
      write_npy(target, array);
    } catch (...) {
      // A failed write leaves neither the target nor a temporary file.
      Unarmed bookkeeping;
      EXPECT_TRUE(names().empty()) << names().size() << " files left, the first " << names()[0];
      throw;
    }
    Unarmed bookkeeping;
    EXPECT_EQ(names(), std::vector<std::string>{"out.npy"});
  });
  EXPECT_GT(s.failures, 0);
  EXPECT_EQ(read_npy<double>(target).values(), array.values());
}

TEST_F(FileFaults, ReadGgufReportsEveryFailedAllocation) {
  // Metadata of each kind the reader allocates for (a string, an array of strings, of numbers and
  // of arrays) and a Q8_0 tensor of more than one read chunk (1 MiB).
  auto u32 = [](std::uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [](std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  auto str = [&](const std::string& s) { return u64(s.size()) + s; };
  const std::uint64_t blocks = 40000;
  std::string bytes = "GGUF" + u32(3) + u64(1) + u64(4);
  bytes += str("general.architecture") + u32(8) + str("llama");
  bytes += str("tokenizer.ggml.tokens") + u32(9) + u32(8) + u64(3) + str("a") + str("b") + str("c");
  bytes += str("ids") + u32(9) + u32(5) + u64(2) + u32(7) + u32(9);
  bytes += str("nested") + u32(9) + u32(9) + u64(1) + u32(0) + u64(2) + "\1\2";
  bytes += str("w") + u32(2) + u64(32) + u64(blocks) + u32(8) + u64(0);
  bytes.append((32 - bytes.size() % 32) % 32, '\0');
  for (std::uint64_t b = 0; b < blocks; ++b)
    bytes += std::string("\x00\x3c", 2) + std::string(32, '\x01');
  const std::string path = folder_ / "m.gguf";
  write_file_atomic(path, bytes);
  EXPECT_GT(sweep([&] { gguf::File f(path); }).failures, 0);
  const gguf::File f(path);
  EXPECT_GT(sweep([&] { f.read("w"); }).failures, 0);
  EXPECT_GT(sweep([&] { f.get_integers("ids"); }).failures, 0);
  EXPECT_EQ(f.read("w").values().back(), 1.0f);
}

}  // namespace
}  // namespace emflow

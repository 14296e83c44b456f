// The execution of one emulated kernel launch (cuda_runtime.h): the CUDA threads of a block as
// fibers of the launching host thread, or under ThreadSanitizer as host threads of their own (see
// "How the threads of a launch take turns" below), the blocks one after another in a shuffled
// order, and every rule of the hardware the emulation can check reported as a violation instead
// of being quietly tolerated:
//   * a __syncthreads reached by only part of the block (some threads exited or wait elsewhere),
//     or reached at two different places of the code, is a violation, not a hang;
//   * a shuffle's mask must name the calling lane and the lane it reads, no lane beyond the
//     block and no lane that has exited; lanes named in the mask that never arrive (waiting at
//     a barrier, say) are a deadlock, reported as a violation;
//   * shared memory, static (EMFLOW_SHARED) and dynamic, holds a poison pattern (all bits set:
//     NaN as float or double, -1 as an integer) at the start of every block;
//   * an asynchronous copy (cp.async) is checked when issued and holds poison until its thread
//     waits for its group (AsyncCopies below).
// A violation prints what happened (kernel, block, thread, place in the code) and aborts the
// process, unless a test expects it (emu::ExpectViolation): then the launch stops, its error is
// returned by the call that synchronises with it, and the message is kept for the test to read.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMU_TSAN 1
#endif
#endif
#if defined(EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace emu {

inline thread_local dim3 thread_index, block_index;
inline dim3 block_dim, grid_dim;
// One more at every block start: per-thread state of the emulated device code (mma.cuh's
// parities) starts afresh when it changes, as the team's threads are kept from launch to launch.
inline unsigned long long block_serial = 0;

// Thrown inside a kernel's threads to unwind them once their launch has failed.
struct KernelStopped {};

// --- Violations ---------------------------------------------------------------------------------
inline std::mutex violation_mutex;
inline int violations_expected = 0;          // > 0 inside an ExpectViolation scope
inline std::vector<std::string> violations;  // those seen while expected
inline const char* current_kernel = "";

inline void report_violation(const std::string& what) {
  std::lock_guard<std::mutex> lock(violation_mutex);
  const std::string message = std::string("emulated CUDA: ") + current_kernel + ": " + what;
  if (violations_expected == 0) {
    std::fprintf(stderr, "%s\n(a rule of the hardware was broken; see tests/cuda/emulation)\n",
                 message.c_str());
    std::fflush(stderr);
    std::abort();
  }
  violations.push_back(message);
}

// While alive, violations are recorded (messages()) instead of aborting the process.
class ExpectViolation {
 public:
  ExpectViolation() {
    std::lock_guard<std::mutex> lock(violation_mutex);
    ++violations_expected;
    violations.clear();
  }
  ~ExpectViolation() {
    std::lock_guard<std::mutex> lock(violation_mutex);
    --violations_expected;
  }
  ExpectViolation(const ExpectViolation&) = delete;
  ExpectViolation& operator=(const ExpectViolation&) = delete;
  std::vector<std::string> messages() const {
    std::lock_guard<std::mutex> lock(violation_mutex);
    return violations;
  }
};

inline std::string where(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash != nullptr ? slash + 1 : file) + ":" + std::to_string(line);
}
inline std::string thread_name() {
  return "block " + std::to_string(block_index.x) + " thread " + std::to_string(thread_index.x);
}
inline std::string hex(unsigned v) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", v);
  return text;
}

// --- Shared memory -------------------------------------------------------------------------------
constexpr unsigned char kPoison = 0xff;

// Fills without ASan's memset interceptor: the static arrays sit among ASan's red zones only
// as a whole, so a plain loop over exactly their bytes is what is wanted.
inline void poison(void* at, std::size_t bytes) {
  auto* p = static_cast<volatile unsigned char*>(at);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = kPoison;
}

struct StaticShared {
  void* at;
  std::size_t bytes;
};
inline std::mutex static_shared_mutex;
inline std::vector<StaticShared> static_shared;

// Called once per EMFLOW_SHARED declaration, by the first thread that reaches it (a function
// static's initialisation, which the other threads wait for): poisons it and keeps it so that
// every later block start poisons it again.
inline bool register_static_shared(void* at, std::size_t bytes) {
  poison(at, bytes);
  std::lock_guard<std::mutex> lock(static_shared_mutex);
  static_shared.push_back({at, bytes});
  return true;
}
inline void poison_static_shared() {
  std::lock_guard<std::mutex> lock(static_shared_mutex);
  for (const StaticShared& s : static_shared) poison(s.at, s.bytes);
}

inline std::vector<float4> dynamic_shared;

// --- How the threads of a launch take turns ------------------------------------------------------
// By default the CUDA threads of a launch are fibers of the host thread that runs it: each has a
// stack of its own, and control passes from one to the next only where a thread waits (a
// barrier, a shuffle, the end of a block), in the order of the threads, round after round. Host
// threads, one per CUDA thread (the Team below), leave those turns to the operating system: with
// one shard of the tests per core, about 375,000 switches a second, and more than two thirds of
// the run in sched_yield and the atomic waits around it. ThreadSanitizer reports races between
// host threads, so under it (and with EMU_THREADS=1 in the environment) every CUDA thread is a
// host thread of its own. Per-thread state of the emulated device code is therefore kept by the
// thread's index in the block, never in thread_local variables (but thread_index, which the
// fibers' scheduler sets at every turn, and block_index, the same for every thread of a block).
inline bool use_fibers() {
#if defined(EMU_TSAN) || !defined(__x86_64__)
  return false;
#else
  static const bool fibers = std::getenv("EMU_THREADS") == nullptr;
  return fibers;
#endif
}

#if defined(__x86_64__)
// Saves the running context's callee-saved registers, its SSE and x87 control words and its stack
// pointer (to *from), and resumes the context whose stack pointer is `to` (System V x86-64).
// Written out rather than swapcontext: glibc's makes a system call at every switch (the signal
// mask), and AddressSanitizer intercepts it to clear the shadow of the whole stack it switches to.
// Weak: every translation unit that includes this header defines it.
extern "C" void emu_switch_context(void** from, void* to);
asm(R"(
  .text
  .weak emu_switch_context
  .type emu_switch_context, @function
emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw 12(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw 12(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_context, .-emu_switch_context
)");
#else
// Elsewhere the CUDA threads are host threads (use_fibers), and this is never called.
inline void emu_switch_context(void**, void*) { std::abort(); }
#endif

class Fibers {
 public:
  // Reserved per fiber; only the pages a kernel touches are backed. A page below it, neither
  // readable nor writable, turns an overflow into a fault.
  static constexpr std::size_t kStackBytes = std::size_t{1} << 20;

  // The calling host thread's fibers, their stacks kept from launch to launch.
  static Fibers& of_this_thread() {
    static thread_local Fibers fibers;
    return fibers;
  }
  Fibers() = default;
  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;
  ~Fibers() {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    for (Fiber& f : fibers_) munmap(f.stack - page, kStackBytes + page);
  }

  // The scheduler of the calling host thread, while it runs a launch (else null).
  static Fibers*& running() {
    static thread_local Fibers* scheduler = nullptr;
    return scheduler;
  }

  // Runs body(t) for t = 0 .. count - 1, each on a fiber; returns when every one has returned.
  void run(unsigned count, const std::function<void(unsigned)>& body) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    while (fibers_.size() < count) {
      void* region = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
      if (region == MAP_FAILED || mprotect(region, page, PROT_NONE) != 0) {
        std::perror("emulated CUDA: a fiber's stack");
        std::abort();
      }
      fibers_.emplace_back();
      fibers_.back().stack = static_cast<unsigned char*>(region) + page;
    }
    body_ = &body;
    Fibers*& scheduler = running();
    scheduler = this;
    for (unsigned t = 0; t < count; ++t) start(fibers_[t]);
    for (unsigned left = count; left > 0;) {
      bool turned = false;
      for (unsigned t = 0; t < count; ++t) {
        Fiber& f = fibers_[t];
        // A waiting fiber takes its turn once what it waits for has changed.
        if (f.done || (f.awaited != nullptr && f.awaited->load() == f.seen)) continue;
        f.awaited = nullptr;
        turned = true;
        current_ = t;
        thread_index = {t, 0, 0};
        void* fake_stack = nullptr;
        start_switch(&fake_stack, f.stack, kStackBytes);
        emu_switch_context(&scheduler_sp_, f.sp);
        finish_switch(fake_stack, nullptr, nullptr);
        if (f.done) --left;
      }
      if (!turned) {
        // The barriers and shuffles report a block whose live threads all wait (a violation)
        // before it can come to this, so this is a defect of the emulation itself.
        std::fprintf(stderr, "emulated CUDA: %s: every fiber of the launch waits\n",
                     current_kernel);
        std::abort();
      }
    }
    scheduler = nullptr;
    body_ = nullptr;
  }

  // The running fiber waits until `generation` is no longer `seen`: the others take their turns.
  void wait(const std::atomic<unsigned>& generation, unsigned seen) {
    Fiber& f = fibers_[current_];
    f.awaited = &generation;
    f.seen = seen;
    start_switch(&f.fake_stack, scheduler_bottom_, scheduler_size_);
    emu_switch_context(&f.sp, scheduler_sp_);
    finish_switch(f.fake_stack, &scheduler_bottom_, &scheduler_size_);
  }

 private:
  struct Fiber {
    unsigned char* stack = nullptr;  // its lowest address; kStackBytes of it
    void* sp = nullptr;              // its saved stack pointer, while switched out
    bool done = false;
    const std::atomic<unsigned>* awaited = nullptr;  // what it waits for, if it waits
    unsigned seen = 0;
    void* fake_stack = nullptr;  // AddressSanitizer's, while the fiber is switched out
  };

  // A fresh fiber: its first turn enters `entry` as if emu_switch_context had been called there.
  static void start(Fiber& f) {
    f.done = false;
    f.awaited = nullptr;
    f.fake_stack = nullptr;
    unsigned char* top = f.stack + kStackBytes;
#if defined(EMU_ASAN)
    // The frames the last fiber on this stack left at its end (entry's) may still be poisoned.
    __asan_unpoison_memory_region(top - kStartBytes, kStartBytes);
#endif
    auto* words = reinterpret_cast<std::uint64_t*>(top);
    *--words = 0;  // entry's return address: none (it never returns), and the end of backtraces
    *--words = reinterpret_cast<std::uint64_t>(&Fibers::entry);
    for (int r = 0; r < 6; ++r) *--words = 0;         // rbp, rbx, r12 to r15
    *--words = std::uint64_t{0x037f} << 32 | 0x1f80;  // the x87 and SSE control words' defaults
    --words;
    f.sp = words;
  }
  static constexpr std::size_t kStartBytes = 16384;

  static void entry() {
    Fibers& self = *running();
    self.finish_switch(nullptr, &self.scheduler_bottom_, &self.scheduler_size_);
    const unsigned t = self.current_;
    try {
      (*self.body_)(t);
    } catch (...) {
      std::terminate();  // as an exception leaving a host thread's function does
    }
    Fiber& f = self.fibers_[t];
    f.done = true;
    self.start_switch(nullptr, self.scheduler_bottom_, self.scheduler_size_);  // ends the fiber
    emu_switch_context(&f.sp, self.scheduler_sp_);
    __builtin_unreachable();
  }

  // AddressSanitizer is told of every switch of stacks, or it takes a fiber's frames for
  // overflows of the host thread's stack.
  static void start_switch([[maybe_unused]] void** fake_stack, [[maybe_unused]] const void* bottom,
                           [[maybe_unused]] std::size_t size) {
#if defined(EMU_ASAN)
    __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#endif
  }
  static void finish_switch([[maybe_unused]] void* fake_stack,
                            [[maybe_unused]] const void** bottom_old,
                            [[maybe_unused]] std::size_t* size_old) {
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(fake_stack, bottom_old, size_old);
#endif
  }

  std::vector<Fiber> fibers_;
  void* scheduler_sp_ = nullptr;            // the host thread's stack pointer, while a fiber runs
  const void* scheduler_bottom_ = nullptr;  // the host thread's stack (AddressSanitizer)
  std::size_t scheduler_size_ = 0;
  unsigned current_ = 0;
  const std::function<void(unsigned)>* body_ = nullptr;
};

// Returns once `generation` has moved past `seen`: the fiber gives up its turn meanwhile, or the
// host thread sleeps on the atomic.
inline void await_change(const std::atomic<unsigned>& generation, unsigned seen) {
  if (Fibers* scheduler = Fibers::running()) {
    while (generation.load() == seen) scheduler->wait(generation, seen);
    return;
  }
  while (generation.load() == seen) generation.wait(seen);
}

// --- One block's threads and their synchronisation -----------------------------------------------
struct Warp {
  unsigned valid = 0;    // lanes that exist (the last warp of a block may be partial)
  unsigned exited = 0;   // lanes that have returned from the kernel
  unsigned mask = 0;     // mask of the shuffle being gathered (0: none)
  unsigned arrived = 0;  // lanes of that shuffle that have arrived
  const char* file = "";
  int line = 0;
  std::atomic<unsigned> generation{0};
  double slots[2][32] = {};  // by generation parity: a lane may start the next shuffle early
};

struct Block {
  std::mutex mutex;
  unsigned threads = 0, live = 0, blocked = 0;
  std::atomic<bool> failed{false};
  // The barrier being gathered.
  unsigned arrived = 0;
  const char* file = "";
  int line = 0;
  const char* barrier = "";
  int vote = 0;
  int votes[2] = {0, 0};
  std::atomic<unsigned> generation{0};
  std::unique_ptr<Warp[]> warps;
  unsigned warp_count = 0;

  void reset(unsigned block_threads) {
    threads = live = block_threads;
    blocked = arrived = 0;
    vote = 0;
    failed.store(false);
    warp_count = (block_threads + 31) / 32;
    warps = std::make_unique<Warp[]>(warp_count);
    for (unsigned w = 0; w < warp_count; ++w) {
      const unsigned lanes = std::min(32u, block_threads - w * 32);
      warps[w].valid = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    }
  }

  // With `mutex` held: records the violation, releases every waiting thread (they stop).
  void fail(const std::string& what) {
    report_violation(thread_name() + ": " + what);
    failed.store(true);
    generation.fetch_add(1);
    generation.notify_all();
    for (unsigned w = 0; w < warp_count; ++w) {
      warps[w].generation.fetch_add(1);
      warps[w].generation.notify_all();
    }
  }

  std::string waiting() const {
    std::string s;
    if (arrived > 0) {
      s += std::to_string(arrived) + " thread(s) at " + barrier + " (" + where(file, line) + ")";
    }
    for (unsigned w = 0; w < warp_count; ++w) {
      if (warps[w].mask == 0) continue;
      s += (s.empty() ? "" : "; ") + std::string("warp ") + std::to_string(w) + " in a shuffle (" +
           where(warps[w].file, warps[w].line) + ", mask " + hex(warps[w].mask) + ", arrived " +
           hex(warps[w].arrived) + ")";
    }
    return s;
  }

  // With `mutex` held, after the caller became blocked: every live thread waits and none can be
  // released, so the block would hang on a GPU.
  void check_deadlock() {
    if (blocked == live) fail("every live thread of the block waits: " + waiting());
  }

  void wait(std::atomic<unsigned>& gen, unsigned seen, std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    await_change(gen, seen);
    if (failed.load()) throw KernelStopped{};
  }

  int sync(const char* name, const char* at_file, int at_line, int predicate) {
    std::unique_lock<std::mutex> lock(mutex);
    if (failed.load()) throw KernelStopped{};
    if (live < threads) {
      fail(std::string(name) + " (" + where(at_file, at_line) + ") reached after " +
           std::to_string(threads - live) +
           " thread(s) of the block exited: a barrier reached by part of the block");
      throw KernelStopped{};
    }
    if (arrived == 0) {
      file = at_file;
      line = at_line;
      barrier = name;
      vote = 0;
    } else if (line != at_line || std::strcmp(file, at_file) != 0) {
      fail(std::string(name) + " at " + where(at_file, at_line) + " while " +
           std::to_string(arrived) + " thread(s) wait at " + barrier + " (" + where(file, line) +
           "): divergent barriers");
      throw KernelStopped{};
    }
    vote |= predicate != 0 ? 1 : 0;
    const unsigned seen = generation.load();
    if (++arrived == live) {
      votes[seen & 1] = vote;
      blocked -= arrived - 1;
      arrived = 0;
      generation.fetch_add(1);
      generation.notify_all();
      return votes[seen & 1];
    }
    ++blocked;
    check_deadlock();
    if (failed.load()) throw KernelStopped{};
    wait(generation, seen, lock);
    return votes[seen & 1];
  }

  double shuffle(unsigned mask, double value, unsigned source, const char* at_file, int at_line) {
    const unsigned t = thread_index.x, lane = t % 32;
    std::unique_lock<std::mutex> lock(mutex);
    if (failed.load()) throw KernelStopped{};
    Warp& w = warps[t / 32];
    // Built only for a violation: the common path stays cheap.
    const auto call = [&] {
      return "__shfl_xor_sync (" + where(at_file, at_line) + ", mask " + hex(mask);
    };
    if ((mask >> lane & 1u) == 0) {
      fail(call() + ") by lane " + std::to_string(lane) + ", which the mask leaves out");
      throw KernelStopped{};
    }
    if ((mask & ~w.valid) != 0) {
      fail(call() + ") names lanes " + hex(mask & ~w.valid) + " beyond the block");
      throw KernelStopped{};
    }
    if ((mask & w.exited) != 0) {
      fail(call() + ") names exited lanes " + hex(mask & w.exited));
      throw KernelStopped{};
    }
    if (source >= 32 || (mask >> source & 1u) == 0) {
      fail(call() + ") reads lane " + std::to_string(source) + ", outside the mask");
      throw KernelStopped{};
    }
    if (w.mask != 0 && (w.mask != mask || w.line != at_line || std::strcmp(w.file, at_file))) {
      fail(call() + ") while lanes " + hex(w.arrived) + " of the warp wait in a shuffle at " +
           where(w.file, w.line) + " with mask " + hex(w.mask));
      throw KernelStopped{};
    }
    const unsigned seen = w.generation.load();
    if (w.mask == 0) {
      w.mask = mask;
      w.file = at_file;
      w.line = at_line;
    }
    w.slots[seen & 1][lane] = value;
    w.arrived |= 1u << lane;
    if (w.arrived == mask) {
      blocked -= static_cast<unsigned>(__builtin_popcount(mask)) - 1;
      w.mask = w.arrived = 0;
      w.generation.fetch_add(1);
      w.generation.notify_all();
      return w.slots[seen & 1][source];
    }
    ++blocked;
    check_deadlock();
    if (failed.load()) throw KernelStopped{};
    wait(w.generation, seen, lock);
    return w.slots[seen & 1][source];
  }

  // The calling thread has returned from the kernel (or was stopped).
  void exit(bool stopped) {
    const unsigned t = thread_index.x, lane = t % 32;
    std::lock_guard<std::mutex> lock(mutex);
    --live;
    warps[t / 32].exited |= 1u << lane;
    if (stopped || failed.load()) return;
    if (arrived > 0) {
      fail("returned while " + waiting() + ": a barrier reached by part of the block");
    } else if ((warps[t / 32].mask >> lane & 1u) != 0) {
      fail("returned while its warp waits for it: " + waiting());
    } else if (live > 0 && blocked == live) {
      fail("returned, and every other live thread waits: " + waiting());
    }
  }
};

inline Block block;

// A rule of the hardware broken inside a kernel: the launch stops with the violation.
[[noreturn]] inline void kernel_violation(const std::string& what) {
  std::unique_lock<std::mutex> lock(block.mutex);
  if (!block.failed.load()) block.fail(what);
  throw KernelStopped{};
}

// Whether [at, at + bytes) lies in the block's shared memory (dynamic or a static array).
inline bool in_shared(const void* at, std::size_t bytes) {
  const auto inside = [&](const void* base, std::size_t size) {
    const auto* p = static_cast<const unsigned char*>(at);
    const auto* b = static_cast<const unsigned char*>(base);
    return p >= b && p + bytes <= b + size;
  };
  if (inside(dynamic_shared.data(), dynamic_shared.size() * sizeof(float4))) return true;
  std::lock_guard<std::mutex> lock(static_shared_mutex);
  return std::any_of(static_shared.begin(), static_shared.end(),
                     [&](const StaticShared& s) { return inside(s.at, s.bytes); });
}

// --- Asynchronous copies (cp.async) --------------------------------------------------------------
// The model of cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes with commit_group
// and wait_group: a copy is checked when issued (4, 8 or 16 bytes, both addresses aligned to
// them, the destination in shared memory, src_bytes <= bytes) and its destination filled with
// the poison pattern at once; its bytes (src_bytes from the source, zeros after) land only when
// the issuing thread waits for its group, so a read before the wait sees poison instead of a
// plausible old tile, and another thread's read before the barrier that follows the wait is a
// data race (ThreadSanitizer) as well as poison. Copies not yet committed to a group are not
// waited for (as in PTX: wait_all is commit + wait 0). A thread's copies still pending when it
// returns land then (the hardware finishes them).
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  unsigned bytes, src_bytes;
};
struct AsyncCopies {
  std::vector<AsyncCopy> pending;  // issued, oldest first
  std::vector<std::size_t> ends;   // per committed group, oldest first: its end in `pending`

  void issue(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
    if (bytes != 4 && bytes != 8 && bytes != 16) {
      kernel_violation(thread_name() + ": cp.async of " + std::to_string(bytes) +
                       " bytes (4, 8 or 16)");
    }
    if (reinterpret_cast<std::uintptr_t>(dst) % bytes != 0 ||
        reinterpret_cast<std::uintptr_t>(src) % bytes != 0) {
      kernel_violation(thread_name() + ": cp.async of " + std::to_string(bytes) +
                       " bytes from or to an address not aligned to them");
    }
    if (src_bytes > bytes) {
      kernel_violation(thread_name() + ": cp.async reads " + std::to_string(src_bytes) +
                       " source bytes into " + std::to_string(bytes));
    }
    if (!in_shared(dst, bytes)) {
      kernel_violation(thread_name() + ": cp.async into memory that is not shared");
    }
    poison(dst, bytes);
    pending.push_back({static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src),
                       bytes, src_bytes});
  }
  void commit() { ends.push_back(pending.size()); }
  // Every committed group but the newest `newest` lands.
  void wait(std::size_t newest) {
    if (ends.size() <= newest) return;
    land(ends[ends.size() - 1 - newest]);
  }
  // The first `count` pending copies land.
  void land(std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const AsyncCopy& c = pending[i];
      for (unsigned b = 0; b < c.bytes; ++b) c.dst[b] = b < c.src_bytes ? c.src[b] : 0;
    }
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(count));
    std::vector<std::size_t> kept;
    for (std::size_t end : ends) {
      if (end > count) kept.push_back(end - count);
    }
    ends = kept;
  }
  void finish(bool stopped) {
    if (!stopped) land(pending.size());
    pending.clear();
    ends.clear();
  }
};
inline AsyncCopies async_copies_of[1024];
// The calling CUDA thread's copies.
inline AsyncCopies& async_copies() { return async_copies_of[thread_index.x]; }

// The order of the blocks: a permutation drawn from EMU_SEED (default 1) and the launch's
// number, so a run is reproducible and every launch sees another order.
inline unsigned long long seed() {
  static const unsigned long long value = [] {
    const char* text = std::getenv("EMU_SEED");
    return text != nullptr ? std::strtoull(text, nullptr, 10) : 1ull;
  }();
  return value;
}
inline unsigned long long launches = 0;

// Runs only the last `n` blocks of each launch when n > 0 (a test of the indexing at the end
// of a grid over an array too large to be processed whole on a CPU).
inline unsigned only_last_blocks = 0;

// The host threads that run a launch's CUDA threads where they are not fibers (ThreadSanitizer,
// EMU_THREADS=1), made once and kept: starting and ending a
// thread costs more than most emulated blocks (about 45 ms for a block of 256 threads under
// ASan, against 0.5 ms for one of its barriers), so each launch hands its body to the first
// `count` of them instead. Launches are serialised (cuda_runtime.h runs them under its queue's
// lock), so one team serves them all; thread_index, block_index and async_copies are set or
// finished per block by the body, so nothing of one launch reaches the next.
class Team {
 public:
  static Team& instance() {
    static Team team;
    return team;
  }
  // Runs body(t) for t = 0 .. count - 1 on `count` threads at once; returns when all are done.
  void run(unsigned count, const std::function<void(unsigned)>& body) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (workers_.size() < count) {
      // A new worker knows the generation before this launch's, so it cannot miss it.
      const auto t = static_cast<unsigned>(workers_.size());
      workers_.emplace_back([this, t, seen = generation_] { work(t, seen); });
    }
    body_ = &body;
    active_ = count;
    finished_ = 0;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return finished_ == active_; });
    body_ = nullptr;
  }
  ~Team() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      ++generation_;
    }
    start_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

 private:
  Team() = default;
  void work(unsigned t, unsigned long long seen) {
    for (;;) {
      const std::function<void(unsigned)>* body = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stopping_) return;
        if (t >= active_) continue;
        body = body_;
      }
      (*body)(t);
      std::lock_guard<std::mutex> lock(mutex_);
      if (++finished_ == active_) done_.notify_one();
    }
  }
  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(unsigned)>* body_ = nullptr;
  unsigned active_ = 0, finished_ = 0;
  unsigned long long generation_ = 0;
  bool stopping_ = false;
};

// The barrier at the end of every block: the last of its threads to arrive starts the next block
// (`start`, with every other thread still waiting), then all go on.
class BetweenBlocks {
 public:
  BetweenBlocks(unsigned threads, const std::function<void()>& start)
      : threads_(threads), start_(start) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned seen = generation_.load();
    if (++arrived_ == threads_) {
      arrived_ = 0;
      start_();
      generation_.fetch_add(1);
      generation_.notify_all();
      return;
    }
    lock.unlock();
    await_change(generation_, seen);
  }

 private:
  const unsigned threads_;
  const std::function<void()>& start_;
  std::mutex mutex_;
  unsigned arrived_ = 0;
  std::atomic<unsigned> generation_{0};
};

// Runs a kernel: `grid` blocks of `threads` threads, `shared` bytes of dynamic shared memory.
// Returns false when a violation stopped it.
template <class Kernel>
bool run_blocks(const char* name, unsigned grid, unsigned threads, std::size_t shared,
                Kernel&& kernel) {
  current_kernel = name;
  block.failed.store(false);
  block_dim = {threads, 1, 1};
  grid_dim = {grid, 1, 1};
  std::vector<unsigned> order(grid);
  for (unsigned b = 0; b < grid; ++b) order[b] = b;
  std::mt19937_64 random(seed() * 0x9e3779b97f4a7c15ull + launches++);
  std::shuffle(order.begin(), order.end(), random);
  if (only_last_blocks > 0 && only_last_blocks < grid) {
    order.assign({});
    for (unsigned b = grid - only_last_blocks; b < grid; ++b) order.push_back(b);
  }
  dynamic_shared.assign((shared + sizeof(float4) - 1) / sizeof(float4), float4{});
  bool stopped = false;
  std::size_t next = 0;
  const std::function<void()> start_block = [&]() noexcept {
    if (block.failed.load()) stopped = true;
    if (stopped || next == order.size()) return;
    block.reset(threads);
    ++block_serial;
    poison(dynamic_shared.data(), dynamic_shared.size() * sizeof(float4));
    poison_static_shared();
    ++next;
  };
  start_block();
  BetweenBlocks between_blocks(threads, start_block);
  const std::function<void(unsigned)> body = [&](unsigned t) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      thread_index = {t, 0, 0};
      block_index = {order[k], 0, 0};
      bool halted = false;
      try {
        kernel();
      } catch (const KernelStopped&) {
        halted = true;
      }
      async_copies().finish(halted);
      block.exit(halted);
      between_blocks.arrive_and_wait();
      if (stopped) break;
    }
  };
  if (use_fibers()) {
    Fibers::of_this_thread().run(threads, body);
  } else {
    Team::instance().run(threads, body);
  }
  current_kernel = "";
  return !stopped && !block.failed.load();
}

}  // namespace emu

#define threadIdx (emu::thread_index)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

#define __syncthreads() (void)emu::block.sync("__syncthreads", __FILE__, __LINE__, 0)
// A barrier that also tells every thread whether `predicate` held for any thread of the block.
#define __syncthreads_or(predicate) \
  emu::block.sync("__syncthreads_or", __FILE__, __LINE__, (predicate))
#define __shfl_xor_sync(mask, value, lane_mask) \
  emu::shfl_xor(mask, value, lane_mask, __FILE__, __LINE__)

namespace emu {
template <class T>
T shfl_xor(unsigned mask, T value, int lane_mask, const char* file, int line) {
  const unsigned lane = thread_index.x % 32;
  return static_cast<T>(block.shuffle(mask, static_cast<double>(value),
                                      lane ^ static_cast<unsigned>(lane_mask), file, line));
}
}  // namespace emu

// Static shared memory is declared with EMFLOW_SHARED (kernels/launch.cuh), which the
// emulation poisons at every block start; a bare __shared__ declaration would escape that.
#define __shared__ \
  static_assert(false, "declare static shared memory with EMFLOW_SHARED (kernels/launch.cuh)");

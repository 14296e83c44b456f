// What the processor offers the CPU paths (Machine::cpu_features, capability.hpp): CPUID and the
// state the operating system saves (XCR0), read here, in code compiled for the baseline target,
// so that it runs on any x86-64 and can tell a user that the CPU backend (src/cpu, compiled for
// the build host by default) needs more than this processor has, before any of its instructions
// run.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "backends.hpp"
#include "emflow/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace emflow::detail {

namespace {

#if defined(__x86_64__) || defined(__i386__)
struct Registers {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Registers cpuid(unsigned leaf, unsigned subleaf) {
  Registers r;
  if (__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx) == 0) return Registers{};
  return r;
}

std::uint64_t saved_state() {
  std::uint32_t low = 0, high = 0;
  __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
  return (static_cast<std::uint64_t>(high) << 32) | low;
}

bool bit(unsigned value, int index) { return ((value >> index) & 1U) != 0; }
#endif

}  // namespace

std::vector<std::string> cpu_feature_names() {
  return {"avx2",       "fma",        "f16c",     "bmi2",       "avx512f",
          "avx512dq",   "avx512bw",   "avx512vl", "avx512vnni", "avx512vbmi",
          "avx512bf16", "avx512fp16", "amx-tile", "amx-bf16",   "amx-int8"};
}

CpuProbe probe_cpu(const char* disabled) {
  CpuProbe probe;
#if defined(__x86_64__) || defined(__i386__)
  const Registers basic = cpuid(0, 0);
  const Registers one = basic.eax >= 1 ? cpuid(1, 0) : Registers{};
  const Registers seven = basic.eax >= 7 ? cpuid(7, 0) : Registers{};
  const Registers seven_one = basic.eax >= 7 && seven.eax >= 1 ? cpuid(7, 1) : Registers{};
  // The operating system must save the vector state: YMM (bits 1, 2 of XCR0), the AVX-512 opmask
  // and ZMM halves (5, 6, 7), the AMX tiles (17, 18).
  const std::uint64_t state = bit(one.ecx, 27) ? saved_state() : 0;
  const bool ymm = (state & 0x6U) == 0x6U;
  const bool zmm = ymm && (state & 0xE0U) == 0xE0U;
  const bool tiles = (state & 0x60000U) == 0x60000U;
  const auto add = [&](const char* name, bool present) {
    if (present) probe.features.emplace_back(name);
  };
  add("avx2", ymm && bit(seven.ebx, 5));
  add("fma", ymm && bit(one.ecx, 12));
  add("f16c", ymm && bit(one.ecx, 29));
  add("bmi2", bit(seven.ebx, 8));
  add("avx512f", zmm && bit(seven.ebx, 16));
  add("avx512dq", zmm && bit(seven.ebx, 17));
  add("avx512bw", zmm && bit(seven.ebx, 30));
  add("avx512vl", zmm && bit(seven.ebx, 31));
  add("avx512vnni", zmm && bit(seven.ecx, 11));
  add("avx512vbmi", zmm && bit(seven.ecx, 1));
  add("avx512bf16", zmm && bit(seven_one.eax, 5));
  add("avx512fp16", zmm && bit(seven.edx, 23));
  add("amx-tile", tiles && bit(seven.edx, 24));
  add("amx-bf16", tiles && bit(seven.edx, 22));
  add("amx-int8", tiles && bit(seven.edx, 25));
  // The brand string: leaves 0x80000002 to 0x80000004, 16 bytes each.
  if (cpuid(0x80000000U, 0).eax >= 0x80000004U) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Registers r = cpuid(0x80000002U + i, 0);
      const unsigned words[4] = {r.eax, r.ebx, r.ecx, r.edx};
      for (int w = 0; w < 4; ++w) {
        for (int b = 0; b < 4; ++b)
          brand[16 * i + 4 * w + b] = static_cast<char>(words[w] >> (8 * b));
      }
    }
    probe.name = brand;
    const auto first = probe.name.find_first_not_of(' ');
    const auto last = probe.name.find_last_not_of(' ');
    probe.name = first == std::string::npos ? "" : probe.name.substr(first, last - first + 1);
  }
  // Family and model (leaf 1, with the extended fields), which name a generation where the
  // brand string does not (a virtual machine's "AMD EPYC").
  if (basic.eax >= 1) {
    unsigned family = (one.eax >> 8) & 0xFU;
    unsigned model = (one.eax >> 4) & 0xFU;
    if (family == 0xFU) family += (one.eax >> 20) & 0xFFU;
    if (family >= 6) model |= ((one.eax >> 16) & 0xFU) << 4;
    probe.name += (probe.name.empty() ? "" : " ") + std::string("(family ") +
                  std::to_string(family) + ", model " + std::to_string(model) + ")";
  }
#endif
  // EMFLOW_CPU_DISABLE: extensions whose paths are not to be taken (for tests of the others).
  if (disabled != nullptr && *disabled != '\0') {
    const std::vector<std::string> known = cpu_feature_names();
    std::stringstream list(disabled);
    std::string name;
    while (std::getline(list, name, ',')) {
      if (name.empty()) continue;
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        std::string names;
        for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
        throw Error(ErrorCode::invalid_argument,
                    "environment variable EMFLOW_CPU_DISABLE names '" + name +
                        "', expected a comma-separated list of: " + names);
      }
      probe.disabled.push_back(name);
    }
  }
  return probe;
}

std::vector<std::string> usable_cpu_features(const CpuProbe& probe) {
  std::vector<std::string> usable;
  for (const std::string& name : probe.features) {
    if (std::find(probe.disabled.begin(), probe.disabled.end(), name) == probe.disabled.end()) {
      usable.push_back(name);
    }
  }
  return usable;
}

std::string cpu_missing_features(const std::vector<std::string>& required,
                                 const std::vector<std::string>& found) {
  std::string missing;
  for (const std::string& name : required) {
    if (std::find(found.begin(), found.end(), name) == found.end()) {
      missing += (missing.empty() ? "" : " ") + name;
    }
  }
  return missing;
}

}  // namespace emflow::detail

// What the libFuzzer targets share: how a defect is reported, which errors a file reader may
// throw, and where an input is written (memory, so a run is not disk-bound).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "emflow/error.hpp"

namespace fuzz {

/// The target's name, for messages and scratch files; each target defines it.
extern const char* const kTarget;

/// A defect: printed, then abort() so libFuzzer keeps the input.
[[noreturn]] inline void defect(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s: %s\n", kTarget, what, detail.c_str());
  std::abort();
}

/// A reader may refuse a file only as malformed (io) or too large (out_of_memory), with a text.
inline void expect_file_error(const emflow::Error& e) {
  if (e.code() != emflow::ErrorCode::io && e.code() != emflow::ErrorCode::out_of_memory) {
    defect("unexpected error kind", std::string(emflow::to_string(e.code())) + ": " + e.what());
  }
  if (std::strlen(e.what()) == 0) defect("empty error message", "");
}

/// A path private to this process in /dev/shm (or /tmp without it), ending in `name`.
inline std::string scratch_path(const char* name) {
  const char* folder = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  return std::string(folder) + "/emflow_" + kTarget + "_" + std::to_string(::getpid()) + "_" + name;
}

/// Writes the fuzzer's bytes to `path`.
inline void write_input(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) defect("cannot write the input file", path);
  const bool written = size == 0 || std::fwrite(data, 1, size, file) == size;
  if (std::fclose(file) != 0 || !written) defect("short write", path);
}

}  // namespace fuzz

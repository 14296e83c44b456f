// Helpers shared by the emflow subcommands: reading input arrays with errors that name the
// option and the file, the --device/--threads options, and outputs that are written all
// together or not at all.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../core/check.hpp"
#include "emflow/attention.hpp"
#include "emflow/io.hpp"
#include "emflow/tensor.hpp"

namespace emflow::detail {
class StagedFile;
}

namespace emflow::cli {

/// Throws emflow::Error(invalid_argument) "option: <parts>", e.g.
/// "--m 'M.npy': has shape (3, 3), expected (64, 64) or (H, 64, 64)".
template <class... Parts>
[[noreturn]] void fail_option(const std::string& option, Parts&&... parts) {
  detail::fail(ErrorCode::invalid_argument, option, " ", std::forward<Parts>(parts)...);
}

/// Runs `body`; an emflow::Error it throws is rethrown with "option: " in front, so a message
/// from the library (which names the file) also names the command-line option.
template <class Body>
auto naming_option(const std::string& option, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const Error& e) {
    throw Error(e.code(), option + ": " + e.what());
  }
}

/// The element type of the .npy file `path` given by `option`; refuses integer files.
Dtype float_dtype(const std::string& option, const std::string& path);

/// Reads the float .npy file `path` given by `option` as T. Its dtype must be `expected` (all
/// float inputs of a command share the precision of its main input, named `main_option`) and
/// its rank in [min_rank, max_rank].
template <class T>
Tensor<T> read_float_input(const std::string& option, const std::string& path, Dtype expected,
                           const std::string& main_option, std::int64_t min_rank,
                           std::int64_t max_rank);

/// Reads the integer (int32 or int64) .npy file `path` given by `option`.
Tensor<std::int64_t> read_integer_input(const std::string& option, const std::string& path,
                                        std::int64_t min_rank, std::int64_t max_rank);

/// Throws unless `actual` == `expected`; `meaning` explains the expectation, e.g. "(d) with d
/// from --x".
void expect_shape(const std::string& option, const std::string& path, const Shape& actual,
                  const Shape& expected, const std::string& meaning = "");

/// Adds --device (auto|cpu|cuda|reference, default auto) bound to `text`.
CLI::Option* add_device_option(CLI::App& command, std::string& text);
/// Adds --threads (CPU threads, 0 = all, default 0) bound to `threads`.
CLI::Option* add_threads_option(CLI::App& command, int& threads);
/// Parses what add_device_option / add_threads_option collected.
ExecutionOptions execution_options(const std::string& device, int threads);

/// The output files of one run. Declare every target first (declare(): cheap checks before any
/// computing, so a mistyped folder fails in milliseconds, not after the work); then stage each
/// result (written in full to a temporary file beside its target) and commit() once: every
/// target is renamed into place, and if one rename fails the targets this run already renamed
/// are removed again, so a failed run leaves no output file and no temporary file behind.
class Outputs {
 public:
  Outputs();
  ~Outputs();
  Outputs(const Outputs&) = delete;
  Outputs& operator=(const Outputs&) = delete;

  /// Records that `option` will write `path`: the path must be non-empty, differ from every
  /// other declared output, and lie in an existing folder.
  void declare(const std::string& option, const std::string& path);

  /// Writes `array` as .npy to a temporary file for the declared `path`.
  template <class T>
  void stage_npy(const std::string& path, const Tensor<T>& array);
  /// Writes raw `bytes` to a temporary file for the declared `path`.
  void stage_bytes(const std::string& path, const std::string& bytes);

  /// Renames every staged file into place (all or none, see above).
  void commit();

 private:
  const std::string& option_of(const std::string& path) const;

  std::vector<std::pair<std::string, std::string>> declared_;  // (option, path)
  std::vector<std::unique_ptr<detail::StagedFile>> staged_;
};

}  // namespace emflow::cli

// Helpers shared by the emflow subcommands: errors that name the option, reading input arrays
// with errors that name the option and the file, the --device/--threads options, and the
// registration of a subcommand.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli11_fwd.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"
#include "emflow/tensor.hpp"

namespace emflow::cli {

/// Throws emflow::Error(code) whose message is `parts` streamed one after the other.
template <class... Parts>
[[noreturn]] void fail(ErrorCode code, Parts&&... parts) {
  std::ostringstream message;
  message.exceptions(std::ios::badbit);  // a failed allocation is rethrown, not truncated text
  (message << ... << std::forward<Parts>(parts));
  throw Error(code, message.str());
}

/// Throws emflow::Error(invalid_argument) "option <parts>", e.g.
/// "--m 'M.npy' has shape (3, 3), expected (64, 64) or (H, 64, 64)".
template <class... Parts>
[[noreturn]] void fail_option(const std::string& option, Parts&&... parts) {
  fail(ErrorCode::invalid_argument, option, " ", std::forward<Parts>(parts)...);
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

/// The element type of the .npy file `path` given by `option`; refuses integer files, and
/// float16 files unless `allow_float16` (the commands that take --precision fp16).
Dtype float_dtype(const std::string& option, const std::string& path, bool allow_float16 = false);

/// Reads the float .npy file `path` given by `option` as T. Its dtype must be `expected` (all
/// float inputs of a command share the precision of its main input, named `main_option`) and
/// its rank in [min_rank, max_rank]. A float16 file is read exactly when `expected` is float16.
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

/// The files of one attention layer's operators as the attend commands take them: --m, --f and
/// the optional --key-bias and --offset (empty: not given).
struct LayerFiles {
  std::string relevance, content, key_bias, offset;

  /// Declares the files as inputs of `outputs` (no output may overwrite one).
  void declare_inputs(OutputFiles& outputs) const {
    outputs.declare_input("--m", relevance);
    outputs.declare_input("--f", content);
    outputs.declare_input("--key-bias", key_bias);
    outputs.declare_input("--offset", offset);
  }
};

/// The operators read from LayerFiles and checked against d (from --x): --m (d, d) or (H, d, d),
/// --f the shape of --m, --key-bias (H, d) (or (d) for one head), --offset (d).
template <class T>
struct LayerArrays {
  std::int64_t heads = 1;
  Tensor<T> relevance, content, key_bias, offset;  ///< key_bias and offset empty if not given

  LayerOperators<T> operators() const {
    return {heads, relevance.data(), content.data(),
            key_bias.size() > 0 ? key_bias.data() : nullptr,
            offset.size() > 0 ? offset.data() : nullptr};
  }
};

/// Reads and checks the operators of `files`, every one of dtype `dtype` (that of --x).
template <class T>
LayerArrays<T> read_layer(const LayerFiles& files, Dtype dtype, std::int64_t dim);

/// With --check-finite: refuses NaN and infinity in the operators, naming the file and the
/// first such element.
template <class T>
void require_finite_layer(const LayerArrays<T>& layer, const LayerFiles& files);

/// Reads the per-cloud lengths `path` of `option` (int32 or int64, shape (batch)); each must lie
/// in [0, limit], `limit_meaning` saying where the limit comes from, e.g. "(N from --x)".
Tensor<std::int64_t> read_lengths(const std::string& option, const std::string& path,
                                  std::int64_t batch, std::int64_t limit,
                                  const std::string& limit_meaning);

/// One factor of a size product, and the option (or the words) it comes from.
struct Factor {
  std::string option;  ///< "--tokens": named first when this factor is the largest
  std::int64_t value;
  std::string shown = "";  ///< how the list shows it; "<option> <value>" when empty
};

/// Returns the product of `factors`; throws emflow::Error(invalid_argument) when it overflows
/// or exceeds `limit`, naming the option of the largest factor first and listing every factor,
/// e.g. "--tokens is too large: --batch 1 x --tokens 1000000000 x --dim 3 = 3000000000 values
/// of the clouds, more than the limit of 2147483648".
std::int64_t expect_product_at_most(const std::vector<Factor>& factors, std::int64_t limit,
                                    const std::string& what);

/// A zeroed Tensor for the output of `option`; a failed allocation is reported as
/// ErrorCode::out_of_memory naming the option and the bytes it needed.
template <class T>
Tensor<T> allocate_output(const std::string& option, const Shape& shape);

/// Adds --device (auto|cpu|cuda|reference, default auto) bound to `text`.
CLI::Option* add_device_option(CLI::App& command, std::string& text);
/// Adds --threads (CPU threads, 0 = all, default 0, at most emflow::max_threads(), the library's
/// limit) bound to `threads`.
CLI::Option* add_threads_option(CLI::App& command, int& threads);
/// Parses what add_device_option / add_threads_option collected.
ExecutionOptions execution_options(const std::string& device, int threads);

/// Whether the user gave `option` (registered, and counted at least once by the parse).
bool given(const CLI::Option* option);

/// Adds the subcommand `name` with its one-line `summary` and the `footer` its --help ends with.
CLI::App* add_command(CLI::App& app, const std::string& name, const std::string& summary,
                      const std::string& footer);

}  // namespace emflow::cli

#include "common.hpp"

namespace emflow::cli {

Dtype float_dtype(const std::string& option, const std::string& path) {
  const NpyHeader header = naming_option(option, [&] { return read_npy_header(path); });
  if (header.dtype != Dtype::float32 && header.dtype != Dtype::float64) {
    fail_option(option, "'", path, "' holds ", to_string(header.dtype),
                " data; expected float32 or float64");
  }
  return header.dtype;
}

namespace {

void expect_rank(const std::string& option, const std::string& path, const Shape& shape,
                 std::int64_t min_rank, std::int64_t max_rank) {
  const auto rank = static_cast<std::int64_t>(shape.size());
  if (rank < min_rank || rank > max_rank) {
    if (min_rank == max_rank) {
      fail_option(option, "'", path, "' has rank ", rank, " (shape ", to_string(shape),
                  "), expected rank ", min_rank);
    }
    fail_option(option, "'", path, "' has rank ", rank, " (shape ", to_string(shape),
                "), expected rank ", min_rank, " to ", max_rank);
  }
}

}  // namespace

template <class T>
Tensor<T> read_float_input(const std::string& option, const std::string& path, Dtype expected,
                           const std::string& main_option, std::int64_t min_rank,
                           std::int64_t max_rank) {
  const Dtype dtype = float_dtype(option, path);
  if (dtype != expected) {
    fail_option(option, "'", path, "' holds ", to_string(dtype), " data but ", main_option,
                " holds ", to_string(expected), "; every float input must have the precision of ",
                main_option);
  }
  Tensor<T> array = naming_option(option, [&] { return read_npy<T>(path); });
  expect_rank(option, path, array.shape(), min_rank, max_rank);
  return array;
}

template Tensor<float> read_float_input<float>(const std::string&, const std::string&, Dtype,
                                               const std::string&, std::int64_t, std::int64_t);
template Tensor<double> read_float_input<double>(const std::string&, const std::string&, Dtype,
                                                 const std::string&, std::int64_t, std::int64_t);

Tensor<std::int64_t> read_integer_input(const std::string& option, const std::string& path,
                                        std::int64_t min_rank, std::int64_t max_rank) {
  const NpyHeader header = naming_option(option, [&] { return read_npy_header(path); });
  if (header.dtype != Dtype::int32 && header.dtype != Dtype::int64) {
    fail_option(option, "'", path, "' holds ", to_string(header.dtype),
                " data; expected int32 or int64");
  }
  Tensor<std::int64_t> array = naming_option(option, [&] { return read_npy<std::int64_t>(path); });
  expect_rank(option, path, array.shape(), min_rank, max_rank);
  return array;
}

void expect_shape(const std::string& option, const std::string& path, const Shape& actual,
                  const Shape& expected, const std::string& meaning) {
  if (actual == expected) return;
  fail_option(option, "'", path, "' has shape ", to_string(actual), ", expected ",
              to_string(expected), meaning.empty() ? "" : " ", meaning);
}

CLI::Option* add_device_option(CLI::App& command, std::string& text) {
  return command
      .add_option("--device", text,
                  "where to compute: auto (the GPU when one is present, else cpu), cpu (fast "
                  "multi-threaded), cuda (an error without a GPU), reference (float64, slow)")
      ->capture_default_str();
}

CLI::Option* add_threads_option(CLI::App& command, int& threads) {
  return command.add_option("--threads", threads, "CPU threads; 0 uses every core")
      ->capture_default_str();
}

ExecutionOptions execution_options(const std::string& device, int threads) {
  ExecutionOptions options;
  options.device = parse_device(device, "--device");
  if (threads < 0) fail_option("--threads", "must be >= 0, got ", threads);
  options.threads = threads;
  return options;
}

CLI::App* add_command(CLI::App& app, const std::string& name, const std::string& summary,
                      const std::string& footer) {
  CLI::App* command = app.add_subcommand(name, summary);
  command->footer(footer);
  return command;
}

}  // namespace emflow::cli

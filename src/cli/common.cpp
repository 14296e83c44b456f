#include "common.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <new>
#include <thread>

#include "emflow/finite.hpp"

namespace emflow::cli {

Dtype float_dtype(const std::string& option, const std::string& path, bool allow_float16) {
  const NpyHeader header = naming_option(option, [&] { return read_npy_header(path); });
  if (header.dtype == Dtype::float16 && !allow_float16) {
    fail_option(option, "'", path,
                "' holds float16 data; expected float32 or float64 (float16 files are read by "
                "'emflow attend --precision fp16')");
  }
  if (header.dtype != Dtype::float32 && header.dtype != Dtype::float64 &&
      header.dtype != Dtype::float16) {
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
  const Dtype dtype = float_dtype(option, path, expected == Dtype::float16);
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

template <class T>
LayerArrays<T> read_layer(const LayerFiles& files, Dtype dtype, std::int64_t dim) {
  const std::string from_x = "(d = " + std::to_string(dim) + " from --x)";
  LayerArrays<T> layer;
  // (d, d) is one head, (H, d, d) a layer of H heads.
  layer.relevance = read_float_input<T>("--m", files.relevance, dtype, "--x", 2, 3);
  const Tensor<T>& m = layer.relevance;
  layer.heads = m.rank() == 3 ? m.extent(0) : 1;
  if (m.extent(m.rank() - 1) != dim || m.extent(m.rank() - 2) != dim) {
    fail_option("--m", "'", files.relevance, "' has shape ", to_string(m.shape()), ", expected (",
                dim, ", ", dim, ") or (H, ", dim, ", ", dim, ") ", from_x);
  }
  layer.content = read_float_input<T>("--f", files.content, dtype, "--x", 2, 3);
  expect_shape("--f", files.content, layer.content.shape(), m.shape(), "(the shape of --m)");
  if (!files.key_bias.empty()) {
    layer.key_bias = read_float_input<T>("--key-bias", files.key_bias, dtype, "--x", 1, 2);
    // One row per head; a single head may also give the bare vector (d).
    if (!(layer.heads == 1 && layer.key_bias.shape() == Shape{dim})) {
      expect_shape("--key-bias", files.key_bias, layer.key_bias.shape(), {layer.heads, dim},
                   layer.heads == 1 ? "or (" + std::to_string(dim) + ",) " + from_x
                                    : "(H from --m, d from --x)");
    }
  }
  if (!files.offset.empty()) {
    layer.offset = read_float_input<T>("--offset", files.offset, dtype, "--x", 1, 1);
    expect_shape("--offset", files.offset, layer.offset.shape(), {dim}, from_x);
  }
  return layer;
}

template LayerArrays<float> read_layer<float>(const LayerFiles&, Dtype, std::int64_t);
template LayerArrays<double> read_layer<double>(const LayerFiles&, Dtype, std::int64_t);

template <class T>
void require_finite_layer(const LayerArrays<T>& layer, const LayerFiles& files) {
  require_finite(layer.relevance, "--m '" + files.relevance + "'");
  require_finite(layer.content, "--f '" + files.content + "'");
  require_finite(layer.key_bias, "--key-bias '" + files.key_bias + "'");
  require_finite(layer.offset, "--offset '" + files.offset + "'");
}

template void require_finite_layer<float>(const LayerArrays<float>&, const LayerFiles&);
template void require_finite_layer<double>(const LayerArrays<double>&, const LayerFiles&);

Tensor<std::int64_t> read_lengths(const std::string& option, const std::string& path,
                                  std::int64_t batch, std::int64_t limit,
                                  const std::string& limit_meaning) {
  Tensor<std::int64_t> lengths = read_integer_input(option, path, 1, 1);
  expect_shape(option, path, lengths.shape(), {batch}, "(one length per cloud of --x)");
  for (std::int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > limit) {
      fail_option(option, "'", path, "' entry ", b, " is ", lengths[b],
                  ", expected a length in [0, ", limit, "] ", limit_meaning);
    }
  }
  return lengths;
}

std::int64_t expect_product_at_most(const std::vector<Factor>& factors, std::int64_t limit,
                                    const std::string& what) {
  std::int64_t product = 1;
  bool overflow = false;
  std::size_t largest = 0;
  for (std::size_t i = 0; i < factors.size(); ++i) {
    overflow = overflow || __builtin_mul_overflow(product, factors[i].value, &product);
    if (factors[i].value > factors[largest].value) largest = i;
  }
  if (!overflow && product <= limit) return product;
  std::ostringstream list;
  list.exceptions(std::ios::badbit);
  for (std::size_t i = 0; i < factors.size(); ++i) {
    list << (i ? " x " : "");
    if (factors[i].shown.empty()) {
      list << factors[i].option << " " << factors[i].value;
    } else {
      list << factors[i].shown;
    }
  }
  if (overflow) {
    fail_option(factors[largest].option, "is too large: ", list.str(), " ", what,
                " overflows 64 bits; the limit is ", limit);
  }
  fail_option(factors[largest].option, "is too large: ", list.str(), " = ", product, " ", what,
              ", more than the limit of ", limit);
}

template <class T>
Tensor<T> allocate_output(const std::string& option, const Shape& shape) {
  try {
    return Tensor<T>(shape);
  } catch (const std::bad_alloc&) {
    const std::int64_t count = checked_element_count(shape, "output");
    fail(ErrorCode::out_of_memory, option, ": out of memory: the output needs ",
         count * static_cast<std::int64_t>(sizeof(T)), " bytes: shape ", to_string(shape), ", ",
         count, " values of ", sizeof(T), " bytes");
  }
}

template Tensor<float> allocate_output<float>(const std::string&, const Shape&);
template Tensor<double> allocate_output<double>(const std::string&, const Shape&);

CLI::Option* add_device_option(CLI::App& command, std::string& text) {
  return command
      .add_option("--device", text,
                  "where to compute: auto (the GPU when one is present, else cpu), cpu (fast "
                  "multi-threaded), cuda (an error without a GPU), reference (float64, slow)")
      ->capture_default_str();
}

CLI::Option* add_threads_option(CLI::App& command, int& threads) {
  return command
      .add_option("--threads", threads,
                  "CPU threads; 0 uses every core; at most 4 per core (" +
                      std::to_string(max_threads()) + " here)")
      ->capture_default_str();
}

ExecutionOptions execution_options(const std::string& device, int threads) {
  ExecutionOptions options;
  options.device = parse_device(device, "--device");
  if (threads < 0) fail_option("--threads", "must be >= 0, got ", threads);
  if (threads > max_threads()) {
    const unsigned cores = std::thread::hardware_concurrency();
    fail_option("--threads", "must be at most ", max_threads(), " (4 per core of the ", cores,
                " cores of this machine; more threads only slow the run down), got ", threads);
  }
  options.threads = threads;
  return options;
}

bool given(const CLI::Option* option) { return option != nullptr && option->count() > 0; }

CLI::App* add_command(CLI::App& app, const std::string& name, const std::string& summary,
                      const std::string& footer) {
  CLI::App* command = app.add_subcommand(name, summary);
  command->footer(footer);
  return command;
}

}  // namespace emflow::cli

#include "common.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "../io/npy_writer.hpp"
#include "../io/staged_file.hpp"

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

Outputs::Outputs() = default;
Outputs::~Outputs() = default;  // unique_ptr<StagedFile> removes what was never committed

void Outputs::declare(const std::string& option, const std::string& path) {
  if (path.empty()) fail_option(option, "needs a file name, got ''");
  for (const auto& [other_option, other_path] : declared_) {
    if (other_path == path) {
      fail_option(option, "'", path, "' is also the file of ", other_option,
                  "; each output needs its own file");
    }
  }
  const std::size_t slash = path.find_last_of('/');
  const std::string folder =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    fail_option(option, "'", path, "': the folder '", folder, "' does not exist");
  }
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    fail_option(option, "'", path, "': the folder '", folder,
                "' is not writable: ", std::strerror(errno));
  }
  declared_.emplace_back(option, path);
}

const std::string& Outputs::option_of(const std::string& path) const {
  for (const auto& [option, declared_path] : declared_) {
    if (declared_path == path) return option;
  }
  detail::fail(ErrorCode::internal, "output '", path, "' was not declared");
}

template <class T>
void Outputs::stage_npy(const std::string& path, const Tensor<T>& array) {
  const std::string& option = option_of(path);
  naming_option(option, [&] {
    auto file = std::make_unique<detail::StagedFile>(path, "write_npy");
    detail::write_npy_to(*file, array);
    staged_.push_back(std::move(file));
  });
}

template void Outputs::stage_npy<float>(const std::string&, const Tensor<float>&);
template void Outputs::stage_npy<double>(const std::string&, const Tensor<double>&);
template void Outputs::stage_npy<std::int64_t>(const std::string&, const Tensor<std::int64_t>&);

void Outputs::stage_bytes(const std::string& path, const std::string& bytes) {
  const std::string& option = option_of(path);
  naming_option(option, [&] {
    auto file = std::make_unique<detail::StagedFile>(path, "write");
    file->write(bytes);
    staged_.push_back(std::move(file));
  });
}

void Outputs::commit() {
  std::size_t done = 0;
  try {
    for (; done < staged_.size(); ++done) {
      const std::string& option = option_of(staged_[done]->target());
      naming_option(option, [&] { staged_[done]->commit(); });
    }
  } catch (...) {
    // All or nothing: take back what this run already put in place.
    for (std::size_t i = 0; i < done; ++i) std::remove(staged_[i]->target().c_str());
    staged_.clear();
    throw;
  }
  staged_.clear();
}

}  // namespace emflow::cli

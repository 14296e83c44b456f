// emflow: files. NumPy .npy arrays (float32 / float64, C order, little endian, rank 1 to 4)
// and atomic output: every file emflow writes is written to a temporary file beside the target
// and renamed into place, so a failed run never leaves a half-written or stale output;
// OutputFiles does the same for several files at once, all or none.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "emflow/precision.hpp"
#include "emflow/tensor.hpp"

namespace emflow {

/// What a .npy header declares.
struct NpyHeader {
  Dtype dtype = Dtype::float64;
  Shape shape;
  std::int64_t data_offset = 0;  ///< bytes from the start of the file to the payload
};

/// Reads and checks the header of `path` (magic, version, dtype, order, shape, payload size).
/// Throws emflow::Error (ErrorCode::io) naming the file and the problem.
NpyHeader read_npy_header(const std::string& path);

/// Reads `path` as T. float16, float32 and float64 files are read as either T (converted exactly
/// for float16 -> float or double and float -> double; double -> float rounds); int32/int64 files
/// only as std::int64_t.
/// Fortran order, big endian, other dtypes, ranks outside 1..4, truncated or oversized
/// headers or payloads are refused with ErrorCode::io.
template <class T>
Tensor<T> read_npy(const std::string& path);

/// Writes `array` (rank 1 to 4) as a little-endian C-order .npy file, atomically; float16 as
/// '<f2'.
template <class T>
void write_npy(const std::string& path, const Tensor<T>& array);

/// Writes `bytes` to `path` atomically (temporary file in the same folder, fsync, rename).
/// Throws ErrorCode::io naming the path on failure and leaves no temporary file behind.
void write_file_atomic(const std::string& path, const std::string& bytes);

/// The output files of one run, written all together or not at all.
///
/// declare() every target first (and declare_input() every file the run reads): it makes the
/// cheap checks before any computing, so a mistyped folder fails in milliseconds, not after the
/// work. Then stage each result (written in full to a temporary file beside its target) and
/// commit() once. commit() first flushes (fsync) and closes every temporary file, then keeps a
/// backup (a hard link) of every existing target, then renames every temporary file over its
/// target back to back, then fsyncs each folder and removes the backups. If a rename fails, the
/// targets this commit already replaced get their old files back (and new targets are removed).
/// A failed run (an exception, or an OutputFiles destroyed without commit()) leaves no output
/// file and no temporary file behind; a killed run leaves every old file as it was unless it is
/// killed during the renames themselves (docs/RELIABILITY.md), and its temporary files, named
/// ".<target name>.emflow-tmp-<pid>-<hex>", are removed by the next write to the same target
/// once process <pid> is gone.
///
/// Two targets are the same file when their folders are the same folder (the same canonical
/// path, after resolving `.`, `..` and symbolic links, or the same device and inode) and their
/// names are equal, or when they are one file on disk (hard or symbolic links to it); declare()
/// refuses the second, and refuses an output that is the same file as a declared input.
///
/// Every target carries a `name` (a command-line option, say) that starts each error message
/// about it: declare() throws ErrorCode::invalid_argument as "<name> <problem>", e.g.
/// "--out 'a/b.npy': the folder 'a' does not exist"; staging and committing throw
/// ErrorCode::io (ErrorCode::out_of_memory) as "<name>: <the message of write_npy>".
class OutputFiles {
 public:
  OutputFiles();
  ~OutputFiles();
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  OutputFiles(OutputFiles&&) noexcept;
  OutputFiles& operator=(OutputFiles&&) noexcept;

  /// Records that `name` will write `path`: the path must be a non-empty file name that is not
  /// an existing folder, be a different file from every other declared target and input, and
  /// lie in an existing, writable folder.
  void declare(const std::string& name, const std::string& path);
  /// Records that the run reads `path` (given by `name`): no declared output may be that file.
  /// An empty path is ignored; a missing file is compared by its folder and name only.
  void declare_input(const std::string& name, const std::string& path);

  /// Writes `array` (rank 1 to 4) as .npy to a temporary file for the declared `path`.
  template <class T>
  void stage_npy(const std::string& path, const Tensor<T>& array);
  /// Writes `bytes` to a temporary file for the declared `path`.
  void stage_bytes(const std::string& path, const std::string& bytes);

  /// Renames every staged file over its target (all or none, see above); afterwards nothing is
  /// staged. Targets declared but never staged are not written.
  void commit();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

extern template Tensor<float> read_npy<float>(const std::string&);
extern template Tensor<double> read_npy<double>(const std::string&);
extern template Tensor<std::int64_t> read_npy<std::int64_t>(const std::string&);
extern template void write_npy<float>(const std::string&, const Tensor<float>&);
extern template void write_npy<double>(const std::string&, const Tensor<double>&);
extern template void write_npy<std::int64_t>(const std::string&, const Tensor<std::int64_t>&);
extern template void OutputFiles::stage_npy<float>(const std::string&, const Tensor<float>&);
extern template void OutputFiles::stage_npy<double>(const std::string&, const Tensor<double>&);
extern template void OutputFiles::stage_npy<std::int64_t>(const std::string&,
                                                          const Tensor<std::int64_t>&);
extern template void write_npy<float16>(const std::string&, const Tensor<float16>&);
extern template void OutputFiles::stage_npy<float16>(const std::string&, const Tensor<float16>&);

}  // namespace emflow

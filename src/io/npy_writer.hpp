// Internal: .npy serialisation onto a staged file, so that a caller with several outputs (the
// CLI) can stage them all and commit them together.
#pragma once

#include "emflow/io.hpp"
#include "staged_file.hpp"

namespace emflow::detail {

/// Writes the .npy header and payload of `array` (rank 1 to 4) to `file` without committing.
template <class T>
void write_npy_to(StagedFile& file, const Tensor<T>& array);

extern template void write_npy_to<float>(StagedFile&, const Tensor<float>&);
extern template void write_npy_to<double>(StagedFile&, const Tensor<double>&);
extern template void write_npy_to<std::int64_t>(StagedFile&, const Tensor<std::int64_t>&);
extern template void write_npy_to<float16>(StagedFile&, const Tensor<float16>&);

}  // namespace emflow::detail

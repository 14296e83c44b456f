// Fast CPU backend: placeholder that forwards to the reference until the fused float32 path
// lands (see the fast CPU backend issue).
#include "../core/backends.hpp"

namespace emflow::detail {

template <class T>
void cpu_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output, int) {
  reference_attend(input, output);
}

template void cpu_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&, int);
template void cpu_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                 int);

}  // namespace emflow::detail

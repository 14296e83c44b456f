// The normalisations of a layer (layer norm, RMS norm, projection onto the sphere), per token
// in double. The GPU's normalize_kernel (kernels/flow_kernels.cu) is this code line by line.
#include <cmath>

#include "emflow/flow.hpp"

namespace emflow::flow {

template <class T>
void normalize(Normalization norm, T* tokens, std::int64_t rows, std::int64_t dim, const T* gain,
               const T* bias, double eps) {
  if (norm == Normalization::none) return;
  const double inv_dim = 1.0 / static_cast<double>(dim);
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
  for (std::int64_t r = 0; r < rows; ++r) {
    T* x = tokens + r * dim;
    double shift = 0.0, scale = 1.0;
    if (norm == Normalization::layernorm) {
      double mean = 0.0, var = 0.0;
      for (std::int64_t a = 0; a < dim; ++a) mean += static_cast<double>(x[a]);
      mean *= inv_dim;
      for (std::int64_t a = 0; a < dim; ++a) {
        const double c = static_cast<double>(x[a]) - mean;
        var += c * c;
      }
      shift = mean;
      scale = 1.0 / std::sqrt(var * inv_dim + eps);
    } else {
      double square = 0.0;
      for (std::int64_t a = 0; a < dim; ++a) square += static_cast<double>(x[a]) * x[a];
      if (norm == Normalization::rmsnorm) {
        scale = 1.0 / std::sqrt(square * inv_dim + eps);
      } else {
        // A zero token has no direction: it stays where it is rather than becoming NaN.
        scale = square > 0.0 ? 1.0 / std::sqrt(square) : 1.0;
      }
    }
    for (std::int64_t a = 0; a < dim; ++a) {
      double v = (static_cast<double>(x[a]) - shift) * scale;
      if (norm != Normalization::sphere) {
        if (gain) v *= static_cast<double>(gain[a]);
        if (norm == Normalization::layernorm && bias) v += static_cast<double>(bias[a]);
      }
      x[a] = static_cast<T>(v);
    }
  }
}

template void normalize<float>(Normalization, float*, std::int64_t, std::int64_t, const float*,
                               const float*, double);
template void normalize<double>(Normalization, double*, std::int64_t, std::int64_t, const double*,
                                const double*, double);

}  // namespace emflow::flow

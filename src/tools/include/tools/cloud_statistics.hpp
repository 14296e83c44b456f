// Measurements of one token cloud that the model pictures show beside the library's observables
// (emflow::flow::Observables): the histogram of its pairwise cosines and its effective rank.
#pragma once

#include <cstdint>
#include <vector>

namespace emflow::tools {

/// The pairs i < j of the `tokens` rows of `cloud` (row-major, tokens x dim) counted by their
/// cosine in `bins` equal bins over [-1, 1]: bin k holds -1 + 2k/bins <= cos < -1 + 2(k+1)/bins,
/// the last bin also cos = 1 (a cosine rounded above 1 or below -1 counts in the end bin). A zero
/// row has cosine 0 with every other.
std::vector<std::int64_t> cosine_histogram(const double* cloud, std::int64_t tokens,
                                           std::int64_t dim, std::int64_t bins);

/// The effective rank of the cloud's directions (Roy and Vetterli): with s_k the singular values
/// of the tokens x dim matrix of unit rows x_i / |x_i| (a zero row stays zero) and
/// p_k = s_k / sum s, exp(-sum p_k log p_k). 1 when all the tokens point one way, min(tokens, dim)
/// when they are orthonormal.
double effective_rank(const double* cloud, std::int64_t tokens, std::int64_t dim);

}  // namespace emflow::tools

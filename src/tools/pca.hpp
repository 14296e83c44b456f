// The projection of many points onto their two principal directions, for pictures of clouds in
// more than three dimensions.
#pragma once

#include <cstdint>
#include <vector>

namespace emflow::tools {

/// Projects the `count` points (count x d, row-major) onto the two principal directions of the
/// whole set, centred on its mean: point e lands at (u[e], v[e]) (u and v hold `count` values).
void principal_projection(const std::vector<double>& points, std::int64_t count, std::int64_t d,
                          std::vector<double>& u, std::vector<double>& v);

}  // namespace emflow::tools

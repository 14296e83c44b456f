#include "colours.hpp"

#include <algorithm>
#include <cmath>

namespace emflow::tools {

// Viridis, sampled at 11 points (matplotlib's table), linearly interpolated: perceptually
// uniform and readable in grey.
Rgb viridis(double t) {
  static const Rgb table[] = {{0.267, 0.005, 0.329}, {0.283, 0.141, 0.458}, {0.254, 0.265, 0.530},
                              {0.207, 0.372, 0.553}, {0.164, 0.471, 0.558}, {0.128, 0.567, 0.551},
                              {0.135, 0.659, 0.518}, {0.267, 0.749, 0.441}, {0.478, 0.821, 0.318},
                              {0.741, 0.873, 0.150}, {0.993, 0.906, 0.144}};
  constexpr int n = sizeof(table) / sizeof(table[0]);
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * (n - 1);
  const int i = std::min(static_cast<int>(t), n - 2);
  const double f = t - i;
  return {table[i].r + f * (table[i + 1].r - table[i].r),
          table[i].g + f * (table[i + 1].g - table[i].g),
          table[i].b + f * (table[i + 1].b - table[i].b)};
}

// Distinct colours for tokens and clouds (a colour wheel with alternating lightness).
Rgb categorical(std::int64_t index, std::int64_t count) {
  static const Rgb tab10[] = {{0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173},
                              {0.839, 0.153, 0.157}, {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294},
                              {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498}, {0.737, 0.741, 0.133},
                              {0.090, 0.745, 0.812}};
  if (count <= 10) return tab10[index % 10];
  const double h = 6.0 * static_cast<double>(index) / static_cast<double>(count);
  const double v = index % 2 == 0 ? 0.85 : 0.6, s = 0.75;
  const int sector = static_cast<int>(h) % 6;
  const double f = h - std::floor(h);
  const double p = v * (1 - s), q = v * (1 - s * f), u = v * (1 - s * (1 - f));
  switch (sector) {
    case 0:
      return {v, u, p};
    case 1:
      return {q, v, p};
    case 2:
      return {p, v, u};
    case 3:
      return {p, q, v};
    case 4:
      return {u, p, v};
    default:
      return {v, p, q};
  }
}

}  // namespace emflow::tools

// Colour maps of the flow pictures.
#pragma once

#include <cstdint>

namespace emflow::tools {

struct Rgb {
  double r, g, b;
};

/// Viridis at t in [0, 1] (clamped; NaN reads as 0): perceptually uniform and readable in grey.
Rgb viridis(double t);

/// Distinct colours for `count` tokens or clouds: matplotlib's tab10 for up to ten, else a
/// colour wheel with alternating lightness.
Rgb categorical(std::int64_t index, std::int64_t count);

}  // namespace emflow::tools

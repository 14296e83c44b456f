// Charts: a rectangle of the picture with data ranges along x and y, its ticks, labels and frame.
#pragma once

#include <cairo.h>

#include <string>
#include <utility>
#include <vector>

namespace emflow::tools {

/// A rectangle of the picture (pixels) showing the data ranges [x0, x1] and [y0, y1].
struct Frame {
  double left, top, width, height;
  double x0, x1, y0, y1;
  double px(double x) const { return left + (x - x0) / (x1 - x0) * width; }
  double py(double y) const { return top + height - (y - y0) / (y1 - y0) * height; }
};

/// Round tick positions (1, 2 or 5 times a power of ten) covering [lo, hi]: the step giving the
/// count nearest `target`, and never fewer than three ticks. `step_out` receives the step.
std::vector<double> nice_ticks(double lo, double hi, int target, double* step_out);

/// A tick label with as many decimals as the step needs.
std::string format_number(double value, double step);

/// Ticks, tick labels, axis labels, title and the frame itself (and a faint grid).
void draw_axes(cairo_t* cr, const Frame& f, const std::string& xlabel, const std::string& ylabel,
               const std::string& title, bool grid = true);

/// Data range with a margin; a flat series gets a unit-sized window around its value.
std::pair<double, double> padded_range(double lo, double hi, double margin = 0.05);

}  // namespace emflow::tools

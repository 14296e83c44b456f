#include "axes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "canvas.hpp"

namespace emflow::tools {

std::vector<double> nice_ticks(double lo, double hi, int target, double* step_out) {
  std::vector<double> ticks;
  if (!(hi > lo)) {
    if (step_out) *step_out = 1.0;
    ticks.push_back(lo);
    return ticks;
  }
  auto count = [&](double step) {
    return std::floor(hi / step + 1e-9) - std::ceil(lo / step - 1e-9) + 1;
  };
  const double base = std::pow(10.0, std::floor(std::log10(hi - lo)) - 2);
  double step = base, best = std::numeric_limits<double>::infinity();
  // Powers of ten from base up; each decade computed from its exponent, not by repeated products.
  for (int e = 0; base * std::pow(10.0, e) < (hi - lo) * 10; ++e) {
    const double decade = base * std::pow(10.0, e);
    for (double m : {1.0, 2.0, 5.0}) {
      const double c = count(m * decade);
      if (c >= 3 && std::abs(c - target) < best) {
        best = std::abs(c - target);
        step = m * decade;
      }
    }
  }
  // Tick k at first + k step: a sum of steps would carry the rounding of every addition into
  // the later ticks (and could drop the last one).
  const double first_index = std::ceil(lo / step - 1e-9);
  for (std::int64_t k = 0;; ++k) {
    const double t = (first_index + static_cast<double>(k)) * step;
    if (t > hi + 1e-9 * step) break;
    ticks.push_back(std::abs(t) < 1e-9 * step ? 0.0 : t);
  }
  if (step_out) *step_out = step;
  return ticks;
}

std::string format_number(double value, double step) {
  char text[32];
  const double magnitude = std::max(std::abs(value), std::abs(step));
  if (magnitude != 0.0 && (magnitude >= 1e5 || magnitude < 1e-3)) {
    std::snprintf(text, sizeof text, "%.2g", value);
  } else {
    int decimals = 0;
    while (decimals < 6 && std::abs(step * std::pow(10.0, decimals) -
                                    std::round(step * std::pow(10.0, decimals))) > 1e-6) {
      ++decimals;
    }
    std::snprintf(text, sizeof text, "%.*f", decimals, value);
  }
  return text;
}

void draw_axes(cairo_t* cr, const Frame& f, const std::string& xlabel, const std::string& ylabel,
               const std::string& title, bool grid) {
  const Rgb ink{0.15, 0.15, 0.15};
  double xstep = 1, ystep = 1;
  const auto xt = nice_ticks(f.x0, f.x1, 5, &xstep);
  const auto yt = nice_ticks(f.y0, f.y1, 4, &ystep);
  cairo_set_line_width(cr, 1.0);
  if (grid) {
    cairo_set_source_rgba(cr, 0, 0, 0, 0.08);
    for (double x : xt) {
      cairo_move_to(cr, std::round(f.px(x)) + 0.5, f.top);
      cairo_line_to(cr, std::round(f.px(x)) + 0.5, f.top + f.height);
    }
    for (double y : yt) {
      cairo_move_to(cr, f.left, std::round(f.py(y)) + 0.5);
      cairo_line_to(cr, f.left + f.width, std::round(f.py(y)) + 0.5);
    }
    cairo_stroke(cr);
  }
  set_colour(cr, ink);
  cairo_rectangle(cr, std::round(f.left) + 0.5, std::round(f.top) + 0.5, std::round(f.width),
                  std::round(f.height));
  cairo_stroke(cr);
  for (double x : xt) {
    const double p = std::round(f.px(x)) + 0.5;
    cairo_move_to(cr, p, f.top + f.height);
    cairo_line_to(cr, p, f.top + f.height + 4);
    cairo_stroke(cr);
    text_at(cr, format_number(x, xstep), p, f.top + f.height + 7, 11, 0.5, 0.0);
  }
  for (double y : yt) {
    const double p = std::round(f.py(y)) + 0.5;
    cairo_move_to(cr, f.left - 4, p);
    cairo_line_to(cr, f.left, p);
    cairo_stroke(cr);
    text_at(cr, format_number(y, ystep), f.left - 7, p, 11, 1.0, 0.5);
  }
  if (!xlabel.empty()) text_at(cr, xlabel, f.left + f.width / 2, f.top + f.height + 24, 12, 0.5, 0);
  if (!ylabel.empty()) {
    text_at(cr, ylabel, f.left - 44, f.top + f.height / 2, 12, 0.5, 1.0, false, -M_PI / 2);
  }
  if (!title.empty()) text_at(cr, title, f.left, f.top - 8, 13, 0.0, 1.0, true);
}

std::pair<double, double> padded_range(double lo, double hi, double margin) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0.0, 1.0};
  if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {
    const double pad = std::max(0.5, std::abs(hi) * 0.1);
    return {lo - pad, hi + pad};
  }
  const double pad = (hi - lo) * margin;
  return {lo - pad, hi + pad};
}

}  // namespace emflow::tools

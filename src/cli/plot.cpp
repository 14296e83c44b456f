// Cairo drawings of the flow: token paths, observables over time, the phase diagram. Every
// picture is rendered to an image surface and encoded to PNG in memory, so the caller writes
// the file atomically with the other outputs.
#include "plot.hpp"

#include <cairo.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <utility>

#include "../core/check.hpp"

namespace emflow::cli {
namespace {

struct Rgb {
  double r, g, b;
};

// Viridis, sampled at 9 points (matplotlib's table), linearly interpolated: perceptually
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

// Round tick positions (1, 2 or 5 times a power of ten) covering [lo, hi]: the step giving the
// count nearest `target`, and never fewer than three ticks.
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
  for (double decade = base; decade < (hi - lo) * 10; decade *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double c = count(m * decade);
      if (c >= 3 && std::abs(c - target) < best) {
        best = std::abs(c - target);
        step = m * decade;
      }
    }
  }
  const double first = std::ceil(lo / step - 1e-9) * step;
  for (double t = first; t <= hi + 1e-9 * step; t += step) {
    ticks.push_back(std::abs(t) < 1e-9 * step ? 0.0 : t);
  }
  if (step_out) *step_out = step;
  return ticks;
}

// A tick label with as many decimals as the step needs.
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

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;
using Context = std::unique_ptr<cairo_t, decltype(&cairo_destroy)>;

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

std::string encode_png(cairo_surface_t* surface) {
  cairo_surface_flush(surface);
  std::string bytes;
  const cairo_status_t status = cairo_surface_write_to_png_stream(surface, append_bytes, &bytes);
  if (status != CAIRO_STATUS_SUCCESS) {
    detail::fail(ErrorCode::internal,
                 "cairo could not encode the picture: ", cairo_status_to_string(status));
  }
  return bytes;
}

void set_colour(cairo_t* cr, Rgb c, double alpha = 1.0) {
  cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha);
}

void text_at(cairo_t* cr, const std::string& text, double x, double y, double size, double align_x,
             double align_y, bool bold = false, double angle = 0.0) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t extents;
  cairo_text_extents(cr, text.c_str(), &extents);
  cairo_save(cr);
  cairo_translate(cr, x, y);
  cairo_rotate(cr, angle);
  cairo_move_to(cr, -extents.x_bearing - align_x * extents.width,
                -extents.y_bearing - align_y * extents.height);
  cairo_show_text(cr, text.c_str());
  cairo_new_path(cr);  // show_text leaves a current point that the next arc would join
  cairo_restore(cr);
}

// A rectangle of the picture with data ranges along x and y.
struct Frame {
  double left, top, width, height;
  double x0, x1, y0, y1;
  double px(double x) const { return left + (x - x0) / (x1 - x0) * width; }
  double py(double y) const { return top + height - (y - y0) / (y1 - y0) * height; }
};

// Ticks, tick labels, axis labels, title and the frame itself.
void draw_axes(cairo_t* cr, const Frame& f, const std::string& xlabel, const std::string& ylabel,
               const std::string& title, bool grid = true) {
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

// Data range with a margin; a flat series gets a unit-sized window around its value.
std::pair<double, double> padded_range(double lo, double hi, double margin = 0.05) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0.0, 1.0};
  if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {
    const double pad = std::max(0.5, std::abs(hi) * 0.1);
    return {lo - pad, hi + pad};
  }
  const double pad = (hi - lo) * margin;
  return {lo - pad, hi + pad};
}

// ---------------------------------------------------------------------------------------------
// Where the tokens go

// Top two principal directions of `points` (count x d, centred by the caller) by power
// iteration with deflation: d is at most a few hundred, so the d x d covariance is small.
std::vector<double> principal_plane(const std::vector<double>& points, std::int64_t count,
                                    std::int64_t d) {
  std::vector<double> cov(static_cast<std::size_t>(d * d), 0.0);
  for (std::int64_t p = 0; p < count; ++p) {
    const double* x = points.data() + p * d;
    for (std::int64_t a = 0; a < d; ++a)
      for (std::int64_t b = 0; b < d; ++b) cov[static_cast<std::size_t>(a * d + b)] += x[a] * x[b];
  }
  std::vector<double> axes(static_cast<std::size_t>(2 * d), 0.0);
  for (int k = 0; k < 2; ++k) {
    std::vector<double> v(static_cast<std::size_t>(d)), w(v.size());
    for (std::int64_t a = 0; a < d; ++a) v[static_cast<std::size_t>(a)] = 1.0 + 0.01 * a + (a == k);
    for (int iteration = 0; iteration < 300; ++iteration) {
      for (std::int64_t a = 0; a < d; ++a) {
        double s = 0.0;
        for (std::int64_t b = 0; b < d; ++b)
          s += cov[static_cast<std::size_t>(a * d + b)] * v[static_cast<std::size_t>(b)];
        w[static_cast<std::size_t>(a)] = s;
      }
      if (k == 1) {  // stay orthogonal to the first axis
        double dot = 0.0;
        for (std::int64_t a = 0; a < d; ++a)
          dot += w[static_cast<std::size_t>(a)] * axes[static_cast<std::size_t>(a)];
        for (std::int64_t a = 0; a < d; ++a)
          w[static_cast<std::size_t>(a)] -= dot * axes[static_cast<std::size_t>(a)];
      }
      double norm = 0.0;
      for (double x : w) norm += x * x;
      norm = std::sqrt(norm);
      if (norm == 0.0) break;
      for (std::int64_t a = 0; a < d; ++a)
        v[static_cast<std::size_t>(a)] = w[static_cast<std::size_t>(a)] / norm;
    }
    std::copy(v.begin(), v.end(), axes.begin() + k * d);
  }
  return axes;
}

void draw_paths(cairo_t* cr, const FlowPicture& pic, double left, double top, double size) {
  const std::int64_t R = pic.records, N = pic.tokens, d = pic.dim;
  auto at = [&](std::int64_t r, std::int64_t i) { return pic.trajectory.data() + (r * N + i) * d; };
  const bool sphere_view = d == 3 && pic.on_sphere;

  // Screen coordinates (u, v) and a depth (for the sphere's back side) of every recorded point.
  std::vector<double> u(static_cast<std::size_t>(R * N)), v(u.size()), depth(u.size(), 1.0);
  std::string xlabel = "x1", ylabel = "x2", title;
  if (sphere_view) {
    const double az = 0.6, el = 0.45;  // a view from above the equator, turned a little
    const double right[3] = {-std::sin(az), std::cos(az), 0.0};
    const double up[3] = {-std::sin(el) * std::cos(az), -std::sin(el) * std::sin(az), std::cos(el)};
    const double forward[3] = {std::cos(el) * std::cos(az), std::cos(el) * std::sin(az),
                               std::sin(el)};
    for (std::int64_t r = 0; r < R; ++r)
      for (std::int64_t i = 0; i < N; ++i) {
        const double* x = at(r, i);
        const auto e = static_cast<std::size_t>(r * N + i);
        u[e] = x[0] * right[0] + x[1] * right[1] + x[2] * right[2];
        v[e] = x[0] * up[0] + x[1] * up[1] + x[2] * up[2];
        depth[e] = x[0] * forward[0] + x[1] * forward[1] + x[2] * forward[2];
      }
    title = "tokens on the sphere S" + superscript(2) + " (orthographic view)";
    xlabel.clear();
    ylabel.clear();
  } else if (d <= 2) {
    for (std::int64_t e = 0; e < R * N; ++e) {
      u[static_cast<std::size_t>(e)] = pic.trajectory[static_cast<std::size_t>(e * d)];
      v[static_cast<std::size_t>(e)] =
          d == 2 ? pic.trajectory[static_cast<std::size_t>(e * d + 1)] : 0.0;
    }
    title = "tokens in the plane";
  } else {
    std::vector<double> centred = pic.trajectory;
    std::vector<double> mean(static_cast<std::size_t>(d), 0.0);
    for (std::int64_t e = 0; e < R * N; ++e)
      for (std::int64_t a = 0; a < d; ++a)
        mean[static_cast<std::size_t>(a)] += centred[static_cast<std::size_t>(e * d + a)];
    for (double& m : mean) m /= static_cast<double>(R * N);
    for (std::int64_t e = 0; e < R * N; ++e)
      for (std::int64_t a = 0; a < d; ++a)
        centred[static_cast<std::size_t>(e * d + a)] -= mean[static_cast<std::size_t>(a)];
    const std::vector<double> axes = principal_plane(centred, R * N, d);
    for (std::int64_t e = 0; e < R * N; ++e) {
      double s = 0.0, t = 0.0;
      for (std::int64_t a = 0; a < d; ++a) {
        s += centred[static_cast<std::size_t>(e * d + a)] * axes[static_cast<std::size_t>(a)];
        t += centred[static_cast<std::size_t>(e * d + a)] * axes[static_cast<std::size_t>(d + a)];
      }
      u[static_cast<std::size_t>(e)] = s;
      v[static_cast<std::size_t>(e)] = t;
    }
    title = "tokens on their two principal directions";
    xlabel = "first principal direction";
    ylabel = "second principal direction";
  }

  // One scale for both axes, so circles stay round.
  double lo_u = std::numeric_limits<double>::infinity(), hi_u = -lo_u, lo_v = lo_u, hi_v = -lo_u;
  for (std::size_t e = 0; e < u.size(); ++e) {
    if (!std::isfinite(u[e]) || !std::isfinite(v[e])) continue;
    lo_u = std::min(lo_u, u[e]);
    hi_u = std::max(hi_u, u[e]);
    lo_v = std::min(lo_v, v[e]);
    hi_v = std::max(hi_v, v[e]);
  }
  if (sphere_view || (pic.on_sphere && d == 2)) lo_u = lo_v = -1.0, hi_u = hi_v = 1.0;
  if (!std::isfinite(lo_u)) lo_u = lo_v = -1.0, hi_u = hi_v = 1.0;
  const double half = 0.5 * std::max({hi_u - lo_u, hi_v - lo_v, 1e-12}) * 1.08;
  const double cu = 0.5 * (lo_u + hi_u), cv = 0.5 * (lo_v + hi_v);
  Frame f{left, top, size, size, cu - half, cu + half, cv - half, cv + half};

  if (sphere_view) {
    text_at(cr, title, f.left, f.top - 8, 13, 0.0, 1.0, true);
    // The sphere: a shaded disc, its outline, and the equator and meridians drawn faint.
    const double cx = f.px(0), cy = f.py(0), radius = f.px(1) - f.px(0);
    cairo_new_path(cr);  // no line from the title's end to the disc
    cairo_pattern_t* shade = cairo_pattern_create_radial(cx - 0.35 * radius, cy - 0.35 * radius,
                                                         0.1 * radius, cx, cy, radius);
    cairo_pattern_add_color_stop_rgb(shade, 0, 1.0, 1.0, 1.0);
    cairo_pattern_add_color_stop_rgb(shade, 1, 0.86, 0.88, 0.92);
    cairo_arc(cr, cx, cy, radius, 0, 2 * M_PI);
    cairo_set_source(cr, shade);
    cairo_fill_preserve(cr);
    cairo_pattern_destroy(shade);
    cairo_set_source_rgba(cr, 0.3, 0.3, 0.35, 0.9);
    cairo_set_line_width(cr, 1.2);
    cairo_stroke(cr);
    const double az = 0.6, el = 0.45;
    const double right[3] = {-std::sin(az), std::cos(az), 0.0};
    const double up[3] = {-std::sin(el) * std::cos(az), -std::sin(el) * std::sin(az), std::cos(el)};
    const double forward[3] = {std::cos(el) * std::cos(az), std::cos(el) * std::sin(az),
                               std::sin(el)};
    auto great = [&](auto point) {  // draws the front half of a circle on the sphere
      bool pen = false;
      for (int k = 0; k <= 180; ++k) {
        double p[3];
        point(2 * M_PI * k / 180.0, p);
        const double depth_k = p[0] * forward[0] + p[1] * forward[1] + p[2] * forward[2];
        const double x = f.px(p[0] * right[0] + p[1] * right[1] + p[2] * right[2]);
        const double y = f.py(p[0] * up[0] + p[1] * up[1] + p[2] * up[2]);
        if (depth_k < 0) {
          pen = false;
          continue;
        }
        if (pen) {
          cairo_line_to(cr, x, y);
        } else {
          cairo_move_to(cr, x, y);
        }
        pen = true;
      }
    };
    cairo_set_source_rgba(cr, 0.3, 0.3, 0.4, 0.18);
    cairo_set_line_width(cr, 0.8);
    for (double lat : {-60.0, -30.0, 0.0, 30.0, 60.0}) {
      const double phi = lat * M_PI / 180;
      great([&](double t, double* p) {
        p[0] = std::cos(phi) * std::cos(t);
        p[1] = std::cos(phi) * std::sin(t);
        p[2] = std::sin(phi);
      });
    }
    for (int m = 0; m < 6; ++m) {
      const double lon = m * M_PI / 6;
      great([&](double t, double* p) {
        p[0] = std::cos(t) * std::cos(lon);
        p[1] = std::cos(t) * std::sin(lon);
        p[2] = std::sin(t);
      });
    }
    cairo_stroke(cr);
  } else {
    draw_axes(cr, f, xlabel, ylabel, title, true);
    if (pic.on_sphere && d == 2) {
      cairo_set_source_rgba(cr, 0.3, 0.3, 0.35, 0.35);
      cairo_set_line_width(cr, 1.0);
      cairo_arc(cr, f.px(0), f.py(0), f.px(1) - f.px(0), 0, 2 * M_PI);
      cairo_stroke(cr);
    }
  }

  cairo_save(cr);
  cairo_rectangle(cr, f.left, f.top, f.width, f.height);
  cairo_clip(cr);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  // Paths: each token its colour; on the sphere the far side is drawn faint.
  for (std::int64_t i = 0; i < N; ++i) {
    const Rgb c = categorical(i, N);
    cairo_set_line_width(cr, 1.6);
    for (std::int64_t r = 1; r < R; ++r) {
      const auto a = static_cast<std::size_t>((r - 1) * N + i),
                 b = static_cast<std::size_t>(r * N + i);
      if (!std::isfinite(u[a] + v[a] + u[b] + v[b])) continue;
      set_colour(cr, c, depth[b] < 0 ? 0.2 : 0.8);
      cairo_move_to(cr, f.px(u[a]), f.py(v[a]));
      cairo_line_to(cr, f.px(u[b]), f.py(v[b]));
      cairo_stroke(cr);
    }
  }
  // Start: small open circles; end: filled dots with a dark rim.
  for (std::int64_t i = 0; i < N; ++i) {
    const auto s = static_cast<std::size_t>(i), e = static_cast<std::size_t>((R - 1) * N + i);
    const Rgb c = categorical(i, N);
    if (std::isfinite(u[s] + v[s])) {
      set_colour(cr, c, depth[s] < 0 ? 0.3 : 1.0);
      cairo_set_line_width(cr, 1.2);
      cairo_arc(cr, f.px(u[s]), f.py(v[s]), 3.0, 0, 2 * M_PI);
      cairo_stroke(cr);
    }
    if (std::isfinite(u[e] + v[e])) {
      cairo_arc(cr, f.px(u[e]), f.py(v[e]), 4.5, 0, 2 * M_PI);
      set_colour(cr, c, depth[e] < 0 ? 0.35 : 1.0);
      cairo_fill_preserve(cr);
      cairo_set_source_rgba(cr, 0.1, 0.1, 0.1, depth[e] < 0 ? 0.3 : 0.9);
      cairo_set_line_width(cr, 1.0);
      cairo_stroke(cr);
    }
  }
  cairo_restore(cr);
  set_colour(cr, {0.15, 0.15, 0.15});
  text_at(cr, "\xE2\x97\x8B start   \xE2\x97\x8F end", f.left + f.width, f.top + f.height + 42, 11,
          1.0, 0.0);
}

// One small chart of an observable over time, one line per cloud.
void draw_series(cairo_t* cr, const FlowPicture& pic, const Frame& box, const std::string& title,
                 double (*value)(const flow::Observables&), bool unit_range) {
  const std::int64_t R = pic.records, B = pic.clouds;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& o : pic.observables) {
    const double y = value(o);
    if (!std::isfinite(y)) continue;
    lo = std::min(lo, y);
    hi = std::max(hi, y);
  }
  auto [y0, y1] = unit_range ? std::pair<double, double>{-0.03, 1.03} : padded_range(lo, hi);
  const double t0 = pic.times.front(), t1 = std::max(pic.times.back(), t0 + 1e-12);
  Frame f = box;
  f.x0 = t0;
  f.x1 = t1;
  f.y0 = y0;
  f.y1 = y1;
  draw_axes(cr, f, pic.time_label, "", title);
  cairo_save(cr);
  cairo_rectangle(cr, f.left, f.top, f.width, f.height);
  cairo_clip(cr);
  cairo_set_line_width(cr, B > 8 ? 1.0 : 1.8);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  for (std::int64_t b = 0; b < B; ++b) {
    set_colour(cr, categorical(b, B), B > 8 ? 0.6 : 0.95);
    bool pen = false;
    for (std::int64_t r = 0; r < R; ++r) {
      const double y = value(pic.observables[static_cast<std::size_t>(r * B + b)]);
      if (!std::isfinite(y)) {
        pen = false;
        continue;
      }
      const double x = f.px(pic.times[static_cast<std::size_t>(r)]), py = f.py(y);
      if (pen) {
        cairo_line_to(cr, x, py);
      } else {
        cairo_move_to(cr, x, py);
      }
      pen = true;
    }
    cairo_stroke(cr);
  }
  cairo_restore(cr);
}

}  // namespace

// "S^{n}" with the exponent in Unicode superscript digits.
std::string superscript(long long n) {
  static const char* digits[] = {"\xE2\x81\xB0", "\xC2\xB9",     "\xC2\xB2",     "\xC2\xB3",
                                 "\xE2\x81\xB4", "\xE2\x81\xB5", "\xE2\x81\xB6", "\xE2\x81\xB7",
                                 "\xE2\x81\xB8", "\xE2\x81\xB9"};
  std::string text;
  for (char c : std::to_string(n)) text += c == '-' ? "\xE2\x81\xBB" : digits[c - '0'];
  return text;
}

std::string draw_flow(const FlowPicture& pic) {
  if (pic.records < 1 || pic.tokens < 1 || pic.dim < 1 || pic.clouds < 1) {
    detail::fail(ErrorCode::internal, "draw_flow: empty picture");
  }
  const int width = 1360, height = 700;
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height),
                  cairo_surface_destroy);
  Context context(cairo_create(surface.get()), cairo_destroy);
  cairo_t* cr = context.get();
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  set_colour(cr, {0.1, 0.1, 0.1});
  text_at(cr, pic.title, 24, 16, 16, 0.0, 0.0, true);

  draw_paths(cr, pic, 80, 80, 540);

  struct Chart {
    const char* title;
    double (*value)(const flow::Observables&);
    bool unit;
  };
  const Chart charts[] = {
      {"fraction of clustered pairs",
       [](const flow::Observables& o) { return o.clustered_fraction; }, true},
      {"clusters", [](const flow::Observables& o) { return static_cast<double>(o.clusters); },
       false},
      {"mean <x\xE1\xB5\xA2, x\xE2\xB1\xBC>",
       [](const flow::Observables& o) { return o.mean_inner; }, false},
      {"min <x\xE1\xB5\xA2, x\xE2\xB1\xBC>", [](const flow::Observables& o) { return o.min_inner; },
       false},
      {"energy E\xCE\xB2", [](const flow::Observables& o) { return o.energy; }, false},
      {"attention entropy (nats)", [](const flow::Observables& o) { return o.entropy; }, false},
  };
  const double x0 = 730, y0 = 96, cw = 270, ch = 135, gx = 330, gy = 205;
  for (int k = 0; k < 6; ++k) {
    Frame box{x0 + (k % 2) * gx, y0 + (k / 2) * gy, cw, ch, 0, 1, 0, 1};
    draw_series(cr, pic, box, charts[k].title, charts[k].value, charts[k].unit);
  }
  if (pic.clouds > 1 && pic.clouds <= 4) {  // which line is which cloud, above the charts
    double x = x0;
    for (std::int64_t b = 0; b < pic.clouds; ++b) {
      set_colour(cr, categorical(b, pic.clouds));
      cairo_rectangle(cr, x, 44, 18, 4);
      cairo_fill(cr);
      char label[64];
      std::snprintf(label, sizeof label, "cloud %lld, \xCE\xB2 = %g", static_cast<long long>(b),
                    pic.betas[static_cast<std::size_t>(b)]);
      set_colour(cr, {0.15, 0.15, 0.15});
      text_at(cr, label, x + 24, 46, 11, 0.0, 0.5);
      x += 150;
    }
  }
  return encode_png(surface.get());
}

std::string draw_phase(const flow::PhaseDiagram& diagram, const std::string& title) {
  const std::size_t T = diagram.times.size(), K = diagram.betas.size();
  if (T < 1 || K < 1 || diagram.clustered.size() != T * K) {
    detail::fail(ErrorCode::internal, "draw_phase: inconsistent diagram");
  }
  const int width = 900, height = 640;
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height),
                  cairo_surface_destroy);
  Context context(cairo_create(surface.get()), cairo_destroy);
  cairo_t* cr = context.get();
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);

  // Cells centred on each (time, beta): the image spans half a step beyond the first and last.
  const double dt = T > 1 ? (diagram.times.back() - diagram.times.front()) / (T - 1) : 1.0;
  const double db = K > 1 ? (diagram.betas.back() - diagram.betas.front()) / (K - 1) : 1.0;
  Frame f{90,
          70,
          640,
          480,
          diagram.times.front() - dt / 2,
          diagram.times.back() + dt / 2,
          diagram.betas.front() - db / 2,
          diagram.betas.back() + db / 2};

  Surface cells(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(T), static_cast<int>(K)),
      cairo_surface_destroy);
  cairo_surface_flush(cells.get());
  unsigned char* pixels = cairo_image_surface_get_data(cells.get());
  const int stride = cairo_image_surface_get_stride(cells.get());
  for (std::size_t k = 0; k < K; ++k) {
    // Row 0 of the image is the top: the largest beta.
    auto* row =
        reinterpret_cast<std::uint32_t*>(pixels + (K - 1 - k) * static_cast<std::size_t>(stride));
    for (std::size_t t = 0; t < T; ++t) {
      const Rgb c = viridis(diagram.clustered[t * K + k]);
      row[t] = (static_cast<std::uint32_t>(std::lround(c.r * 255)) << 16) |
               (static_cast<std::uint32_t>(std::lround(c.g * 255)) << 8) |
               static_cast<std::uint32_t>(std::lround(c.b * 255));
    }
  }
  cairo_surface_mark_dirty(cells.get());
  cairo_save(cr);
  cairo_translate(cr, f.left, f.top);
  cairo_scale(cr, f.width / static_cast<double>(T), f.height / static_cast<double>(K));
  cairo_set_source_surface(cr, cells.get(), 0, 0);
  cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
  cairo_rectangle(cr, 0, 0, static_cast<double>(T), static_cast<double>(K));
  cairo_fill(cr);
  cairo_restore(cr);
  set_colour(cr, {0.1, 0.1, 0.1});
  draw_axes(cr, f, "time t", "inverse temperature \xCE\xB2", "", false);
  text_at(cr, title, f.left, 24, 15, 0.0, 0.0, true);
  text_at(cr,
          "fraction of pairs with <x\xE1\xB5\xA2, x\xE2\xB1\xBC> > 1 - 10\xE2\x81\xBB\xC2\xB3, "
          "mean over clouds",
          f.left, 46, 12, 0.0, 0.0);

  // The colour bar.
  Frame bar{f.left + f.width + 40, f.top, 22, f.height, 0, 1, 0, 1};
  for (int p = 0; p < static_cast<int>(bar.height); ++p) {
    set_colour(cr, viridis(1.0 - p / bar.height));
    cairo_rectangle(cr, bar.left, bar.top + p, bar.width, 1.0);
    cairo_fill(cr);
  }
  set_colour(cr, {0.15, 0.15, 0.15});
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, bar.left + 0.5, bar.top + 0.5, bar.width, bar.height);
  cairo_stroke(cr);
  for (double v : {0.0, 0.2, 0.4, 0.6, 0.8, 1.0}) {
    const double y = std::round(bar.py(v)) + 0.5;
    cairo_move_to(cr, bar.left + bar.width, y);
    cairo_line_to(cr, bar.left + bar.width + 4, y);
    cairo_stroke(cr);
    text_at(cr, format_number(v, 0.2), bar.left + bar.width + 7, y, 11, 0.0, 0.5);
  }
  text_at(cr, "clustered fraction", bar.left + bar.width + 48, bar.top + bar.height / 2, 12, 0.5,
          0.0, false, -M_PI / 2);
  return encode_png(surface.get());
}

// ---------------------------------------------------------------------------------------------

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)),
      enabled_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(std::int64_t done, std::int64_t total) {
  if (!enabled_ || total <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  drawn_ = true;
  const double fraction =
      std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0);
  const int width = 30, filled = static_cast<int>(fraction * width);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(width, '.');
  char line[160];
  std::snprintf(line, sizeof line, "\r%s [%s] %3.0f%%  %.1f s", label_.c_str(), bar.c_str(),
                100.0 * fraction, elapsed);
  std::cerr << line << std::flush;
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  std::cerr << "\r\x1b[2K" << std::flush;  // clear the line
  drawn_ = false;
}

flow::Progress ProgressBar::callback() {
  if (!enabled_) return {};
  return [this](std::int64_t done, std::int64_t total) { update(done, total); };
}

}  // namespace emflow::cli

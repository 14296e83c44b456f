#include "paths.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "axes.hpp"
#include "canvas.hpp"
#include "colours.hpp"
#include "pca.hpp"

namespace emflow::tools {
namespace {

// The orthographic view of the unit sphere: from above the equator, turned a little. A point p
// lands at (u, v) on the screen; depth < 0 is the far side.
struct SphereView {
  static constexpr double az = 0.6, el = 0.45;
  const double right[3] = {-std::sin(az), std::cos(az), 0.0};
  const double up[3] = {-std::sin(el) * std::cos(az), -std::sin(el) * std::sin(az), std::cos(el)};
  const double forward[3] = {std::cos(el) * std::cos(az), std::cos(el) * std::sin(az),
                             std::sin(el)};

  static double dot(const double* p, const double* axis) {
    return p[0] * axis[0] + p[1] * axis[1] + p[2] * axis[2];
  }
  double u(const double* p) const { return dot(p, right); }
  double v(const double* p) const { return dot(p, up); }
  double depth(const double* p) const { return dot(p, forward); }
};

// Screen coordinates (u, v) and a depth (for the sphere's back side) of every recorded point,
// record r of token i at r * N + i, and what the chart is called.
struct Projection {
  std::vector<double> u, v, depth;
  std::string title, xlabel = "x1", ylabel = "x2";
};

Projection project(const FlowPicture& pic, bool sphere_view) {
  const std::int64_t count = pic.records * pic.tokens, d = pic.dim;
  Projection p;
  p.u.resize(static_cast<std::size_t>(count));
  p.v.resize(p.u.size());
  p.depth.assign(p.u.size(), 1.0);
  if (sphere_view) {
    const SphereView view;
    for (std::int64_t e = 0; e < count; ++e) {
      const double* x = pic.trajectory.data() + e * d;
      const auto k = static_cast<std::size_t>(e);
      p.u[k] = view.u(x);
      p.v[k] = view.v(x);
      p.depth[k] = view.depth(x);
    }
    p.title = "tokens on the sphere S" + superscript(2) + " (orthographic view)";
    p.xlabel.clear();
    p.ylabel.clear();
  } else if (d <= 2) {
    for (std::int64_t e = 0; e < count; ++e) {
      p.u[static_cast<std::size_t>(e)] = pic.trajectory[static_cast<std::size_t>(e * d)];
      p.v[static_cast<std::size_t>(e)] =
          d == 2 ? pic.trajectory[static_cast<std::size_t>(e * d + 1)] : 0.0;
    }
    p.title = "tokens in the plane";
  } else {
    principal_projection(pic.trajectory, count, d, p.u, p.v);
    p.title = "tokens on their two principal directions";
    p.xlabel = "first principal direction";
    p.ylabel = "second principal direction";
  }
  return p;
}

// Draws the front half of the circle point(t), t in [0, 2 pi], on the sphere.
template <class Point>
void front_half(cairo_t* cr, const Frame& f, const SphereView& view, Point point) {
  bool pen = false;
  for (int k = 0; k <= 180; ++k) {
    double p[3];
    point(2 * M_PI * k / 180.0, p);
    const double x = f.px(view.u(p)), y = f.py(view.v(p));
    if (view.depth(p) < 0) {
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
}

// The sphere: a shaded disc, its outline, and the parallels and meridians drawn faint.
void draw_sphere(cairo_t* cr, const Frame& f) {
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
  const SphereView view;
  cairo_set_source_rgba(cr, 0.3, 0.3, 0.4, 0.18);
  cairo_set_line_width(cr, 0.8);
  for (double lat : {-60.0, -30.0, 0.0, 30.0, 60.0}) {
    const double phi = lat * M_PI / 180;
    front_half(cr, f, view, [&](double t, double* p) {
      p[0] = std::cos(phi) * std::cos(t);
      p[1] = std::cos(phi) * std::sin(t);
      p[2] = std::sin(phi);
    });
  }
  for (int m = 0; m < 6; ++m) {
    const double lon = m * M_PI / 6;
    front_half(cr, f, view, [&](double t, double* p) {
      p[0] = std::cos(t) * std::cos(lon);
      p[1] = std::cos(t) * std::sin(lon);
      p[2] = std::sin(t);
    });
  }
  cairo_stroke(cr);
}

// Paths, each token in its colour (the far side of the sphere faint); start: small open
// circles; end: filled dots with a dark rim.
void draw_tokens(cairo_t* cr, const Frame& f, const FlowPicture& pic, const Projection& p) {
  const std::int64_t R = pic.records, N = pic.tokens;
  const std::vector<double>&u = p.u, &v = p.v, &depth = p.depth;
  cairo_save(cr);
  cairo_rectangle(cr, f.left, f.top, f.width, f.height);
  cairo_clip(cr);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
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
}

}  // namespace

void draw_paths(cairo_t* cr, const FlowPicture& pic, double left, double top, double size) {
  const std::int64_t d = pic.dim;
  const bool sphere_view = d == 3 && pic.on_sphere;
  const Projection p = project(pic, sphere_view);

  // One scale for both axes, so circles stay round.
  double lo_u = std::numeric_limits<double>::infinity(), hi_u = -lo_u, lo_v = lo_u, hi_v = -lo_u;
  for (std::size_t e = 0; e < p.u.size(); ++e) {
    if (!std::isfinite(p.u[e]) || !std::isfinite(p.v[e])) continue;
    lo_u = std::min(lo_u, p.u[e]);
    hi_u = std::max(hi_u, p.u[e]);
    lo_v = std::min(lo_v, p.v[e]);
    hi_v = std::max(hi_v, p.v[e]);
  }
  if (sphere_view || (pic.on_sphere && d == 2)) lo_u = lo_v = -1.0, hi_u = hi_v = 1.0;
  if (!std::isfinite(lo_u)) lo_u = lo_v = -1.0, hi_u = hi_v = 1.0;
  const double half = 0.5 * std::max({hi_u - lo_u, hi_v - lo_v, 1e-12}) * 1.08;
  const double cu = 0.5 * (lo_u + hi_u), cv = 0.5 * (lo_v + hi_v);
  const Frame f{left, top, size, size, cu - half, cu + half, cv - half, cv + half};

  if (sphere_view) {
    text_at(cr, p.title, f.left, f.top - 8, 13, 0.0, 1.0, true);
    draw_sphere(cr, f);
  } else {
    draw_axes(cr, f, p.xlabel, p.ylabel, p.title, true);
    if (pic.on_sphere && d == 2) {
      cairo_set_source_rgba(cr, 0.3, 0.3, 0.35, 0.35);
      cairo_set_line_width(cr, 1.0);
      cairo_arc(cr, f.px(0), f.py(0), f.px(1) - f.px(0), 0, 2 * M_PI);
      cairo_stroke(cr);
    }
  }
  draw_tokens(cr, f, pic, p);
  set_colour(cr, {0.15, 0.15, 0.15});
  text_at(cr, "\xE2\x97\x8B start   \xE2\x97\x8F end", f.left + f.width, f.top + f.height + 42, 11,
          1.0, 0.0);
}

}  // namespace emflow::tools

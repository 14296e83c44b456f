// The picture of a real model's flow: the token cloud after every layer in one fixed projection,
// tokens labelled, beside per-layer observables.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "axes.hpp"
#include "canvas.hpp"
#include "colours.hpp"
#include "emflow/error.hpp"
#include "pca.hpp"
#include "tools/plot.hpp"

namespace emflow::tools {
namespace {

struct Series {
  const char* title;
  std::vector<double> values;
};

void draw_series(cairo_t* cr, const Frame& box, const Series& s, bool unit_range) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double y : s.values) {
    if (std::isfinite(y)) {
      lo = std::min(lo, y);
      hi = std::max(hi, y);
    }
  }
  auto [y0, y1] = unit_range ? std::pair<double, double>{-1.03, 1.03} : padded_range(lo, hi);
  Frame f = box;
  f.x0 = 0;
  f.x1 = std::max<double>(1.0, static_cast<double>(s.values.size() - 1));
  f.y0 = y0;
  f.y1 = y1;
  draw_axes(cr, f, "layer", "", s.title);
  set_colour(cr, categorical(0, 1));
  cairo_set_line_width(cr, 1.8);
  for (std::size_t r = 0; r < s.values.size(); ++r) {
    const double x = f.px(static_cast<double>(r)), y = f.py(s.values[r]);
    r == 0 ? cairo_move_to(cr, x, y) : cairo_line_to(cr, x, y);
  }
  cairo_stroke(cr);
  for (std::size_t r = 0; r < s.values.size(); ++r) {
    cairo_arc(cr, f.px(static_cast<double>(r)), f.py(s.values[r]), 3.0, 0, 2 * M_PI);
    cairo_fill(cr);
  }
}

}  // namespace

std::string draw_model_flow(const ModelPicture& pic) {
  const std::int64_t R = pic.records, N = pic.tokens, d = pic.dim;
  if (R < 1 || N < 1 || d < 1) throw Error(ErrorCode::internal, "draw_model_flow: empty picture");
  // Unit directions, each record centred: the projection shows how the directions gather.
  std::vector<double> points(pic.trajectory.size());
  std::vector<double> mean_cos(static_cast<std::size_t>(R)), min_cos(mean_cos.size());
  for (std::int64_t r = 0; r < R; ++r) {
    std::vector<double> centre(static_cast<std::size_t>(d), 0.0);
    for (std::int64_t i = 0; i < N; ++i) {
      const double* x = pic.trajectory.data() + (r * N + i) * d;
      double norm = 0;
      for (std::int64_t a = 0; a < d; ++a) norm += x[a] * x[a];
      norm = norm > 0 ? std::sqrt(norm) : 1.0;
      double* p = points.data() + (r * N + i) * d;
      for (std::int64_t a = 0; a < d; ++a) {
        p[a] = x[a] / norm;
        centre[a] += p[a] / static_cast<double>(N);
      }
    }
    double sum = 0, least = 1;
    std::int64_t pairs = 0;
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t j = i + 1; j < N; ++j) {
        double c = 0;
        for (std::int64_t a = 0; a < d; ++a) {
          c += points[(r * N + i) * d + a] * points[(r * N + j) * d + a];
        }
        sum += c;
        least = std::min(least, c);
        ++pairs;
      }
    }
    mean_cos[r] = pairs ? sum / static_cast<double>(pairs) : 1.0;
    min_cos[r] = pairs ? least : 1.0;
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t a = 0; a < d; ++a) points[(r * N + i) * d + a] -= centre[a];
  }
  std::vector<double> u(static_cast<std::size_t>(R * N)), v(u.size());
  principal_projection(points, R * N, d, u, v);
  double extent = 1e-12;
  for (std::size_t k = 0; k < u.size(); ++k)
    extent = std::max({extent, std::abs(u[k]), std::abs(v[k])});

  // Up to four panels in one row, up to eight in two rows, else rows of eight smaller panels
  // (a 30-layer model: four rows).
  const int columns = R <= 4   ? static_cast<int>(R)
                      : R <= 8 ? static_cast<int>((R + 1) / 2)
                               : static_cast<int>(std::min<std::int64_t>(R, 8));
  const int rows = static_cast<int>((R + columns - 1) / columns);
  const double panel = R <= 8 ? 250 : 200, gap = 16, left = 24, top = 60;
  const int width = static_cast<int>(left + columns * (panel + gap) + 420);
  const int charts = pic.effective_rank.empty() ? 4 : 5;
  const Canvas canvas(width, static_cast<int>(std::max(top + 20 + charts * 160.0 + 20,
                                                       top + rows * (panel + 34) + 40)));
  cairo_t* cr = canvas.context();
  set_colour(cr, {0.1, 0.1, 0.1});
  text_at(cr, pic.title, 24, 16, 16, 0.0, 0.0, true);
  for (std::int64_t r = 0; r < R; ++r) {
    const double x0 = left + static_cast<double>(r % columns) * (panel + gap);
    const double y0 = top + static_cast<double>(r / columns) * (panel + 34);
    Frame f{x0, y0 + 20, panel, panel, -1.1 * extent, 1.1 * extent, -1.1 * extent, 1.1 * extent};
    set_colour(cr, {0.97, 0.97, 0.97});
    cairo_rectangle(cr, f.left, f.top, f.width, f.height);
    cairo_fill(cr);
    set_colour(cr, {0.6, 0.6, 0.6});
    cairo_set_line_width(cr, 1.0);
    cairo_rectangle(cr, f.left, f.top, f.width, f.height);
    cairo_stroke(cr);
    set_colour(cr, {0.15, 0.15, 0.15});
    char heading[64];
    std::snprintf(heading, sizeof heading, r == 0 ? "input (embeddings)" : "after layer %lld",
                  static_cast<long long>(r));
    text_at(cr, heading, x0 + panel / 2, y0 + 2, 12, 0.5, 0.0, true);
    for (std::int64_t i = 0; i < N; ++i) {
      const auto k = static_cast<std::size_t>(r * N + i);
      const double px = f.px(u[k]), py = f.py(v[k]);
      set_colour(cr, categorical(i, N), 0.9);
      cairo_arc(cr, px, py, 3.5, 0, 2 * M_PI);
      cairo_fill(cr);
      if (!pic.labels.empty()) {
        set_colour(cr, {0.1, 0.1, 0.1}, 0.85);
        text_at(cr, pic.labels[static_cast<std::size_t>(i)], px + 5, py, 9, 0.0, 0.5);
      }
    }
  }
  std::vector<double> clusters(pic.clusters.begin(), pic.clusters.end());
  std::vector<double> entropy(pic.entropy.begin(), pic.entropy.end());
  if (entropy.size() > 1) entropy.pop_back();  // the last record has no attention after it
  std::vector<Series> series = {{"mean pairwise cosine", mean_cos},
                                {"min pairwise cosine", min_cos},
                                {"clusters (cos > 1 - eps)", clusters}};
  if (!pic.effective_rank.empty()) {
    series.push_back({"effective rank of the directions", pic.effective_rank});
  }
  series.push_back({"attention entropy (nats)", entropy});
  const double cx = left + columns * (panel + gap) + 60;
  for (std::size_t k = 0; k < series.size(); ++k) {
    Frame box{cx, top + 20 + static_cast<double>(k) * 160.0, 320, 96, 0, 1, 0, 1};
    draw_series(cr, box, series[k], k < 2);
  }
  return canvas.png();
}

}  // namespace emflow::tools

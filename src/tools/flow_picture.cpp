// The flow picture: the tokens' paths on the left (paths.cpp), the observables of every cloud
// over time on the right.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "axes.hpp"
#include "canvas.hpp"
#include "colours.hpp"
#include "emflow/error.hpp"
#include "paths.hpp"
#include "tools/plot.hpp"

namespace emflow::tools {
namespace {

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

std::string draw_flow(const FlowPicture& pic) {
  if (pic.records < 1 || pic.tokens < 1 || pic.dim < 1 || pic.clouds < 1) {
    throw Error(ErrorCode::internal, "draw_flow: empty picture");
  }
  const Canvas canvas(1360, 700);
  cairo_t* cr = canvas.context();
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
    const int column = k % 2, row = k / 2;  // two charts a row
    Frame box{x0 + column * gx, y0 + row * gy, cw, ch, 0, 1, 0, 1};
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
  return canvas.png();
}

}  // namespace emflow::tools

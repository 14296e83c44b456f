// The per-layer histogram of a model's pairwise cosines as one heat map (layer x cosine bin):
// the measurement Geshkovski et al. ("A mathematical perspective on Transformers") show for
// ALBERT, where the mass moves toward cosine 1 with depth.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

#include "axes.hpp"
#include "canvas.hpp"
#include "colours.hpp"
#include "emflow/error.hpp"
#include "tools/plot.hpp"

namespace emflow::tools {

std::string draw_cosine_histogram(const CosineHistogramPicture& pic) {
  const std::int64_t R = pic.records, K = pic.bins;
  if (R < 1 || K < 1 || pic.counts.size() != static_cast<std::size_t>(R * K) ||
      pic.mean_cosine.size() != static_cast<std::size_t>(R)) {
    throw Error(ErrorCode::internal, "draw_cosine_histogram: inconsistent picture");
  }
  // Each row is the fraction of that record's pairs per bin; the colour scale is the largest
  // fraction of any cell.
  std::vector<double> fraction(pic.counts.size(), 0.0);
  double top = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    std::int64_t pairs = 0;
    for (std::int64_t k = 0; k < K; ++k) pairs += pic.counts[static_cast<std::size_t>(r * K + k)];
    for (std::int64_t k = 0; k < K; ++k) {
      const auto at = static_cast<std::size_t>(r * K + k);
      fraction[at] = pairs ? static_cast<double>(pic.counts[at]) / static_cast<double>(pairs) : 0;
      top = std::max(top, fraction[at]);
    }
  }
  if (top <= 0) top = 1;

  const double row_height = std::clamp(560.0 / static_cast<double>(R), 14.0, 60.0);
  const double height = row_height * static_cast<double>(R);
  const Canvas canvas(900, static_cast<int>(height + 150));
  cairo_t* cr = canvas.context();
  // Rows from the input (layer 0, y in [R - 1, R]) at the top to the last layer at the bottom.
  Frame f{90, 80, 640, height, -1.0, 1.0, -0.5, static_cast<double>(R) - 0.5};

  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> cells(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(K), static_cast<int>(R)),
      cairo_surface_destroy);
  cairo_surface_flush(cells.get());
  unsigned char* pixels = cairo_image_surface_get_data(cells.get());
  const int stride = cairo_image_surface_get_stride(cells.get());
  for (std::int64_t r = 0; r < R; ++r) {
    auto* row = reinterpret_cast<std::uint32_t*>(pixels + r * stride);
    for (std::int64_t k = 0; k < K; ++k) {
      const Rgb c = viridis(fraction[static_cast<std::size_t>(r * K + k)] / top);
      row[k] = (static_cast<std::uint32_t>(std::lround(c.r * 255)) << 16) |
               (static_cast<std::uint32_t>(std::lround(c.g * 255)) << 8) |
               static_cast<std::uint32_t>(std::lround(c.b * 255));
    }
  }
  cairo_surface_mark_dirty(cells.get());
  cairo_save(cr);
  cairo_translate(cr, f.left, f.top);
  cairo_scale(cr, f.width / static_cast<double>(K), f.height / static_cast<double>(R));
  cairo_set_source_surface(cr, cells.get(), 0, 0);
  cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
  cairo_rectangle(cr, 0, 0, static_cast<double>(K), static_cast<double>(R));
  cairo_fill(cr);
  cairo_restore(cr);

  // The mean cosine of each row: a white tick with a dark outline, joined from row to row.
  const auto row_y = [&](std::int64_t r) {
    return f.top + (static_cast<double>(r) + 0.5) * row_height;
  };
  cairo_set_line_width(cr, 1.2);
  set_colour(cr, {1, 1, 1}, 0.8);
  for (std::int64_t r = 0; r < R; ++r) {
    const double x = f.px(std::clamp(pic.mean_cosine[static_cast<std::size_t>(r)], -1.0, 1.0));
    r == 0 ? cairo_move_to(cr, x, row_y(r)) : cairo_line_to(cr, x, row_y(r));
  }
  cairo_stroke(cr);
  for (std::int64_t r = 0; r < R; ++r) {
    const double x = f.px(std::clamp(pic.mean_cosine[static_cast<std::size_t>(r)], -1.0, 1.0));
    cairo_arc(cr, x, row_y(r), std::min(4.0, row_height / 3), 0, 2 * M_PI);
    set_colour(cr, {1, 1, 1});
    cairo_fill_preserve(cr);
    set_colour(cr, {0.1, 0.1, 0.1});
    cairo_stroke(cr);
  }

  // Axes: cosine along x, the layer names along y.
  set_colour(cr, {0.15, 0.15, 0.15});
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, f.left + 0.5, f.top + 0.5, f.width, f.height);
  cairo_stroke(cr);
  for (int tick = 0; tick <= 8; ++tick) {
    const double c = -1.0 + 0.25 * tick;
    const double x = std::round(f.px(c)) + 0.5;
    cairo_move_to(cr, x, f.top + f.height);
    cairo_line_to(cr, x, f.top + f.height + 4);
    cairo_stroke(cr);
    text_at(cr, format_number(c, 0.25), x, f.top + f.height + 7, 11, 0.5, 0.0);
  }
  text_at(cr, "cosine between two tokens, cos(x\xE1\xB5\xA2, x\xE2\xB1\xBC)", f.left + f.width / 2,
          f.top + f.height + 26, 12, 0.5, 0.0);
  const std::int64_t label_every =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(13.0 / row_height)));
  for (std::int64_t r = 0; r < R; ++r) {
    if (r % label_every != 0 && r != R - 1) continue;
    char label[32];
    std::snprintf(label, sizeof label, r == 0 ? "input" : "%lld", static_cast<long long>(r));
    text_at(cr, label, f.left - 6, row_y(r), 11, 1.0, 0.5);
  }
  text_at(cr, "after layer", 24, f.top + f.height / 2, 12, 0.5, 0.0, false, -M_PI / 2);
  text_at(cr, pic.title, f.left, 22, 15, 0.0, 0.0, true);
  text_at(cr,
          "per layer, the fraction of the token pairs in each cosine bin; "
          "dots: the mean cosine",
          f.left, 46, 12, 0.0, 0.0);

  // The colour bar, in fractions of a row's pairs.
  Frame bar{f.left + f.width + 30, f.top, 20, std::min(f.height, 400.0), 0, top, 0, top};
  for (int p = 0; p < static_cast<int>(bar.height); ++p) {
    set_colour(cr, viridis(1.0 - p / bar.height));
    cairo_rectangle(cr, bar.left, bar.top + p, bar.width, 1.0);
    cairo_fill(cr);
  }
  set_colour(cr, {0.15, 0.15, 0.15});
  cairo_rectangle(cr, bar.left + 0.5, bar.top + 0.5, bar.width, bar.height);
  cairo_stroke(cr);
  double step = 0;
  for (double v : nice_ticks(0, top, 5, &step)) {
    if (v < 0 || v > top * 1.0001) continue;
    const double y = std::round(bar.py(v)) + 0.5;
    cairo_move_to(cr, bar.left + bar.width, y);
    cairo_line_to(cr, bar.left + bar.width + 4, y);
    cairo_stroke(cr);
    text_at(cr, format_number(v, step), bar.left + bar.width + 7, y, 11, 0.0, 0.5);
  }
  text_at(cr, "fraction of pairs", bar.left + bar.width + 58, bar.top + bar.height / 2, 12, 0.5,
          0.0, false, -M_PI / 2);
  return canvas.png();
}

}  // namespace emflow::tools

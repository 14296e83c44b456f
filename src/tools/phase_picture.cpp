// The phase diagram: the clustered fraction over (time, beta) as an image of cells, with its
// colour bar.
#include <cmath>
#include <cstdint>
#include <memory>

#include "axes.hpp"
#include "canvas.hpp"
#include "colours.hpp"
#include "emflow/error.hpp"
#include "tools/plot.hpp"

namespace emflow::tools {

std::string draw_phase(const flow::PhaseDiagram& diagram, const std::string& title) {
  const std::size_t T = diagram.times.size(), K = diagram.betas.size();
  if (T < 1 || K < 1 || diagram.clustered.size() != T * K) {
    throw Error(ErrorCode::internal, "draw_phase: inconsistent diagram");
  }
  const Canvas canvas(900, 640);
  cairo_t* cr = canvas.context();

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

  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> cells(
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
  return canvas.png();
}

}  // namespace emflow::tools

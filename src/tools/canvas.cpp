#include "canvas.hpp"

#include "emflow/error.hpp"
#include "tools/plot.hpp"

namespace emflow::tools {
namespace {

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

}  // namespace

Canvas::Canvas(int width, int height)
    : surface_(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height),
               cairo_surface_destroy),
      context_(cairo_create(surface_.get()), cairo_destroy) {
  cairo_set_source_rgb(context(), 1, 1, 1);
  cairo_paint(context());
}

std::string Canvas::png() const {
  cairo_surface_flush(surface_.get());
  std::string bytes;
  const cairo_status_t status =
      cairo_surface_write_to_png_stream(surface_.get(), append_bytes, &bytes);
  if (status != CAIRO_STATUS_SUCCESS) {
    throw Error(ErrorCode::internal, std::string("cairo could not encode the picture: ") +
                                         cairo_status_to_string(status));
  }
  return bytes;
}

void set_colour(cairo_t* cr, Rgb c, double alpha) {
  cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha);
}

void text_at(cairo_t* cr, const std::string& text, double x, double y, double size, double align_x,
             double align_y, bool bold, double angle) {
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

// "S^{n}" with the exponent in Unicode superscript digits.
std::string superscript(long long n) {
  static const char* digits[] = {"\xE2\x81\xB0", "\xC2\xB9",     "\xC2\xB2",     "\xC2\xB3",
                                 "\xE2\x81\xB4", "\xE2\x81\xB5", "\xE2\x81\xB6", "\xE2\x81\xB7",
                                 "\xE2\x81\xB8", "\xE2\x81\xB9"};
  std::string text;
  for (char c : std::to_string(n)) text += c == '-' ? "\xE2\x81\xBB" : digits[c - '0'];
  return text;
}

}  // namespace emflow::tools

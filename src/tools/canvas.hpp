// A picture being drawn: a cairo image surface that ends as PNG bytes in memory (the caller
// writes them atomically with its other outputs), and the text and colour primitives of every
// picture.
#pragma once

#include <cairo.h>

#include <memory>
#include <string>

#include "colours.hpp"

namespace emflow::tools {

/// An ARGB image of width x height pixels on a white background.
class Canvas {
 public:
  Canvas(int width, int height);
  cairo_t* context() const noexcept { return context_.get(); }
  /// The picture so far, encoded as PNG. Throws emflow::Error (ErrorCode::internal) when cairo
  /// fails.
  std::string png() const;

 private:
  std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface_;
  std::unique_ptr<cairo_t, decltype(&cairo_destroy)> context_;
};

void set_colour(cairo_t* cr, Rgb c, double alpha = 1.0);

/// Draws `text` at (x, y): align_x and align_y in [0, 1] say which point of its box lies
/// there (0, 0: top left), `angle` turns it (radians) about that point.
void text_at(cairo_t* cr, const std::string& text, double x, double y, double size, double align_x,
             double align_y, bool bold = false, double angle = 0.0);

}  // namespace emflow::tools

// Where the tokens go: the left half of the flow picture.
#pragma once

#include <cairo.h>

#include "tools/plot.hpp"

namespace emflow::tools {

/// The recorded positions of the picture's cloud in the size x size square at (left, top): each
/// token's path in its colour, open circles where it starts and dots where it ends; in the
/// plane for d <= 2, on an orthographic sphere for d = 3 on the sphere (the far side faint),
/// else on the two principal directions of all recorded positions.
void draw_paths(cairo_t* cr, const FlowPicture& picture, double left, double top, double size);

}  // namespace emflow::tools

// The files of `emflow flow --generate K` (cmd_flow.cpp) beyond the paths: the metrics table and
// the picture of an emflow::Generation (emflow/generate.hpp, which does the generation).
#pragma once

#include <string>

#include "emflow/generate.hpp"

namespace emflow::cli {

/// The --metrics table: token, position, layer, move (how far the layer moved it), seconds; with
/// several clouds a leading cloud column.
std::string generation_metrics(const Generation& g);

/// The picture of cloud 0's new tokens moving through the stack (PNG bytes): each token's path
/// over the layers and, per layer, its pairwise cosines, clusters and attention entropy.
std::string generation_picture(const Generation& g, const std::string& title);

}  // namespace emflow::cli

// CLI11's classes by name only. The tool's headers declare their commands and options with these;
// <CLI/CLI.hpp> itself is included by the files that build commands and read options, since its
// inline code costs every translation unit that includes it several seconds of compilation.
#pragma once

namespace CLI {
class App;
class Option;
}  // namespace CLI

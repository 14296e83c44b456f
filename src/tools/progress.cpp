#include "tools/progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <utility>

namespace emflow::tools {

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)),
      enabled_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(std::int64_t done, std::int64_t total) {
  if (!enabled_ || total <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  drawn_ = true;
  const double fraction =
      std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0);
  const int width = 30, filled = static_cast<int>(fraction * width);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(width, '.');
  char line[160];
  std::snprintf(line, sizeof line, "\r%s [%s] %3.0f%%  %.1f s", label_.c_str(), bar.c_str(),
                100.0 * fraction, elapsed);
  std::cerr << line << std::flush;
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  std::cerr << "\r\x1b[2K" << std::flush;  // clear the line
  drawn_ = false;
}

flow::Progress ProgressBar::callback() {
  if (!enabled_) return {};
  return [this](std::int64_t done, std::int64_t total) { update(done, total); };
}

}  // namespace emflow::tools

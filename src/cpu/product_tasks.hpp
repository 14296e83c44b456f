// How cpu_products and cpu_products_bf16 (products.cpp, products_bf16.cpp) choose their team of
// threads and deal their work to it: by panels of B's columns, and, where the panels are fewer than
// twice the team (a prompt's 576-column products: 3 panels), by chunks of whole row blocks too.
// Each element is computed the same way whichever task holds it, so the result does not depend on
// the team. Internal to src/cpu.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "core/backends.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

struct ProductTasks {
  int team = 1;  ///< the threads: `threads`, or with 0 every core when the product is large
  std::int64_t panels = 1, chunk_rows = 0, chunks = 1;
  std::int64_t count() const { return panels * chunks; }

  /// Task `task`'s panel and rows [first, last).
  struct Task {
    std::int64_t panel, first, last;
  };
  Task at(std::int64_t task, std::int64_t rows) const {
    const std::int64_t first = task % chunks * chunk_rows;
    return {task / chunks, first, std::min(rows, first + chunk_rows)};
  }
};

inline ProductTasks product_tasks(std::int64_t rows, std::int64_t depth, std::int64_t columns,
                                  int threads, std::int64_t row_block) {
  ProductTasks t;
  const double work =
      static_cast<double>(rows) * static_cast<double>(depth) * static_cast<double>(columns);
  t.team = threads > 0 ? threads : work < 2.5e5 ? 1 : omp_get_max_threads();
  t.panels = (columns + kProductPanel - 1) / kProductPanel;
  t.chunk_rows = rows;
  if (t.team > 1 && t.panels < 2 * t.team && rows >= 2 * row_block) {
    const std::int64_t per = (rows + t.team - 1) / t.team;
    t.chunk_rows = (per + row_block - 1) / row_block * row_block;
    t.chunks = (rows + t.chunk_rows - 1) / t.chunk_rows;
  }
  return t;
}

EMFLOW_CPU_END

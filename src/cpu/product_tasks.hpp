// How cpu_products and cpu_products_bf16 (products.cpp, products_bf16.cpp) deal their work to a
// team of threads: by panels of B's columns, and, where the panels are fewer than twice the
// team (a prompt's 576-column products: 3 panels), by chunks of whole row blocks too. Each
// element is computed the same way whichever task holds it, so the result does not depend on the
// team. Internal to src/cpu.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/backends.hpp"

namespace emflow::detail::cpu {

struct ProductTasks {
  std::int64_t panels = 1, chunk_rows = 0, chunks = 1;
  std::int64_t count() const { return panels * chunks; }
};

inline ProductTasks product_tasks(std::int64_t rows, std::int64_t columns, int team,
                                  std::int64_t row_block) {
  ProductTasks t;
  t.panels = (columns + kProductPanel - 1) / kProductPanel;
  t.chunk_rows = rows;
  if (team > 1 && t.panels < 2 * team && rows >= 2 * row_block) {
    const std::int64_t per = (rows + team - 1) / team;
    t.chunk_rows = (per + row_block - 1) / row_block * row_block;
    t.chunks = (rows + t.chunk_rows - 1) / t.chunk_rows;
  }
  return t;
}

}  // namespace emflow::detail::cpu

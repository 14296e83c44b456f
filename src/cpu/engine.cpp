// The fused float32 attention engine of the fast CPU backend (see engine.hpp for what it
// computes). How it computes it:
//
// Phase 1 (projections, O(N d^2) per head): queries Q_h, values V_h and, for the factored form,
// keys K_h are computed by the register-blocked micro-kernel of simd.hpp, one 64-row block of a
// cloud per task. Keys are stored transposed, in panels of kKeyTile keys (score_dim x kKeyTile),
// so a score tile is again a small GEMM with contiguous vector loads. For the dense form the keys
// are the cloud itself and one set of panels serves every head.
//
// Phase 2 (attention, O(N^2 d) per head, O(N d) memory): one task per (cloud, block of queries).
// For each head in order 0..H-1, the block's queries meet the key tiles one at a time, kChunkRows
// queries at a time: a score tile (kChunkRows x kKeyTile) by the micro-kernel, an online softmax
// (running max m, a per-lane running sum Z and a per-lane running sum E of p (s - m) for the
// entropy, all rescaled when m grows), and the content step O += P V_h by the micro-kernel.
// Key tiles wholly outside the mask are skipped; tiles wholly inside it need no masking.
// The normalised head outputs are summed into the block's update in head order, so every output
// element is computed by one thread in one fixed order: results are bitwise identical whatever
// the thread count and the schedule.
//
// Entropy is computed as H_i = log Z_i - E_i / Z_i with E_i = sum_j exp(s_ij - m_i)(s_ij - m_i):
// both terms are non-negative, so no cancellation happens where lse_i is large.
#include "engine.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/check.hpp"
#include "simd.hpp"

namespace emflow::detail::cpu {

namespace {

constexpr std::int64_t kKeyTile = 32;     // keys per score tile
constexpr std::int64_t kTokenAlign = 64;  // buffers hold the tokens rounded up to this
#if EMFLOW_CPU_LANES == 16
constexpr int kChunkRows = 8;  // 8 x 32 scores = 16 accumulators of 16 lanes
#else
constexpr int kChunkRows = 4;
#endif
constexpr int kContentRows = kChunkRows;  // rows per content micro-kernel call (O += P V)
constexpr std::int64_t kProjectionRows = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Bytes of projected operands to hold at once; clouds are processed in groups within it.
constexpr std::int64_t kGroupBytes = std::int64_t{96} << 20;

static_assert(kTokenAlign % kKeyTile == 0 && kTokenAlign % kChunkRows == 0, "tile sizes");

/// Zero-filled float storage aligned to a cache line, freed with the object.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::int64_t count) {
    const std::size_t bytes = (static_cast<std::size_t>(count) * sizeof(float) + 63) / 64 * 64;
    if (bytes == 0) return;
    data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data_) {
      fail(ErrorCode::out_of_memory, "attend: could not allocate ", bytes,
           " bytes of CPU working memory");
    }
    std::memset(data_.get(), 0, bytes);
  }
  float* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

std::int64_t round_up(std::int64_t n, std::int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

/// Which keys of a tile a set of query rows may see.
enum class TileCover { empty, partial, full };

/// Rows [row_begin, row_end) against keys [key_begin, key_begin + kKeyTile). Visible key
/// intervals only grow with the row (Mask::visible_keys), so the rows together see
/// [first of the top row, last of the bottom row) and each of them sees
/// [first of the bottom row, last of the top row).
TileCover cover(const Mask& mask, std::int64_t length, std::int64_t row_begin, std::int64_t row_end,
                std::int64_t key_begin) {
  if (row_end <= row_begin) return TileCover::empty;
  const std::int64_t key_end = key_begin + kKeyTile;
  const KeyRange top = mask.visible_keys(row_begin, length);
  const KeyRange bottom = mask.visible_keys(row_end - 1, length);
  if (key_begin >= bottom.last || key_end <= top.first) return TileCover::empty;
  return bottom.first <= key_begin && key_end <= top.last ? TileCover::full : TileCover::partial;
}

/// The shapes every task shares.
struct Geometry {
  std::int64_t tokens = 0, padded_tokens = 0, dim = 0, heads = 0;
  std::int64_t score_dim = 0, score_stride = 0;  // query rows, key panels
  std::int64_t value_dim = 0, value_stride = 0;
  std::int64_t dim_stride = 0;  // update rows
  std::int64_t query_block = 64;
  bool shared_keys = true;
  std::int64_t query_floats() const { return padded_tokens * score_stride; }
  std::int64_t key_floats() const { return padded_tokens * score_dim; }
  std::int64_t value_floats() const { return padded_tokens * value_stride; }
};

/// Per-thread working memory: O(query_block x (value_dim + dim)) floats.
struct Scratch {
  AlignedBuffer head_output;       // O: query_block x value_stride
  AlignedBuffer update;            // delta: query_block x dim_stride
  AlignedBuffer scores;            // S, then P: kChunkRows x kKeyTile
  AlignedBuffer sums;              // Z per lane: query_block x kLanes
  AlignedBuffer entropy_sums;      // E per lane: query_block x kLanes
  AlignedBuffer projected;         // one block of projected keys: kTokenAlign x score_stride
  AlignedBuffer rows;              // kProjectionRows cloud rows, zero padded
  std::vector<float> running_max;  // m: query_block
  std::vector<float> row_lse;      // lse of the current head: query_block
  std::vector<char> saw_key;       // per query row: some head had a visible key

  explicit Scratch(const Geometry& g)
      : head_output(g.query_block * g.value_stride),
        update(g.query_block * g.dim_stride),
        scores(kChunkRows * kKeyTile),
        sums(g.query_block * kLanes),
        entropy_sums(g.query_block * kLanes),
        projected(g.shared_keys ? 0 : kTokenAlign * g.score_stride),
        rows(kProjectionRows * g.dim),
        running_max(static_cast<std::size_t>(g.query_block)),
        row_lse(static_cast<std::size_t>(g.query_block)),
        saw_key(static_cast<std::size_t>(g.query_block)) {}
};

/// out[rows x columns] = X[rows x dim] map[dim x columns] (+ bias) for the cloud rows
/// [row_begin, row_begin + rows) of a cloud whose first `tokens` rows are read; rows past those
/// read as zero (written as 0 within the last group of kProjectionRows, otherwise left as they
/// are in `out`).
void project(const float* cloud, std::int64_t tokens, std::int64_t dim, std::int64_t row_begin,
             std::int64_t rows, const float* map, std::int64_t columns, const float* bias,
             float* out, float* row_scratch) {
  for (std::int64_t r = 0; r < rows; r += kProjectionRows) {
    const std::int64_t first = row_begin + r;
    if (first >= tokens) break;
    const float* A = cloud + first * dim;
    if (first + kProjectionRows > tokens) {
      std::fill(row_scratch, row_scratch + kProjectionRows * dim, 0.0f);
      std::copy(A, cloud + tokens * dim, row_scratch);
      A = row_scratch;
    }
    row_block_gemm<kProjectionRows>(dim, A, dim, map, columns, columns, out + r * columns, columns,
                                    false);
    if (bias != nullptr) {
      const std::int64_t valid = std::min(kProjectionRows, tokens - first);
      for (std::int64_t i = 0; i < valid; ++i) {
        float* row = out + (r + i) * columns;
        for (std::int64_t a = 0; a < columns; a += kLanes) {
          store(row + a, load(row + a) + load(bias + a));
        }
      }
    }
  }
}

/// Copies keys [key_begin, key_begin + count) (rows of a row-major matrix with `stride`) into the
/// transposed panels: panel t holds keys [t kKeyTile, (t + 1) kKeyTile) as score_dim x kKeyTile.
void pack_keys(const float* keys, std::int64_t stride, std::int64_t score_dim,
               std::int64_t key_begin, std::int64_t count, float* panels) {
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t key = key_begin + j;
    float* panel = panels + (key / kKeyTile) * score_dim * kKeyTile + key % kKeyTile;
    const float* row = keys + j * stride;
    for (std::int64_t k = 0; k < score_dim; ++k) panel[k * kKeyTile] = row[k];
  }
}

/// The operands of one head of one cloud.
struct HeadOperands {
  float* queries;  // padded_tokens x score_stride
  float* panels;   // padded_tokens / kKeyTile panels of score_dim x kKeyTile
  float* values;   // padded_tokens x value_stride
};

/// Online-softmax step for the rows [row0, row0 + kChunkRows) of a block on one key tile:
/// masks the scores if the tile is partial, updates m, Z, E and rescales O rows where m grows,
/// and turns the scores into unnormalised weights exp(s - m) in place.
void softmax_step(float* scores, std::int64_t local_row0, std::int64_t query0, std::int64_t key0,
                  bool partial, const Mask& mask, std::int64_t length, const Geometry& g,
                  Scratch& s) {
  constexpr std::int64_t kVectors = kKeyTile / kLanes;
  for (int r = 0; r < kChunkRows; ++r) {
    const std::int64_t local = local_row0 + r;
    float* row = scores + r * kKeyTile;
    if (partial) {
      const KeyRange keys = mask.visible_keys(query0 + r, length);
      for (std::int64_t jj = 0; jj < kKeyTile; ++jj) {
        if (!keys.contains(key0 + jj)) row[jj] = kNegInf;
      }
    }
    Vec tile_max = load(row);
    for (std::int64_t v = 1; v < kVectors; ++v) tile_max = max(tile_max, load(row + v * kLanes));
    const float old_max = s.running_max[static_cast<std::size_t>(local)];
    float* z = s.sums.data() + local * kLanes;
    float* e = s.entropy_sums.data() + local * kLanes;
    // Most tiles do not raise the running max: one vector compare instead of a reduction.
    float new_max = old_max;
    if (any_greater(tile_max, splat(old_max))) {
      new_max = horizontal_max(tile_max);
      float* o = s.head_output.data() + local * g.value_stride;
      if (old_max == kNegInf) {  // first visible key: O, Z and E are still zero
        std::fill(o, o + g.value_stride, 0.0f);
      } else {
        // exp(s - m_new) = alpha exp(s - m_old): rescale O and Z; E also gains (m_old - m_new) Z.
        const Vec alpha = splat(std::exp(old_max - new_max));
        const Vec shift = splat(old_max - new_max);
        const Vec zv = load(z);
        store(e, alpha * fma(shift, zv, load(e)));
        store(z, alpha * zv);
        for (std::int64_t a = 0; a < g.value_stride; a += kLanes) {
          store(o + a, alpha * load(o + a));
        }
      }
      s.running_max[static_cast<std::size_t>(local)] = new_max;
    } else if (old_max == kNegInf) {
      // Nothing finite for this row yet: its scores here are -inf or NaN (which the max above
      // drops). Rare (a window row past a partial tile, or NaN scores), so a sum tells them
      // apart: a NaN makes the running max NaN, which every later step carries (§6.6).
      Vec sum = load(row);
      for (std::int64_t v = 1; v < kVectors; ++v) sum += load(row + v * kLanes);
      const float total = horizontal_sum(sum);
      std::fill(row, row + kKeyTile, total == total ? 0.0f : total);
      if (total != total) s.running_max[static_cast<std::size_t>(local)] = total;
      continue;
    }
    const Vec m = splat(new_max);
    const Vec floor_value = splat(-1.0e4f);  // keeps 0 * (s - m) finite where s = -inf
    Vec zv = load(z), ev = load(e);
    for (std::int64_t v = 0; v < kVectors; ++v) {
      const Vec centred = load(row + v * kLanes) - m;
      const Vec p = exp_nonpositive(centred);
      zv += p;
      ev = fma(p, max(centred, floor_value), ev);
      store(row + v * kLanes, p);
    }
    store(z, zv);
    store(e, ev);
  }
}

/// Attention of the queries [query_begin, query_begin + query_block) of cloud `b` (all heads),
/// written to the outputs.
void attend_block(std::int64_t b, std::int64_t query_begin, const Geometry& g,
                  const std::vector<HeadOperands>& heads, const EngineLayer& layer,
                  const Mask& mask, std::int64_t length, const AttentionOutput<float>& out,
                  Scratch& s) {
  const std::int64_t N = g.tokens;
  const std::int64_t rows = std::min(g.query_block, N - query_begin);
  // Rows past the key length see no key (padding queries); rows before it always see key i.
  const std::int64_t live = std::clamp<std::int64_t>(length - query_begin, 0, rows);
  const std::int64_t live_chunks = round_up(live, kChunkRows);
  float* update = s.update.data();
  std::fill(update, update + live_chunks * g.dim_stride, 0.0f);
  std::fill(s.saw_key.begin(), s.saw_key.end(), 0);

  // Key tiles any live row of the block can see.
  std::int64_t key_begin = 0;
  std::int64_t key_end = 0;
  if (live > 0) {
    key_begin = mask.visible_keys(query_begin, length).first;
    key_end = mask.visible_keys(query_begin + live - 1, length).last;
  }
  const std::int64_t tile_begin = key_begin / kKeyTile;
  const std::int64_t tile_end = (key_end + kKeyTile - 1) / kKeyTile;

  for (std::int64_t h = 0; h < g.heads; ++h) {
    const HeadOperands& op = heads[static_cast<std::size_t>(h)];
    const std::int64_t stats_row = (b * g.heads + h) * N + query_begin;
    if (live > 0) {
      std::fill(s.running_max.begin(), s.running_max.end(), kNegInf);
      std::fill(s.sums.data(), s.sums.data() + live_chunks * kLanes, 0.0f);
      std::fill(s.entropy_sums.data(), s.entropy_sums.data() + live_chunks * kLanes, 0.0f);
      for (std::int64_t t = tile_begin; t < tile_end; ++t) {
        const std::int64_t key0 = t * kKeyTile;
        const float* panel = op.panels + t * g.score_dim * kKeyTile;
        const float* values = op.values + key0 * g.value_stride;
        for (std::int64_t c = 0; c < live_chunks; c += kChunkRows) {
          const std::int64_t query0 = query_begin + c;
          const TileCover tile =
              cover(mask, length, query0, std::min(query0 + kChunkRows, query_begin + live), key0);
          if (tile == TileCover::empty) continue;
          float* scores = s.scores.data();
          row_block_gemm<kChunkRows>(g.score_dim, op.queries + query0 * g.score_stride,
                                     g.score_stride, panel, kKeyTile, kKeyTile, scores, kKeyTile,
                                     false);
          softmax_step(scores, c, query0, key0, tile == TileCover::partial, mask, length, g, s);
          for (int r = 0; r < kChunkRows; r += kContentRows) {
            const std::int64_t local = c + r;
            // A row whose running max is still -inf has O = 0 and weights 0: nothing to add.
            row_block_gemm<kContentRows>(
                kKeyTile, scores + r * kKeyTile, kKeyTile, values, g.value_stride, g.value_stride,
                s.head_output.data() + local * g.value_stride, g.value_stride, true);
          }
        }
      }
    }

    // Normalise, record lse and entropy, and add this head's output to the update. A NaN score
    // needs no test of its own in the loops above: it makes exp(s - m), hence Z and O, NaN, which
    // the formulas below carry into lse, entropy and delta (+inf does the same through
    // inf - inf). Only a live row whose running max stayed -inf (every visible score NaN or
    // -inf: the tiles then add nothing) must be made NaN here; live rows always see a key.
    for (std::int64_t r = 0; r < rows; ++r) {
      const float m = r < live ? s.running_max[static_cast<std::size_t>(r)] : kNegInf;
      float* o = s.head_output.data() + r * g.value_stride;
      float lse = kNegInf, entropy = 0.0f;
      if (m == kNegInf && r < live) {
        lse = entropy = std::numeric_limits<float>::quiet_NaN();
        std::fill(o, o + g.value_stride, lse);
        s.saw_key[static_cast<std::size_t>(r)] = 1;
      } else if (m != kNegInf) {
        const float z = horizontal_sum(load(s.sums.data() + r * kLanes));
        const float e = horizontal_sum(load(s.entropy_sums.data() + r * kLanes));
        const float log_z = std::log(z);
        lse = m + log_z;
        entropy = log_z - e / z;
        const Vec inv = splat(1.0f / z);
        for (std::int64_t a = 0; a < g.value_stride; a += kLanes) store(o + a, inv * load(o + a));
        s.saw_key[static_cast<std::size_t>(r)] = 1;
      }
      s.row_lse[static_cast<std::size_t>(r)] = lse;
      if (out.lse) out.lse[stats_row + r] = lse;
      if (out.entropy) out.entropy[stats_row + r] = entropy;
    }
    if (live > 0) {
      float* o = s.head_output.data();
      if (layer.output_map == nullptr) {
        for (std::int64_t i = 0; i < live_chunks * g.dim_stride; i += kLanes) {
          store(update + i, load(update + i) + load(o + i));
        }
      } else {
        const float* map = layer.output_map + h * g.value_dim * g.dim_stride;
        for (std::int64_t r = 0; r < live_chunks; r += kContentRows) {
          row_block_gemm<kContentRows>(g.value_dim, o + r * g.value_stride, g.value_stride, map,
                                       g.dim_stride, g.dim_stride, update + r * g.dim_stride,
                                       g.dim_stride, true);
        }
      }
    }

    // Weights need the N x N matrix anyway: recompute each score tile and write exp(s - lse).
    if (out.weights != nullptr) {
      for (std::int64_t r = 0; r < rows; ++r) {
        float* w = out.weights + (stats_row + r) * N;
        std::fill(w, w + N, 0.0f);
      }
      for (std::int64_t c = 0; c < live_chunks; c += kChunkRows) {
        const std::int64_t query0 = query_begin + c;
        const std::int64_t chunk_end = std::min(query0 + kChunkRows, query_begin + live);
        for (std::int64_t t = 0; t * kKeyTile < N; ++t) {
          const std::int64_t key0 = t * kKeyTile;
          if (cover(mask, length, query0, chunk_end, key0) == TileCover::empty) continue;
          float* scores = s.scores.data();
          row_block_gemm<kChunkRows>(g.score_dim, op.queries + query0 * g.score_stride,
                                     g.score_stride, op.panels + t * g.score_dim * kKeyTile,
                                     kKeyTile, kKeyTile, scores, kKeyTile, false);
          for (std::int64_t i = query0; i < chunk_end; ++i) {
            const float lse = s.row_lse[static_cast<std::size_t>(i - query_begin)];
            float* w = out.weights + (stats_row + i - query_begin) * N;
            const float* row = scores + (i - query0) * kKeyTile - key0;
            const KeyRange keys = mask.visible_keys(i, length);
            for (std::int64_t j = key0; j < std::min(key0 + kKeyTile, N); ++j) {
              if (keys.contains(j)) w[j] = std::exp(row[j] - lse);
            }
          }
        }
      }
    }
  }

  // delta_i = sum_h (...) + c for every query that saw a key; 0 for the others.
  for (std::int64_t r = 0; r < rows; ++r) {
    float* dst = out.update + (b * N + query_begin + r) * g.dim;
    const float* src = update + r * g.dim_stride;
    if (!s.saw_key[static_cast<std::size_t>(r)]) {
      std::fill(dst, dst + g.dim, 0.0f);
    } else if (layer.offset != nullptr) {
      for (std::int64_t a = 0; a < g.dim; ++a) dst[a] = src[a] + layer.offset[a];
    } else {
      std::copy(src, src + g.dim, dst);
    }
  }
}

}  // namespace

std::int64_t padded_columns(std::int64_t columns) { return round_to_lanes(columns); }

bool all_finite(const float* values, std::int64_t count) {
  if (values == nullptr) return true;
  // Finite x gives x - x = 0; NaN and +-inf give NaN, which the sum keeps.
  float sum = 0.0f;
  for (std::int64_t i = 0; i < count; ++i) sum += values[i] - values[i];
  return sum == 0.0f;
}

bool clouds_finite(const float* cloud, std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                   const std::int64_t* key_lengths) {
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = key_lengths ? key_lengths[b] : tokens;
    if (!all_finite(cloud + b * tokens * dim, length * dim)) return false;
  }
  return true;
}

void fused_attend(const float* cloud, std::int64_t batch, std::int64_t tokens,
                  const EngineLayer& layer, const Mask& mask, const std::int64_t* key_lengths,
                  const AttentionOutput<float>& out, int threads) {
  Geometry g;
  g.tokens = tokens;
  g.padded_tokens = round_up(tokens, kTokenAlign);
  g.dim = layer.dim;
  g.heads = layer.heads;
  g.score_dim = layer.score_dim;
  g.score_stride = padded_columns(layer.score_dim);
  g.value_dim = layer.value_dim;
  g.value_stride = padded_columns(layer.value_dim);
  g.dim_stride = padded_columns(layer.dim);
  g.shared_keys = layer.key_map == nullptr;

  // With the thread count left to us, small calls run on one thread: waking a team costs a few
  // microseconds on an idle machine and up to a scheduler time slice on a busy one, more than
  // a call of a few MFLOP takes alone.
  const double work = 4.0 * static_cast<double>(batch) * static_cast<double>(layer.heads) *
                      static_cast<double>(tokens) * static_cast<double>(tokens) *
                      static_cast<double>(layer.score_dim + layer.value_dim) / 2.0;
  constexpr double kSmallCallFlop = 4e6;
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();
  const std::int64_t H = g.heads;
  const std::int64_t key_sets = g.shared_keys ? 1 : H;
  const std::int64_t cloud_floats =
      H * (g.query_floats() + g.value_floats()) + key_sets * g.key_floats();
  const std::int64_t group = std::clamp<std::int64_t>(kGroupBytes / (4 * cloud_floats), 1, batch);

  // Smaller query blocks when there are few, so every thread gets work; the results do not
  // depend on the block size (rows are computed independently, tiles in the same order).
  const std::int64_t wide_blocks = group * ((tokens + 63) / 64);
  g.query_block = 64;
  while (g.query_block > kChunkRows && wide_blocks * (64 / g.query_block) < 4 * team) {
    g.query_block /= 2;
  }
  const std::int64_t blocks = (tokens + g.query_block - 1) / g.query_block;

  AlignedBuffer queries(group * H * g.query_floats());
  AlignedBuffer panels(group * key_sets * g.key_floats());
  AlignedBuffer values(group * H * g.value_floats());
  std::vector<std::unique_ptr<Scratch>> scratch;
  for (int t = 0; t < team; ++t) scratch.push_back(std::make_unique<Scratch>(g));

  auto operands = [&](std::int64_t local_cloud) {
    std::vector<HeadOperands> heads(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t head_set = local_cloud * H + h;
      const std::int64_t key_set = local_cloud * key_sets + (g.shared_keys ? 0 : h);
      heads[static_cast<std::size_t>(h)] = {queries.data() + head_set * g.query_floats(),
                                            panels.data() + key_set * g.key_floats(),
                                            values.data() + head_set * g.value_floats()};
    }
    return heads;
  };

  const std::int64_t projection_blocks = g.padded_tokens / kTokenAlign;
  for (std::int64_t first = 0; first < batch; first += group) {
    const std::int64_t count = std::min(group, batch - first);
    std::vector<std::vector<HeadOperands>> cloud_operands;
    for (std::int64_t c = 0; c < count; ++c) cloud_operands.push_back(operands(c));

#pragma omp parallel num_threads(team)
    {
      Scratch& s = *scratch[static_cast<std::size_t>(omp_get_thread_num())];
      // Phase 1: projections, one 64-row block of one head of one cloud per task (dynamic, so a
      // thread that the OS holds back does not hold back the others).
      const std::int64_t projection_tasks = count * H * projection_blocks;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < projection_tasks; ++task) {
        const std::int64_t c = task / (H * projection_blocks);
        const std::int64_t h = (task / projection_blocks) % H;
        const std::int64_t row0 = (task % projection_blocks) * kTokenAlign;
        const float* X = cloud + (first + c) * tokens * g.dim;
        const HeadOperands& op = cloud_operands[static_cast<std::size_t>(c)][h];
        const float* bias = layer.query_bias ? layer.query_bias + h * g.score_stride : nullptr;
        project(X, tokens, g.dim, row0, kTokenAlign, layer.query_map + h * g.dim * g.score_stride,
                g.score_stride, bias, op.queries + row0 * g.score_stride, s.rows.data());
        // Values of keys past the key length are never weighted; they stay 0 (or finite from an
        // earlier cloud), so whatever the caller left in the padding cannot turn 0 * v into NaN.
        const std::int64_t length = key_lengths ? key_lengths[first + c] : tokens;
        project(X, length, g.dim, row0, kTokenAlign, layer.value_map + h * g.dim * g.value_stride,
                g.value_stride, nullptr, op.values + row0 * g.value_stride, s.rows.data());
        const std::int64_t valid = std::min(kTokenAlign, tokens - row0);
        if (valid <= 0) continue;
        if (g.shared_keys) {
          if (h == 0) {
            pack_keys(X + row0 * g.dim, g.dim, g.score_dim, row0, valid, op.panels);
          }
        } else {
          project(X, tokens, g.dim, row0, kTokenAlign, layer.key_map + h * g.dim * g.score_stride,
                  g.score_stride, nullptr, s.projected.data(), s.rows.data());
          pack_keys(s.projected.data(), g.score_stride, g.score_dim, row0, valid, op.panels);
        }
      }

      // Phase 2: attention, one block of queries of one cloud per task, the last blocks first
      // (under a causal mask they have the most keys).
      const std::int64_t attention_tasks = count * blocks;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < attention_tasks; ++task) {
        const std::int64_t c = task % count;
        const std::int64_t block = blocks - 1 - task / count;
        const std::int64_t b = first + c;
        const std::int64_t length = key_lengths ? key_lengths[b] : tokens;
        attend_block(b, block * g.query_block, g, cloud_operands[static_cast<std::size_t>(c)],
                     layer, mask, length, out, s);
      }
    }
  }
}

}  // namespace emflow::detail::cpu

// The backward pass of a layer on the CPU in float (layer_backward.hpp, docs/MATH.md §8.4, §8.5).
//
// 1. The rows that take part (§8.6) are copied into zero-padded panels: the query rows of the
//    queries that see a key, the key rows j < L_b, and dDelta on the same query rows; every other
//    row is zero, so nothing below reads padding or the upstream gradients of queries without
//    keys.
// 2. Per head the SDPA-shaped operator's arrays are projected by the micro-kernel: queries
//    x^ query_map + query_bias, keys x key_map (or x), values x value_map, and the head's upstream
//    dO = dDelta output_map^T (or dDelta).
// 3. The forward pass of every head is recomputed (sdpa_forward): its average O_h enters D_i and
//    the output map's gradient, and the update sums it away. Then the fused backward pass
//    (sdpa_backward) gives dQ_h, dK_h, dV_h and dscale.
// 4. The chain rule, as batched products of the micro-kernel: the maps' gradients transposed,
//    dW^T = dY^T X (the reduction over the rows; one task per head and map, the clouds and rows
//    summed in order), and the clouds' gradients dX = sum_h dY_h W_h^T (one task per block of
//    rows, the heads summed in order 0..H-1). So the gradients are bitwise the same for every
//    thread count, as the SDPA-shaped passes' are.
#include "layer_backward.hpp"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine_internal.hpp"
#include "sdpa.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

using namespace engine;

namespace {

constexpr std::int64_t kRows = kProjectionRows;  // rows per micro-kernel call here
constexpr std::int64_t kBlock = kTokenAlign;     // rows per task
constexpr double kSmallCallFlop = 4e6;

/// A matrix of `rows` x `cols` floats with rows of padded_columns(cols), zero-filled, with room
/// for the micro-kernel's whole groups of kRows rows.
struct Panel {
  std::int64_t rows = 0, cols = 0, stride = 0;
  AlignedBuffer data;
  Panel(std::int64_t r, std::int64_t c)
      : rows(r), cols(c), stride(padded_columns(c)), data((round_up(r, kRows) + kRows) * stride) {}
  float* row(std::int64_t i) const { return data.data() + i * stride; }
};

/// Dense float storage of `count` values with a little room past the end: the micro-kernel
/// reads whole groups of kRows rows or columns.
struct Dense {
  AlignedBuffer data;
  explicit Dense(std::int64_t count, std::int64_t slack) : data(count + slack) {}
  float* get() const { return data.data(); }
};

/// W (rows x cols, dense) into a zero-padded panel; transposed: W^T (cols x rows).
void pad_map(const float* W, std::int64_t rows, std::int64_t cols, bool transposed, Panel& out) {
  for (std::int64_t a = 0; a < rows; ++a) {
    for (std::int64_t b = 0; b < cols; ++b) {
      if (transposed) {
        out.row(b)[a] = W[a * cols + b];
      } else {
        out.row(a)[b] = W[a * cols + b];
      }
    }
  }
}

/// Rows [i0, i1) of `out` (dense, `cols` wide) = rows of `X` (a panel) times the padded map `W`
/// (+ bias); the rows for which `part` is 0 are zero.
void project(const Panel& X, std::int64_t dim, std::int64_t i0, std::int64_t i1, const Panel& W,
             const float* bias, const std::vector<char>& part, float* out, float* scratch) {
  const std::int64_t cols = W.cols;
  for (std::int64_t i = i0; i < i1; i += kRows) {
    row_block_gemm<kRows>(dim, X.row(i), X.stride, W.data.data(), W.stride, W.stride, scratch,
                          W.stride, false);
    for (std::int64_t r = 0; r < std::min(kRows, i1 - i); ++r) {
      float* dst = out + (i + r) * cols;
      if (!part[static_cast<std::size_t>(i + r)]) {
        std::fill(dst, dst + cols, 0.0f);
        continue;
      }
      const float* src = scratch + r * W.stride;
      for (std::int64_t c = 0; c < cols; ++c) dst[c] = src[c] + (bias ? bias[c] : 0.0f);
    }
  }
}

/// G (cols x Z.cols, a panel, accumulated) += Y^T Z over `rows` rows: Y dense (`cols` wide, read
/// as the micro-kernel's transposed A), Z a panel (the cloud's rows).
void transposed_product(const float* Y, std::int64_t cols, const Panel& Z, std::int64_t z0,
                        std::int64_t rows, Panel& G) {
  for (std::int64_t c = 0; c < cols; c += kRows) {
    row_block_gemm<kRows, true>(rows, Y + c, cols, Z.row(z0), Z.stride, Z.stride, G.row(c),
                                G.stride, true);
  }
}

/// dst rows [0, valid) += A (kRows rows of K values, row stride lda) times the panel W, through
/// `scratch` (kRows rows of W's stride): the rows past `valid` belong to another block.
void add_product(std::int64_t K, const float* A, std::int64_t lda, const Panel& W,
                 std::int64_t valid, float* dst, std::int64_t ldd, float* scratch) {
  row_block_gemm<kRows>(K, A, lda, W.data.data(), W.stride, W.stride, scratch, W.stride, false);
  for (std::int64_t r = 0; r < valid; ++r) {
    const float* src = scratch + r * W.stride;
    float* row = dst + r * ldd;
    for (std::int64_t c = 0; c < W.cols; ++c) row[c] += src[c];
  }
}

}  // namespace

bool layer_backward(const BackwardClouds& cl, const BackwardLayer& L, const LayerUpstream& up,
                    const BackwardLayerGradients& out, int threads) {
  const std::int64_t B = cl.batch, N = cl.tokens, Nq = cl.query_tokens, d = L.dim, H = L.heads;
  const std::int64_t rs = L.score_dim, rv = L.value_dim;
  const double work = 7.0 * static_cast<double>(B * H) * static_cast<double>(Nq) *
                      static_cast<double>(N) * static_cast<double>(rs + rv);
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();

  // 1. The rows that take part, and zero-padded copies of them.
  std::vector<char> query_part(static_cast<std::size_t>(B * Nq)),
      key_part(static_cast<std::size_t>(B * N));
  for (std::int64_t b = 0; b < B; ++b) {
    const QueryRule& rule = cl.rules[b];
    for (std::int64_t i = 0; i < Nq; ++i) {
      query_part[static_cast<std::size_t>(b * Nq + i)] = static_cast<char>(!rule.keys(i).empty());
    }
    for (std::int64_t j = 0; j < N; ++j) {
      key_part[static_cast<std::size_t>(b * N + j)] = static_cast<char>(j < rule.key_length);
    }
  }
  Panel Xk(B * N, d), Xq(cl.self_attention ? 0 : B * Nq, d), dDelta(up.update ? B * Nq : 0, d);
  const Panel& Xquery = cl.self_attention ? Xk : Xq;
  auto copy_rows = [d](const float* src, const std::vector<char>& part, Panel& dst) {
    for (std::int64_t i = 0; i < dst.rows; ++i) {
      if (part[static_cast<std::size_t>(i)]) std::copy(src + i * d, src + (i + 1) * d, dst.row(i));
    }
  };
  copy_rows(cl.keys, key_part, Xk);
  if (!cl.self_attention) copy_rows(cl.queries, query_part, Xq);
  if (up.update) copy_rows(up.update, query_part, dDelta);
  // For self-attention the query rows are the key rows (j < L_b, all finite once checked); the
  // projections below are zero on the queries that see no key.

  // The maps, padded for the products: W_h as the projections read them, W_h^T for dX.
  std::vector<Panel> query_maps, key_maps, value_maps, output_maps, query_back, key_back,
      value_back;
  for (std::int64_t h = 0; h < H; ++h) {
    query_maps.emplace_back(d, rs);
    pad_map(L.query_map + h * d * rs, d, rs, false, query_maps.back());
    query_back.emplace_back(rs, d);
    pad_map(L.query_map + h * d * rs, d, rs, true, query_back.back());
    if (L.key_map) {
      key_maps.emplace_back(d, rs);
      pad_map(L.key_map + h * d * rs, d, rs, false, key_maps.back());
      key_back.emplace_back(rs, d);
      pad_map(L.key_map + h * d * rs, d, rs, true, key_back.back());
    }
    value_maps.emplace_back(d, rv);
    pad_map(L.value_map + h * d * rv, d, rv, false, value_maps.back());
    value_back.emplace_back(rv, d);
    pad_map(L.value_map + h * d * rv, d, rv, true, value_back.back());
    if (L.output_map) {
      // dO = dDelta output_map^T: the map transposed, (dim x value_dim).
      output_maps.emplace_back(d, rv);
      pad_map(L.output_map + h * rv * d, rv, d, true, output_maps.back());
    }
  }

  // 2. The SDPA-shaped arrays (B, H, rows, width), dense, with slack for the micro-kernel.
  const std::int64_t slack = kRows * (std::max(rs, rv) + 64);
  Dense Q(B * H * Nq * rs, slack), K(B * H * N * rs, slack), V(B * H * N * rv, slack);
  Dense dO(up.update ? B * H * Nq * rv : 0, slack);
  const std::int64_t query_blocks = (Nq + kBlock - 1) / kBlock,
                     key_blocks = (N + kBlock - 1) / kBlock;
  std::vector<std::unique_ptr<AlignedBuffer>> scratch;
  const std::int64_t widest = padded_columns(std::max({rs, rv, d}));
  for (int t = 0; t < team; ++t) scratch.push_back(std::make_unique<AlignedBuffer>(kRows * widest));
#pragma omp parallel num_threads(team)
  {
    float* s = scratch[static_cast<std::size_t>(omp_get_thread_num())]->data();
    const std::int64_t query_tasks = B * H * query_blocks;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < query_tasks + B * H * key_blocks; ++task) {
      if (task < query_tasks) {
        const std::int64_t bh = task / query_blocks, b = bh / H, h = bh % H;
        const std::int64_t i0 = b * Nq + (task % query_blocks) * kBlock;
        const std::int64_t i1 = std::min(i0 + kBlock, (b + 1) * Nq);
        const std::int64_t head = bh * Nq - b * Nq;  // (b H + h) Nq - b Nq: rows of head h
        project(Xquery, d, i0, i1, query_maps[h], L.query_bias ? L.query_bias + h * rs : nullptr,
                query_part, Q.get() + head * rs, s);
        if (up.update && L.output_map) {
          project(dDelta, d, i0, i1, output_maps[h], nullptr, query_part, dO.get() + head * rv, s);
        } else if (up.update) {
          for (std::int64_t i = i0; i < i1; ++i) {
            std::copy(dDelta.row(i), dDelta.row(i) + d, dO.get() + (head + i) * rv);
          }
        }
        continue;
      }
      const std::int64_t key_task = task - query_tasks;
      const std::int64_t bh = key_task / key_blocks, b = bh / H, h = bh % H;
      const std::int64_t j0 = b * N + (key_task % key_blocks) * kBlock;
      const std::int64_t j1 = std::min(j0 + kBlock, (b + 1) * N);
      const std::int64_t head = bh * N - b * N;
      if (L.key_map) {
        project(Xk, d, j0, j1, key_maps[h], nullptr, key_part, K.get() + head * rs, s);
      } else {
        for (std::int64_t j = j0; j < j1; ++j) {
          std::copy(Xk.row(j), Xk.row(j) + d, K.get() + (head + j) * rs);
        }
      }
      project(Xk, d, j0, j1, value_maps[h], nullptr, key_part, V.get() + head * rv, s);
    }
  }

  // 3. The SDPA-shaped forward and backward passes of every head (one key head per query head).
  SdpaArrays arrays;
  arrays.queries = Q.get();
  arrays.keys = K.get();
  arrays.values = V.get();
  arrays.batch = B;
  arrays.query_heads = arrays.kv_heads = H;
  arrays.query_tokens = Nq;
  arrays.tokens = N;
  arrays.rank = rs;
  arrays.value_rank = rv;
  arrays.scale = L.beta;
  arrays.rules = cl.rules;
  if (!sdpa_inputs_finite(arrays)) return false;
  Dense O(B * H * Nq * rv, slack);
  std::vector<float> lse(static_cast<std::size_t>(B * H * Nq)), entropy(lse.size());
  sdpa_forward(arrays, O.get(), lse.data(), entropy.data(), team);
  SdpaBackwardArrays saved;
  saved.output = O.get();
  saved.lse = lse.data();
  saved.entropy = entropy.data();
  saved.output_gradient = up.update ? dO.get() : nullptr;
  saved.lse_gradient = up.lse;
  saved.entropy_gradient = up.entropy;
  if (!sdpa_backward_finite(arrays, saved)) return false;
  Dense dQ(B * H * Nq * rs, slack), dK(B * H * N * rs, slack), dV(B * H * N * rv, slack);
  double dscale = 0.0;
  sdpa_backward(arrays, saved, {dQ.get(), dK.get(), dV.get(), &dscale}, team);

  // 4. The chain rule. The maps' gradients, transposed (G = dY^T X), one task per head and map.
  enum Map { kQuery, kKey, kValue, kOutput, kMaps };
  std::vector<Panel> grads;
  for (std::int64_t e = 0; e < H * kMaps; ++e) {
    const Map m = static_cast<Map>(e % kMaps);
    grads.emplace_back(m == kValue || m == kOutput ? rv : rs, d);
  }
  auto wanted = [&](Map m) {
    switch (m) {
      case kQuery:
        return out.query_map != nullptr || out.query_bias != nullptr;
      case kKey:
        return out.key_map != nullptr && L.key_map != nullptr;
      case kValue:
        return out.value_map != nullptr;
      case kOutput:
        return out.output_map != nullptr && L.output_map != nullptr && up.update != nullptr;
      case kMaps:
        break;
    }
    return false;
  };
  // The clouds' gradients, padded: dX (the key and value parts) and the query part.
  Panel dX(B * N, d), dXq(cl.self_attention || !out.queries ? 0 : B * Nq, d);
  Panel& dXquery = cl.self_attention ? dX : dXq;
  const bool want_clouds = out.keys != nullptr || out.queries != nullptr;
#pragma omp parallel num_threads(team)
  {
    float* s = scratch[static_cast<std::size_t>(omp_get_thread_num())]->data();
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t e = 0; e < H * kMaps; ++e) {
      const std::int64_t h = e / kMaps;
      const Map m = static_cast<Map>(e % kMaps);
      if (!wanted(m)) continue;
      Panel& G = grads[static_cast<std::size_t>(e)];
      for (std::int64_t b = 0; b < B; ++b) {
        const std::int64_t bh = b * H + h;
        switch (m) {
          case kQuery:
            transposed_product(dQ.get() + bh * Nq * rs, rs, Xquery, b * Nq, Nq, G);
            break;
          case kKey:
            transposed_product(dK.get() + bh * N * rs, rs, Xk, b * N, N, G);
            break;
          case kValue:
            transposed_product(dV.get() + bh * N * rv, rv, Xk, b * N, N, G);
            break;
          case kOutput:
            transposed_product(O.get() + bh * Nq * rv, rv, dDelta, b * Nq, Nq, G);
            break;
          case kMaps:
            break;
        }
      }
    }
    // dX = sum_h (dK_h key_map_h^T (or dK_h) + dV_h value_map_h^T), and the query part
    // sum_h dQ_h query_map_h^T, a block of rows per task, the heads in order.
    const std::int64_t key_tasks = want_clouds ? B * key_blocks : 0;
    const std::int64_t query_tasks = want_clouds && dXquery.rows > 0 ? B * query_blocks : 0;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < key_tasks; ++task) {
      const std::int64_t b = task / key_blocks, j0 = (task % key_blocks) * kBlock;
      const std::int64_t j1 = std::min(j0 + kBlock, N);
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t head = (b * H + h) * N;
        for (std::int64_t j = j0; j < j1; j += kRows) {
          const std::int64_t valid = std::min(kRows, j1 - j);
          float* dst = dX.row(b * N + j);
          if (L.key_map) {
            add_product(rs, dK.get() + (head + j) * rs, rs, key_back[h], valid, dst, dX.stride, s);
          } else {
            for (std::int64_t r = 0; r < valid; ++r) {
              const float* src = dK.get() + (head + j + r) * rs;
              for (std::int64_t c = 0; c < d; ++c) dst[r * dX.stride + c] += src[c];
            }
          }
          add_product(rv, dV.get() + (head + j) * rv, rv, value_back[h], valid, dst, dX.stride, s);
        }
      }
    }
    // For self-attention the query part adds to the same rows: after the key parts, so that
    // each row is summed in one order (keys and values over the heads, then the queries).
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < query_tasks; ++task) {
      const std::int64_t b = task / query_blocks, i0 = (task % query_blocks) * kBlock;
      const std::int64_t i1 = std::min(i0 + kBlock, Nq);
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t head = (b * H + h) * Nq;
        for (std::int64_t i = i0; i < i1; i += kRows) {
          add_product(rs, dQ.get() + (head + i) * rs, rs, query_back[h], std::min(kRows, i1 - i),
                      dXquery.row(b * Nq + i), dXquery.stride, s);
        }
      }
    }
  }

  // The results in the callers' layouts. Rows that take no part are exactly zero: so are their
  // dK, dV and dQ rows.
  for (std::int64_t h = 0; h < H; ++h) {
    const Panel* g = &grads[static_cast<std::size_t>(h * kMaps)];
    if (out.query_map) {
      for (std::int64_t k = 0; k < d; ++k) {
        for (std::int64_t c = 0; c < rs; ++c)
          out.query_map[(h * d + k) * rs + c] = g[kQuery].row(c)[k];
      }
    }
    if (out.query_bias) {
      for (std::int64_t c = 0; c < rs; ++c) {
        float sum = 0.0f;
        for (std::int64_t b = 0; b < B; ++b) {
          const float* dq = dQ.get() + (b * H + h) * Nq * rs;
          for (std::int64_t i = 0; i < Nq; ++i) sum += dq[i * rs + c];
        }
        out.query_bias[h * rs + c] = sum;
      }
    }
    auto store = [&](float* dst, const Panel& G, std::int64_t cols) {
      for (std::int64_t k = 0; k < d; ++k) {
        for (std::int64_t c = 0; c < cols; ++c) dst[(h * d + k) * cols + c] = G.row(c)[k];
      }
    };
    if (out.key_map && L.key_map) store(out.key_map, g[kKey], rs);
    if (out.value_map) store(out.value_map, g[kValue], rv);
    if (out.output_map && L.output_map) {
      // output_map is (value_dim x dim); G holds O^T dDelta, the same layout.
      for (std::int64_t c = 0; c < rv; ++c) {
        for (std::int64_t k = 0; k < d; ++k) {
          out.output_map[(h * rv + c) * d + k] = up.update ? g[kOutput].row(c)[k] : 0.0f;
        }
      }
    }
  }
  if (out.keys) {
    for (std::int64_t j = 0; j < B * N; ++j) std::copy(dX.row(j), dX.row(j) + d, out.keys + j * d);
  }
  if (out.queries && !cl.self_attention) {
    for (std::int64_t i = 0; i < B * Nq; ++i) {
      std::copy(dXq.row(i), dXq.row(i) + d, out.queries + i * d);
    }
  }
  if (out.offset) {
    for (std::int64_t c = 0; c < d; ++c) {
      double sum = 0.0;
      if (up.update) {
        for (std::int64_t i = 0; i < B * Nq; ++i) sum += dDelta.row(i)[c];
      }
      out.offset[c] = static_cast<float>(sum);
    }
  }
  if (out.beta) *out.beta = dscale;
  return true;
}

EMFLOW_CPU_END

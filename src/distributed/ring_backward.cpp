// The backward pass of the attention ring (emflow/sequence_parallel.hpp: attend_backward and
// attend_factored_backward over a ShardInput; docs/MATH.md §8.4, §8.5, §8.9).
//
// Each head of a layer is the SDPA-shaped operator between projections (docs/MATH.md §8.1), and
// the projections are per token: so every rank projects its own tokens (queries, keys and
// values of every head, in the SDPA ring's segment-major layout), the SDPA ring recomputes the
// heads' averages and lse (sdpa_attend) and runs the backward pass (sdpa_backward: each key
// shard's dK and dV come home), and each rank applies the chain rule through the projections
// to its own tokens. The operators' gradients are sums over every token: each rank sums its
// tokens' terms and one allreduce (in rank order) adds the ranks'; so do dc and dbeta.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.hpp"
#include "emflow/backward.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::distributed {

namespace {

// Row c of the shard's cloud (segment-major (batch, count_s, width) blocks) and row q of head h
// in the SDPA ring's layout (segment-major (batch, heads, count_s, width) blocks) for every token
// of every cloud b of every segment that is not padding (position < key_lengths[b]; padding
// takes no part, docs/MATH.md §8.6: it is neither read nor given a gradient): visit(c, h, q).
template <class Visit>
void for_each_row(const std::vector<Segment>& segments, std::int64_t B, std::int64_t H,
                  const std::int64_t* lengths, Visit&& visit) {
  std::int64_t before = 0;  // tokens of the segments before this one
  for (const Segment& s : segments) {
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t real = lengths != nullptr
                                    ? std::clamp<std::int64_t>(lengths[b] - s.position, 0, s.count)
                                    : s.count;
      for (std::int64_t h = 0; h < H; ++h) {
        for (std::int64_t i = 0; i < real; ++i) {
          visit(B * before + b * s.count + i, h, B * H * before + (b * H + h) * s.count + i);
        }
      }
    }
    before += s.count;
  }
}

// The sums over ranks of the operators' gradients, in double and in rank order; then rounded
// into `out` (when not null).
template <class T>
void sum_over_ranks(Communicator& comm, std::vector<double>& sums, T* out) {
  comm.allreduce_sum(sums.data(), static_cast<std::int64_t>(sums.size()));
  if (out != nullptr) {
    for (std::size_t e = 0; e < sums.size(); ++e) out[e] = static_cast<T>(sums[e]);
  }
}

// The arguments both forms check before the ring: the shard's, the gradients' presence.
template <class T>
void check_common(Communicator& comm, const ShardInput<T>& in, const T* queries_gradient,
                  const char* op) {
  if (comm.memory() != Memory::host) {
    detail::fail(ErrorCode::unsupported, op,
                 ": needs a host communicator (the ring's blocks are computed on the host)");
  }
  if (in.queries != nullptr || in.query_tokens != 0 || in.query_lengths != nullptr ||
      in.key_position != 0 || in.query_position != kAlignToEnd || in.query_positions != nullptr ||
      queries_gradient != nullptr) {
    detail::fail_argument(op, "queries",
                          "and query_tokens, query_lengths, key_position, query_position, "
                          "query_positions and gradients.queries must keep their defaults: the "
                          "ring's queries are the shard's own tokens");
  }
  detail::expect_positive(op, "batch", in.batch);
  detail::expect_positive(op, "tokens", in.tokens);
  detail::expect_positive(op, "dim", in.dim);
  if (!std::isfinite(in.beta)) detail::fail_argument(op, "beta", "must be finite, got ", in.beta);
  if (shard_tokens(shard(in.layout, in.tokens, comm.size(), comm.rank())) > 0) {
    detail::expect_not_null(op, "cloud", in.cloud);
  }
  if (in.key_lengths) {
    for (std::int64_t b = 0; b < in.batch; ++b) {
      if (in.key_lengths[b] < 0 || in.key_lengths[b] > in.tokens) {
        detail::fail_argument(op, "key_lengths", "entry ", b, " is ", in.key_lengths[b],
                              ", expected a length in [0, ", in.tokens, "]");
      }
    }
  }
}

// The SDPA ring's input over this shard's projections.
template <class T>
SdpaShardInput<T> sdpa_shard(const ShardInput<T>& in, std::int64_t heads, std::int64_t rank,
                             std::int64_t value_rank, const std::vector<T>& Q,
                             const std::vector<T>& K, const std::vector<T>& V) {
  SdpaShardInput<T> s;
  s.queries = Q.data();
  s.keys = K.data();
  s.values = V.data();
  s.batch = in.batch;
  s.query_heads = s.kv_heads = heads;
  s.tokens = in.tokens;
  s.rank = rank;
  s.value_rank = value_rank;
  s.scale = in.beta;
  s.mask = in.mask;
  s.key_lengths = in.key_lengths;
  s.layout = in.layout;
  return s;
}

// The forward pass of the heads (their averages O, lse and H) and its backward pass through the
// ring: dQ, dK, dV of the projections and the whole sequence's dscale.
template <class T>
struct HeadGradients {
  std::vector<T> O, dQ, dK, dV;
  std::vector<Stat<T>> lse, entropy;
  double dscale = 0.0;
};

template <class T>
HeadGradients<T> ring_heads(Communicator& comm, const SdpaShardInput<T>& s,
                            const std::vector<T>& dO, const UpstreamGradients<T>& up,
                            std::int64_t local, const ExecutionOptions& options, RingTimes* times) {
  HeadGradients<T> g;
  const auto rows = static_cast<std::size_t>(s.batch * s.query_heads * local);
  g.O.resize(rows * static_cast<std::size_t>(s.value_rank));
  g.lse.resize(rows);
  g.entropy.resize(rows);
  RingTimes forward, backward;
  sdpa_attend(comm, s, SdpaOutput<T>{g.O.data(), g.lse.data(), g.entropy.data()}, options,
              &forward);
  g.dQ.resize(rows * static_cast<std::size_t>(s.rank));
  g.dK.resize(g.dQ.size());
  g.dV.resize(g.O.size());
  UpstreamGradients<T> head_up;
  head_up.update = up.update != nullptr ? dO.data() : nullptr;
  head_up.lse = up.lse;
  head_up.entropy = up.entropy;
  sdpa_backward(comm, s, SdpaSaved<T>{g.O.data(), g.lse.data(), g.entropy.data()}, head_up,
                SdpaGradientOutput<T>{g.dQ.data(), g.dK.data(), g.dV.data(), &g.dscale}, options,
                &backward);
  if (times != nullptr) {
    times->compute = forward.compute + backward.compute;
    times->exposed_wait = forward.exposed_wait + backward.exposed_wait;
    times->bytes_sent = forward.bytes_sent + backward.bytes_sent;
  }
  return g;
}

// dc = the sum of dDelta over the queries that see a key (lse of head 0 not -inf), over ranks.
template <class T>
void offset_gradient(Communicator& comm, const std::vector<Segment>& segments, std::int64_t B,
                     std::int64_t H, std::int64_t d, const std::int64_t* lengths, const T* dDelta,
                     const std::vector<Stat<T>>& lse, T* out) {
  std::vector<double> dc(static_cast<std::size_t>(d), 0.0);
  if (dDelta != nullptr) {
    for_each_row(segments, B, H, lengths, [&](std::int64_t c, std::int64_t h, std::int64_t q) {
      if (h != 0 || lse[static_cast<std::size_t>(q)] == -std::numeric_limits<Stat<T>>::infinity()) {
        return;
      }
      for (std::int64_t a = 0; a < d; ++a) dc[static_cast<std::size_t>(a)] += dDelta[c * d + a];
    });
  }
  sum_over_ranks(comm, dc, out);
}

template <class T>
void dense_backward(Communicator& comm, const ShardInput<T>& in, const UpstreamGradients<T>& up,
                    const LayerGradientOutput<T>& out, const ExecutionOptions& options,
                    RingTimes* times) {
  const char* op = "distributed attend_backward";
  const LayerOperators<T>& layer = in.layer;
  const std::vector<Segment> segments = shard(in.layout, in.tokens, comm.size(), comm.rank());
  const std::int64_t local = shard_tokens(segments);
  const std::int64_t B = in.batch, H = layer.heads, d = in.dim;
  agreed(comm, [&] {
    check_common(comm, in, out.queries, op);
    detail::expect_positive(op, "heads", layer.heads);
    detail::expect_not_null(op, "relevance", layer.relevance);
    detail::expect_not_null(op, "content", layer.content);
    if (layer.key_bias == nullptr && out.key_bias != nullptr) {
      detail::fail_argument(op, "gradients.key_bias", "must be null: the layer has no key_bias");
    }
    if (layer.offset == nullptr && out.offset != nullptr) {
      detail::fail_argument(op, "gradients.offset", "must be null: the layer has no offset");
    }
  });
  // Per head: queries r_i = M_h^T x_i + u_h, keys x_j, values C_j = F_h x_j (docs/MATH.md §8.4).
  const auto rows = static_cast<std::size_t>(B * H * local * d);
  std::vector<T> R(rows), K(rows), C(rows), dO(up.update != nullptr ? rows : 0);
  const T* X = in.cloud;
  for_each_row(segments, B, H, in.key_lengths, [&](std::int64_t c, std::int64_t h, std::int64_t q) {
    const T* M = layer.relevance + h * d * d;
    const T* F = layer.content + h * d * d;
    const T* x = X + c * d;
    for (std::int64_t a = 0; a < d; ++a) {
      double r = layer.key_bias != nullptr ? static_cast<double>(layer.key_bias[h * d + a]) : 0.0;
      double v = 0.0;
      for (std::int64_t k = 0; k < d; ++k) {
        r += static_cast<double>(M[k * d + a]) * x[k];
        v += static_cast<double>(F[a * d + k]) * x[k];
      }
      R[static_cast<std::size_t>(q * d + a)] = static_cast<T>(r);
      K[static_cast<std::size_t>(q * d + a)] = x[a];
      C[static_cast<std::size_t>(q * d + a)] = static_cast<T>(v);
      if (up.update != nullptr) dO[static_cast<std::size_t>(q * d + a)] = up.update[c * d + a];
    }
  });
  const HeadGradients<T> g =
      ring_heads(comm, sdpa_shard(in, H, d, d, R, K, C), dO, up, local, options, times);

  // dM_h = X^T dR_h, du_h = sum_i dR_h,i, dF_h = dC_h^T X over this rank's tokens, summed over
  // ranks; dX = sum_h (dR_h M_h^T + dK_h + dC_h F_h) of this rank's tokens.
  const auto hdd = static_cast<std::size_t>(H * d * d);
  std::vector<double> dM(hdd, 0.0), dF(hdd, 0.0), du(static_cast<std::size_t>(H * d), 0.0);
  std::vector<double> dX(static_cast<std::size_t>(B * local * d), 0.0);
  for_each_row(segments, B, H, in.key_lengths, [&](std::int64_t c, std::int64_t h, std::int64_t q) {
    const T* M = layer.relevance + h * d * d;
    const T* F = layer.content + h * d * d;
    const T* x = X + c * d;
    const T* dr = g.dQ.data() + q * d;
    const T* dk = g.dK.data() + q * d;
    const T* dc = g.dV.data() + q * d;
    for (std::int64_t k = 0; k < d; ++k) {
      double sum = dk[k];
      for (std::int64_t a = 0; a < d; ++a) {
        dM[static_cast<std::size_t>((h * d + k) * d + a)] += static_cast<double>(x[k]) * dr[a];
        dF[static_cast<std::size_t>((h * d + k) * d + a)] += static_cast<double>(dc[k]) * x[a];
        sum +=
            static_cast<double>(dr[a]) * M[k * d + a] + static_cast<double>(dc[a]) * F[a * d + k];
      }
      du[static_cast<std::size_t>(h * d + k)] += dr[k];
      dX[static_cast<std::size_t>(c * d + k)] += sum;
    }
  });
  if (out.cloud != nullptr) {
    for (std::size_t e = 0; e < dX.size(); ++e) out.cloud[e] = static_cast<T>(dX[e]);
  }
  sum_over_ranks(comm, dM, out.relevance);
  sum_over_ranks(comm, dF, out.content);
  sum_over_ranks(comm, du, out.key_bias);
  offset_gradient(comm, segments, B, H, d, in.key_lengths, up.update, g.lse, out.offset);
  if (out.beta != nullptr) *out.beta = g.dscale;
}

template <class T>
void factored_backward(Communicator& comm, const ShardInput<T>& in, const FactoredLayer<T>& f,
                       const UpstreamGradients<T>& up, const FactoredGradientOutput<T>& out,
                       const ExecutionOptions& options, RingTimes* times) {
  const char* op = "distributed attend_factored_backward";
  const std::vector<Segment> segments = shard(in.layout, in.tokens, comm.size(), comm.rank());
  const std::int64_t local = shard_tokens(segments);
  const std::int64_t B = in.batch, H = f.heads, d = in.dim, r = f.rank;
  agreed(comm, [&] {
    check_common(comm, in, out.queries, op);
    if (in.layer.relevance != nullptr || in.layer.content != nullptr) {
      detail::fail_argument(op, "layer",
                            "must be empty with a FactoredLayer (the operators come from it)");
    }
    detail::expect_positive(op, "heads", f.heads);
    detail::expect_positive(op, "rank", f.rank);
    detail::expect_not_null(op, "query_factor", f.query_factor);
    detail::expect_not_null(op, "key_factor", f.key_factor);
    detail::expect_not_null(op, "content_up", f.content_up);
    detail::expect_not_null(op, "content_down", f.content_down);
    if (f.rotary.dim != 0 || f.key_heads() != f.heads) {
      detail::fail(ErrorCode::unsupported, op,
                   ": rotary positions (rotary.dim) and grouped kv heads (kv_heads) have no "
                   "backward pass yet, got rotary.dim ",
                   f.rotary.dim, ", kv_heads ", f.key_heads(), " of ", f.heads, " heads");
    }
    if (f.key_bias == nullptr && out.key_bias != nullptr) {
      detail::fail_argument(op, "gradients.key_bias", "must be null: the layer has no key_bias");
    }
    if (f.offset == nullptr && out.offset != nullptr) {
      detail::fail_argument(op, "gradients.offset", "must be null: the layer has no offset");
    }
  });
  // Per head: queries (A_h x_i, 1), keys (B_h x_j, u_h^T x_j) (the last column only with a key
  // bias), values V_h x_j, dO_h = U_h^T dDelta (docs/MATH.md §8.5).
  const bool bias = f.key_bias != nullptr;
  const std::int64_t rs = r + (bias ? 1 : 0);
  const auto n = static_cast<std::size_t>(B * H * local);
  std::vector<T> Q(n * static_cast<std::size_t>(rs)), K(Q.size()),
      V(n * static_cast<std::size_t>(r)), dO(up.update != nullptr ? V.size() : 0);
  const T* X = in.cloud;
  for_each_row(segments, B, H, in.key_lengths, [&](std::int64_t c, std::int64_t h, std::int64_t q) {
    const T* x = X + c * d;
    for (std::int64_t a = 0; a < r; ++a) {
      const T* A = f.query_factor + (h * r + a) * d;
      const T* Bk = f.key_factor + (h * r + a) * d;
      const T* Vd = f.content_down + (h * r + a) * d;
      double qa = 0.0, ka = 0.0, va = 0.0, oa = 0.0;
      for (std::int64_t k = 0; k < d; ++k) {
        qa += static_cast<double>(A[k]) * x[k];
        ka += static_cast<double>(Bk[k]) * x[k];
        va += static_cast<double>(Vd[k]) * x[k];
        if (up.update != nullptr) {
          oa += static_cast<double>(f.content_up[(h * d + k) * r + a]) * up.update[c * d + k];
        }
      }
      Q[static_cast<std::size_t>(q * rs + a)] = static_cast<T>(qa);
      K[static_cast<std::size_t>(q * rs + a)] = static_cast<T>(ka);
      V[static_cast<std::size_t>(q * r + a)] = static_cast<T>(va);
      if (up.update != nullptr) dO[static_cast<std::size_t>(q * r + a)] = static_cast<T>(oa);
    }
    if (bias) {
      double w = 0.0;
      for (std::int64_t k = 0; k < d; ++k) w += static_cast<double>(f.key_bias[h * d + k]) * x[k];
      Q[static_cast<std::size_t>(q * rs + r)] = T(1);
      K[static_cast<std::size_t>(q * rs + r)] = static_cast<T>(w);
    }
  });
  const HeadGradients<T> g =
      ring_heads(comm, sdpa_shard(in, H, rs, r, Q, K, V), dO, up, local, options, times);

  // dA_h = dQ_h^T X, dB_h = dK_h^T X, du_h = X^T dw_h, dV_h = dY_h^T X, dU_h = dDelta^T O_h;
  // dX = sum_h (dQ_h A_h + dK_h B_h + dw_h u_h^T + dY_h V_h).
  const auto hrd = static_cast<std::size_t>(H * r * d);
  std::vector<double> dA(hrd, 0.0), dB(hrd, 0.0), dVd(hrd, 0.0), dU(hrd, 0.0),
      du(static_cast<std::size_t>(H * d), 0.0), dX(static_cast<std::size_t>(B * local * d), 0.0);
  for_each_row(segments, B, H, in.key_lengths, [&](std::int64_t c, std::int64_t h, std::int64_t q) {
    const T* x = X + c * d;
    const T* dq = g.dQ.data() + q * rs;
    const T* dk = g.dK.data() + q * rs;
    const T* dy = g.dV.data() + q * r;
    const T* o = g.O.data() + q * r;
    for (std::int64_t a = 0; a < r; ++a) {
      const T* A = f.query_factor + (h * r + a) * d;
      const T* Bk = f.key_factor + (h * r + a) * d;
      const T* Vd = f.content_down + (h * r + a) * d;
      for (std::int64_t k = 0; k < d; ++k) {
        const auto e = static_cast<std::size_t>((h * r + a) * d + k);
        dA[e] += static_cast<double>(dq[a]) * x[k];
        dB[e] += static_cast<double>(dk[a]) * x[k];
        dVd[e] += static_cast<double>(dy[a]) * x[k];
        dX[static_cast<std::size_t>(c * d + k)] += static_cast<double>(dq[a]) * A[k] +
                                                   static_cast<double>(dk[a]) * Bk[k] +
                                                   static_cast<double>(dy[a]) * Vd[k];
      }
      if (up.update != nullptr) {
        for (std::int64_t k = 0; k < d; ++k) {
          dU[static_cast<std::size_t>((h * d + k) * r + a)] +=
              static_cast<double>(up.update[c * d + k]) * o[a];
        }
      }
    }
    if (bias) {
      for (std::int64_t k = 0; k < d; ++k) {
        du[static_cast<std::size_t>(h * d + k)] += static_cast<double>(dk[r]) * x[k];
        dX[static_cast<std::size_t>(c * d + k)] +=
            static_cast<double>(dk[r]) * f.key_bias[h * d + k];
      }
    }
  });
  if (out.cloud != nullptr) {
    for (std::size_t e = 0; e < dX.size(); ++e) out.cloud[e] = static_cast<T>(dX[e]);
  }
  sum_over_ranks(comm, dA, out.query_factor);
  sum_over_ranks(comm, dB, out.key_factor);
  sum_over_ranks(comm, dU, out.content_up);
  sum_over_ranks(comm, dVd, out.content_down);
  sum_over_ranks(comm, du, out.key_bias);
  offset_gradient(comm, segments, B, H, d, in.key_lengths, up.update, g.lse, out.offset);
  if (out.beta != nullptr) *out.beta = g.dscale;
}

}  // namespace

template <class T>
void attend_backward(Communicator& comm, const ShardInput<T>& input,
                     const UpstreamGradients<T>& upstream, const LayerGradientOutput<T>& gradients,
                     const ExecutionOptions& options, RingTimes* times) {
  dense_backward(comm, input, upstream, gradients, options, times);
}

template <class T>
void attend_factored_backward(Communicator& comm, const ShardInput<T>& input,
                              const FactoredLayer<T>& layer, const UpstreamGradients<T>& upstream,
                              const FactoredGradientOutput<T>& gradients,
                              const ExecutionOptions& options, RingTimes* times) {
  factored_backward(comm, input, layer, upstream, gradients, options, times);
}

#define EMFLOW_DISTRIBUTED_BACKWARD(T)                                                           \
  template void attend_backward<T>(Communicator&, const ShardInput<T>&,                          \
                                   const UpstreamGradients<T>&, const LayerGradientOutput<T>&,   \
                                   const ExecutionOptions&, RingTimes*);                         \
  template void attend_factored_backward<T>(                                                     \
      Communicator&, const ShardInput<T>&, const FactoredLayer<T>&, const UpstreamGradients<T>&, \
      const FactoredGradientOutput<T>&, const ExecutionOptions&, RingTimes*);
EMFLOW_DISTRIBUTED_BACKWARD(float)
EMFLOW_DISTRIBUTED_BACKWARD(double)
#undef EMFLOW_DISTRIBUTED_BACKWARD

}  // namespace emflow::distributed

#include "attention/cross.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/testing.hpp"
#include "emflow/error.hpp"

namespace emflow::testing {

namespace {

std::vector<double> rounded(std::vector<double> values) {
  for (double& v : values) v = static_cast<double>(static_cast<float>(v));
  return values;
}

template <class T>
std::vector<T> as(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

}  // namespace

void CrossProblem::fill(std::uint64_t seed) {
  const double scale = 2.0 / std::sqrt(static_cast<double>(dim));
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  cloud = rounded(uniform(n(batch * tokens * dim), seed));
  queries =
      self ? std::vector<double>{} : rounded(uniform(n(batch * query_tokens * dim), seed + 1));
  relevance = rounded(uniform(n(heads * dim * dim), seed + 2, -scale, scale));
  content = rounded(uniform(n(heads * dim * dim), seed + 3, -scale, scale));
  key_bias = bias ? rounded(uniform(n(heads * dim), seed + 4)) : std::vector<double>{};
  shift = offset ? rounded(uniform(n(dim), seed + 5)) : std::vector<double>{};
}

std::int64_t CrossProblem::key_length(std::int64_t b) const {
  return key_lengths.empty() ? tokens : key_lengths[static_cast<std::size_t>(b)];
}

std::int64_t CrossProblem::query_length(std::int64_t b) const {
  if (!query_lengths.empty()) return query_lengths[static_cast<std::size_t>(b)];
  return self ? key_length(b) : query_tokens;
}

std::int64_t CrossProblem::query_origin(std::int64_t b) const {
  if (!query_positions.empty()) return query_positions[static_cast<std::size_t>(b)];
  if (query_position != kAlignToEnd) return query_position;
  return key_position + key_length(b) - query_length(b);
}

CrossResult cross_oracle(const CrossProblem& p) {
  const std::int64_t B = p.batch, H = p.heads, N = p.tokens, Nq = p.rows(), d = p.dim;
  const double inf = std::numeric_limits<double>::infinity();
  CrossResult out;
  out.update.assign(static_cast<std::size_t>(B * Nq * d), 0.0);
  out.lse.assign(static_cast<std::size_t>(B * H * Nq), -inf);
  out.entropy.assign(out.lse.size(), 0.0);
  out.weights.assign(static_cast<std::size_t>(B * H * Nq * N), 0.0);
  const std::vector<double>& Q = p.self ? p.cloud : p.queries;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < p.query_length(b); ++i) {
      const double* q = &Q[static_cast<std::size_t>((b * Nq + i) * d)];
      std::vector<std::int64_t> visible;
      for (std::int64_t j = 0; j < p.key_length(b); ++j) {
        if (p.mask.allows(p.query_origin(b) + i, p.key_position + j)) visible.push_back(j);
      }
      if (visible.empty()) continue;
      double* delta = &out.update[static_cast<std::size_t>((b * Nq + i) * d)];
      for (std::int64_t h = 0; h < H; ++h) {
        std::vector<double> s;
        for (std::int64_t j : visible) {
          const double* x = &p.cloud[static_cast<std::size_t>((b * N + j) * d)];
          double score = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            for (std::int64_t a = 0; a < d; ++a) {
              score += q[k] * p.relevance[static_cast<std::size_t>((h * d + k) * d + a)] * x[a];
            }
            if (p.bias) score += p.key_bias[static_cast<std::size_t>(h * d + k)] * x[k];
          }
          s.push_back(p.beta * score);
        }
        double m = -inf;
        for (double v : s) m = std::max(m, v);
        double z = 0.0;
        for (double v : s) z += std::exp(v - m);
        const double lse = m + std::log(z);
        double expected = 0.0;
        const std::int64_t row = (b * H + h) * Nq + i;
        for (std::size_t k = 0; k < visible.size(); ++k) {
          const double w = std::exp(s[k] - lse);
          expected += w * s[k];
          out.weights[static_cast<std::size_t>(row * N + visible[k])] = w;
          const double* x = &p.cloud[static_cast<std::size_t>((b * N + visible[k]) * d)];
          for (std::int64_t a = 0; a < d; ++a) {
            double c = 0.0;
            for (std::int64_t e = 0; e < d; ++e) {
              c += p.content[static_cast<std::size_t>((h * d + a) * d + e)] * x[e];
            }
            delta[a] += w * c;
          }
        }
        out.lse[static_cast<std::size_t>(row)] = lse;
        out.entropy[static_cast<std::size_t>(row)] = lse - expected;
      }
      for (std::int64_t a = 0; p.offset && a < d; ++a)
        delta[a] += p.shift[static_cast<std::size_t>(a)];
    }
  }
  return out;
}

template <class T>
CrossBuffers<T>::CrossBuffers(const CrossProblem& p, bool with_weights)
    : cloud(as<T>(p.cloud)),
      queries(as<T>(p.queries)),
      relevance(as<T>(p.relevance)),
      content(as<T>(p.content)),
      key_bias(as<T>(p.key_bias)),
      shift(as<T>(p.shift)),
      update(static_cast<std::size_t>(p.batch * p.rows() * p.dim)),
      lse(static_cast<std::size_t>(p.batch * p.heads * p.rows())),
      entropy(lse.size()),
      weights(with_weights ? lse.size() * static_cast<std::size_t>(p.tokens) : 0),
      key_lengths(p.key_lengths),
      query_lengths(p.query_lengths),
      query_positions(p.query_positions) {
  input.cloud = cloud.data();
  input.batch = p.batch;
  input.tokens = p.tokens;
  input.dim = p.dim;
  input.layer = {p.heads, relevance.data(), content.data(), p.bias ? key_bias.data() : nullptr,
                 p.offset ? shift.data() : nullptr};
  input.beta = p.beta;
  input.mask = p.mask;
  input.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
  input.queries = p.self ? nullptr : queries.data();
  input.query_tokens = p.self ? 0 : p.query_tokens;
  input.query_lengths = query_lengths.empty() ? nullptr : query_lengths.data();
  input.key_position = p.key_position;
  input.query_position = p.query_position;
  input.query_positions = query_positions.empty() ? nullptr : query_positions.data();
  output = {update.data(), lse.data(), entropy.data(), with_weights ? weights.data() : nullptr};
  poison();
}

template <class T>
void CrossBuffers<T>::poison() {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (auto* v : {&update, &lse, &entropy, &weights}) v->assign(v->size(), nan);
}

template <class T>
void run_cross(const Target& target, CrossBuffers<T>& buffers) {
  switch (target.backend) {
    case Backend::reference:
      attend(buffers.input, buffers.output, {Device::reference});
      return;
    case Backend::cpu:
      attend(buffers.input, buffers.output, {Device::cpu, target.threads});
      return;
    case Backend::cuda:
      attend(buffers.input, buffers.output, {Device::cuda});
      return;
    case Backend::cuda_fused:
    case Backend::cuda_unfused: {
#if defined(EMFLOW_WITH_CUDA)
      CudaStream s;
      const auto up = [&](const std::vector<T>& host) {
        cuda::DeviceBuffer<T> device(host.size());
        device.copy_from_host(host.data(), host.size(), s.stream);
        return device;
      };
      const auto up_index = [&](const std::vector<std::int64_t>& host) {
        cuda::DeviceBuffer<std::int64_t> device(host.size());
        device.copy_from_host(host.data(), host.size(), s.stream);
        return device;
      };
      cuda::DeviceBuffer<T> cloud = up(buffers.cloud), queries = up(buffers.queries);
      cuda::DeviceBuffer<T> relevance = up(buffers.relevance), content = up(buffers.content);
      cuda::DeviceBuffer<T> bias = up(buffers.key_bias), shift = up(buffers.shift);
      cuda::DeviceBuffer<T> update = up(buffers.update), lse = up(buffers.lse);
      cuda::DeviceBuffer<T> entropy = up(buffers.entropy), weights = up(buffers.weights);
      cuda::DeviceBuffer<std::int64_t> key_lengths = up_index(buffers.key_lengths);
      cuda::DeviceBuffer<std::int64_t> query_lengths = up_index(buffers.query_lengths);
      cuda::DeviceBuffer<std::int64_t> query_positions = up_index(buffers.query_positions);
      AttentionInput<T> in = buffers.input;
      const auto or_null = [](auto& device, const void* host) {
        return host != nullptr ? device.data() : nullptr;
      };
      in.cloud = cloud.data();
      in.queries = or_null(queries, buffers.input.queries);
      in.layer.relevance = relevance.data();
      in.layer.content = content.data();
      in.layer.key_bias = or_null(bias, buffers.input.layer.key_bias);
      in.layer.offset = or_null(shift, buffers.input.layer.offset);
      in.key_lengths = or_null(key_lengths, buffers.input.key_lengths);
      in.query_lengths = or_null(query_lengths, buffers.input.query_lengths);
      in.query_positions = or_null(query_positions, buffers.input.query_positions);
      AttentionOutput<T> out{update.data(), or_null(lse, buffers.output.lse),
                             or_null(entropy, buffers.output.entropy),
                             or_null(weights, buffers.output.weights)};
      const cuda::Algorithm algorithm =
          target.backend == Backend::cuda_fused ? cuda::Algorithm::fused : cuda::Algorithm::unfused;
      const std::size_t bytes = cuda::attend_workspace_size(in, out, {algorithm});
      cuda::DeviceBuffer<unsigned char> workspace(bytes);
      cuda::attend_async(in, out, workspace.data(), bytes, s.stream, {algorithm});
      update.copy_to_host(buffers.update.data(), buffers.update.size(), s.stream);
      lse.copy_to_host(buffers.lse.data(), buffers.lse.size(), s.stream);
      entropy.copy_to_host(buffers.entropy.data(), buffers.entropy.size(), s.stream);
      weights.copy_to_host(buffers.weights.data(), buffers.weights.size(), s.stream);
      EXPECT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
      return;
#else
      ADD_FAILURE() << target.name() << " needs a CUDA build";
      return;
#endif
    }
  }
}

template <class T>
void expect_cross_matches(const CrossBuffers<T>& got, const CrossResult& want, double tolerance,
                          const std::string& what) {
  EXPECT_TRUE(close_to(got.update, want.update, tolerance)) << what << ": update";
  if (got.output.lse) {
    EXPECT_TRUE(close_to(got.lse, want.lse, tolerance)) << what << ": lse";
  }
  if (got.output.entropy) {
    EXPECT_TRUE(close_to(got.entropy, want.entropy, tolerance)) << what << ": entropy";
  }
  if (got.output.weights) {
    EXPECT_TRUE(close_to(got.weights, want.weights, tolerance)) << what << ": weights";
  }
  // Queries without keys: exactly zero, -inf and zero; hidden weights exactly zero.
  for (std::size_t r = 0; r < want.lse.size(); ++r) {
    if (want.lse[r] != -std::numeric_limits<double>::infinity()) continue;
    if (got.output.lse) {
      EXPECT_EQ(got.lse[r], -std::numeric_limits<T>::infinity()) << what << " row " << r;
    }
    if (got.output.entropy) {
      EXPECT_EQ(got.entropy[r], T(0)) << what << " row " << r;
    }
  }
  for (std::size_t k = 0; k < want.update.size(); ++k) {
    if (want.update[k] == 0.0) {
      EXPECT_EQ(got.update[k], T(0)) << what << " update " << k;
    }
  }
  for (std::size_t k = 0; got.output.weights && k < want.weights.size(); ++k) {
    if (want.weights[k] == 0.0) {
      EXPECT_EQ(got.weights[k], T(0)) << what << " weight " << k;
    }
  }
}

template struct CrossBuffers<float>;
template struct CrossBuffers<double>;
template void run_cross(const Target&, CrossBuffers<float>&);
template void run_cross(const Target&, CrossBuffers<double>&);
template void expect_cross_matches(const CrossBuffers<float>&, const CrossResult&, double,
                                   const std::string&);
template void expect_cross_matches(const CrossBuffers<double>&, const CrossResult&, double,
                                   const std::string&);

}  // namespace emflow::testing

// The factored decode cache with rotary positions and grouped kv heads (decode.hpp,
// docs/MATH.md §2.4, docs/DECODING.md): decoding a cloud token by token (append x_t, attend x_t
// under the causal or a window mask), and in blocks of several tokens, gives the rows of the
// one-pass attend_factored of the same rotary, grouped layer (float 1e-6, double 1e-12
// relative), for both pairings, a rotary dimension below the rank, the scalings with fixed
// frequencies and explicit frequencies; queries of their own at an explicit query_position; a
// long cache split across threads; the grouped cache equal to the layer with B and V repeated;
// the rotation read (a cache that ignored it would differ); and the refusals by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"

namespace emflow {
namespace {

using testing::close_to;

/// A factored layer of `heads` query heads sharing `kv_heads` kv heads, with key bias and
/// offset, its arrays in T.
template <class T>
struct GroupedLayer {
  std::int64_t heads, kv_heads, dim, rank;
  std::vector<T> A, B, U, V, bias, offset;
  Rotary rotary;

  GroupedLayer(std::int64_t h, std::int64_t kv, std::int64_t d, std::int64_t r,
               std::uint64_t seed = 40)
      : heads(h), kv_heads(kv), dim(d), rank(r) {
    const double s = 1.5 / std::sqrt(static_cast<double>(d));
    const auto make = [](std::int64_t n, std::uint64_t at, double lo, double hi) {
      const std::vector<double> v = testing::uniform(static_cast<std::size_t>(n), at, lo, hi);
      return std::vector<T>(v.begin(), v.end());
    };
    A = make(h * r * d, seed + 1, -s, s);
    B = make(kv * r * d, seed + 2, -s, s);
    U = make(h * d * r, seed + 3, -s, s);
    V = make(kv * r * d, seed + 4, -s, s);
    bias = make(h * d, seed + 5, -1, 1);
    offset = make(d, seed + 6, -1, 1);
  }
  FactoredLayer<T> layer() const {
    FactoredLayer<T> f{heads,    rank,        A.data(),      B.data(), U.data(),
                       V.data(), bias.data(), offset.data(), kv_heads, rotary};
    return f;
  }
};

template <class T>
struct Rows {
  std::vector<T> update, lse, entropy;
};

/// attend_factored of `queries` (count rows, or the cloud itself when null) at `query_position`
/// against the first `tokens` rows of `cloud`, in one call.
template <class T>
Rows<T> one_pass(const FactoredLayer<T>& layer, std::int64_t dim, const std::vector<T>& cloud,
                 std::int64_t tokens, const Mask& mask, double beta, const T* queries = nullptr,
                 std::int64_t count = 0, std::int64_t query_position = kAlignToEnd,
                 Device device = testing::host_device()) {
  const std::int64_t Nq = queries ? count : tokens, H = layer.heads;
  Rows<T> out{std::vector<T>(static_cast<std::size_t>(Nq * dim), T(NAN)),
              std::vector<T>(static_cast<std::size_t>(H * Nq), T(NAN)),
              std::vector<T>(static_cast<std::size_t>(H * Nq), T(NAN))};
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.tokens = tokens;
  in.dim = dim;
  in.mask = mask;
  in.beta = beta;
  if (queries != nullptr) {
    in.queries = queries;
    in.query_tokens = count;
    in.query_position = query_position;
  }
  attend_factored(in, layer, {out.update.data(), out.lse.data(), out.entropy.data(), nullptr},
                  {device});
  return out;
}

/// Decodes the cloud `step` tokens at a time: append them, attend them under `mask`.
template <class T>
Rows<T> decode(const FactoredLayer<T>& layer, std::int64_t dim, const std::vector<T>& cloud,
               std::int64_t tokens, std::int64_t step, const Mask& mask, double beta) {
  const std::int64_t d = dim, H = layer.heads;
  BasicDecodeCache<T> cache(layer, d, beta);
  EXPECT_TRUE(cache.factored());
  EXPECT_EQ(cache.device(), Device::cpu);
  Rows<T> out{std::vector<T>(static_cast<std::size_t>(tokens * d)),
              std::vector<T>(static_cast<std::size_t>(H * tokens)),
              std::vector<T>(static_cast<std::size_t>(H * tokens))};
  for (std::int64_t t = 0; t < tokens; t += step) {
    const std::int64_t n = std::min(step, tokens - t);
    cache.append(cloud.data() + t * d, n);
    std::vector<T> update(static_cast<std::size_t>(n * d), T(NAN));
    std::vector<T> lse(static_cast<std::size_t>(H * n), T(NAN)), entropy(lse.size(), T(NAN));
    // The thread count left to the cache (one thread for these small calls); the long cache
    // below runs two.
    cache.attend(cloud.data() + t * d, n, mask,
                 {update.data(), lse.data(), entropy.data(), nullptr});
    std::copy(update.begin(), update.end(), out.update.begin() + t * d);
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < n; ++i) {
        out.lse[static_cast<std::size_t>(h * tokens + t + i)] = lse[h * n + i];
        out.entropy[static_cast<std::size_t>(h * tokens + t + i)] = entropy[h * n + i];
      }
    }
  }
  return out;
}

template <class T>
void expect_rows(const Rows<T>& got, const Rows<T>& want, double tolerance) {
  EXPECT_TRUE(close_to(got.update, want.update, tolerance)) << "update";
  EXPECT_TRUE(close_to(got.lse, want.lse, tolerance)) << "lse";
  EXPECT_TRUE(close_to(got.entropy, want.entropy, tolerance)) << "entropy";
}

template <class T>
double tolerance_of() {
  return std::is_same_v<T, float> ? 1e-6 : 1e-12;
}

/// The rotary embeddings a case runs: both pairings, a rotary dimension below the rank, the
/// fixed scalings, explicit frequencies, and none.
struct RotaryCase {
  const char* name;
  Rotary rotary;
};

std::vector<RotaryCase> rotary_cases(const std::vector<double>& explicit_frequencies) {
  std::vector<RotaryCase> out;
  Rotary half;
  half.dim = 8;
  half.base = 30.0;  // low, so that every pair turns visibly over the cloud
  out.push_back({"half_split", half});
  Rotary pairs = half;
  pairs.dim = 4;  // below the rank 8: the last coordinates stay unrotated
  pairs.pairing = RotaryPairing::interleaved;
  out.push_back({"interleaved_dim4", pairs});
  Rotary linear = half;
  linear.scaling = RotaryScaling::linear;
  linear.factor = 2.5;
  out.push_back({"linear", linear});
  Rotary llama3 = half;
  llama3.scaling = RotaryScaling::llama3;
  llama3.factor = 8.0;
  llama3.original_max_positions = 16;
  out.push_back({"llama3", llama3});
  Rotary given;
  given.dim = 6;
  given.inverse_frequencies = explicit_frequencies.data();
  out.push_back({"explicit", given});
  out.push_back({"none", Rotary{}});
  return out;
}

template <class T>
class DecodeRotary : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DecodeRotary, Types);

TYPED_TEST(DecodeRotary, TokenByTokenAndBlocksEqualTheOnePass) {
  using T = TypeParam;
  const std::int64_t N = 37, d = 10, r = 8, H = 6;
  const std::vector<double> values = testing::uniform(N * d, 11);
  const std::vector<T> cloud(values.begin(), values.end());
  const std::vector<double> frequencies{0.9, 0.31, 0.05};
  for (const std::int64_t kv : {6, 3, 2, 1}) {
    GroupedLayer<T> layer(H, kv, d, r, 50 + static_cast<std::uint64_t>(kv));
    for (const RotaryCase& c : rotary_cases(frequencies)) {
      layer.rotary = c.rotary;
      for (const Mask& mask : {Mask::causal(), Mask::sliding_window(5)}) {
        const Rows<T> want = one_pass(layer.layer(), d, cloud, N, mask, 0.8);
        for (const std::int64_t step : {1, 3, 17}) {
          SCOPED_TRACE(std::string(c.name) + " kv_heads " + std::to_string(kv) + " " +
                       to_string(mask) + " step " + std::to_string(step));
          expect_rows(decode(layer.layer(), d, cloud, N, step, mask, 0.8), want, tolerance_of<T>());
        }
      }
    }
  }
}

// The rotation is read: the same cache without it, or with another base, gives other rows.
TYPED_TEST(DecodeRotary, TheRotationChangesTheRows) {
  using T = TypeParam;
  const std::int64_t N = 20, d = 10, r = 8;
  const std::vector<double> values = testing::uniform(N * d, 12);
  const std::vector<T> cloud(values.begin(), values.end());
  GroupedLayer<T> layer(4, 2, d, r);
  layer.rotary.dim = 8;
  layer.rotary.base = 30.0;
  const Rows<T> rotated = decode(layer.layer(), d, cloud, N, 1, Mask::causal(), 1.0);
  layer.rotary = Rotary{};
  const Rows<T> plain = decode(layer.layer(), d, cloud, N, 1, Mask::causal(), 1.0);
  EXPECT_GT(testing::relative_error(rotated.update, plain.update), 1e-3);
  EXPECT_GT(testing::relative_error(rotated.lse, plain.lse), 1e-4);
  // The first token sees itself only, at offset 0: no rotation reaches it.
  const double near = std::is_same_v<T, float> ? 1e-5 : 1e-13;
  for (std::int64_t a = 0; a < d; ++a) {
    EXPECT_NEAR(static_cast<double>(rotated.update[static_cast<std::size_t>(a)]),
                static_cast<double>(plain.update[static_cast<std::size_t>(a)]), near);
  }
}

// Queries of their own at an explicit position (a draft of several tokens, or a query that sits
// elsewhere): attend() rotates them there, as attend_factored's query_position does.
TYPED_TEST(DecodeRotary, QueriesAtAnExplicitPositionEqualTheOnePass) {
  using T = TypeParam;
  const std::int64_t N = 29, Nq = 4, d = 10, r = 8;
  const std::vector<double> values = testing::uniform(N * d, 13);
  const std::vector<T> cloud(values.begin(), values.end());
  const std::vector<double> q = testing::uniform(Nq * d, 14);
  const std::vector<T> queries(q.begin(), q.end());
  GroupedLayer<T> layer(6, 3, d, r);
  layer.rotary.dim = 8;
  layer.rotary.base = 20.0;
  BasicDecodeCache<T> cache(layer.layer(), d, 0.9);
  cache.append(cloud.data(), 10);
  cache.append(cloud.data() + 10 * d, N - 10);
  for (const std::int64_t position : {std::int64_t{0}, std::int64_t{12}, N - Nq, N + 5}) {
    for (const Mask& mask : {Mask::none(), Mask::causal(), Mask::sliding_window(7)}) {
      SCOPED_TRACE("query_position " + std::to_string(position) + " " + to_string(mask));
      const Rows<T> want =
          one_pass(layer.layer(), d, cloud, N, mask, 0.9, queries.data(), Nq, position);
      Rows<T> got{std::vector<T>(static_cast<std::size_t>(Nq * d), T(NAN)),
                  std::vector<T>(static_cast<std::size_t>(6 * Nq), T(NAN)),
                  std::vector<T>(static_cast<std::size_t>(6 * Nq), T(NAN))};
      cache.attend(queries.data(), Nq, mask,
                   {got.update.data(), got.lse.data(), got.entropy.data(), nullptr}, position, 2);
      expect_rows(got, want, tolerance_of<T>());
    }
  }
}

// 2600 keys: with two threads each query's keys split into spans, merged exactly.
TYPED_TEST(DecodeRotary, LongCacheSplitAcrossThreadsMatchesTheReference) {
  using T = TypeParam;
  const std::int64_t N = 2600, Nq = 2, d = 6, r = 4;
  const std::vector<double> values = testing::uniform(N * d, 15);
  const std::vector<T> cloud(values.begin(), values.end());
  GroupedLayer<T> layer(4, 2, d, r);
  layer.rotary.dim = 4;
  layer.rotary.base = 10000.0;
  BasicDecodeCache<T> cache(layer.layer(), d);
  cache.append(cloud.data(), N - 600);
  cache.append(cloud.data() + (N - 600) * d, 600);
  for (const Mask& mask : {Mask::causal(), Mask::sliding_window(1900)}) {
    SCOPED_TRACE(to_string(mask));
    const T* queries = cloud.data() + (N - Nq) * d;
    const Rows<T> want =
        one_pass(layer.layer(), d, cloud, N, mask, 1.0, queries, Nq, N - Nq, Device::reference);
    Rows<T> got{std::vector<T>(static_cast<std::size_t>(Nq * d), T(NAN)),
                std::vector<T>(static_cast<std::size_t>(4 * Nq), T(NAN)),
                std::vector<T>(static_cast<std::size_t>(4 * Nq), T(NAN))};
    cache.attend(queries, Nq, mask,
                 {got.update.data(), got.lse.data(), got.entropy.data(), nullptr}, kAlignToEnd, 2);
    expect_rows(got, want, tolerance_of<T>());
  }
}

// kv_heads K: the cache of the grouped layer is the cache of the layer whose B and V repeat each
// kv head for its group (heads / K query heads), as transformers' repeat_kv.
TYPED_TEST(DecodeRotary, GroupedCacheIsTheCacheOfTheRepeatedLayer) {
  using T = TypeParam;
  const std::int64_t N = 15, d = 10, r = 8, H = 6, K = 2;
  const std::vector<double> values = testing::uniform(N * d, 16);
  const std::vector<T> cloud(values.begin(), values.end());
  GroupedLayer<T> grouped(H, K, d, r);
  grouped.rotary.dim = 8;
  grouped.rotary.base = 30.0;
  GroupedLayer<T> repeated = grouped;
  repeated.kv_heads = H;
  repeated.B.clear();
  repeated.V.clear();
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t g = h / (H / K);
    repeated.B.insert(repeated.B.end(), grouped.B.begin() + g * r * d,
                      grouped.B.begin() + (g + 1) * r * d);
    repeated.V.insert(repeated.V.end(), grouped.V.begin() + g * r * d,
                      grouped.V.begin() + (g + 1) * r * d);
  }
  const Rows<T> a = decode(grouped.layer(), d, cloud, N, 2, Mask::causal(), 1.0);
  const Rows<T> b = decode(repeated.layer(), d, cloud, N, 2, Mask::causal(), 1.0);
  // The same sums in the same order: equal.
  EXPECT_EQ(a.update, b.update);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.entropy, b.entropy);
  EXPECT_TRUE(testing::all_finite_or_neg_inf(a.update));
  EXPECT_GT(testing::relative_error(a.update, std::vector<T>(a.update.size(), T(0))), 0.5);
}

TYPED_TEST(DecodeRotary, RefusesWhatItCannotComputeByName) {
  using T = TypeParam;
  const std::int64_t d = 10, r = 8;
  GroupedLayer<T> layer(6, 3, d, r);
  layer.rotary.dim = 8;
  const std::vector<std::int64_t> positions(4, 0);
  const auto invalid = [](auto&& call, const std::vector<std::string>& fragments) {
    return testing::throws_error(call, ErrorCode::invalid_argument, fragments);
  };
  FactoredLayer<T> f = layer.layer();
  f.kv_heads = 4;
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'kv_heads'", "got 4"}));
  f = layer.layer();
  f.rotary.dim = 3;
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'rotary.dim'", "got 3"}));
  f = layer.layer();
  f.rotary.dim = 10;  // above the rank
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'rotary.dim'", "got 10"}));
  f = layer.layer();
  f.rotary.base = 1.0;
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'rotary.base'"}));
  f = layer.layer();
  f.rotary.key_positions = positions.data();
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'rotary.key_positions'"}));
  f = layer.layer();
  f.rotary.query_positions = positions.data();
  EXPECT_TRUE(invalid([&] { BasicDecodeCache<T> c(f, d); }, {"'rotary.query_positions'"}));
  // The dynamic scaling's frequencies grow with the cloud: not for a cache that rotates each
  // key once.
  f = layer.layer();
  f.rotary.scaling = RotaryScaling::dynamic_ntk;
  f.rotary.factor = 2.0;
  f.rotary.original_max_positions = 16;
  EXPECT_TRUE(testing::throws_error([&] { BasicDecodeCache<T> c(f, d); }, ErrorCode::unsupported,
                                    {"DecodeCache", "'rotary.scaling'", "inverse_frequencies"}));
  // The GPU holds no rotary or grouped cache: route() says so by name, and automatic stays on
  // the host.
  Machine gpu;
  gpu.cuda_built = gpu.cuda_device = true;
  const Problem problem = describe(layer.layer(), d, DecodeOptions{Device::cuda, 64});
  EXPECT_EQ(problem.operation, Operation::decode);
  EXPECT_EQ(problem.kv_heads, 3);
  EXPECT_EQ(problem.rotary_dim, 8);
  const Route refused = route(problem, Device::cuda, gpu, "DecodeCache");
  EXPECT_FALSE(refused.supported);
  EXPECT_NE(refused.reason.find("rotary positions (rotary.dim 8)"), std::string::npos)
      << refused.reason;
  EXPECT_NE(refused.reason.find("grouped kv heads (kv_heads 3 of 6)"), std::string::npos)
      << refused.reason;
  EXPECT_NE(refused.reason.find("no GPU kernel"), std::string::npos) << refused.reason;
  const Route automatic = route(problem, Device::automatic, gpu, "DecodeCache");
  EXPECT_TRUE(automatic.supported) << automatic.reason;
  EXPECT_EQ(automatic.device, Device::cpu);
  EXPECT_TRUE(testing::throws_error(
      [&] {
        BasicDecodeCache<T> c(layer.layer(), d, 1.0, DecodeOptions{Device::cuda, 64});
      },
      ErrorCode::unsupported, {"DecodeCache"}));
}

}  // namespace
}  // namespace emflow

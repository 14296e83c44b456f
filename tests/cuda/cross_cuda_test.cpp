// Cross-attention, key splits and partial states on the CUDA device (kernels/), held against the
// double reference (Device::reference) and against the host's merge_partial / finish_partial:
//
//   CudaCross        queries against keys at awkward sizes (Nq = 1, 7, 33; N = 1, 65, 300), every
//                    mask, ragged key and query lengths, on the fused kernel and the unfused path
//                    in float and double, every output NaN-poisoned before the call.
//   CudaKeySplits    the fused kernel's key splits forced on small problems (2, 3 and 5 splits),
//                    for the update and for the partial state, against the reference and the
//                    unsplit kernel; the automatic choice for a decoding shape.
//   CudaPartial      keys cut at random places into 1..8 blocks, each block's partial state
//                    merged on the device and finished, against one pass (1e-6 in float, 1e-12
//                    in double); the device merge and finish against the host's on every special
//                    state; the blocking attend_partial on Device::cuda.
//
// The tests skip without a device; tests/cuda/emulation runs them on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/partial.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/products_strategy.hpp"
#include "emflow/cuda.hpp"

namespace emflow::testing {
namespace {

using cuda::Algorithm;
using cuda::DeviceBuffer;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A cross-attention problem in double (values rounded to float so both precisions agree).
struct Cross {
  std::int64_t B = 1, H = 1, N = 1, Nq = 1, d = 1;
  Mask mask;
  std::vector<double> cloud, queries, relevance, content, bias, shift;
  std::vector<std::int64_t> key_lengths, query_lengths;

  Cross(std::int64_t b, std::int64_t h, std::int64_t n, std::int64_t nq, std::int64_t dim, Mask m,
        bool ragged, std::uint64_t seed)
      : B(b), H(h), N(n), Nq(nq), d(dim), mask(m) {
    const auto rounded = [](std::vector<double> v, double scale) {
      for (double& x : v) x = static_cast<double>(static_cast<float>(x * scale));
      return v;
    };
    const double op = 2.0 / std::sqrt(static_cast<double>(d));
    const auto size = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    cloud = rounded(uniform(size(B * N * d), seed), 1.0);
    queries = rounded(uniform(size(B * Nq * d), seed + 1), 1.0);
    relevance = rounded(uniform(size(H * d * d), seed + 2), op);
    content = rounded(uniform(size(H * d * d), seed + 3), op);
    bias = rounded(uniform(size(H * d), seed + 4), 1.0);
    shift = rounded(uniform(size(d), seed + 5), 1.0);
    for (std::int64_t c = 0; ragged && c < B; ++c) {
      const std::int64_t keys[] = {N, N - N / 3, N / 2};
      const std::int64_t rows[] = {Nq, (Nq + 1) / 2, Nq};
      key_lengths.push_back(keys[c % 3]);
      query_lengths.push_back(rows[c % 3]);
    }
  }
  std::size_t rows() const { return static_cast<std::size_t>(B * H * Nq); }
};

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// The host arrays of a problem in T and the AttentionInput over them.
template <class T>
struct Host {
  std::vector<T> cloud, queries, relevance, content, bias, shift;
  std::vector<std::int64_t> key_lengths, query_lengths;
  AttentionInput<T> in;

  explicit Host(const Cross& p)
      : cloud(as<T>(p.cloud)),
        queries(as<T>(p.queries)),
        relevance(as<T>(p.relevance)),
        content(as<T>(p.content)),
        bias(as<T>(p.bias)),
        shift(as<T>(p.shift)),
        key_lengths(p.key_lengths),
        query_lengths(p.query_lengths) {
    in.cloud = cloud.data();
    in.batch = p.B;
    in.tokens = p.N;
    in.dim = p.d;
    in.layer = {p.H, relevance.data(), content.data(), bias.data(), shift.data()};
    in.beta = 0.8;
    in.mask = p.mask;
    in.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
    in.queries = queries.data();
    in.query_tokens = p.Nq;
    in.query_lengths = query_lengths.empty() ? nullptr : query_lengths.data();
  }
};

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& host) {
  DeviceBuffer<T> device(host.size());
  device.copy_from_host(host.data(), host.size(), nullptr);
  // `host` may be a temporary: the copy must have read it before the caller frees it.
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  return device;
}

template <class T>
std::vector<T> download(const DeviceBuffer<T>& device) {
  std::vector<T> host(device.size());
  device.copy_to_host(host.data(), host.size(), nullptr);
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  return host;
}

// NaN-filled device array of `count` entries (what an unwritten output would keep).
template <class T>
DeviceBuffer<T> poisoned(std::size_t count) {
  return upload(std::vector<T>(count, std::numeric_limits<T>::quiet_NaN()));
}

// A host problem's inputs on the device, and the device-side AttentionInput over them.
template <class T>
struct OnDevice {
  DeviceBuffer<T> cloud, queries, relevance, content, bias, shift;
  DeviceBuffer<std::int64_t> key_lengths, query_lengths, query_positions;
  AttentionInput<T> in;

  explicit OnDevice(const Host<T>& h, const std::vector<std::int64_t>& positions = {})
      : cloud(upload(h.cloud)),
        queries(upload(h.queries)),
        relevance(upload(h.relevance)),
        content(upload(h.content)),
        bias(upload(h.bias)),
        shift(upload(h.shift)),
        key_lengths(upload(h.key_lengths)),
        query_lengths(upload(h.query_lengths)),
        query_positions(upload(positions)) {
    in = h.in;
    in.cloud = cloud.data();
    in.queries = queries.data();
    in.layer = {h.in.layer.heads, relevance.data(), content.data(), bias.data(), shift.data()};
    in.key_lengths = h.in.key_lengths ? key_lengths.data() : nullptr;
    in.query_lengths = h.in.query_lengths ? query_lengths.data() : nullptr;
    in.query_positions = positions.empty() ? nullptr : query_positions.data();
  }
};

// The update, lse and entropy of one call.
struct Result {
  std::vector<double> update, lse, entropy;
};

Result reference(const Cross& p) {
  Host<double> h(p);
  Result r{std::vector<double>(static_cast<std::size_t>(p.B * p.Nq * p.d)),
           std::vector<double>(p.rows()), std::vector<double>(p.rows())};
  attend(h.in, AttentionOutput<double>{r.update.data(), r.lse.data(), r.entropy.data()},
         {emflow::Device::reference});
  return r;
}

// `got` agrees with `want` to `tolerance` relative to max(1, |want|); infinities exactly; no NaN.
template <class T>
void expect_near(const std::vector<T>& got, const std::vector<double>& want, double tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (std::size_t k = 0; k < got.size() && reported < 5; ++k) {
    const double g = static_cast<double>(got[k]), w = want[k];
    const bool ok =
        std::isinf(w) ? g == w : std::abs(g - w) <= tolerance * std::max(1.0, std::abs(w));
    if (!ok) {
      ADD_FAILURE() << what << "[" << k << "]: got " << g << ", want " << w;
      ++reported;
    }
  }
}

template <class T>
void expect_result(const DeviceBuffer<T>& update, const DeviceBuffer<T>& lse,
                   const DeviceBuffer<T>& entropy, const Result& want, double tolerance,
                   const std::string& what) {
  expect_near(download(update), want.update, tolerance, what + " update");
  expect_near(download(lse), want.lse, tolerance, what + " lse");
  expect_near(download(entropy), want.entropy, tolerance, what + " entropy");
}

std::string name(const Cross& p) {
  return "B" + std::to_string(p.B) + " H" + std::to_string(p.H) + " N" + std::to_string(p.N) +
         " Nq" + std::to_string(p.Nq) + " d" + std::to_string(p.d) + " " + to_string(p.mask) +
         (p.key_lengths.empty() ? "" : " ragged");
}

// One attend_async call with poisoned outputs, against the reference.
template <class T>
void check_async(const Cross& p, Algorithm algorithm, double tolerance, const std::string& what) {
  const Host<T> host(p);
  const OnDevice<T> device(host);
  DeviceBuffer<T> update = poisoned<T>(static_cast<std::size_t>(p.B * p.Nq * p.d));
  DeviceBuffer<T> lse = poisoned<T>(p.rows()), entropy = poisoned<T>(p.rows());
  const AttentionOutput<T> out{update.data(), lse.data(), entropy.data()};
  const cuda::PlanOptions options{algorithm};
  const std::size_t bytes = cuda::attend_workspace_size(device.in, out, options);
  DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(device.in, out, workspace.data(), bytes, nullptr, options);
  expect_result(update, lse, entropy, reference(p), tolerance, what + " " + name(p));
}

std::vector<Mask> every_mask() {
  return {Mask::none(), Mask::causal(), Mask::sliding_window(5), Mask::sliding_window(40)};
}

// Three clouds: the first with every key and query real, the second with a third of its keys and
// half its queries padding, the third with half its keys padding (none for N = 1).
Cross awkward(std::int64_t N, std::int64_t Nq, const Mask& mask) {
  return Cross(3, 2, N, Nq, 5, mask, true, static_cast<std::uint64_t>(7 * N + Nq));
}

TEST(CudaCross, FusedAwkwardSizesEveryMaskMatchReference) {
  EMFLOW_REQUIRE_CUDA();
  for (std::int64_t Nq : {1, 7, 33}) {
    for (std::int64_t N : {1, 65, 300}) {
      for (const Mask& mask : every_mask()) {
        check_async<float>(awkward(N, Nq, mask), Algorithm::fused, 1e-5, "fused");
      }
    }
  }
}

// Fewer cases than the fused kernel: the emulated cuBLAS is slow, and the unfused path's only
// new parts are the rectangular products and the row rules, which each case covers.
TEST(CudaCross, UnfusedAwkwardSizesMatchReference) {
  EMFLOW_REQUIRE_CUDA();
  check_async<float>(awkward(65, 1, Mask::causal()), Algorithm::unfused, 1e-5, "unfused");
  check_async<float>(awkward(65, 33, Mask::sliding_window(5)), Algorithm::unfused, 1e-5, "unfused");
  check_async<double>(awkward(1, 7, Mask::none()), Algorithm::unfused, 1e-12, "unfused double");
  for (const Mask& mask : every_mask()) {
    check_async<double>(awkward(65, 7, mask), Algorithm::unfused, 1e-12, "unfused double");
  }
}

TEST(CudaCross, BlockingAttendTakesQueriesLengthsAndPositions) {
  EMFLOW_REQUIRE_CUDA();
  Cross p(2, 1, 70, 9, 8, Mask::causal(), true, 7);
  for (const bool is_double : {false, true}) {
    const Result want = reference(p);
    Result got{std::vector<double>(want.update.size(), NAN),
               std::vector<double>(want.lse.size(), NAN),
               std::vector<double>(want.lse.size(), NAN)};
    if (is_double) {
      Host<double> h(p);
      attend(h.in, AttentionOutput<double>{got.update.data(), got.lse.data(), got.entropy.data()},
             {emflow::Device::cuda});
      expect_near(got.update, want.update, 1e-12, "cuda double update");
      expect_near(got.entropy, want.entropy, 1e-12, "cuda double entropy");
    } else {
      Host<float> h(p);
      std::vector<float> update(want.update.size(), NAN), lse(want.lse.size(), NAN),
          entropy(want.lse.size(), NAN);
      attend(h.in, AttentionOutput<float>{update.data(), lse.data(), entropy.data()},
             {emflow::Device::cuda});
      expect_near(update, want.update, 1e-5, "cuda float update");
      expect_near(lse, want.lse, 1e-5, "cuda float lse");
    }
  }
}

// The fused kernel with `splits` key splits forced through the plan, for the update.
void check_splits(const Cross& p, int splits) {
  const Host<float> host(p);
  const OnDevice<float> device(host);
  DeviceBuffer<float> update = poisoned<float>(static_cast<std::size_t>(p.B * p.Nq * p.d));
  DeviceBuffer<float> lse = poisoned<float>(p.rows()), entropy = poisoned<float>(p.rows());
  const AttentionOutput<float> out{update.data(), lse.data(), entropy.data()};
  const cuda::AttentionPlan<float> plan(device.in, out,
                                        {Algorithm::fused, Precision::fp32, splits});
  ASSERT_EQ(plan.key_splits(), splits) << name(p);
  DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  plan.run(device.in, out, workspace.data(), workspace.size(), nullptr);
  expect_result(update, lse, entropy, reference(p), 1e-5,
                std::to_string(splits) + " splits " + name(p));
}

TEST(CudaKeySplits, ForcedSplitsMatchReference) {
  EMFLOW_REQUIRE_CUDA();
  std::uint64_t seed = 300;
  for (const Mask& mask : every_mask()) {
    check_splits(Cross(3, 2, 300, 7, 6, mask, true, seed++), 2);
    check_splits(Cross(1, 1, 300, 1, 6, mask, false, seed++), 5);
    check_splits(Cross(2, 3, 300, 33, 6, mask, true, seed++), 3);
  }
}

// A decoding shape splits by itself, self-attention never, and the workspace grows with it.
TEST(CudaKeySplits, PlanSplitsDecodingShapesOnly) {
  const detail::KeySplits decode = detail::choose_key_splits(1, 1, 1, 131072, true);
  EXPECT_EQ(decode.splits, 512);
  EXPECT_EQ(decode.keys, 256);
  EXPECT_EQ(detail::choose_key_splits(1, 1, 4096, 4096, false).splits, 1);
  EXPECT_EQ(detail::choose_key_splits(8, 16, 4096, 4096, true).splits, 1);
  EXPECT_EQ(detail::choose_key_splits(1, 1, 1, 100, true).splits, 1);
  const detail::KeySplits forced = detail::choose_key_splits(1, 1, 7, 300, false, 3);
  EXPECT_EQ(forced.splits, 3);
  EXPECT_EQ(forced.keys, 128);
  Cross p(1, 1, 4096, 1, 16, Mask::causal(), false, 5);
  const Host<float> h(p);
  std::vector<float> update(16), lse(1);
  const AttentionOutput<float> out{update.data(), lse.data(), nullptr};
  // Sized without a device: the splits depend on the shapes alone.
  using Plan = cuda::AttentionPlan<float>;
  const std::size_t split = Plan::get_workspace_size(h.in, out, {Algorithm::fused});
  const std::size_t unsplit =
      Plan::get_workspace_size(h.in, out, {Algorithm::fused, Precision::fp32, 1});
  EXPECT_GT(split, unsplit);
  EXPECT_EQ(cuda::attend_workspace_size(h.in, out), split);
  // 16 splits of 256 keys: the split rows (16 x 16 floats) and their lse and entropy.
  EXPECT_GE(split - unsplit, std::size_t{16 * 16 * sizeof(float)});
}

// A partial state on the device (batch, heads, Nq, dim), (batch, heads, Nq) twice.
template <class T>
struct DeviceState {
  DeviceBuffer<T> heads, lse, entropy;
  explicit DeviceState(const Cross& p)
      : heads(poisoned<T>(p.rows() * static_cast<std::size_t>(p.d))),
        lse(poisoned<T>(p.rows())),
        entropy(poisoned<T>(p.rows())) {}
  PartialOutput<T> out() { return {heads.data(), lse.data(), entropy.data()}; }
  PartialInput<T> in() const { return {heads.data(), lse.data(), entropy.data()}; }
};

// Keys cut at `cuts` (increasing, inside (0, N)): each block's partial state through
// attend_partial_async (its keys copied out, key_position at its start, every cloud's queries at
// their bottom-right origin over the whole cloud), merged in order with merge_partial_async and
// finished with finish_partial_async; against one attend_async pass of the same algorithm.
template <class T>
void check_blocks(const Cross& p, const std::vector<std::int64_t>& cuts, Algorithm algorithm,
                  double tolerance, int splits = 0) {
  const Host<T> whole(p);
  std::vector<std::int64_t> origins;
  for (std::int64_t b = 0; b < p.B; ++b) {
    const std::int64_t lk = p.key_lengths.empty() ? p.N : p.key_lengths[b];
    const std::int64_t lq = p.query_lengths.empty() ? p.Nq : p.query_lengths[b];
    origins.push_back(lk - lq);
  }
  const PartialShape shape{p.B, p.H, p.Nq, p.d};
  DeviceState<T> merged(p);
  std::vector<std::int64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(p.N);
  for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
    const std::int64_t first = bounds[k], count = bounds[k + 1] - first;
    Cross block = p;
    block.N = count;
    block.cloud.clear();
    for (std::int64_t b = 0; b < p.B; ++b) {
      const auto at = p.cloud.begin() + (b * p.N + first) * p.d;
      block.cloud.insert(block.cloud.end(), at, at + count * p.d);
      if (!p.key_lengths.empty()) {
        block.key_lengths[b] = std::clamp<std::int64_t>(p.key_lengths[b] - first, 0, count);
      }
    }
    Host<T> host(block);
    host.in.key_position = first;
    const OnDevice<T> device(host, origins);
    DeviceState<T> part(p);
    DeviceState<T>& target = k == 0 ? merged : part;
    if (splits > 0) {
      const cuda::AttentionPlan<T> plan(device.in, target.out(),
                                        {algorithm, Precision::fp32, splits});
      DeviceBuffer<unsigned char> workspace(plan.workspace_size());
      plan.run(device.in, target.out(), workspace.data(), workspace.size(), nullptr);
    } else {
      const std::size_t bytes = cuda::attend_partial_workspace_size(device.in, {algorithm});
      DeviceBuffer<unsigned char> workspace(bytes);
      cuda::attend_partial_async(device.in, target.out(), workspace.data(), bytes, nullptr,
                                 {algorithm});
    }
    if (k > 0) cuda::merge_partial_async(shape, part.in(), merged.out(), nullptr);
  }
  const OnDevice<T> device(whole);
  DeviceBuffer<T> update = poisoned<T>(static_cast<std::size_t>(p.B * p.Nq * p.d));
  DeviceBuffer<T> lse = poisoned<T>(p.rows()), entropy = poisoned<T>(p.rows());
  cuda::finish_partial_async(shape, merged.in(), device.in.layer.offset,
                             AttentionOutput<T>{update.data(), lse.data(), entropy.data()},
                             nullptr);
  // One pass of the same algorithm.
  DeviceBuffer<T> one_update = poisoned<T>(static_cast<std::size_t>(p.B * p.Nq * p.d));
  DeviceBuffer<T> one_lse = poisoned<T>(p.rows()), one_entropy = poisoned<T>(p.rows());
  const AttentionOutput<T> one{one_update.data(), one_lse.data(), one_entropy.data()};
  const std::size_t bytes = cuda::attend_workspace_size(device.in, one, {algorithm});
  DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(device.in, one, workspace.data(), bytes, nullptr, {algorithm});
  const auto widen = [](const DeviceBuffer<T>& buffer) {
    const std::vector<T> values = download(buffer);
    return std::vector<double>(values.begin(), values.end());
  };
  const Result want{widen(one_update), widen(one_lse), widen(one_entropy)};
  std::string where = std::to_string(cuts.size() + 1) + " blocks " + name(p);
  expect_result(update, lse, entropy, want, tolerance, where);
  // And both against the reference.
  expect_result(update, lse, entropy, reference(p), std::is_same_v<T, float> ? 1e-5 : 1e-12,
                where + " vs reference");
}

std::vector<std::int64_t> random_cuts(std::int64_t N, std::mt19937_64& random) {
  const int blocks = 1 + static_cast<int>(random() % 8);
  std::vector<std::int64_t> cuts;
  for (int k = 1; k < blocks && N > 1; ++k)
    cuts.push_back(1 + static_cast<std::int64_t>(random() % (N - 1)));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

TEST(CudaPartial, RandomKeyBlocksMergeIntoOnePass) {
  EMFLOW_REQUIRE_CUDA();
  std::mt19937_64 random(2024);
  std::uint64_t seed = 500;
  for (const Mask& mask : every_mask()) {
    const Cross p(3, 2, 150, 7, 6, mask, true, seed++);
    check_blocks<float>(p, random_cuts(p.N, random), Algorithm::fused, 1e-6);
    check_blocks<double>(p, random_cuts(p.N, random), Algorithm::unfused, 1e-12);
  }
  // One query against keys cut into 8 blocks, each block itself split by the fused kernel.
  const Cross decode(1, 1, 520, 1, 6, Mask::causal(), false, seed++);
  check_blocks<float>(decode, {64, 100, 200, 260, 333, 400, 470}, Algorithm::fused, 1e-6);
  check_blocks<float>(decode, {130, 390}, Algorithm::fused, 1e-6, 2);
}

TEST(CudaPartial, BlockingAttendPartialMatchesReference) {
  EMFLOW_REQUIRE_CUDA();
  Cross p(3, 2, 90, 9, 5, Mask::sliding_window(30), true, 77);
  Host<double> want_host(p);
  std::vector<double> heads(p.rows() * 5), lse(p.rows()), entropy(p.rows());
  attend_partial(want_host.in, PartialOutput<double>{heads.data(), lse.data(), entropy.data()},
                 {emflow::Device::reference});
  Host<float> fh(p);
  std::vector<float> fheads(heads.size(), NAN), flse(lse.size(), NAN), fentropy(lse.size(), NAN);
  attend_partial(fh.in, PartialOutput<float>{fheads.data(), flse.data(), fentropy.data()},
                 {emflow::Device::cuda});
  expect_near(fheads, heads, 1e-5, "float heads");
  expect_near(flse, lse, 1e-5, "float lse");
  expect_near(fentropy, entropy, 1e-5, "float entropy");
  std::vector<double> dheads(heads.size(), NAN), dlse(lse.size(), NAN), dentropy(lse.size(), NAN);
  attend_partial(want_host.in, PartialOutput<double>{dheads.data(), dlse.data(), dentropy.data()},
                 {emflow::Device::cuda});
  expect_near(dheads, heads, 1e-12, "double heads");
  expect_near(dlse, lse, 1e-12, "double lse");
  expect_near(dentropy, entropy, 1e-12, "double entropy");
}

// Every pair of the states a part can be in (finite, no key, every visible score -inf, NaN),
// merged and finished on the device as on the host.
template <class T>
void check_special_states() {
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  struct S {
    T lse, entropy, o;
  };
  const S states[] = {{T(1.5), T(0.7), T(0.25)}, {T(-0.5), T(1.1), T(-2)}, {-inf, T(0), T(0)},
                      {-inf, nan, T(0)},         {-inf, nan, nan},         {nan, nan, nan}};
  const int n = 6, d = 2;
  const PartialShape shape{1, n, n, d};  // head h, query i: states[h] into states[i]
  std::vector<T> a_heads, a_lse, a_entropy, b_heads, b_lse, b_entropy;
  for (int h = 0; h < n; ++h) {
    for (int i = 0; i < n; ++i) {
      a_lse.push_back(states[i].lse);
      a_entropy.push_back(states[i].entropy);
      b_lse.push_back(states[h].lse);
      b_entropy.push_back(states[h].entropy);
      for (int a = 0; a < d; ++a) {
        a_heads.push_back(states[i].o + T(a));
        b_heads.push_back(states[h].o - T(a));
      }
    }
  }
  DeviceBuffer<T> dah = upload(a_heads), dal = upload(a_lse), dae = upload(a_entropy);
  const DeviceBuffer<T> dbh = upload(b_heads), dbl = upload(b_lse), dbe = upload(b_entropy);
  cuda::merge_partial_async(shape, PartialInput<T>{dbh.data(), dbl.data(), dbe.data()},
                            PartialOutput<T>{dah.data(), dal.data(), dae.data()}, nullptr);
  merge_partial(shape, PartialInput<T>{b_heads.data(), b_lse.data(), b_entropy.data()},
                PartialOutput<T>{a_heads.data(), a_lse.data(), a_entropy.data()});
  const auto same = [](const std::vector<T>& got, const std::vector<T>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      const bool ok = std::isnan(want[k])   ? std::isnan(got[k])
                      : std::isinf(want[k]) ? got[k] == want[k]
                                            : std::abs(got[k] - want[k]) <=
                                                  T(1e-6) * std::max(T(1), std::abs(want[k]));
      EXPECT_TRUE(ok) << what << "[" << k << "]: got " << got[k] << ", want " << want[k];
    }
  };
  same(download(dah), a_heads, "merged heads");
  same(download(dal), a_lse, "merged lse");
  same(download(dae), a_entropy, "merged entropy");

  const std::vector<T> offset = {T(0.5), T(-0.25)};
  const DeviceBuffer<T> doffset = upload(offset);
  DeviceBuffer<T> update = poisoned<T>(n * d), lse = poisoned<T>(n * n),
                  entropy = poisoned<T>(n * n);
  cuda::finish_partial_async(
      shape, PartialInput<T>{dah.data(), dal.data(), dae.data()}, doffset.data(),
      AttentionOutput<T>{update.data(), lse.data(), entropy.data()}, nullptr);
  std::vector<T> h_update(n * d), h_lse(n * n), h_entropy(n * n);
  finish_partial(shape, PartialInput<T>{a_heads.data(), a_lse.data(), a_entropy.data()},
                 offset.data(),
                 AttentionOutput<T>{h_update.data(), h_lse.data(), h_entropy.data()});
  same(download(update), h_update, "finished update");
  same(download(lse), h_lse, "finished lse");
  same(download(entropy), h_entropy, "finished entropy");
}

TEST(CudaPartial, DeviceMergeAndFinishFollowTheHostOnEverySpecialState) {
  EMFLOW_REQUIRE_CUDA();
  check_special_states<float>();
  check_special_states<double>();
}

TEST(CudaPartial, MergeRefusesOverlapAndHostPointers) {
  EMFLOW_REQUIRE_CUDA();
  const PartialShape shape{1, 1, 2, 3};
  DeviceBuffer<float> heads(6), lse(2), entropy(2);
  std::vector<float> host(6);
  EXPECT_TRUE(throws_error(
      [&] {
        cuda::merge_partial_async(
            shape, PartialInput<float>{heads.data(), lse.data(), entropy.data()},
            PartialOutput<float>{heads.data(), lse.data(), entropy.data()}, nullptr);
      },
      ErrorCode::invalid_argument, {"shares memory"}));
  DeviceBuffer<float> other(6), other_lse(2), other_entropy(2);
  EXPECT_TRUE(throws_error(
      [&] {
        cuda::merge_partial_async(
            shape, PartialInput<float>{host.data(), lse.data(), entropy.data()},
            PartialOutput<float>{other.data(), other_lse.data(), other_entropy.data()}, nullptr);
      },
      ErrorCode::invalid_argument, {"part.heads"}));
}

}  // namespace
}  // namespace emflow::testing

#endif

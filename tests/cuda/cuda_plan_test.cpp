// The public CUDA plan (cuda::AttentionPlan, emflow/cuda.hpp), strategy by strategy: made once
// from shapes alone (null arrays), run twice with other arrays and another beta on one
// workspace, each run bitwise equal to the one-call form (attend_async, attend_factored_async,
// attend_partial_async) and held against the double reference; route() names the strategy. A run
// that does not match its plan, and a bad workspace, are refused by name. The sizes and
// can_implement need no device; the runs skip without one (the CPU emulation of CUDA runs them),
// and the device binding (two emulated devices, their shared-memory limits, a device reset) is
// checked under the emulation only, where a test can present the devices.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/stored.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/error.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/precision.hpp"
#include "emflow/sdpa.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"

namespace emflow::testing {
namespace {

using cuda::Algorithm;
using cuda::AttentionPlan;
using cuda::DeviceBuffer;
using cuda::PlanOptions;

// --- One problem in every form -------------------------------------------------------------------

struct Sizes {
  std::int64_t batch = 2, tokens = 40, queries = 0, dim = 12, heads = 2, rank = 0;
  Mask mask = Mask::causal();
  bool lengths = true, weights = false;
};

template <class T>
std::vector<T> random_of(std::size_t count, std::uint64_t seed, double scale) {
  const std::vector<double> values = uniform(count, seed, -scale, scale);
  std::vector<T> out;
  out.reserve(count);
  for (double v : values) out.push_back(stored<T>(v));
  return out;
}

// Host arrays of storage T; the dense operators or the factors, by shape.rank.
template <class T>
struct HostCase {
  Sizes shape;
  std::vector<T> cloud, queries, relevance, content, query_factor, key_factor, up, down, bias,
      offset;
  std::vector<std::int64_t> key_lengths;
  double beta = 1.0;

  HostCase(const Sizes& s, std::uint64_t seed, double beta_) : shape(s), beta(beta_) {
    const auto B = static_cast<std::size_t>(s.batch), N = static_cast<std::size_t>(s.tokens);
    const auto d = static_cast<std::size_t>(s.dim), H = static_cast<std::size_t>(s.heads);
    const auto r = static_cast<std::size_t>(s.rank);
    const double scale = 2.0 / std::sqrt(static_cast<double>(s.dim));
    cloud = random_of<T>(B * N * d, seed, 1.0);
    if (s.queries > 0)
      queries = random_of<T>(B * static_cast<std::size_t>(s.queries) * d, seed + 1, 1.0);
    if (s.rank == 0) {
      relevance = random_of<T>(H * d * d, seed + 2, scale);
      content = random_of<T>(H * d * d, seed + 3, scale);
    } else {
      const double factor = std::sqrt(scale);
      query_factor = random_of<T>(H * r * d, seed + 2, factor);
      key_factor = random_of<T>(H * r * d, seed + 3, factor);
      up = random_of<T>(H * d * r, seed + 4, factor);
      down = random_of<T>(H * r * d, seed + 5, factor);
    }
    bias = random_of<T>(H * d, seed + 6, 0.5);
    offset = random_of<T>(d, seed + 7, 0.5);
    if (s.lengths) {
      for (std::int64_t b = 0; b < s.batch; ++b) {
        key_lengths.push_back(s.tokens - b * (s.tokens / 3));
      }
    }
  }
  std::int64_t query_count() const { return shape.queries > 0 ? shape.queries : shape.tokens; }
  std::size_t update_size() const {
    return static_cast<std::size_t>(shape.batch * query_count() * shape.dim);
  }
  std::size_t rows() const {
    return static_cast<std::size_t>(shape.batch * shape.heads * query_count());
  }
};

template <class T>
AttentionInput<T> input_of(const Sizes& s, double beta, const T* cloud, const T* queries,
                           const std::int64_t* lengths) {
  AttentionInput<T> in;
  in.cloud = cloud;
  in.batch = s.batch;
  in.tokens = s.tokens;
  in.dim = s.dim;
  in.queries = queries;
  in.query_tokens = s.queries;
  in.beta = beta;
  in.mask = s.mask;
  in.key_lengths = lengths;
  return in;
}

template <class T>
std::vector<double> widen_all(const std::vector<T>& values) {
  std::vector<double> out;
  out.reserve(values.size());
  for (const T& v : values) out.push_back(value_of(v));
  return out;
}

// The double reference on the stored values: the update's outputs (lse, entropy, weights) or
// the partial state's (heads, lse, entropy).
struct Expected {
  std::vector<double> update, lse, entropy, weights;
};

template <class T>
Expected reference(const HostCase<T>& c, bool partial) {
  const Sizes& s = c.shape;
  const std::vector<double> cloud = widen_all(c.cloud), queries = widen_all(c.queries);
  const std::vector<double> relevance = widen_all(c.relevance), content = widen_all(c.content);
  const std::vector<double> a = widen_all(c.query_factor), b = widen_all(c.key_factor);
  const std::vector<double> up = widen_all(c.up), down = widen_all(c.down);
  const std::vector<double> bias = widen_all(c.bias), offset = widen_all(c.offset);
  AttentionInput<double> in =
      input_of<double>(s, c.beta, cloud.data(), queries.empty() ? nullptr : queries.data(),
                       c.key_lengths.empty() ? nullptr : c.key_lengths.data());
  Expected e;
  e.lse.resize(c.rows());
  e.entropy.resize(c.rows());
  if (partial) {
    in.layer = {s.heads, relevance.data(), content.data(), bias.data(), nullptr};
    e.update.resize(c.rows() * static_cast<std::size_t>(s.dim));
    attend_partial(in, PartialOutput<double>{e.update.data(), e.lse.data(), e.entropy.data()},
                   {Device::reference});
    return e;
  }
  e.update.resize(c.update_size());
  if (s.weights) e.weights.resize(c.rows() * static_cast<std::size_t>(s.tokens));
  const AttentionOutput<double> out{e.update.data(), e.lse.data(), e.entropy.data(),
                                    s.weights ? e.weights.data() : nullptr};
  if (s.rank == 0) {
    in.layer = {s.heads, relevance.data(), content.data(), bias.data(), offset.data()};
    attend(in, out, {Device::reference});
  } else {
    const FactoredLayer<double> layer{s.heads,   s.rank,      a.data(),    b.data(),
                                      up.data(), down.data(), bias.data(), offset.data()};
    attend_factored(in, layer, out, {Device::reference});
  }
  return e;
}

template <class V>
DeviceBuffer<V> upload(const std::vector<V>& host, cudaStream_t s) {
  DeviceBuffer<V> device(host.size());
  device.copy_from_host(host.data(), host.size(), s);
  return device;
}

template <class V>
std::vector<V> download(const DeviceBuffer<V>& device, cudaStream_t s) {
  std::vector<V> host(device.size());
  device.copy_to_host(host.data(), host.size(), s);
  return host;
}

// NaN where a device array was not written.
template <class V>
DeviceBuffer<V> poisoned(std::size_t count, cudaStream_t s) {
  std::vector<V> nan(count);
  if (count > 0) std::memset(static_cast<void*>(nan.data()), 0xff, count * sizeof(V));
  DeviceBuffer<V> device(count);
  device.copy_from_host(nan.data(), count, s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return device;
}

struct OwnedStream {
  cudaStream_t handle = nullptr;
  OwnedStream() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking), cudaSuccess);
  }
  ~OwnedStream() {
    if (handle != nullptr) cudaStreamDestroy(handle);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

// A case's arrays on the device, and where a run writes.
template <class T>
struct DeviceCase {
  DeviceBuffer<T> cloud, queries, relevance, content, query_factor, key_factor, up, down, bias,
      offset, update, heads;
  DeviceBuffer<std::int64_t> key_lengths;
  DeviceBuffer<Stat<T>> lse, entropy, weights;
  AttentionInput<T> input;
  FactoredLayer<T> layer;
  AttentionOutput<T> output;
  PartialOutput<T> partial;

  DeviceCase(const HostCase<T>& c, cudaStream_t s)
      : cloud(upload(c.cloud, s)),
        queries(upload(c.queries, s)),
        relevance(upload(c.relevance, s)),
        content(upload(c.content, s)),
        query_factor(upload(c.query_factor, s)),
        key_factor(upload(c.key_factor, s)),
        up(upload(c.up, s)),
        down(upload(c.down, s)),
        bias(upload(c.bias, s)),
        offset(upload(c.offset, s)),
        update(poisoned<T>(c.update_size(), s)),
        heads(poisoned<T>(c.rows() * static_cast<std::size_t>(c.shape.dim), s)),
        key_lengths(upload(c.key_lengths, s)),
        lse(poisoned<Stat<T>>(c.rows(), s)),
        entropy(poisoned<Stat<T>>(c.rows(), s)),
        weights(poisoned<Stat<T>>(c.shape.weights ? c.rows() * c.shape.tokens : 0, s)) {
    const Sizes& sh = c.shape;
    input = input_of<T>(sh, c.beta, cloud.data(), sh.queries > 0 ? queries.data() : nullptr,
                        sh.lengths ? key_lengths.data() : nullptr);
    if (sh.rank == 0) {
      input.layer = {sh.heads, relevance.data(), content.data(), bias.data(), offset.data()};
    } else {
      layer = {sh.heads,  sh.rank,     query_factor.data(), key_factor.data(),
               up.data(), down.data(), bias.data(),         offset.data()};
    }
    output = {update.data(), lse.data(), entropy.data(), sh.weights ? weights.data() : nullptr};
    partial = {heads.data(), lse.data(), entropy.data()};
  }
};

// What a run wrote, on the host (the partial state's rows in `update`).
struct Got {
  std::vector<double> update, lse, entropy, weights;
  std::vector<unsigned char> bits;  // every byte written, to compare runs bitwise
};

template <class T>
Got got_of(const DeviceCase<T>& d, bool partial, cudaStream_t s) {
  Got g;
  const std::vector<T> update = download(partial ? d.heads : d.update, s);
  const std::vector<Stat<T>> lse = download(d.lse, s), entropy = download(d.entropy, s);
  const std::vector<Stat<T>> weights = download(d.weights, s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  g.update = widen_all(update);
  g.lse.assign(lse.begin(), lse.end());
  g.entropy.assign(entropy.begin(), entropy.end());
  g.weights.assign(weights.begin(), weights.end());
  const auto append = [&g](const auto& values) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
    g.bits.insert(g.bits.end(), bytes, bytes + values.size() * sizeof(values[0]));
  };
  append(update);
  append(lse);
  append(entropy);
  append(weights);
  return g;
}

// --- Made once, run twice, against the one-call form and the reference ---------------------------

// Which entry point a case runs: attend_async, attend_factored_async or attend_partial_async.
enum class Entry { dense, factored, partial };

struct StrategyCase {
  const char* name;
  Entry entry;
  Dtype storage;
  PlanOptions options;
  Sizes shape;
  const char* route;  // to_string of the plan's route
  double tolerance;   // relative, against the double reference
  int key_splits = 1;
};

std::ostream& operator<<(std::ostream& out, const StrategyCase& c) { return out << c.name; }

Sizes with(Sizes s, std::int64_t rank, bool weights = false) {
  s.rank = rank;
  s.weights = weights;
  return s;
}

// The unfused path's row softmax runs one emulated block of 256 threads per row: few rows (one
// cloud; the key lengths of two clouds are the other cases').
Sizes few_rows(std::int64_t rank = 0, bool weights = false) {
  Sizes s;
  s.batch = 1;
  s.tokens = 9;
  s.dim = 6;
  s.rank = rank;
  s.weights = weights;
  return s;
}

Sizes cross_shape() {
  Sizes s;
  s.batch = 1;
  s.tokens = 300;
  s.queries = 3;
  s.dim = 8;
  s.mask = Mask::sliding_window(200);
  return s;
}

// clang-format off
const StrategyCase kStrategies[] = {
    {"fused_f32", Entry::dense, Dtype::float32, {Algorithm::fused}, Sizes{},
     "cuda cuda_fused fp32", 1e-5},
    {"unfused_f32", Entry::dense, Dtype::float32, {Algorithm::unfused}, few_rows(0, true),
     "cuda cuda_unfused fp32", 1e-5},
    {"unfused_f64", Entry::dense, Dtype::float64, {}, few_rows(),
     "cuda cuda_unfused fp64", 1e-12},
    {"key_splits_f32", Entry::dense, Dtype::float32, {Algorithm::automatic, Precision::fp32, 3},
     cross_shape(), "cuda cuda_fused fp32", 1e-5, 3},
    {"tensor_cores_bf16", Entry::dense, Dtype::bfloat16, {}, Sizes{},
     "cuda cuda_tensor_cores bf16", 3e-2},
    {"tensor_cores_tf32", Entry::dense, Dtype::float32, {Algorithm::automatic, Precision::tf32},
     Sizes{}, "cuda cuda_tensor_cores tf32", 1e-2},
    {"tensor_cores_factored_f16", Entry::factored, Dtype::float16, {}, with(Sizes{}, 6),
     "cuda cuda_tensor_cores fp16", 1e-2},
    {"expanded_f32", Entry::factored, Dtype::float32, {}, with(Sizes{}, 6),
     "cuda cuda_fused fp32 (expanded)", 1e-5},
    {"expanded_f64", Entry::factored, Dtype::float64, {}, few_rows(4),
     "cuda cuda_unfused fp64 (expanded)", 1e-12},
    {"expanded_tf32_weights", Entry::factored, Dtype::float32,
     {Algorithm::automatic, Precision::tf32}, few_rows(4, true),
     "cuda cuda_unfused fp32 (expanded)", 1e-5},
    {"partial_f32", Entry::partial, Dtype::float32, {}, Sizes{}, "cuda cuda_fused fp32", 1e-5},
    {"partial_f64", Entry::partial, Dtype::float64, {Algorithm::unfused}, few_rows(),
     "cuda cuda_unfused fp64", 1e-12},
};
// clang-format on

// The plan of `c` made from shapes alone: no array given except the optional ones whose presence
// the plan reads (queries, key_bias, the outputs asked).
template <class T>
AttentionPlan<T> plan_from_shapes(const StrategyCase& c, const DeviceCase<T>& d) {
  AttentionInput<T> shapes = d.input;
  shapes.cloud = nullptr;
  shapes.key_lengths = nullptr;
  shapes.layer.relevance = shapes.layer.content = shapes.layer.offset = nullptr;
  AttentionOutput<T> outputs = d.output;
  outputs.update = nullptr;
  if (c.entry == Entry::factored) {
    FactoredLayer<T> layer = d.layer;
    layer.query_factor = layer.key_factor = layer.content_up = layer.content_down = nullptr;
    return AttentionPlan<T>(shapes, layer, outputs, c.options);
  }
  if (c.entry == Entry::partial) {
    shapes.layer.offset = nullptr;
    return AttentionPlan<T>(shapes, PartialOutput<T>{}, c.options);
  }
  return AttentionPlan<T>(shapes, outputs, c.options);
}

template <class T>
void run_one_call(const StrategyCase& c, const DeviceCase<T>& d, void* workspace, std::size_t bytes,
                  cudaStream_t s) {
  switch (c.entry) {
    case Entry::dense:
      ASSERT_EQ(cuda::attend_workspace_size(d.input, d.output, c.options), bytes);
      cuda::attend_async(d.input, d.output, workspace, bytes, s, c.options);
      return;
    case Entry::factored:
      ASSERT_EQ(cuda::attend_factored_workspace_size(d.input, d.layer, d.output, c.options), bytes);
      cuda::attend_factored_async(d.input, d.layer, d.output, workspace, bytes, s, c.options);
      return;
    case Entry::partial:
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        ASSERT_EQ(cuda::attend_partial_workspace_size(d.input, c.options), bytes);
        AttentionInput<T> in = d.input;
        in.layer.offset = nullptr;
        cuda::attend_partial_async(in, d.partial, workspace, bytes, s, c.options);
      }
      return;
  }
}

template <class T>
void run_plan(const StrategyCase& c, const AttentionPlan<T>& plan, const DeviceCase<T>& d,
              void* workspace, std::size_t bytes, cudaStream_t s) {
  switch (c.entry) {
    case Entry::dense:
      plan.run(d.input, d.output, workspace, bytes, s);
      return;
    case Entry::factored:
      plan.run(d.input, d.layer, d.output, workspace, bytes, s);
      return;
    case Entry::partial: {
      AttentionInput<T> in = d.input;
      in.layer.offset = nullptr;
      plan.run(in, d.partial, workspace, bytes, s);
      return;
    }
  }
}

template <class T>
void check_strategy(const StrategyCase& c) {
  const bool partial = c.entry == Entry::partial;
  OwnedStream s;
  const HostCase<T> first(c.shape, 11, 0.7), second(c.shape, 23, 1.4);
  DeviceCase<T> planned_first(first, s.handle), planned_second(second, s.handle);
  DeviceCase<T> once_first(first, s.handle), once_second(second, s.handle);

  const AttentionPlan<T> plan = plan_from_shapes(c, planned_first);
  EXPECT_EQ(to_string(plan.route()), c.route);
  EXPECT_EQ(plan.key_splits(), c.key_splits);
  EXPECT_EQ(plan.device(), 0);
  const std::size_t bytes = plan.workspace_size();
  DeviceBuffer<unsigned char> workspace(bytes);
  run_plan(c, plan, planned_first, workspace.data(), bytes, s.handle);
  run_plan(c, plan, planned_second, workspace.data(), bytes, s.handle);
  run_one_call(c, once_first, workspace.data(), bytes, s.handle);
  run_one_call(c, once_second, workspace.data(), bytes, s.handle);

  const Got a = got_of(planned_first, partial, s.handle),
            b = got_of(planned_second, partial, s.handle);
  EXPECT_TRUE(a.bits == got_of(once_first, partial, s.handle).bits)
      << c.name << ": the plan's first run differs from the one-call form";
  EXPECT_TRUE(b.bits == got_of(once_second, partial, s.handle).bits)
      << c.name << ": the plan's second run differs from the one-call form";
  const Expected want_a = reference(first, partial), want_b = reference(second, partial);
  ASSERT_GT(relative_error(std::vector<double>(want_a.update.size(), 0.0), want_a.update), 0.5);
  EXPECT_TRUE(close_to(a.update, want_a.update, c.tolerance)) << c.name << " first";
  EXPECT_TRUE(close_to(a.lse, want_a.lse, c.tolerance)) << c.name << " first lse";
  EXPECT_TRUE(close_to(b.update, want_b.update, c.tolerance)) << c.name << " second";
  EXPECT_TRUE(close_to(b.entropy, want_b.entropy, 10 * c.tolerance)) << c.name << " second entropy";
  if (c.shape.weights) {
    EXPECT_TRUE(close_to(b.weights, want_b.weights, c.tolerance)) << c.name << " weights";
  }
  // Another beta and other arrays: the second run did not reuse the first's.
  EXPECT_GT(relative_error(a.update, b.update), 1e-2) << c.name;
}

class CudaPlanStrategies : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(CudaPlanStrategies, MadeOnceRunTwiceIsTheOneCallFormAndTheReference) {
  EMFLOW_REQUIRE_CUDA();
  const StrategyCase& c = GetParam();
  switch (c.storage) {
    case Dtype::float32:
      check_strategy<float>(c);
      return;
    case Dtype::float64:
      check_strategy<double>(c);
      return;
    case Dtype::bfloat16:
      check_strategy<bfloat16>(c);
      return;
    default:
      check_strategy<float16>(c);
      return;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaPlanStrategies, ::testing::ValuesIn(kStrategies),
                         [](const ::testing::TestParamInfo<StrategyCase>& info) {
                           return std::string(info.param.name);
                         });

// --- Sizes and can_implement: no device needed ---------------------------------------------------

TEST(CudaPlanSize, TheWorkspaceOfAPlanIsTheOneCallFormsAndNeedsNoDevice) {
  Sizes shape;
  const HostCase<float> dense(shape, 5, 1.0);
  AttentionInput<float> in = input_of<float>(shape, 1.0, dense.cloud.data(), nullptr, nullptr);
  in.layer = {shape.heads, dense.relevance.data(), dense.content.data()};
  std::vector<float> update(dense.update_size()), lse(dense.rows());
  const AttentionOutput<float> out{update.data(), lse.data()};
  std::size_t sizes[3];
  int k = 0;
  for (Algorithm a : {Algorithm::automatic, Algorithm::fused, Algorithm::unfused}) {
    sizes[k] = AttentionPlan<float>::get_workspace_size(in, out, {a});
    EXPECT_EQ(sizes[k], cuda::attend_workspace_size(in, out, PlanOptions{a}));
    ++k;
  }
  EXPECT_EQ(sizes[0], sizes[1]);  // automatic is fused here
  EXPECT_GT(sizes[2], sizes[1]);  // the unfused path keeps the scores
  // The factored float layer in fp32: the expanded operators before the dense workspace.
  const HostCase<float> factored(with(shape, 6), 5, 1.0);
  const FactoredLayer<float> layer{shape.heads,
                                   6,
                                   factored.query_factor.data(),
                                   factored.key_factor.data(),
                                   factored.up.data(),
                                   factored.down.data()};
  AttentionInput<float> bare = in;
  bare.layer = {};
  const std::size_t expanded = cuda::attend_factored_workspace_size(bare, layer, out);
  EXPECT_EQ(expanded, AttentionPlan<float>::get_workspace_size(bare, layer, out));
  EXPECT_GE(expanded, sizes[0] + 2 * sizeof(float) * shape.heads * shape.dim * shape.dim);
  // The deprecated positional forms are the same calls.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  EXPECT_EQ(cuda::attend_workspace_size(in, out, Algorithm::unfused), sizes[2]);
  EXPECT_EQ(cuda::attend_factored_workspace_size(bare, layer, out, Precision::fp32), expanded);
  EXPECT_EQ(cuda::attend_partial_workspace_size(in, Algorithm::unfused),
            cuda::attend_partial_workspace_size(in, PlanOptions{Algorithm::unfused}));
#pragma GCC diagnostic pop
}

TEST(CudaPlanSize, CanImplementSaysHowOrWhyNotWithoutThrowing) {
  Sizes shape;
  const HostCase<bfloat16> c(shape, 7, 1.0);
  AttentionInput<bfloat16> in = input_of<bfloat16>(shape, 1.0, c.cloud.data(), nullptr, nullptr);
  in.layer = {shape.heads, c.relevance.data(), c.content.data()};
  std::vector<bfloat16> update(c.update_size());
  std::vector<float> weights(c.rows() * shape.tokens);
  const AttentionOutput<bfloat16> with_weights{update.data(), nullptr, nullptr, weights.data()};
  // What the problem needs comes first, with or without a device: route()'s reason.
  const Route refused = AttentionPlan<bfloat16>::can_implement(in, with_weights);
  EXPECT_FALSE(refused.supported);
  EXPECT_FALSE(refused.device_missing);
  EXPECT_NE(refused.reason.find("do not form the weights"), std::string::npos) << refused.reason;
  AttentionInput<bfloat16> empty = in;
  empty.tokens = 0;
  const AttentionOutput<bfloat16> plain{update.data()};
  const Route invalid = AttentionPlan<bfloat16>::can_implement(empty, plain);
  EXPECT_FALSE(invalid.supported);
  EXPECT_NE(invalid.reason.find("'tokens'"), std::string::npos) << invalid.reason;
  const Route bad_precision =
      AttentionPlan<bfloat16>::can_implement(in, plain, {Algorithm::automatic, Precision::tf32});
  EXPECT_NE(bad_precision.reason.find("'precision'"), std::string::npos) << bad_precision.reason;
  EXPECT_THROW(AttentionPlan<bfloat16>::get_workspace_size(in, with_weights), Error);
  const Route fits = AttentionPlan<bfloat16>::can_implement(in, plain);
  std::string why;
  if (!cuda::device_available(&why)) {
    EXPECT_FALSE(fits.supported);
    EXPECT_TRUE(fits.device_missing) << fits.reason;
    EXPECT_TRUE(throws_error([&] { AttentionPlan<bfloat16> plan(in, plain); },
                             ErrorCode::unsupported, {why}));
    return;
  }
  EXPECT_EQ(to_string(fits), "cuda cuda_tensor_cores bf16");
}

// --- A run that is not its plan's, and bad workspaces ------------------------------------------

TEST(CudaPlan, ARunThatDoesNotMatchItsPlanIsRefusedByName) {
  EMFLOW_REQUIRE_CUDA();
  Sizes shape;
  shape.mask = Mask::sliding_window(5);
  OwnedStream s;
  const HostCase<float> host(shape, 31, 1.0);
  DeviceCase<float> d(host, s.handle);
  const AttentionPlan<float> plan(d.input, d.output);
  DeviceBuffer<unsigned char> workspace(plan.workspace_size() + 512);
  const std::size_t bytes = plan.workspace_size();
  const auto refused = [&](const AttentionInput<float>& input, const AttentionOutput<float>& output,
                           const std::string& needle) {
    EXPECT_TRUE(throws_error([&] { plan.run(input, output, workspace.data(), bytes, s.handle); },
                             ErrorCode::invalid_argument, {"cuda::AttentionPlan", needle}));
    EXPECT_FALSE(plan.matches(input, output)) << needle;
  };
  AttentionInput<float> fewer_tokens = d.input;
  fewer_tokens.tokens = 39;
  refused(fewer_tokens, d.output, "argument 'tokens' is 39, but the plan was made for 40");
  AttentionInput<float> more_heads = d.input;
  more_heads.layer.heads = 3;
  refused(more_heads, d.output, "argument 'heads' is 3");
  AttentionInput<float> wider_window = d.input;
  wider_window.mask = Mask::sliding_window(6);
  refused(wider_window, d.output, "is window:6, but the plan was made for window:5");
  AttentionInput<float> no_bias = d.input;
  no_bias.layer.key_bias = nullptr;
  refused(no_bias, d.output, "argument 'key_bias' is null, but the plan was made with it given");
  AttentionInput<float> cross = d.input;
  cross.queries = d.cloud.data();
  cross.query_tokens = shape.tokens;
  refused(cross, d.output, "argument 'queries' is given");
  AttentionOutput<float> without_lse = d.output;
  without_lse.lse = nullptr;
  refused(d.input, without_lse, "argument 'lse' is null, but the plan was made with it given");
  AttentionOutput<float> without_update = d.output;
  without_update.update = nullptr;
  refused(d.input, without_update, "update");
  AttentionInput<float> infinite_beta = d.input;
  infinite_beta.beta = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(
      throws_error([&] { plan.run(infinite_beta, d.output, workspace.data(), bytes, s.handle); },
                   ErrorCode::invalid_argument, {"'beta'"}));
  // Another form through this plan.
  EXPECT_TRUE(throws_error([&] { plan.run(d.input, d.partial, workspace.data(), bytes, s.handle); },
                           ErrorCode::invalid_argument, {"must be an AttentionOutput"}));
  FactoredLayer<float> layer{
      shape.heads, 4, d.relevance.data(), d.relevance.data(), d.content.data(), d.content.data()};
  AttentionInput<float> bare = d.input;
  bare.layer = {};
  EXPECT_TRUE(
      throws_error([&] { plan.run(bare, layer, d.output, workspace.data(), bytes, s.handle); },
                   ErrorCode::invalid_argument, {"made for a dense layer"}));
  // The workspace: null, too small, misaligned.
  EXPECT_TRUE(throws_error([&] { plan.run(d.input, d.output, nullptr, bytes, s.handle); },
                           ErrorCode::invalid_argument, {"'workspace' must not be null"}));
  EXPECT_TRUE(
      throws_error([&] { plan.run(d.input, d.output, workspace.data(), bytes - 1, s.handle); },
                   ErrorCode::invalid_argument, {"'workspace_bytes' must be >= "}));
  EXPECT_TRUE(
      throws_error([&] { plan.run(d.input, d.output, workspace.data() + 16, bytes, s.handle); },
                   ErrorCode::invalid_argument, {"aligned to 256"}));
  // A factored plan refuses another rank and the dense form.
  AttentionPlan<float> factored(bare, layer, d.output);
  FactoredLayer<float> wider = layer;
  wider.rank = 5;
  EXPECT_TRUE(throws_error(
      [&] { factored.run(bare, wider, d.output, workspace.data(), bytes, s.handle); },
      ErrorCode::invalid_argument, {"argument 'rank' is 5, but the plan was made for 4"}));
  EXPECT_TRUE(
      throws_error([&] { factored.run(d.input, d.output, workspace.data(), bytes, s.handle); },
                   ErrorCode::invalid_argument, {"made for a factored layer"}));
  // Nothing was enqueued by the refusals: the matching run is right.
  ASSERT_TRUE(plan.matches(d.input, d.output));
  plan.run(d.input, d.output, workspace.data(), bytes, s.handle);
  const Got got = got_of(d, false, s.handle);
  EXPECT_TRUE(close_to(got.update, reference(host, false).update, 1e-5));
  // A plan that was moved from is refused, not run.
  AttentionPlan<float> moved = std::move(factored);
  EXPECT_EQ(factored.workspace_size(), 0u);  // NOLINT(bugprone-use-after-move): the point
  EXPECT_GT(moved.workspace_size(), 0u);
  EXPECT_TRUE(
      throws_error([&] { factored.run(bare, layer, d.output, workspace.data(), bytes, s.handle); },
                   ErrorCode::invalid_argument, {"moved from"}));
}

// The blocking attend_factored on Device::cuda runs the same plan as the asynchronous call: the
// same bits, in float with fp32 products and in double.
template <class T>
void blocking_factored_is_async(double tolerance) {
  Sizes shape = few_rows(5);
  shape.queries = 4;
  const HostCase<T> host(shape, 41, 0.9);
  OwnedStream s;
  DeviceCase<T> d(host, s.handle);
  const std::size_t bytes = cuda::attend_factored_workspace_size(d.input, d.layer, d.output);
  DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_factored_async(d.input, d.layer, d.output, workspace.data(), bytes, s.handle);
  const Got async = got_of(d, false, s.handle);
  AttentionInput<T> in = input_of<T>(shape, host.beta, host.cloud.data(), host.queries.data(),
                                     host.key_lengths.data());
  const FactoredLayer<T> layer{
      shape.heads,    shape.rank,       host.query_factor.data(), host.key_factor.data(),
      host.up.data(), host.down.data(), host.bias.data(),         host.offset.data()};
  std::vector<T> update(host.update_size(), std::numeric_limits<T>::quiet_NaN());
  std::vector<T> lse(host.rows(), std::numeric_limits<T>::quiet_NaN()), entropy(lse);
  attend_factored(in, layer, {update.data(), lse.data(), entropy.data()}, {Device::cuda});
  EXPECT_EQ(std::vector<double>(update.begin(), update.end()), async.update);
  EXPECT_EQ(std::vector<double>(lse.begin(), lse.end()), async.lse);
  EXPECT_TRUE(close_to(async.update, reference(host, false).update, tolerance));
}

TEST(CudaPlanFactored, BlockingAndAsyncFormsComputeTheSameInFloatAndDouble) {
  EMFLOW_REQUIRE_CUDA();
  blocking_factored_is_async<float>(1e-5);
  blocking_factored_is_async<double>(1e-12);
}

// --- The device binding, on two emulated devices ------------------------------------------------

#if defined(EMFLOW_CUDA_EMULATION)

// Presents `models` as the devices for one test, and the one default device again after it.
class PresentedDevices {
 public:
  explicit PresentedDevices(std::vector<emu::DeviceModel> models) {
    emu::present_devices(std::move(models));
  }
  ~PresentedDevices() { emu::present_devices({emu::DeviceModel{}}); }
  PresentedDevices(const PresentedDevices&) = delete;
  PresentedDevices& operator=(const PresentedDevices&) = delete;
};

int current_device() {
  int device = -1;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  return device;
}

TEST(CudaPlanDevices, ARunMakesThePlansDeviceCurrentAndRestoresTheCallers) {
  PresentedDevices devices({emu::DeviceModel{}, emu::DeviceModel{}});
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  OwnedStream s;  // of device 1, as every array below
  const HostCase<float> host(few_rows(0, true), 51, 1.0);
  DeviceCase<float> d(host, s.handle);
  // The unfused path: cuBLAS's handle of device 1 as well as the kernels.
  const AttentionPlan<float> plan(d.input, d.output, {Algorithm::unfused});
  EXPECT_EQ(plan.device(), 1);
  DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  plan.run(d.input, d.output, workspace.data(), workspace.size(), s.handle);
  EXPECT_EQ(current_device(), 0) << "the caller's device is current again";
  const Got got = got_of(d, false, s.handle);
  const Expected want = reference(host, false);
  EXPECT_TRUE(close_to(got.update, want.update, 1e-5));
  EXPECT_TRUE(close_to(got.weights, want.weights, 1e-5));
  // The one-call form plans on the current device (0) and refuses the arrays of device 1.
  EXPECT_TRUE(throws_error(
      [&] { cuda::attend_async(d.input, d.output, workspace.data(), workspace.size(), s.handle); },
      ErrorCode::invalid_argument,
      {"argument 'cloud' is memory of device 1, but the current device is 0"}));
  // A plan of device 0 refuses a stream of device 1 before enqueuing anything.
  const AttentionPlan<float> on_zero(d.input, d.output, {Algorithm::unfused});
  EXPECT_EQ(on_zero.device(), 0);
  EXPECT_TRUE(throws_error(
      [&] { on_zero.run(d.input, d.output, workspace.data(), workspace.size(), s.handle); },
      ErrorCode::invalid_argument,
      {"argument 'stream' belongs to device 1, but the plan was made on device 0"}));
  EXPECT_EQ(current_device(), 0);
  ASSERT_EQ(cudaStreamSynchronize(s.handle), cudaSuccess);
}

// The fused kernel at dim 64 and the TF32 tensor-core kernel need more than the default 48 KiB of
// dynamic shared memory: each plan allows it on its own device. cudaDeviceReset clears a device's
// attributes: a plan made before it fails to launch there (as a GPU's would), one made after runs.
TEST(CudaPlanDevices, EachPlanAllowsItsKernelsTheirSharedMemoryOnItsDevice) {
  PresentedDevices devices({emu::DeviceModel{}, emu::DeviceModel{}});
  for (const PlanOptions& options :
       {PlanOptions{Algorithm::fused}, PlanOptions{Algorithm::automatic, Precision::tf32}}) {
    Sizes shape;
    shape.batch = 1;
    shape.tokens = 20;
    shape.dim = 64;
    const HostCase<float> host(shape, 61, 1.0);
    const Expected want = reference(host, false);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    OwnedStream zero;
    DeviceCase<float> on_zero(host, zero.handle);
    const AttentionPlan<float> first(on_zero.input, on_zero.output, options);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    OwnedStream one;
    DeviceCase<float> on_one(host, one.handle);
    const AttentionPlan<float> second(on_one.input, on_one.output, options);
    DeviceBuffer<unsigned char> workspace_one(second.workspace_size());
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    DeviceBuffer<unsigned char> workspace_zero(first.workspace_size());
    first.run(on_zero.input, on_zero.output, workspace_zero.data(), workspace_zero.size(),
              zero.handle);
    second.run(on_one.input, on_one.output, workspace_one.data(), workspace_one.size(), one.handle);
    const double tolerance = options.precision == Precision::tf32 ? 1e-2 : 1e-5;
    EXPECT_TRUE(close_to(got_of(on_zero, false, zero.handle).update, want.update, tolerance));
    EXPECT_TRUE(close_to(got_of(on_one, false, one.handle).update, want.update, tolerance));

    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
    EXPECT_TRUE(throws_error(
        [&] {
          second.run(on_one.input, on_one.output, workspace_one.data(), workspace_one.size(),
                     one.handle);
        },
        ErrorCode::device, {"launch of", "failed"}));
    ASSERT_EQ(cudaStreamSynchronize(one.handle), cudaSuccess);
    const AttentionPlan<float> again(on_one.input, on_one.output, options);
    again.run(on_one.input, on_one.output, workspace_one.data(), workspace_one.size(), one.handle);
    EXPECT_TRUE(close_to(got_of(on_one, false, one.handle).update, want.update, tolerance));
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
}

// A tile that does not fit the device's opt-in shared memory per block is refused by name when
// the plan is made, and said by can_implement: TF32 at dim 256 needs 195.25 KiB, the fused kernel
// at dim 256 150 KiB, against the 99 KiB of a device like sm_86 / sm_89; the same for the SDPA
// operator's plan.
TEST(CudaPlanDevices, ATileBeyondTheDevicesSharedMemoryIsRefusedByName) {
  PresentedDevices devices({emu::DeviceModel{}, emu::DeviceModel{101376}});
  Sizes shape;
  shape.batch = 1;
  shape.tokens = 8;
  shape.dim = 256;
  shape.heads = 1;
  const AttentionInput<float> in = input_of<float>(shape, 1.0, nullptr, nullptr, nullptr);
  const AttentionOutput<float> out{};
  const PlanOptions tf32{Algorithm::automatic, Precision::tf32};
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_TRUE(throws_error([&] { AttentionPlan<float> plan(in, out, tf32); },
                           ErrorCode::unsupported,
                           {"the tensor-core attention needs 199936 bytes of shared memory",
                            "device 1 allows 101376", "Precision::fp32"}));
  const Route refused = AttentionPlan<float>::can_implement(in, out, tf32);
  EXPECT_FALSE(refused.supported);
  EXPECT_NE(refused.reason.find("199936"), std::string::npos) << refused.reason;
  EXPECT_TRUE(throws_error(
      [&] { AttentionPlan<float> plan(in, out, {Algorithm::fused}); }, ErrorCode::unsupported,
      {"the fused kernel needs", "device 1 allows 101376", "Algorithm::unfused"}));
  // What fits there is made; the same problems fit device 0 (227 KiB); sizes need no device.
  AttentionInput<bfloat16> half = input_of<bfloat16>(shape, 1.0, nullptr, nullptr, nullptr);
  half.dim = 128;
  EXPECT_EQ(AttentionPlan<bfloat16>(half, AttentionOutput<bfloat16>{}).device(), 1);
  EXPECT_EQ(AttentionPlan<float>(in, out, {Algorithm::unfused}).device(), 1);
  EXPECT_GT(AttentionPlan<float>::get_workspace_size(in, out, tf32), 0u);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_TRUE(AttentionPlan<float>::can_implement(in, out, tf32).supported);
  EXPECT_EQ(AttentionPlan<float>(in, out, tf32).device(), 0);

  // The SDPA operator's plan checks its kernel the same way (TF32 at rank 256), before any
  // launch: refused on device 1, made on device 0.
  SdpaInput<float> sdpa;
  sdpa.query_tokens = sdpa.tokens = 8;
  sdpa.rank = sdpa.value_rank = 256;
  const SdpaOutput<float> sdpa_out{};
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_TRUE(throws_error([&] { AttentionPlan<float> plan(sdpa, sdpa_out, tf32); },
                           ErrorCode::unsupported,
                           {"the tensor-core attention needs 199936 bytes of shared memory",
                            "device 1 allows 101376", "Precision::fp32 (the float32 kernel)"}));
  const Route sdpa_refused = AttentionPlan<float>::can_implement(sdpa, sdpa_out, tf32);
  EXPECT_FALSE(sdpa_refused.supported);
  EXPECT_NE(sdpa_refused.reason.find("199936"), std::string::npos) << sdpa_refused.reason;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(AttentionPlan<float>(sdpa, sdpa_out, tf32).device(), 0);
}

// The device decode cache belongs to the device that was current when it was made: its calls run
// there whatever device is current, and leave the caller's current; they allocate nothing.
TEST(CudaPlanDevices, TheDecodeCacheRunsOnItsOwnDeviceAndAllocatesOnlyWhenMade) {
  PresentedDevices devices({emu::DeviceModel{}, emu::DeviceModel{}});
  const std::int64_t d = 8, heads = 2;
  const std::vector<float> relevance = random_of<float>(heads * d * d, 71, 0.7);
  const std::vector<float> content = random_of<float>(heads * d * d, 72, 0.7);
  const std::vector<float> bias = random_of<float>(heads * d, 73, 0.5);
  const std::vector<float> tokens = random_of<float>(300 * d, 74, 1.0);
  const LayerOperators<float> layer{heads, relevance.data(), content.data(), bias.data(), nullptr};
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  DecodeCache on_device(layer, d, 0.8, {Device::cuda, 300});
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DecodeCache on_host(layer, d, 0.8);
  const long allocations = emu::counters.allocations;
  // A prompt of 270 tokens attended at once (more queries than one run of the cache's plan
  // takes), then tokens one by one.
  const std::vector<std::pair<std::int64_t, std::int64_t>> calls = {{0, 270}, {270, 1}, {271, 1}};
  for (const auto& [first, count] : calls) {
    on_device.append(tokens.data() + first * d, count);
    on_host.append(tokens.data() + first * d, count);
    EXPECT_EQ(current_device(), 0);
    const float* queries = tokens.data() + first * d;
    std::vector<float> update(count * d, std::nanf("")), lse(heads * count, std::nanf(""));
    std::vector<float> entropy(lse), want(update), want_lse(lse), want_entropy(lse);
    on_device.attend(queries, count, Mask::causal(),
                     {update.data(), lse.data(), entropy.data(), nullptr});
    on_host.attend(queries, count, Mask::causal(),
                   {want.data(), want_lse.data(), want_entropy.data(), nullptr});
    EXPECT_EQ(current_device(), 0);
    EXPECT_TRUE(close_to(update, want, 1e-5)) << count << " queries at " << first;
    EXPECT_TRUE(close_to(lse, want_lse, 1e-5)) << count << " queries at " << first;
    EXPECT_TRUE(close_to(entropy, want_entropy, 1e-4)) << count << " queries at " << first;
  }
  EXPECT_EQ(emu::counters.allocations, allocations) << "cudaMalloc inside append or attend";
}

#endif  // EMFLOW_CUDA_EMULATION

}  // namespace
}  // namespace emflow::testing

#endif  // EMFLOW_WITH_CUDA

// Every host entry point asks route() (emflow/capability.hpp) and runs where it says: attend,
// attend_factored, attend_partial and the decode cache are called with every storage type
// (float64, float32, bfloat16, float16), every precision the type may be asked for, on every
// device, and each outcome is compared with route()'s answer for the same call: a supported
// route runs (the route recorded by the entry point is the one route() names, and the outputs,
// poisoned with NaN before, meet the double reference of the stored values), a refused one throws
// ErrorCode::unsupported with route()'s reason, word for word. On a machine without a GPU the
// cuda device is refused as missing; under the CUDA emulation its routes run.
//
// A second group checks the route by what it computes, not by the record: the bits of a call
// are those of the kernel the route names, called directly (the engine for finite input, the
// reference for a NaN, the float engine on the widened values for the 16-bit types).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/stored.hpp"
#include "common/testing.hpp"
#include "core/backends.hpp"
#include "core/dispatch.hpp"
#include "core/low_precision.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"

namespace emflow {
namespace {

using testing::close_to;
using testing::throws_error;

constexpr Device kDevices[] = {Device::automatic, Device::cpu, Device::reference, Device::cuda};

using testing::stored;
using testing::value_of;
using testing::values_of;

/// The precisions T may be asked for: fp32, its own, and tf32 for float.
template <class T>
std::vector<Precision> precisions() {
  if constexpr (std::is_same_v<T, float>) {
    return {Precision::fp32, Precision::tf32};
  } else if constexpr (is_16bit_v<T>) {
    return {Precision::fp32, storage_precision<T>()};
  } else {
    return {Precision::fp32};
  }
}

/// How far a routed result may be from the double reference of the stored inputs: far looser
/// than each kernel's own bound (the accuracy suites hold those), tight enough that an output
/// left untouched (NaN) or zero fails.
template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  if constexpr (std::is_same_v<T, float>) return 1e-4;
  if constexpr (std::is_same_v<T, float16>) return 1e-2;
  return 5e-2;
}

void expect_same_route(const Route& got, const Route& want, const std::string& where) {
  EXPECT_EQ(got.supported, want.supported) << where;
  EXPECT_EQ(got.device, want.device) << where << ": " << to_string(got);
  EXPECT_EQ(got.kernel, want.kernel) << where << ": " << to_string(got);
  EXPECT_EQ(got.products, want.products) << where << ": " << to_string(got);
  EXPECT_EQ(got.computes, want.computes) << where << ": " << to_string(got);
  EXPECT_EQ(got.expanded, want.expanded) << where << ": " << to_string(got);
  EXPECT_EQ(got.reason, want.reason) << where;
}

/// Runs `call` and compares its outcome with `want`: no error and the route recorded when
/// supported, ErrorCode::unsupported with exactly want.reason otherwise. Returns whether it ran.
template <class Call>
bool matches_route(Call&& call, const Route& want, const std::string& where) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_FALSE(want.supported) << where << ": " << e.what();
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << where << ": " << e.what();
    EXPECT_EQ(std::string(e.what()), want.reason) << where;
    expect_same_route(detail::last_route(), want, where);
    return false;
  }
  EXPECT_TRUE(want.supported) << where << ": ran, but route() says " << to_string(want);
  expect_same_route(detail::last_route(), want, where);
  return want.supported;
}

/// One seeded problem in storage type T: two clouds of 7 tokens in R^5 (the second with 4 real
/// tokens), two heads, causal, key bias and offset; a factored layer of rank 3 over the same
/// clouds; lse and entropy asked for.
template <class T>
struct Case {
  static constexpr std::int64_t B = 2, N = 7, d = 5, H = 2, r = 3;
  std::vector<T> cloud, relevance, content, bias, shift, A, Bf, U, V;
  std::vector<std::int64_t> lengths{7, 4};
  std::vector<T> update;
  std::vector<Stat<T>> lse, entropy;
  std::vector<T> heads;  // partial states

  explicit Case(std::uint64_t seed = 3) {
    const testing::Problem p = testing::Problem::random(B, N, d, H, seed);
    cloud = stored<T>(p.cloud);
    relevance = stored<T>(p.relevance);
    content = stored<T>(p.content);
    bias = stored<T>(p.bias);
    shift = stored<T>(p.shift);
    const double s = 1.0 / std::sqrt(static_cast<double>(r));
    A = stored<T>(testing::uniform(H * r * d, seed + 10, -s, s));
    Bf = stored<T>(testing::uniform(H * r * d, seed + 11, -s, s));
    U = stored<T>(testing::uniform(H * d * r, seed + 12, -s, s));
    V = stored<T>(testing::uniform(H * r * d, seed + 13, -s, s));
    poison();
  }

  void poison() {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    update.assign(B * N * d, stored<T>(nan));
    heads.assign(B * H * N * d, stored<T>(nan));
    lse.assign(B * H * N, static_cast<Stat<T>>(nan));
    entropy.assign(B * H * N, static_cast<Stat<T>>(nan));
  }

  AttentionInput<T> input(bool factored = false) const {
    AttentionInput<T> in;
    in.cloud = cloud.data();
    in.batch = B;
    in.tokens = N;
    in.dim = d;
    in.beta = 0.8;
    in.mask = Mask::causal();
    in.key_lengths = lengths.data();
    if (!factored) in.layer = {H, relevance.data(), content.data(), bias.data(), shift.data()};
    return in;
  }
  FactoredLayer<T> factored() const {
    return {H, r, A.data(), Bf.data(), U.data(), V.data(), bias.data(), shift.data()};
  }
  AttentionOutput<T> output() { return {update.data(), lse.data(), entropy.data()}; }
  PartialOutput<T> partial() { return {heads.data(), lse.data(), entropy.data()}; }
};

/// The double reference of the values a Case<T> stores.
template <class T>
struct Expected {
  Case<double> wide;
  std::vector<double> update, lse, entropy, heads;

  explicit Expected(const Case<T>& c) {
    wide.cloud = values_of(c.cloud);
    wide.relevance = values_of(c.relevance);
    wide.content = values_of(c.content);
    wide.bias = values_of(c.bias);
    wide.shift = values_of(c.shift);
    wide.A = values_of(c.A);
    wide.Bf = values_of(c.Bf);
    wide.U = values_of(c.U);
    wide.V = values_of(c.V);
  }
  void attend(bool factored) {
    const ExecutionOptions on_reference{Device::reference};
    if (factored) {
      attend_factored(wide.input(true), wide.factored(), wide.output(), on_reference);
    } else {
      emflow::attend(wide.input(), wide.output(), on_reference);
    }
    keep();
  }
  void partial() {
    attend_partial(wide.input(), wide.partial(), {Device::reference});
    keep();
  }
  void keep() {
    update = wide.update;
    lse = wide.lse;
    entropy = wide.entropy;
    heads = wide.heads;
  }
};

template <class T>
std::string where(const char* entry, Device device, Precision precision) {
  return std::string(entry) + "<" + to_string(dtype_of<T>()) + "> on " + to_string(device) +
         " with " + to_string(precision);
}

template <class T>
void attend_everywhere() {
  for (const bool factored : {false, true}) {
    Case<T> c;
    Expected<T> want_values(c);
    want_values.attend(factored);
    for (Precision precision : precisions<T>()) {
      for (Device device : kDevices) {
        const std::string at = where<T>(factored ? "attend_factored" : "attend", device, precision);
        c.poison();
        const ExecutionOptions options{device, 0, precision};
        const AttentionInput<T> in = c.input(factored);
        const AttentionOutput<T> out = c.output();
        Problem problem =
            factored ? describe(in, c.factored(), out, options) : describe(in, out, options);
        const Route want = route(problem, device, factored ? "attend_factored" : "attend");
        const bool ran = matches_route(
            [&] {
              if (factored) {
                attend_factored(in, c.factored(), out, options);
              } else {
                attend(in, out, options);
              }
            },
            want, at);
        if (!ran) continue;
        EXPECT_TRUE(close_to(values_of(c.update), want_values.update, tolerance<T>())) << at;
        EXPECT_TRUE(close_to(c.lse, want_values.lse, tolerance<T>())) << at;
        EXPECT_TRUE(close_to(c.entropy, want_values.entropy, 10 * tolerance<T>())) << at;
      }
    }
  }
}

template <class T>
void partial_everywhere() {
  Case<T> c;
  Expected<T> want_values(c);
  if constexpr (!is_16bit_v<T>) want_values.partial();
  for (Precision precision : precisions<T>()) {
    for (Device device : kDevices) {
      const std::string at = where<T>("attend_partial", device, precision);
      c.poison();
      const ExecutionOptions options{device, 0, precision};
      const AttentionInput<T> in = c.input();
      const PartialOutput<T> out = c.partial();
      const Route want = route(describe(in, out, options), device, "attend_partial");
      if (is_16bit_v<T>) {
        EXPECT_FALSE(want.supported) << at;
      }
      if (!matches_route([&] { attend_partial(in, out, options); }, want, at)) continue;
      EXPECT_TRUE(close_to(values_of(c.heads), want_values.heads, tolerance<T>())) << at;
      EXPECT_TRUE(close_to(c.lse, want_values.lse, tolerance<T>())) << at;
    }
  }
}

TEST(EntryRoutes, AttendAndAttendFactoredRunWhereRouteSays) {
  attend_everywhere<double>();
  attend_everywhere<float>();
  attend_everywhere<bfloat16>();
  attend_everywhere<float16>();
}

TEST(EntryRoutes, AttendPartialRunsWhereRouteSaysAndRefusesTheSixteenBitTypesWithItsReason) {
  partial_everywhere<double>();
  partial_everywhere<float>();
  partial_everywhere<bfloat16>();
  partial_everywhere<float16>();
}

// The decode cache asks route() once, in its constructor: where it lives (device()) and which
// kernel holds it follow the answer, and the cache then attends as attend does over its tokens.
template <class T>
void decode_everywhere() {
  Case<T> c;
  for (const bool factored : {false, true}) {
    for (Device device : kDevices) {
      for (std::int64_t capacity : {0, 16}) {
        if (device == Device::cuda && capacity == 0) continue;  // invalid_argument, below
        for (Precision precision : precisions<T>()) {
          const DecodeOptions options{device, capacity, precision};
          const std::string at =
              where<T>(factored ? "factored DecodeCache" : "DecodeCache", device, precision) +
              " capacity " + std::to_string(capacity);
          const LayerOperators<T> dense{c.H, c.relevance.data(), c.content.data(), c.bias.data(),
                                        c.shift.data()};
          const Problem problem =
              factored ? describe(c.factored(), c.d, options) : describe(dense, c.d, options);
          const Route want = route(problem, device, "DecodeCache: argument 'device'");
          std::unique_ptr<BasicDecodeCache<T>> cache;
          const bool made = matches_route(
              [&] {
                cache = factored
                            ? std::make_unique<BasicDecodeCache<T>>(c.factored(), c.d, 0.8, options)
                            : std::make_unique<BasicDecodeCache<T>>(dense, c.d, 0.8, options);
              },
              want, at);
          if (!made) continue;
          EXPECT_EQ(cache->device(), want.device) << at;
          // Decoding cloud 0 in one block equals attend over it.
          cache->append(c.cloud.data(), c.N);
          std::vector<T> update(c.N * c.d, stored<T>(NAN));
          std::vector<Stat<T>> lse(c.H * c.N, NAN);
          cache->attend(c.cloud.data(), c.N, Mask::causal(),
                        AttentionOutput<T>{update.data(), lse.data()});
          Case<T> one = c;
          one.poison();
          AttentionInput<T> in = one.input(factored);
          in.batch = 1;
          in.key_lengths = nullptr;
          const AttentionOutput<T> out = one.output();
          if (factored) {
            attend_factored(in, one.factored(), out, {Device::reference});
          } else {
            attend(in, out, {Device::reference});
          }
          one.update.resize(update.size());
          EXPECT_TRUE(close_to(update, one.update, 1e-4)) << at;
        }
      }
    }
  }
}

TEST(EntryRoutes, DecodeCachesLiveWhereRouteSays) {
  decode_everywhere<double>();
  decode_everywhere<float>();
  // The 16-bit types have no cache (BasicDecodeCache is instantiated for float and double), and
  // route() says so for every device.
  for (Dtype storage : {Dtype::bfloat16, Dtype::float16}) {
    Problem p;
    p.operation = Operation::decode;
    p.storage = storage;
    p.dim = 4;
    p.tokens = 16;
    for (Device device : kDevices) EXPECT_FALSE(route(p, device).supported) << to_string(device);
  }
}

TEST(EntryRoutes, DecodeCachesDefaultToAutomaticAndRefuseWhatNoDeviceHolds) {
  EXPECT_EQ(DecodeOptions{}.device, Device::automatic);
  const Case<float> c;
  const LayerOperators<float> dense{c.H, c.relevance.data(), c.content.data()};
  // Without a capacity the GPU cannot hold it: automatic stays on the host.
  EXPECT_EQ(DecodeCache(dense, c.d).device(), Device::cpu);
  EXPECT_TRUE(throws_error([&] { DecodeCache bad(dense, c.d, 1.0, {Device::reference}); },
                           ErrorCode::unsupported, {"'device'", "reference holds no cache"}));
  EXPECT_TRUE(throws_error(
      [&] {
        DecodeCache bad(dense, c.d, 1.0, {Device::cpu, -1});
      },
      ErrorCode::invalid_argument, {"'capacity'"}));
  EXPECT_TRUE(throws_error(
      [&] {
        DecodeCache bad(dense, c.d, 1.0, {Device::cpu, 0, Precision::bf16});
      },
      ErrorCode::invalid_argument, {"'precision'", "bf16 needs bfloat16 storage, got float32"}));
  // A capacity on the host is a limit.
  DecodeCache limited(dense, c.d, 1.0, {Device::cpu, 3});
  limited.append(c.cloud.data(), 3);
  EXPECT_TRUE(throws_error([&] { limited.append(c.cloud.data(), 1); }, ErrorCode::invalid_argument,
                           {"'count'", "capacity of 3"}));
}

// --- The route by what it computes ---------------------------------------------------------

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(EntryRoutesByBits, FloatOnTheCpuIsTheEngineAndANaNSendsItToTheReference) {
  for (const bool nan : {false, true}) {
    Case<float> c;
    if (nan) c.cloud[3 * c.d + 1] = NAN;  // token 3 of cloud 0, seen by queries 3 to 6
    Case<float> direct = c;
    attend(c.input(), c.output(), {Device::cpu, 1});
    EXPECT_EQ(detail::last_route().kernel, nan ? Kernel::reference : Kernel::cpu_fused);
    if (nan) {
      detail::reference_attend(direct.input(), direct.output());
    } else {
      detail::cpu_attend(direct.input(), direct.output(), 1);
    }
    EXPECT_TRUE(same_bits(c.update, direct.update)) << "nan " << nan;
    EXPECT_TRUE(same_bits(c.lse, direct.lse)) << "nan " << nan;
    // Not vacuous: the engine and the reference differ in the last bits somewhere, and the NaN
    // reaches the queries that see the token.
    if (nan) {
      EXPECT_TRUE(std::isnan(c.update[3 * c.d])) << c.update[3 * c.d];
      EXPECT_FALSE(std::isnan(c.update[2 * c.d])) << c.update[2 * c.d];
    }
  }
  Case<float> engine, reference;
  detail::cpu_attend(engine.input(), engine.output(), 1);
  detail::reference_attend(reference.input(), reference.output());
  EXPECT_FALSE(same_bits(engine.update, reference.update));
}

TEST(EntryRoutesByBits, FactoredFloatOnTheCpuIsTheRankREngineOrTheExpandedReference) {
  for (const bool nan : {false, true}) {
    Case<float> c;
    if (nan) c.V[4] = INFINITY;
    Case<float> direct = c;
    attend_factored(c.input(true), c.factored(), c.output(), {Device::cpu, 1});
    EXPECT_EQ(detail::last_route().kernel, nan ? Kernel::reference : Kernel::cpu_fused);
    EXPECT_EQ(detail::last_route().expanded, nan);
    if (nan) {
      // The expansion in double, then the reference on the double values, rounded to float.
      const detail::ExpandedLayer<double> dense(direct.factored(), direct.d);
      const std::vector<double> cloud(direct.cloud.begin(), direct.cloud.end());
      AttentionInput<double> in;
      in.cloud = cloud.data();
      in.batch = direct.B;
      in.tokens = direct.N;
      in.dim = direct.d;
      in.beta = 0.8;
      in.mask = Mask::causal();
      in.key_lengths = direct.lengths.data();
      in.layer = dense.operators();
      std::vector<double> update(direct.update.size()), lse(direct.lse.size()),
          entropy(direct.entropy.size());
      detail::reference_attend(in,
                               AttentionOutput<double>{update.data(), lse.data(), entropy.data()});
      direct.update.assign(update.begin(), update.end());
      direct.lse.assign(lse.begin(), lse.end());
    } else {
      detail::cpu_attend_factored(direct.input(true), direct.factored(), direct.output(), 1);
    }
    EXPECT_TRUE(same_bits(c.update, direct.update)) << "nan " << nan;
    EXPECT_TRUE(same_bits(c.lse, direct.lse)) << "nan " << nan;
  }
}

TEST(EntryRoutesByBits, PartialFloatOnTheCpuIsTheEngineOrForANaNTheReference) {
  for (const bool nan : {false, true}) {
    Case<float> c;
    if (nan) c.cloud[7] = NAN;  // a key of the first cloud
    Case<float> direct = c;
    attend_partial(c.input(), c.partial(), {Device::cpu, 1});
    EXPECT_EQ(detail::last_route().kernel, nan ? Kernel::reference : Kernel::cpu_fused);
    if (nan) {
      detail::reference_partial(direct.input(), direct.partial());
    } else {
      detail::cpu_partial(direct.input(), direct.partial(), 1);
    }
    EXPECT_TRUE(same_bits(c.heads, direct.heads)) << "nan " << nan;
    EXPECT_TRUE(same_bits(c.lse, direct.lse)) << "nan " << nan;
  }
}

// 16-bit storage on the CPU without AVX512-BF16 (or float16 anywhere): the float engine on the
// stored values widened exactly, the update rounded to the storage type once.
template <class T>
void sixteen_bit_is_the_widened_engine() {
  Case<T> c;
  attend(c.input(), c.output(), {Device::cpu, 1});
  const Route& taken = detail::last_route();
  if (taken.kernel == Kernel::cpu_bf16) return;  // the AVX512-BF16 products: its own suite
  ASSERT_EQ(taken.kernel, Kernel::cpu_fused) << to_string(taken);
  Case<float> wide;
  wide.cloud.assign(c.cloud.size(), 0.0f);
  for (std::size_t i = 0; i < c.cloud.size(); ++i) wide.cloud[i] = to_float(c.cloud[i]);
  for (std::size_t i = 0; i < c.relevance.size(); ++i) {
    wide.relevance[i] = to_float(c.relevance[i]);
    wide.content[i] = to_float(c.content[i]);
  }
  for (std::size_t i = 0; i < c.bias.size(); ++i) wide.bias[i] = to_float(c.bias[i]);
  for (std::size_t i = 0; i < c.shift.size(); ++i) wide.shift[i] = to_float(c.shift[i]);
  detail::cpu_attend(wide.input(), wide.output(), 1);
  EXPECT_TRUE(same_bits(c.lse, wide.lse));
  int wrong = 0;
  for (std::size_t i = 0; i < c.update.size(); ++i) {
    wrong += stored<T>(wide.update[i]).bits != c.update[i].bits;
  }
  EXPECT_EQ(wrong, 0);
}

TEST(EntryRoutesByBits, SixteenBitStorageOnTheCpuIsTheFloatEngineOnTheStoredValues) {
  sixteen_bit_is_the_widened_engine<bfloat16>();
  sixteen_bit_is_the_widened_engine<float16>();
}

}  // namespace
}  // namespace emflow

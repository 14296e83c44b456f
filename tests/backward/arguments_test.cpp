// Every refusal of the SDPA-shaped operator and of the layers' backward passes names the argument
// and what was expected (include/emflow/sdpa.hpp, include/emflow/backward.hpp): shapes, grouped
// heads, null pointers, overlapping outputs, the scale, lengths, threads, devices, precisions.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/backward.hpp"
#include "emflow/capability.hpp"
#include "emflow/sdpa.hpp"

namespace emflow {
namespace {

using testing::throws_error;

/// A small valid SDPA call: B = 2, Hq = 4, Hkv = 2, Nq = 3, Nk = 7, r = 5, rv = 6.
struct SdpaCall {
  std::vector<float> Q = std::vector<float>(2 * 4 * 3 * 5, 0.5f);
  std::vector<float> K = std::vector<float>(2 * 2 * 7 * 5, 0.25f);
  std::vector<float> V = std::vector<float>(2 * 2 * 7 * 6, 1.0f);
  std::vector<float> O = std::vector<float>(2 * 4 * 3 * 6), lse = std::vector<float>(2 * 4 * 3),
                     H = std::vector<float>(2 * 4 * 3);
  std::vector<float> dO = std::vector<float>(2 * 4 * 3 * 6, 1.0f),
                     dlse = std::vector<float>(2 * 4 * 3, 1.0f);
  std::vector<float> dQ = std::vector<float>(Q.size()), dK = std::vector<float>(K.size()),
                     dV = std::vector<float>(V.size());
  std::vector<std::int64_t> key_lengths = {7, 4};
  SdpaInput<float> in;
  SdpaCall() {
    in.queries = Q.data();
    in.keys = K.data();
    in.values = V.data();
    in.batch = 2;
    in.query_heads = 4;
    in.kv_heads = 2;
    in.query_tokens = 3;
    in.tokens = 7;
    in.rank = 5;
    in.value_rank = 6;
    in.scale = 0.5;
  }
  void forward(const SdpaInput<float>& input, const SdpaOutput<float>& out,
               const ExecutionOptions& options = {Device::cpu, 1}) {
    sdpa_attend(input, out, options);
  }
  SdpaOutput<float> outputs() { return {O.data(), lse.data(), H.data()}; }
  SdpaSaved<float> saved() { return {O.data(), lse.data(), H.data()}; }
  UpstreamGradients<float> upstream() { return {dO.data(), dlse.data(), nullptr}; }
  SdpaGradientOutput<float> gradients() { return {dQ.data(), dK.data(), dV.data(), nullptr}; }
};

TEST(SdpaArguments, AValidCallRuns) {
  SdpaCall call;
  call.in.key_lengths = call.key_lengths.data();
  call.forward(call.in, call.outputs());
  sdpa_backward(call.in, call.saved(), call.upstream(), call.gradients(), {Device::cpu, 1});
}

TEST(SdpaArguments, ShapesAreNamed) {
  for (const char* field :
       {"batch", "query_heads", "kv_heads", "query_tokens", "tokens", "rank", "value_rank"}) {
    SdpaCall call;
    SdpaInput<float> in = call.in;
    const std::string name = field;
    std::int64_t* extent = name == "batch"          ? &in.batch
                           : name == "query_heads"  ? &in.query_heads
                           : name == "kv_heads"     ? &in.kv_heads
                           : name == "query_tokens" ? &in.query_tokens
                           : name == "tokens"       ? &in.tokens
                           : name == "rank"         ? &in.rank
                                                    : &in.value_rank;
    *extent = 0;
    EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                             {"sdpa_attend", "'" + name + "'", ">= 1, got 0"}));
  }
}

TEST(SdpaArguments, QueryHeadsMustBeAMultipleOfKvHeads) {
  SdpaCall call;
  SdpaInput<float> in = call.in;
  in.query_heads = 3;
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'query_heads'", "multiple of kv_heads (2), got 3"}));
  EXPECT_TRUE(
      throws_error([&] { sdpa_backward(in, call.saved(), call.upstream(), call.gradients()); },
                   ErrorCode::invalid_argument, {"sdpa_backward", "'query_heads'"}));
}

TEST(SdpaArguments, NullPointersAreNamed) {
  SdpaCall call;
  for (const char* name : {"queries", "keys", "values"}) {
    SdpaInput<float> in = call.in;
    const std::string n = name;
    (n == "queries" ? in.queries : n == "keys" ? in.keys : in.values) = nullptr;
    EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                             {"'" + n + "' must not be null"}));
  }
  EXPECT_TRUE(throws_error([&] { call.forward(call.in, SdpaOutput<float>{}); },
                           ErrorCode::invalid_argument, {"'output' must not be null"}));
  SdpaGradientOutput<float> g = call.gradients();
  g.keys = nullptr;
  EXPECT_TRUE(throws_error([&] { sdpa_backward(call.in, call.saved(), call.upstream(), g); },
                           ErrorCode::invalid_argument, {"'gradients.keys' must not be null"}));
  SdpaSaved<float> saved = call.saved();
  saved.lse = nullptr;
  EXPECT_TRUE(
      throws_error([&] { sdpa_backward(call.in, saved, call.upstream(), call.gradients()); },
                   ErrorCode::invalid_argument, {"'saved.lse' must not be null"}));
  saved = call.saved();
  saved.output = nullptr;
  EXPECT_TRUE(
      throws_error([&] { sdpa_backward(call.in, saved, call.upstream(), call.gradients()); },
                   ErrorCode::invalid_argument, {"'saved.output'", "upstream.update"}));
  saved = call.saved();
  saved.entropy = nullptr;
  UpstreamGradients<float> up = call.upstream();
  up.entropy = call.dlse.data();
  EXPECT_TRUE(throws_error([&] { sdpa_backward(call.in, saved, up, call.gradients()); },
                           ErrorCode::invalid_argument, {"'saved.entropy'", "upstream.entropy"}));
}

TEST(SdpaArguments, OverlappingOutputsAreRefused) {
  SdpaCall call;
  SdpaOutput<float> out = call.outputs();
  out.output = call.Q.data();  // O written over Q
  EXPECT_TRUE(throws_error([&] { call.forward(call.in, out); }, ErrorCode::invalid_argument,
                           {"'output' shares memory with queries"}));
  SdpaGradientOutput<float> g = call.gradients();
  g.keys = call.dQ.data() + 1;
  EXPECT_TRUE(throws_error([&] { sdpa_backward(call.in, call.saved(), call.upstream(), g); },
                           ErrorCode::invalid_argument, {"gradients.keys", "gradients.queries"}));
  g = call.gradients();
  g.values = call.dO.data();
  EXPECT_TRUE(throws_error([&] { sdpa_backward(call.in, call.saved(), call.upstream(), g); },
                           ErrorCode::invalid_argument,
                           {"'gradients.values' shares memory with upstream.update"}));
}

TEST(SdpaArguments, ScaleLengthsThreadsDevicesAndPrecisionsAreChecked) {
  SdpaCall call;
  SdpaInput<float> in = call.in;
  in.scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'scale' must be finite"}));
  in.scale = 1e30;
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'scale'", "2^64"}));
  in = call.in;
  std::vector<std::int64_t> bad = {7, 8};
  in.key_lengths = bad.data();
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'key_lengths' entry 1 must be in [0, 7], got 8"}));
  in = call.in;
  std::vector<std::int64_t> bad_queries = {4, 1};
  in.query_lengths = bad_queries.data();
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'query_lengths' entry 0 must be in [0, 3], got 4"}));
  in = call.in;
  in.mask = Mask::sliding_window(0);
  EXPECT_TRUE(throws_error([&] { call.forward(in, call.outputs()); }, ErrorCode::invalid_argument,
                           {"'mask'", "window"}));
  EXPECT_TRUE(throws_error(
      [&] {
        call.forward(call.in, call.outputs(), {Device::cpu, -1});
      },
      ErrorCode::invalid_argument, {"'threads' must be >= 0", "got -1"}));
  EXPECT_TRUE(throws_error(
      [&] {
        call.forward(call.in, call.outputs(), {Device::cuda, 1});
      },
      ErrorCode::unsupported, {"sdpa_attend", "cuda"}));
  // The float backward runs on a GPU where there is one (tests/cuda/sdpa_cuda_test.cpp); without
  // one it is refused naming the device.
  if (!this_machine().cuda_device) {
    EXPECT_TRUE(throws_error(
        [&] {
          sdpa_backward(call.in, call.saved(), call.upstream(), call.gradients(),
                        {Device::cuda, 1});
        },
        ErrorCode::unsupported, {"sdpa_backward", "cuda"}));
  }
  ExecutionOptions bf16{Device::cpu, 1};
  bf16.precision = Precision::bf16;
  EXPECT_TRUE(throws_error([&] { call.forward(call.in, call.outputs(), bf16); },
                           ErrorCode::invalid_argument, {"precision"}));
}

/// A small valid dense layer: B = 2, N = 5, d = 3, H = 2, with a key bias, no offset.
struct LayerCall {
  std::vector<float> X = std::vector<float>(2 * 5 * 3, 0.5f),
                     Q = std::vector<float>(2 * 4 * 3, 0.25f);
  std::vector<float> M = std::vector<float>(2 * 3 * 3, 0.1f),
                     F = std::vector<float>(2 * 3 * 3, 0.2f), u = std::vector<float>(2 * 3, 0.3f);
  std::vector<float> dDelta = std::vector<float>(2 * 5 * 3, 1.0f);
  std::vector<float> dX = std::vector<float>(X.size()), dQ = std::vector<float>(Q.size()),
                     dM = std::vector<float>(M.size()), du = std::vector<float>(u.size()),
                     dc = std::vector<float>(3);
  AttentionInput<float> in;
  LayerCall() {
    in.cloud = X.data();
    in.batch = 2;
    in.tokens = 5;
    in.dim = 3;
    in.layer = {2, M.data(), F.data(), u.data(), nullptr};
  }
  UpstreamGradients<float> upstream() { return {dDelta.data(), nullptr, nullptr}; }
};

TEST(LayerBackwardArguments, GradientOutputsAreChecked) {
  LayerCall call;
  LayerGradientOutput<float> g;
  g.cloud = call.dX.data();
  g.relevance = call.dM.data();
  g.key_bias = call.du.data();
  attend_backward(call.in, call.upstream(), g, {Device::cpu, 1});  // valid
  LayerGradientOutput<float> bad = g;
  bad.queries = call.dQ.data();
  EXPECT_TRUE(throws_error(
      [&] { attend_backward(call.in, call.upstream(), bad); }, ErrorCode::invalid_argument,
      {"attend_backward", "'gradients.queries' must be null for self-attention"}));
  bad = g;
  bad.offset = call.dc.data();
  EXPECT_TRUE(throws_error([&] { attend_backward(call.in, call.upstream(), bad); },
                           ErrorCode::invalid_argument, {"'gradients.offset'", "no offset"}));
  AttentionInput<float> no_bias = call.in;
  no_bias.layer.key_bias = nullptr;
  EXPECT_TRUE(throws_error([&] { attend_backward(no_bias, call.upstream(), g); },
                           ErrorCode::invalid_argument, {"'gradients.key_bias'", "no key_bias"}));
  bad = g;
  bad.cloud = call.X.data();
  EXPECT_TRUE(throws_error([&] { attend_backward(call.in, call.upstream(), bad); },
                           ErrorCode::invalid_argument,
                           {"'gradients.cloud' shares memory with cloud"}));
  bad = g;
  bad.relevance = call.dX.data() + 2;
  EXPECT_TRUE(throws_error([&] { attend_backward(call.in, call.upstream(), bad); },
                           ErrorCode::invalid_argument,
                           {"gradients.relevance", "gradients.cloud"}));
}

TEST(LayerBackwardArguments, InputsDevicesAndThreadsAreChecked) {
  LayerCall call;
  LayerGradientOutput<float> g;
  g.cloud = call.dX.data();
  AttentionInput<float> in = call.in;
  in.layer.relevance = nullptr;
  EXPECT_TRUE(throws_error([&] { attend_backward(in, call.upstream(), g); },
                           ErrorCode::invalid_argument, {"'relevance' must not be null"}));
  in = call.in;
  in.beta = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(throws_error([&] { attend_backward(in, call.upstream(), g); },
                           ErrorCode::invalid_argument, {"'beta' must be finite"}));
  EXPECT_TRUE(throws_error(
      [&] {
        attend_backward(call.in, call.upstream(), g, {Device::cuda, 1});
      },
      ErrorCode::unsupported, {"attend_backward", "cuda"}));
  EXPECT_TRUE(throws_error(
      [&] {
        attend_backward(call.in, call.upstream(), g, {Device::cpu, -2});
      },
      ErrorCode::invalid_argument, {"'threads'"}));
  // The factored form: its own checks, and input.layer must stay empty.
  std::vector<float> A(2 * 2 * 3, 0.1f), Bf(2 * 2 * 3, 0.2f), U(2 * 3 * 2, 0.3f),
      V(2 * 2 * 3, 0.4f), dA(A.size());
  FactoredLayer<float> f;
  f.heads = 2;
  f.rank = 2;
  f.query_factor = A.data();
  f.key_factor = Bf.data();
  f.content_up = U.data();
  f.content_down = V.data();
  AttentionInput<float> plain = call.in;
  plain.layer = {};
  FactoredGradientOutput<float> fg;
  fg.query_factor = dA.data();
  attend_factored_backward(plain, f, call.upstream(), fg, {Device::cpu, 1});  // valid
  EXPECT_TRUE(throws_error([&] { attend_factored_backward(call.in, f, call.upstream(), fg); },
                           ErrorCode::invalid_argument,
                           {"attend_factored_backward", "'input.layer' must be empty"}));
  FactoredGradientOutput<float> bad = fg;
  bad.key_bias = call.du.data();
  EXPECT_TRUE(throws_error([&] { attend_factored_backward(plain, f, call.upstream(), bad); },
                           ErrorCode::invalid_argument, {"'gradients.key_bias'"}));
  bad = fg;
  bad.content_up = A.data();
  EXPECT_TRUE(throws_error([&] { attend_factored_backward(plain, f, call.upstream(), bad); },
                           ErrorCode::invalid_argument,
                           {"'gradients.content_up' shares memory with query_factor"}));
}

}  // namespace
}  // namespace emflow

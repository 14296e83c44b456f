// The capability function (emflow/capability.hpp) on machines described by hand: every rule of
// src/core/capability.cpp, whatever this machine has.
#include "emflow/capability.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/validate.hpp"
#include "emflow/error.hpp"

namespace emflow {
namespace {

// The CPU engine's paths this build holds, lowest first (EMFLOW_CPU_BUILT_<path>, set by
// CMakeLists.txt: every path, or the one EMFLOW_ONLY_CPU_PATH keeps).
std::vector<std::string> built_paths() {
  std::vector<std::string> paths;
#if defined(EMFLOW_CPU_BUILT_avx2)
  paths.emplace_back("avx2");
#endif
#if defined(EMFLOW_CPU_BUILT_avx512)
  paths.emplace_back("avx512");
#endif
#if defined(EMFLOW_CPU_BUILT_avx512bf16)
  paths.emplace_back("avx512bf16");
#endif
#if defined(EMFLOW_CPU_BUILT_generic)
  paths.emplace_back("generic");
#endif
  return paths;
}

Machine cpu_only() {
  Machine m;
  m.cuda_reason = "no CUDA device is present";
  return m;
}

Machine with_gpu() {
  Machine m;
  m.cuda_built = true;
  m.cuda_device = true;
  return m;
}

Machine with_bf16_cpu() {
  Machine m = cpu_only();
  m.avx512_bf16 = true;
  return m;
}

Problem dense(Dtype storage, std::int64_t dim = 64) {
  Problem p;
  p.storage = storage;
  p.batch = 2;
  p.tokens = p.query_tokens = 100;
  p.dim = dim;
  p.heads = 2;
  return p;
}

Problem factored(Dtype storage, std::int64_t rank = 16) {
  Problem p = dense(storage);
  p.form = Form::factored;
  p.rank = rank;
  return p;
}

void expect_route(const Route& r, Device device, Kernel kernel, Precision products,
                  bool expanded = false) {
  ASSERT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.device, device);
  EXPECT_EQ(r.kernel, kernel) << to_string(r);
  EXPECT_EQ(r.products, products) << to_string(r);
  EXPECT_EQ(r.expanded, expanded) << to_string(r);
  EXPECT_TRUE(r.reason.empty());
}

void expect_refusal(const Route& r, const std::string& part) {
  EXPECT_FALSE(r.supported) << to_string(r);
  EXPECT_NE(r.reason.find(part), std::string::npos) << r.reason;
}

TEST(Capability, TheReferenceComputesEveryStorageTypeInDouble) {
  for (Dtype s : {Dtype::float64, Dtype::float32, Dtype::bfloat16, Dtype::float16}) {
    const Route r = route(dense(s), Device::reference, cpu_only());
    expect_route(r, Device::reference, Kernel::reference, Precision::fp32);
    EXPECT_EQ(r.computes, Dtype::float64);
    expect_route(route(factored(s), Device::reference, cpu_only()), Device::reference,
                 Kernel::reference, Precision::fp32, /*expanded=*/true);
  }
}

TEST(Capability, TheCpuRunsFloatInTheEngineAndDoubleInTheReference) {
  expect_route(route(dense(Dtype::float32), Device::cpu, cpu_only()), Device::cpu,
               Kernel::cpu_fused, Precision::fp32);
  expect_route(route(dense(Dtype::float64), Device::cpu, cpu_only()), Device::cpu,
               Kernel::reference, Precision::fp32);
  expect_route(route(factored(Dtype::float32), Device::cpu, cpu_only()), Device::cpu,
               Kernel::cpu_fused, Precision::fp32);
  expect_route(route(factored(Dtype::float64), Device::cpu, cpu_only()), Device::cpu,
               Kernel::reference, Precision::fp32, /*expanded=*/true);
  // Automatic without a GPU is the CPU.
  expect_route(route(dense(Dtype::float32), Device::automatic, cpu_only()), Device::cpu,
               Kernel::cpu_fused, Precision::fp32);
}

TEST(Capability, NonFiniteInputGoesToTheReferenceOnTheCpu) {
  Problem p = factored(Dtype::float32);
  p.finite = false;
  expect_route(route(p, Device::cpu, cpu_only()), Device::cpu, Kernel::reference, Precision::fp32,
               /*expanded=*/true);
  Problem b = dense(Dtype::bfloat16);
  b.finite = false;
  expect_route(route(b, Device::cpu, with_bf16_cpu()), Device::cpu, Kernel::reference,
               Precision::fp32);
}

TEST(Capability, Bf16ProductsOnTheCpuNeedTheInstructionsAndPlainSelfAttention) {
  expect_route(route(dense(Dtype::bfloat16), Device::cpu, with_bf16_cpu()), Device::cpu,
               Kernel::cpu_bf16, Precision::bf16);
  // Without AVX512-BF16, with weights, or with queries: widened to float32.
  expect_route(route(dense(Dtype::bfloat16), Device::cpu, cpu_only()), Device::cpu,
               Kernel::cpu_fused, Precision::fp32);
  Problem weights = dense(Dtype::bfloat16);
  weights.weights = true;
  expect_route(route(weights, Device::cpu, with_bf16_cpu()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  Problem cross = dense(Dtype::bfloat16);
  cross.cross = true;
  expect_route(route(cross, Device::cpu, with_bf16_cpu()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  expect_route(route(dense(Dtype::float16), Device::cpu, with_bf16_cpu()), Device::cpu,
               Kernel::cpu_fused, Precision::fp32);
}

TEST(Capability, Tf32IsAPermissionThatTheCpuComputesInFp32) {
  Problem p = dense(Dtype::float32);
  p.precision = Precision::tf32;
  expect_route(route(p, Device::cpu, cpu_only()), Device::cpu, Kernel::cpu_fused, Precision::fp32);
  expect_route(route(p, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_tensor_cores,
               Precision::tf32);
  p.weights = true;  // the tensor cores do not form weights: float32 products instead
  expect_route(route(p, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_unfused,
               Precision::fp32);
}

TEST(Capability, PrecisionMustMatchTheStorage) {
  Problem p = dense(Dtype::float64);
  p.precision = Precision::tf32;
  expect_refusal(route(p, Device::cpu, cpu_only()), "tf32 needs float32 storage, got float64");
  Problem q = dense(Dtype::float32);
  q.precision = Precision::bf16;
  expect_refusal(route(q, Device::cpu, cpu_only()), "bf16 needs bfloat16 storage");
  Problem h = dense(Dtype::bfloat16);
  h.precision = Precision::fp16;
  expect_refusal(route(h, Device::reference, cpu_only()), "fp16 needs float16 storage");
}

TEST(Capability, TheGpuChoosesFusedUnfusedOrTheTensorCores) {
  expect_route(route(dense(Dtype::float32), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_fused, Precision::fp32);
  expect_route(route(dense(Dtype::float32, 257), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_unfused, Precision::fp32);
  Problem w = dense(Dtype::float32);
  w.weights = true;
  expect_route(route(w, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_unfused,
               Precision::fp32);
  expect_route(route(dense(Dtype::float64), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_unfused, Precision::fp32);
  expect_route(route(dense(Dtype::bfloat16), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_tensor_cores, Precision::bf16);
  expect_route(route(factored(Dtype::float16), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_tensor_cores, Precision::fp16);
  // The factored form in float32 or float64 without tf32: expanded, then the dense rule.
  expect_route(route(factored(Dtype::float32), Device::cuda, with_gpu()), Device::cuda,
               Kernel::cuda_fused, Precision::fp32, /*expanded=*/true);
  // Automatic with a GPU takes it.
  expect_route(route(dense(Dtype::float32), Device::automatic, with_gpu()), Device::cuda,
               Kernel::cuda_fused, Precision::fp32);
}

TEST(Capability, TheGpuRefusesWhatItsKernelsCannotCompute) {
  Problem w = dense(Dtype::bfloat16);
  w.weights = true;
  expect_refusal(route(w, Device::cuda, with_gpu()), "tensor cores do not form the weights");
  // ... and automatic then takes the CPU.
  expect_route(route(w, Device::automatic, with_gpu()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  expect_refusal(route(dense(Dtype::float16, 300), Device::cuda, with_gpu()),
                 "dim <= 256, got 300");
  expect_refusal(route(factored(Dtype::bfloat16, 257), Device::cuda, with_gpu()),
                 "rank <= 256, got 257");
  Problem unfused = dense(Dtype::bfloat16);
  unfused.algorithm = Algorithm::unfused;
  expect_refusal(route(unfused, Device::cuda, with_gpu()), "unfused algorithm (cuBLAS)");
  Problem fused = dense(Dtype::float64);
  fused.algorithm = Algorithm::fused;
  expect_refusal(route(fused, Device::cuda, with_gpu()), "fused algorithm runs float32 only");
  Problem big = dense(Dtype::float32);
  big.tokens = big.query_tokens = std::int64_t{1} << 31;
  expect_refusal(route(big, Device::cuda, with_gpu()), "32-bit index limit");
}

// Rotary positions and grouped kv heads on the GPU: the factored update on the tensor cores
// (16-bit storage, or float with tf32), or for float with fp32 on the SDPA operator's float32
// kernel (rank <= 128, never expanded); float64 (which would expand), ranks beyond 128 in fp32,
// partial states, decode caches and explicit positions are refused by name, and automatic then
// stays on the CPU.
TEST(Capability, RotaryAndGroupedHeadsRunOnTheGpuUnexpanded) {
  Problem p = factored(Dtype::bfloat16);
  p.kv_heads = 1;
  p.rotary_dim = 8;
  expect_route(route(p, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_tensor_cores,
               Precision::bf16);
  expect_route(route(p, Device::automatic, with_gpu()), Device::cuda, Kernel::cuda_tensor_cores,
               Precision::bf16);
  Problem tf32 = p;
  tf32.storage = Dtype::float32;
  tf32.precision = Precision::tf32;
  expect_route(route(tf32, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_tensor_cores,
               Precision::tf32);
  Problem fp32 = tf32;
  fp32.precision = Precision::fp32;
  expect_route(route(fp32, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  expect_route(route(fp32, Device::automatic, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  Problem grouped_only = fp32;
  grouped_only.rotary_dim = 0;
  expect_route(route(grouped_only, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  Problem wide = fp32;
  wide.rank = kCudaSdpaBackwardMaxRank + 1;
  const Route too_wide = route(wide, Device::cuda, with_gpu());
  expect_refusal(too_wide,
                 "rotary positions (rotary.dim 8) and grouped kv heads (kv_heads 1 of 2)");
  expect_refusal(too_wide, "float32 kernel (float with Precision::fp32, rank <= 128");
  expect_route(route(wide, Device::automatic, with_gpu()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  Problem wide_weights = fp32;
  wide_weights.weights = true;
  expect_refusal(route(wide_weights, Device::cuda, with_gpu()), "no weights");
  Problem f64 = fp32;
  f64.storage = Dtype::float64;
  expect_refusal(route(f64, Device::cuda, with_gpu()), "the float64 path expands the layer");
  Problem positions = p;
  positions.rotary_positions = true;
  expect_refusal(route(positions, Device::cuda, with_gpu()), "explicit rotary positions");
  Problem partial = p;
  partial.operation = Operation::partial;
  expect_refusal(route(partial, Device::cuda, with_gpu()), "no GPU kernel for partial states");
}

TEST(Capability, AMissingDeviceIsSaidAsSuch) {
  const Route r = route(dense(Dtype::float32), Device::cuda, cpu_only());
  EXPECT_FALSE(r.supported);
  EXPECT_TRUE(r.device_missing);
  EXPECT_NE(r.reason.find("emflow was built without CUDA"), std::string::npos) << r.reason;
  Machine absent;
  absent.cuda_built = true;
  absent.cuda_reason = "no CUDA device is present";
  const Route s = route(dense(Dtype::float32), Device::cuda, absent, "attend_partial");
  EXPECT_TRUE(s.device_missing);
  EXPECT_EQ(s.reason.rfind("attend_partial: cuda: device 'cuda' requested but unavailable: "
                           "no CUDA device is present",
                           0),
            0u)
      << s.reason;
  // A refusal for another reason is not a missing device.
  Problem w = dense(Dtype::bfloat16);
  w.weights = true;
  EXPECT_FALSE(route(w, Device::cuda, with_gpu()).device_missing);
}

TEST(Capability, PartialStatesAndDecodeCaches) {
  Problem partial = dense(Dtype::float32);
  partial.operation = Operation::partial;
  expect_route(route(partial, Device::cpu, cpu_only()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  expect_route(route(partial, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  partial.storage = Dtype::bfloat16;
  expect_refusal(route(partial, Device::cpu, cpu_only()), "partial states are float or double");
  Problem decode = dense(Dtype::float32);
  decode.operation = Operation::decode;
  expect_route(route(decode, Device::cpu, cpu_only()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  expect_route(route(decode, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  expect_refusal(route(decode, Device::reference, cpu_only()), "lives on cpu or cuda");
  decode.tokens = 0;  // no capacity
  expect_refusal(route(decode, Device::cuda, with_gpu()), "needs a capacity");
  decode.tokens = 10;
  decode.form = Form::factored;
  decode.rank = 4;
  expect_route(route(decode, Device::cpu, cpu_only()), Device::cpu, Kernel::reference,
               Precision::fp32);
  expect_refusal(route(decode, Device::cuda, with_gpu()), "float32 caches of the dense form");
}

TEST(Capability, PartialStatesOfNonFiniteInputGoToTheReference) {
  Problem partial = dense(Dtype::float32);
  partial.operation = Operation::partial;
  partial.finite = false;
  expect_route(route(partial, Device::cpu, cpu_only()), Device::cpu, Kernel::reference,
               Precision::fp32);
  // The GPU's kernels take non-finite input themselves (finite.hpp).
  expect_route(route(partial, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
}

TEST(Capability, DescribeADecodeCache) {
  float m[4] = {}, bias[2] = {};
  LayerOperators<float> layer{1, m, m, bias, nullptr};
  const Problem p = describe(layer, 2, DecodeOptions{Device::cuda, 64, Precision::tf32});
  EXPECT_EQ(p.operation, Operation::decode);
  EXPECT_EQ(p.form, Form::dense);
  EXPECT_EQ(p.storage, Dtype::float32);
  EXPECT_EQ(p.precision, Precision::tf32);
  EXPECT_EQ(p.tokens, 64);
  EXPECT_EQ(p.dim, 2);
  EXPECT_TRUE(p.key_bias);
  EXPECT_FALSE(p.offset);
  expect_route(route(p, Device::cuda, with_gpu()), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  expect_route(route(p, Device::automatic, cpu_only()), Device::cpu, Kernel::cpu_fused,
               Precision::fp32);
  FactoredLayer<double> f;
  f.heads = 2;
  f.rank = 3;
  const Problem q = describe(f, 8, DecodeOptions{});
  EXPECT_EQ(q.form, Form::factored);
  EXPECT_EQ(q.storage, Dtype::float64);
  EXPECT_EQ(q.rank, 3);
  EXPECT_EQ(q.heads, 2);
  expect_route(route(q, Device::automatic, with_gpu()), Device::cpu, Kernel::reference,
               Precision::fp32);
}

TEST(Capability, ThePrecisionRuleIsTheValidatorsToo) {
  // The same sentence in both places: route() refuses with it, check_precision makes it an
  // invalid argument (tests/core/attention_validation_test.cpp).
  EXPECT_EQ(detail::precision_mismatch(Dtype::float64, Precision::tf32),
            "tf32 needs float32 storage, got float64");
  EXPECT_EQ(detail::precision_mismatch(Dtype::float32, Precision::fp16),
            "fp16 needs float16 storage, got float32");
  for (Dtype s : {Dtype::float64, Dtype::float32, Dtype::bfloat16, Dtype::float16}) {
    EXPECT_EQ(detail::precision_mismatch(s, Precision::fp32), "") << to_string(s);
  }
  EXPECT_EQ(detail::precision_mismatch(Dtype::bfloat16, Precision::bf16), "");
  EXPECT_EQ(detail::precision_mismatch(Dtype::float32, Precision::tf32), "");
}

TEST(Capability, DescribeReadsShapesOptionsAndWhichArraysAreGiven) {
  float x[8] = {}, m[4] = {}, q[4] = {}, update[8] = {}, lse[4] = {};
  std::int64_t lengths[1] = {4};
  AttentionInput<float> in;
  in.cloud = x;
  in.tokens = 4;
  in.dim = 2;
  in.layer.relevance = m;
  in.layer.content = m;
  in.key_lengths = lengths;
  in.queries = q;
  in.query_tokens = 2;
  AttentionOutput<float> out;
  out.update = update;
  out.lse = lse;
  ExecutionOptions options;
  options.precision = Precision::tf32;
  const Problem p = describe(in, out, options);
  EXPECT_EQ(p.storage, Dtype::float32);
  EXPECT_EQ(p.precision, Precision::tf32);
  EXPECT_EQ(p.tokens, 4);
  EXPECT_EQ(p.query_tokens, 2);
  EXPECT_TRUE(p.cross);
  EXPECT_TRUE(p.key_lengths);
  EXPECT_TRUE(p.lse);
  EXPECT_FALSE(p.entropy);
  EXPECT_FALSE(p.weights);
  EXPECT_FALSE(p.plain_self_attention());
  EXPECT_EQ(p.form, Form::dense);
  FactoredLayer<float> f;
  f.heads = 3;
  f.rank = 5;
  const Problem pf = describe(in, f, out);
  EXPECT_EQ(pf.form, Form::factored);
  EXPECT_EQ(pf.heads, 3);
  EXPECT_EQ(pf.rank, 5);
  EXPECT_EQ(pf.score_width(), 5);
}

TEST(Capability, RoutesReadAsText) {
  EXPECT_EQ(to_string(route(dense(Dtype::bfloat16), Device::cuda, with_gpu())),
            "cuda cuda_tensor_cores bf16");
  EXPECT_EQ(to_string(route(factored(Dtype::float64), Device::cpu, cpu_only())),
            "cpu reference fp64 (expanded)");
  EXPECT_EQ(to_string(route(dense(Dtype::float32), Device::cuda, cpu_only()))
                .rfind("unsupported: attend: cuda: ", 0),
            0u);
}

TEST(Capability, ThisMachineAgreesWithTheBuild) {
  const Machine& m = this_machine();
#if defined(EMFLOW_WITH_CUDA)
  EXPECT_TRUE(m.cuda_built);
#else
  EXPECT_FALSE(m.cuda_built);
  EXPECT_FALSE(m.cuda_device);
#endif
  if (!m.cuda_device) {
    EXPECT_FALSE(m.cuda_reason.empty() && m.cuda_built);
  }
  EXPECT_EQ(&m, &this_machine());
}

// The tests run here, so the processor has every extension the engine was compiled for; the
// names come from one list, and the probe finds at least those.
TEST(Capability, TheProcessorHasWhatTheEngineWasCompiledFor) {
  const Machine& m = this_machine();
  EXPECT_TRUE(m.cpu_missing.empty()) << m.cpu_missing;
  EXPECT_FALSE(m.cpu_instruction_set.empty());
  const std::vector<std::string> names = detail::cpu_feature_names();
  for (const std::string& name : m.cpu_compiled_for) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
    EXPECT_NE(std::find(m.cpu_features.begin(), m.cpu_features.end(), name), m.cpu_features.end())
        << "compiled for " << name << ", not found";
  }
  for (const std::string& name : m.cpu_features) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
#if defined(__x86_64__)
  EXPECT_FALSE(m.cpu_name.empty());
  EXPECT_NE(m.cpu_name.find("family "), std::string::npos) << m.cpu_name;
#endif
  // The path taken is one of the build's, the highest whose extensions the processor has
  // (EMFLOW_CPU_PATH or EMFLOW_CPU_DISABLE may ask for a lower one).
  EXPECT_NE(std::find(m.cpu_paths.begin(), m.cpu_paths.end(), m.cpu_instruction_set),
            m.cpu_paths.end())
      << m.cpu_instruction_set;
  const bool asked_lower = std::getenv("EMFLOW_CPU_PATH") != nullptr || !m.cpu_disabled.empty();
#if defined(__x86_64__)
  EXPECT_EQ(m.cpu_paths, built_paths());
  const auto has = [&m](const char* name) {
    return std::find(m.cpu_features.begin(), m.cpu_features.end(), name) != m.cpu_features.end();
  };
  const auto built = [&m](const char* name) {
    return std::find(m.cpu_paths.begin(), m.cpu_paths.end(), name) != m.cpu_paths.end();
  };
  if (!asked_lower) {
    // The highest of the build's paths whose extensions the processor has.
    std::string highest = "none";
    if (built("avx2") && has("avx2")) highest = "avx2";
    if (built("avx512") && has("avx512f") && has("avx512bw")) highest = "avx512";
    if (built("avx512bf16") && has("avx512bf16") && has("avx512f")) highest = "avx512bf16";
    EXPECT_EQ(m.cpu_instruction_set, highest);
  }
#endif
  if (m.cpu_instruction_set.rfind("avx512", 0) == 0) {
    EXPECT_NE(std::find(m.cpu_compiled_for.begin(), m.cpu_compiled_for.end(), "avx512f"),
              m.cpu_compiled_for.end());
  }
  EXPECT_EQ(m.avx512_bf16, m.cpu_instruction_set == "avx512bf16");
}

// The choice of a path: the highest the usable extensions allow, or the one EMFLOW_CPU_PATH
// names, which must be the build's and must run here.
TEST(Capability, ThePathIsTheHighestTheProcessorHasOrTheOneAskedFor) {
#if defined(__x86_64__)
  if (built_paths().size() != 3) {
    GTEST_SKIP() << "this build holds one path of the CPU engine (EMFLOW_ONLY_CPU_PATH): "
                 << built_paths().front();
  }
  const std::vector<std::string> v3{"avx2", "fma", "f16c", "bmi2"};
  std::vector<std::string> v4 = v3;
  for (const char* name : {"avx512f", "avx512dq", "avx512bw", "avx512vl"}) v4.emplace_back(name);
  std::vector<std::string> bf16 = v4;
  bf16.emplace_back("avx512bf16");
  EXPECT_EQ(detail::choose_cpu_path(v3, nullptr).name, "avx2");
  EXPECT_EQ(detail::choose_cpu_path(v4, nullptr).name, "avx512");
  EXPECT_EQ(detail::choose_cpu_path(bf16, nullptr).name, "avx512bf16");
  EXPECT_EQ(detail::choose_cpu_path(bf16, "").name, "avx512bf16");
  EXPECT_EQ(detail::choose_cpu_path(bf16, "avx2").name, "avx2");
  EXPECT_EQ(detail::choose_cpu_path(bf16, "avx512").required, v4);
  // AVX512-BF16 without the rest of AVX-512 is no path of its own.
  std::vector<std::string> odd = v3;
  odd.emplace_back("avx512bf16");
  EXPECT_EQ(detail::choose_cpu_path(odd, nullptr).name, "avx2");
  // No AVX2: no path; what the lowest needs is named.
  const detail::CpuPath none = detail::choose_cpu_path({"fma", "f16c"}, nullptr);
  EXPECT_EQ(none.name, "none");
  EXPECT_EQ(none.missing, "avx2 bmi2");
  EXPECT_EQ(none.required, v3);
  try {
    detail::choose_cpu_path(v4, "avx512bf16");
    ADD_FAILURE() << "a path the processor lacks was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("EMFLOW_CPU_PATH names 'avx512bf16', which needs "
                                         "avx512bf16 that this processor lacks"),
              std::string::npos)
        << e.what();
  }
  try {
    detail::choose_cpu_path(v4, "sse2");
    ADD_FAILURE() << "an unknown path was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected one of this build's paths: avx2, avx512, "
                                         "avx512bf16"),
              std::string::npos)
        << e.what();
  }
#else
  GTEST_SKIP() << "the x86-64 paths are built on x86-64 only";
#endif
}

// On a processor without an extension the engine was compiled for, the engine's kernels are
// refused with the reason (their code would stop on an illegal instruction), the double
// reference still runs, and the unrouted entry points refuse too.
TEST(Capability, AnEngineBuiltForMoreThanTheProcessorHasIsRefused) {
  Machine m = cpu_only();
  m.cpu_instruction_set = "avx512";
  m.cpu_compiled_for = {"avx2", "fma", "avx512f"};
  m.cpu_features = {"avx2", "fma"};
  m.cpu_missing = detail::cpu_missing_features(m.cpu_compiled_for, m.cpu_features);
  ASSERT_EQ(m.cpu_missing, "avx512f");
  for (const Dtype storage : {Dtype::float32, Dtype::bfloat16, Dtype::float16}) {
    const Route r = route(dense(storage), Device::cpu, m, "attend");
    EXPECT_FALSE(r.supported) << to_string(r);
    EXPECT_FALSE(r.device_missing);
    EXPECT_NE(r.reason.find("lacks avx512f"), std::string::npos) << r.reason;
    EXPECT_NE(r.reason.find("the double reference still runs"), std::string::npos) << r.reason;
    // Asked for no device in particular, the call computes in the reference instead.
    const Route automatic = route(dense(storage), Device::automatic, m, "attend");
    EXPECT_TRUE(automatic.supported) << automatic.reason;
    EXPECT_EQ(automatic.device, Device::reference);
    EXPECT_EQ(automatic.kernel, Kernel::reference);
  }
  // The dense float decode cache is the engine's; a double one, and the factored form's in
  // double loops, run anywhere.
  Problem cache = dense(Dtype::float32);
  cache.operation = Operation::decode;
  EXPECT_FALSE(route(cache, Device::cpu, m, "DecodeCache").supported);
  cache.storage = Dtype::float64;
  EXPECT_TRUE(route(cache, Device::cpu, m, "DecodeCache").supported);
  const Route f64 = route(dense(Dtype::float64), Device::cpu, m, "attend");
  EXPECT_TRUE(f64.supported) << f64.reason;
  EXPECT_EQ(f64.kernel, Kernel::reference);
  EXPECT_TRUE(route(dense(Dtype::float32), Device::reference, m, "attend").supported);
  EXPECT_EQ(detail::cpu_missing_features({"avx2"}, {"avx2", "fma"}), "");
  EXPECT_EQ(detail::cpu_missing_features({"avx512f", "avx512bw"}, {}), "avx512f avx512bw");
}

// EMFLOW_CPU_DISABLE's names: listed, not taken out of what was found, and an unknown name is
// an error naming it and the list.
TEST(Capability, TheDisableListIsCheckedAndKept) {
  const detail::CpuProbe plain = detail::probe_cpu(nullptr);
  const detail::CpuProbe some = detail::probe_cpu("avx512bf16,,amx-tile");
  EXPECT_EQ(some.features, plain.features);
  EXPECT_EQ(some.disabled, (std::vector<std::string>{"avx512bf16", "amx-tile"}));
  EXPECT_TRUE(plain.disabled.empty());
  try {
    detail::probe_cpu("avx512bf16,avx9");
    ADD_FAILURE() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    const std::string message = e.what();
    EXPECT_NE(message.find("EMFLOW_CPU_DISABLE names 'avx9'"), std::string::npos) << message;
    EXPECT_NE(message.find("avx512fp16"), std::string::npos) << message;
  }
}

// The SDPA-shaped operator, its backward and a layer's backward are routed as every other call:
// the engine (its bfloat16 backward where the machine has AVX512-BF16), double in the reference,
// on the GPU the SDPA operator's float32 kernels for float (forward and backward) and its
// tensor-core kernels for 16-bit storage (none for a layer's backward), and the reference under
// Device::automatic where no engine path runs.
TEST(Capability, TheSdpaOperatorAndTheBackwardPassAreRouted) {
  Machine bf16 = cpu_only();
  bf16.avx512_bf16 = true;
  const Machine widened = cpu_only();
  for (const Operation operation :
       {Operation::sdpa, Operation::sdpa_backward, Operation::backward}) {
    SCOPED_TRACE(to_string(operation));
    Problem p = operation == Operation::backward ? dense(Dtype::float32) : factored(Dtype::float32);
    p.operation = operation;
    Route r = route(p, Device::cpu, bf16, "op");
    EXPECT_TRUE(r.supported) << r.reason;
    EXPECT_EQ(r.kernel, Kernel::cpu_fused);
    r = route(p, Device::cuda, with_gpu(), "op");
    if (operation != Operation::backward) {
      // The float32 kernels (kernels/sdpa_backward.cu), rank and value_rank <= 128.
      expect_route(r, Device::cuda, Kernel::cuda_fused, Precision::fp32);
      EXPECT_EQ(route(p, Device::automatic, with_gpu(), "op").device, Device::cuda);
      Problem wide = p;
      wide.rank = kCudaSdpaBackwardMaxRank + 1;
      r = route(wide, Device::cuda, with_gpu(), "op");
      EXPECT_FALSE(r.supported);
      EXPECT_NE(r.reason.find("rank and value_rank <= 128"), std::string::npos) << r.reason;
    } else {
      EXPECT_EQ(route(p, Device::automatic, with_gpu(), "op").device, Device::cpu);
      EXPECT_FALSE(r.supported);
      EXPECT_NE(r.reason.find("op: cuda: "), std::string::npos) << r.reason;
      EXPECT_NE(r.reason.find("no GPU path yet"), std::string::npos) << r.reason;
    }
    EXPECT_EQ(route(p, Device::reference, bf16, "op").kernel, Kernel::reference);
    p.storage = Dtype::float64;
    EXPECT_EQ(route(p, Device::cpu, bf16, "op").kernel, Kernel::reference);
    p.storage = Dtype::bfloat16;
    r = route(p, Device::cpu, bf16, "op");
    if (operation == Operation::backward) {
      EXPECT_FALSE(r.supported);
      EXPECT_NE(r.reason.find("float or double, got bfloat16"), std::string::npos) << r.reason;
      continue;
    }
    EXPECT_EQ(r.kernel,
              operation == Operation::sdpa_backward ? Kernel::cpu_bf16 : Kernel::cpu_fused);
    EXPECT_EQ(route(p, Device::cpu, widened, "op").kernel, Kernel::cpu_fused);
    if (operation == Operation::sdpa_backward) {
      // 16-bit storage: the backward's tensor-core kernels, in the storage type's products.
      expect_route(route(p, Device::cuda, with_gpu(), "op"), Device::cuda,
                   Kernel::cuda_tensor_cores, Precision::bf16);
      p.storage = Dtype::float16;
      expect_route(route(p, Device::cuda, with_gpu(), "op"), Device::cuda,
                   Kernel::cuda_tensor_cores, Precision::fp16);
    }
    // No path of the engine here: refused on the cpu, computed in the reference when automatic.
    Machine old = cpu_only();
    old.cpu_missing = "avx2";
    p.storage = Dtype::float32;
    EXPECT_FALSE(route(p, Device::cpu, old, "op").supported);
    r = route(p, Device::automatic, old, "op");
    EXPECT_TRUE(r.supported) << r.reason;
    EXPECT_EQ(r.device, Device::reference);
  }
}

// The SDPA-shaped operator's forward on the GPU: the tensor-core kernel, for 16-bit storage or
// float with TF32 products, with grouped heads, value_rank equal to rank, rank <= 256, and the
// float32 kernel for float with fp32 products; taken under Device::automatic where a GPU is
// present.
TEST(Capability, TheSdpaOperatorRunsOnTheTensorCores) {
  Problem p = factored(Dtype::bfloat16);
  p.operation = Operation::sdpa;
  p.dim = p.rank;
  p.kv_heads = 1;
  p.heads = 4;
  Route r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.kernel, Kernel::cuda_tensor_cores);
  EXPECT_EQ(r.products, Precision::bf16);
  EXPECT_EQ(route(p, Device::automatic, with_gpu(), "op").device, Device::cuda);
  EXPECT_EQ(route(p, Device::automatic, cpu_only(), "op").device, Device::cpu);
  p.storage = Dtype::float32;
  p.precision = Precision::tf32;
  r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.products, Precision::tf32);
  p.dim = p.rank + 1;
  r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_FALSE(r.supported);
  EXPECT_NE(r.reason.find("value_rank equal to rank"), std::string::npos) << r.reason;
  p.dim = p.rank = kTensorCoreMaxDim + 1;
  r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_FALSE(r.supported);
  EXPECT_NE(r.reason.find("rank <= 256"), std::string::npos) << r.reason;
  // Float with Precision::fp32: the float32 kernel, a value rank unlike the rank allowed, up to
  // 128; beyond, the reason names the limit and the tensor cores' TF32.
  p.precision = Precision::fp32;
  p.rank = 40;
  p.dim = 24;
  expect_route(route(p, Device::cuda, with_gpu(), "op"), Device::cuda, Kernel::cuda_fused,
               Precision::fp32);
  p.dim = kCudaSdpaBackwardMaxRank + 1;
  r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_FALSE(r.supported);
  EXPECT_NE(r.reason.find("float32 SDPA needs rank and value_rank <= 128, got 40 and 129"),
            std::string::npos)
      << r.reason;
  EXPECT_NE(r.reason.find("Precision::tf32"), std::string::npos) << r.reason;
  p.storage = Dtype::float64;
  p.precision = Precision::fp32;
  p.dim = p.rank = 16;
  r = route(p, Device::cuda, with_gpu(), "op");
  EXPECT_FALSE(r.supported);
  EXPECT_NE(r.reason.find("float64"), std::string::npos) << r.reason;
}

}  // namespace
}  // namespace emflow

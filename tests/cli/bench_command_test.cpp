// `emflow bench` prints one JSON object per line with the documented keys; --baseline and --peak
// add their lines; bad options fail with a message naming the option. No timing is asserted.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "emflow/memory.hpp"

namespace {

using emflow::memory_limit_bytes;

#if defined(EMFLOW_CLI_PATH)
using Result = emflow::testing::CliOutput;

Result run(const std::string& arguments) { return emflow::testing::run_cli_output(arguments); }

bool has(const std::string& line, const std::string& text) {
  return line.find(text) != std::string::npos;
}

TEST(BenchCommand, PrintsOneJsonObjectPerMeasurement) {
  const Result r =
      run("bench --tokens 70 --dim 5 --heads 2 --batch 2 --mask causal --repeats 1 "
          "--threads 2 --baseline --peak");
  ASSERT_EQ(r.status, 0);
  ASSERT_EQ(r.lines.size(), 3u);
  const char* keys[] = {"\"op\"",     "\"device\"", "\"precision\"", "\"batch\"",     "\"heads\"",
                        "\"tokens\"", "\"dim\"",    "\"mask\"",      "\"ms_median\"", "\"gflops\""};
  for (const std::string& line : r.lines) {
    EXPECT_EQ(line.front(), '{') << line;
    EXPECT_EQ(line.back(), '}') << line;
    for (const char* key : keys) EXPECT_TRUE(has(line, key)) << key << " missing in " << line;
  }
  EXPECT_TRUE(has(r.lines[0], "\"op\": \"fma_peak\""));
  // The peak line names the processor, its extensions and the path of each storage type.
  for (const char* key :
       {"\"cpu\": \"", "\"cpu_features\": [", "\"cpu_compiled_for\": [",
        "\"paths\": {\"float64\": \"", "\"float32\": \"", "\"bfloat16\": \"", "\"float16\": \""}) {
    EXPECT_TRUE(has(r.lines[0], key)) << key << " missing in " << r.lines[0];
  }
  EXPECT_TRUE(has(r.lines[1], "\"op\": \"attend\""));
  EXPECT_TRUE(has(r.lines[1], "\"tokens\": 70"));
  EXPECT_TRUE(has(r.lines[1], "\"mask\": \"causal\""));
  EXPECT_TRUE(has(r.lines[2], "\"op\": \"unfused_blas\""));
}

// Decoding shapes: NQ queries through attend, through a DecodeCache, one token appended and
// attended, and self-attention at --self-tokens in the same rounds.
TEST(BenchCommand, TimesDecodingShapes) {
  const Result r =
      run("bench --tokens 300 --dim 8 --queries-tokens 4 --self-tokens 64 "
          "--mask causal --repeats 1 --threads 2");
  ASSERT_EQ(r.status, 0);
  ASSERT_EQ(r.lines.size(), 4u);
  EXPECT_TRUE(has(r.lines[0], "\"op\": \"attend_queries\""));
  EXPECT_TRUE(has(r.lines[0], "\"query_tokens\": 4"));
  EXPECT_TRUE(has(r.lines[0], "\"tokens\": 300"));
  EXPECT_TRUE(has(r.lines[1], "\"op\": \"decode_queries\""));
  EXPECT_TRUE(has(r.lines[2], "\"op\": \"decode_token\""));
  EXPECT_TRUE(has(r.lines[2], "\"query_tokens\": 1"));
  EXPECT_TRUE(has(r.lines[3], "\"op\": \"attend_self\""));
  EXPECT_TRUE(has(r.lines[3], "\"self_tokens\": 64"));
  Result bad = run("bench --queries-tokens -1");
  EXPECT_NE(bad.status, 0);
  ASSERT_FALSE(bad.lines.empty());
  EXPECT_TRUE(has(bad.lines.back(), "--queries-tokens")) << bad.lines.back();
}

// --backward: the SDPA-shaped operator's forward and backward, per precision, in place of the
// update; the backward's FLOP are 2.5 times the forward's (the same shape in the same rounds).
TEST(BenchCommand, TimesTheBackwardPass) {
  const Result r =
      run("bench --backward --tokens 70 --dim 5 --heads 2 --mask causal --repeats 1 "
          "--threads 2 --precision fp32,bf16");
  ASSERT_EQ(r.status, 0);
  ASSERT_EQ(r.lines.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(
        has(r.lines[i], i % 2 == 0 ? "\"op\": \"sdpa_attend\"" : "\"op\": \"sdpa_backward\""))
        << r.lines[i];
    EXPECT_TRUE(has(r.lines[i], i < 2 ? "\"precision\": \"fp32\"" : "\"precision\": \"bf16\""))
        << r.lines[i];
    EXPECT_TRUE(has(r.lines[i], "\"tokens\": 70")) << r.lines[i];
  }
  Result bad = run("bench --backward --queries-tokens 4");
  EXPECT_NE(bad.status, 0);
  ASSERT_FALSE(bad.lines.empty());
  EXPECT_TRUE(has(bad.lines.back(), "--backward")) << bad.lines.back();
  bad = run("bench --backward --precision tf32");
  EXPECT_NE(bad.status, 0);
  ASSERT_FALSE(bad.lines.empty());
  EXPECT_TRUE(has(bad.lines.back(), "--backward")) << bad.lines.back();
}

TEST(BenchCommand, RejectsBadOptionsNamingThem) {
  Result r = run("bench --tokens 0");
  EXPECT_NE(r.status, 0);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--tokens")) << r.lines.back();
  r = run("bench --mask diagonal");
  EXPECT_NE(r.status, 0);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--mask")) << r.lines.back();
  r = run("bench --device tpu");
  EXPECT_NE(r.status, 0);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--device")) << r.lines.back();
}

// Sizes are refused before any work or allocation, naming the option and the bytes: the
// queries of 10^11 tokens used to be walked one by one for over an hour before a size check,
// and 4 arrays of as many queries as memory holds grew until the allocation failed.
TEST(BenchCommand, SizesThatCannotFitAreRefusedBeforeAnyWork) {
  const auto start = std::chrono::steady_clock::now();
  Result r = run("bench --queries-tokens 100000000000 --repeats 1");
  EXPECT_EQ(r.status, 256) << (r.lines.empty() ? "" : r.lines.back());
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_TRUE(has(r.lines[0], "emflow: error: --queries-tokens is too large: the run needs "))
      << r.lines[0];
  EXPECT_TRUE(has(r.lines[0], "--queries-tokens 100000000000)")) << r.lines[0];
  EXPECT_TRUE(has(r.lines[0], "bytes of memory available")) << r.lines[0];
  // Just past this machine's memory with the smallest tokens: the queries alone (4 float
  // arrays of Nq values) need the limit.
  const std::int64_t queries = memory_limit_bytes() / 16 + 1;
  r = run("bench --queries-tokens " + std::to_string(queries) + " --tokens 4 --dim 1");
  EXPECT_EQ(r.status, 256);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--queries-tokens is too large")) << r.lines.back();
  r = run("bench --tokens 4000000000000 --dim 64");
  EXPECT_EQ(r.status, 256);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--tokens is too large")) << r.lines.back();
  r = run("bench --tokens 8 --self-tokens 4000000000000");
  EXPECT_EQ(r.status, 256);
  ASSERT_FALSE(r.lines.empty());
  EXPECT_TRUE(has(r.lines.back(), "--self-tokens is too large")) << r.lines.back();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 20.0);
}
#endif

}  // namespace

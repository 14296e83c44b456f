// Error messages of the emflow binary name the option to change: sizes too large name the
// largest factor and list them all, out of memory names the output and its bytes, --threads is
// bounded, and --mask parses surrounding whitespace the same for every form.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <thread>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"
#include "emflow/types.hpp"

namespace emflow {
namespace {

namespace fs = std::filesystem;

using testing::CliRun;

class CliMessages : public testing::CliFolder {
 protected:
  CliMessages() : CliFolder("emflow_cli_messages_", "out") {}

  std::string attend(std::int64_t tokens = 6) const {
    Tensor<float> x({tokens, 2}), m({2, 2}, {0.5f, 0, 0, 0.5f});
    for (std::int64_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::cos(0.3 * i));
    write_npy(path("x.npy"), x);
    write_npy(path("m.npy"), m);
    return "attend --device cpu --x " + path("x.npy") + " --m " + path("m.npy") + " --f " +
           path("m.npy");
  }
};

TEST_F(CliMessages, SizesTooLargeNameTheLargestFactor) {
  CliRun run = emflow("flow --tokens 1000000000");
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(run.err,
            "emflow: error: --tokens is too large: --batch 1 x --tokens 1000000000 x --dim 3 = "
            "3000000000 values of the generated clouds, more than the limit of 2147483648\n");
  run = emflow("flow --batch 4 --dim 1000000000");
  EXPECT_EQ(run.err.rfind("emflow: error: --dim is too large: --batch 4 x --tokens 32 x --dim", 0),
            0u)
      << run.err;
  run = emflow("flow --layers 1000000000");
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(run.err.rfind("emflow: error: --layers is too large: 1000000001 records "
                          "(1000000000 layers of --layers, --record-every 1) x --batch 1 x "
                          "--tokens 32 x --dim 3 = 96000000096 values of the trajectory",
                          0),
            0u)
      << run.err;
  run = emflow("flow --time 1000000 --dt 0.01 --tokens 64");
  EXPECT_EQ(run.err.rfind("emflow: error: --time/--dt is too large: 100000001 records", 0), 0u)
      << run.err;
  run = emflow("phase --tokens 1000000000 --clouds 1");
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(run.err,
            "emflow: error: --tokens is too large: --clouds 1 x --betas COUNT 90 x --tokens "
            "1000000000 x --dim 2 = 180000000000 values of the sweep (every cloud at every beta), "
            "more than the limit of 2147483648\n");
  run = emflow("phase --clouds 100000000");
  EXPECT_EQ(run.err.rfind("emflow: error: --clouds is too large: --clouds 100000000 x", 0), 0u)
      << run.err;
  // Products that overflow 64 bits say so.
  run = emflow("phase --clouds 4000000000000000000 --tokens 8");
  EXPECT_EQ(run.err.rfind("emflow: error: --clouds is too large: ", 0), 0u) << run.err;
  EXPECT_NE(run.err.find("overflows 64 bits"), std::string::npos) << run.err;
}

TEST_F(CliMessages, OutOfMemoryNamesTheOutputAndItsBytes) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit this test sets";
#else
  // 2^15 tokens: the weights need 2^30 floats (4 GiB), far more than the 1 GiB of address
  // space the run gets, but less than the machine's memory, so only the allocation fails.
  const CliRun run = emflow(attend(std::int64_t{1} << 15) + " --out " + path("out/d.npy") +
                                " --weights " + path("out/w.npy"),
                            "ulimit -v 1048576;");
  EXPECT_EQ(run.status, 1);
  if (run.err.find("bytes of memory available") != std::string::npos) {
    GTEST_SKIP() << "this machine has less than 4 GiB: " << run.err;
  }
  EXPECT_EQ(
      run.err,
      "emflow: error: --weights: out of memory: the output needs 4294967296 bytes: shape (1, 1, "
      "32768, 32768), 1073741824 values of 4 bytes\n");
  EXPECT_TRUE(fs::is_empty(folder_ / "out"));
#endif
}

TEST_F(CliMessages, ThreadsAreBounded) {
  const unsigned cores = std::thread::hardware_concurrency();
  const int limit = cores == 0 ? 1024 : static_cast<int>(4 * cores);
  const std::string common = attend() + " --out " + path("out/d.npy") + " --threads ";
  CliRun run = emflow(common + "10000");
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(run.err, "emflow: error: --threads must be at most " + std::to_string(limit) +
                         " (4 per core of the " + std::to_string(cores) +
                         " cores of this machine; more threads only slow the run down), got "
                         "10000\n");
  run = emflow(common + std::to_string(limit + 1));
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_TRUE(fs::is_empty(folder_ / "out"));
  run = emflow(common + std::to_string(limit));
  EXPECT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(read_npy<float>(path("out/d.npy")).shape(), (Shape{6, 2}));
}

TEST_F(CliMessages, MaskWhitespaceIsTrimmedAroundAndRefusedInside) {
  EXPECT_EQ(parse_mask("causal ").kind, MaskKind::causal);
  EXPECT_EQ(parse_mask(" \tnone\n").kind, MaskKind::none);
  const Mask window = parse_mask(" window:3 ");
  EXPECT_EQ(window.kind, MaskKind::window);
  EXPECT_EQ(window.window, 3);
  for (const char* bad : {"window: 3", "window :3", "window:3 4", "window:+3", "win dow:3",
                          "caus al", "", "   ", "window:"}) {
    SCOPED_TRACE(bad);
    try {
      parse_mask(bad, "--mask");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(std::string("got '") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
  // The command line agrees: "causal " computes what "causal" does.
  const std::string common = attend() + " --mask ";
  CliRun run = emflow(common + "'causal ' --out " + path("out/a.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  run = emflow(common + "causal --out " + path("out/b.npy"));
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(read_npy<float>(path("out/a.npy")).values(),
            read_npy<float>(path("out/b.npy")).values());
  run = emflow(common + "none --out " + path("out/c.npy"));
  EXPECT_NE(read_npy<float>(path("out/a.npy")).values(),
            read_npy<float>(path("out/c.npy")).values());
  run = emflow(common + "'window: 3' --out " + path("out/d.npy"));
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(run.err,
            "emflow: error: parse_mask: argument '--mask' expects window:W with an integer W >= "
            "1, got 'window: 3'\n");
}

}  // namespace
}  // namespace emflow

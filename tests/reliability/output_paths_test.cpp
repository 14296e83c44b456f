// The emflow binary against outputs that are one file under two names, outputs over inputs,
// a folder where an output should go, and a kill between staging and commit: nothing is lost
// and nothing is silently wrong.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/testing.hpp"
#include "emflow/io.hpp"
#include "emflow/tensor.hpp"
#include "io/staged_file.hpp"

namespace emflow {
namespace {

namespace fs = std::filesystem;

using testing::CliRun;

class OutputPaths : public testing::CliFolder {
 protected:
  OutputPaths() : CliFolder("emflow_output_paths_", "o") {}
  void SetUp() override {
    CliFolder::SetUp();
    if (IsSkipped()) return;
    write_npy(path("x.npy"), cloud(64, 4));
    Tensor<float> identity({4, 4});
    for (int i = 0; i < 4; ++i) identity[i * 5] = 0.5f;
    write_npy(path("m.npy"), identity);
    write_npy(path("f.npy"), identity);
  }

  static Tensor<float> cloud(std::int64_t tokens, std::int64_t dim) {
    Tensor<float> x({1, tokens, dim});
    for (std::int64_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.2));
    }
    return x;
  }

  std::string attend() const {
    return "attend --device cpu --x " + path("x.npy") + " --m " + path("m.npy") + " --f " +
           path("f.npy");
  }

  // Runs emflow with `arguments` (split at spaces) in folder_, `hook` as the value of the
  // environment variable detail::kStopBeforeFsync (src/io/staged_file.hpp) when non-empty;
  // returns the child's pid, stderr in err_.
  pid_t start(const std::string& arguments, const std::string& hook = "") const {
    std::vector<std::string> words{"emflow"};
    std::istringstream in(arguments);
    for (std::string word; in >> word;) words.push_back(word);
    const std::string err = path("stderr.txt");
    const pid_t child = ::fork();
    if (child == 0) {
      std::vector<char*> argv;
      for (std::string& word : words) argv.push_back(&word[0]);
      argv.push_back(nullptr);
      if (!hook.empty()) ::setenv(emflow::detail::kStopBeforeFsync, hook.c_str(), 1);
      if (::chdir(folder_.c_str()) != 0) ::_exit(126);
      if (!std::freopen(err.c_str(), "w", stderr) || !std::freopen("/dev/null", "w", stdout)) {
        ::_exit(126);
      }
#ifdef EMFLOW_CLI_PATH
      ::execv(EMFLOW_CLI_PATH, argv.data());
#endif
      ::_exit(127);
    }
    return child;
  }

  CliRun emflow(const std::string& arguments) const {
    const pid_t child = start(arguments);
    int raw = 0;
    ::waitpid(child, &raw, 0);
    return testing::cli_outcome(raw, path("stderr.txt"));
  }

  // Whether `name` still holds what put() wrote there ("OLD <name>"), without printing a whole
  // .npy file when it does not.
  ::testing::AssertionResult holds_old(const std::string& name) const {
    const std::string text = text_of(name);
    if (text == "OLD " + name) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << name << " was replaced (" << text.size()
                                         << " bytes, starting '" << text.substr(0, 6) << "')";
  }
};

TEST_F(OutputPaths, AttendRefusesTwoOutputsThatAreOneFile) {
  fs::create_directory_symlink(folder_ / "o", folder_ / "olink");
  const std::string d = path("o/d.npy");
  const std::vector<std::string> spellings = {"o/./d.npy", path("o/./d.npy"), "o/../o/d.npy",
                                              "olink/d.npy", path("o//d.npy")};
  for (const std::string& spelling : spellings) {
    SCOPED_TRACE(spelling);
    const CliRun run = emflow(attend() + " --out o/d.npy --lse " + spelling);
    EXPECT_EQ(run.status, 1) << run.err;
    EXPECT_EQ(run.err, "emflow: error: --lse '" + spelling + "' is also the file of --out " +
                           "'o/d.npy' (both are '" + d + "'); each output needs its own file\n");
    EXPECT_TRUE(entries("o").empty());
  }
  // A hard link to an existing output.
  put("o/d.npy", "OLD");
  fs::create_hard_link(d, path("o/e.npy"));
  const CliRun run = emflow(attend() + " --out o/d.npy --weights o/e.npy");
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--weights 'o/e.npy' is also the file of --out 'o/d.npy'"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(text_of("o/d.npy"), "OLD");
}

TEST_F(OutputPaths, FlowAndPhaseRefuseTwoOutputsThatAreOneFile) {
  CliRun run = emflow("flow --tokens 4 --time 0.2 --out o/o.npy --plot o/./o.npy");
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--plot 'o/./o.npy' is also the file of --out 'o/o.npy' (both are '" +
                         path("o/o.npy") + "')"),
            std::string::npos)
      << run.err;
  EXPECT_TRUE(entries("o").empty());
  run = emflow("phase --tokens 4 --clouds 2 --betas 1:2:2 --time 0.2 --plot o/p.png --out " +
               path("o/p.png"));
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--out '" + path("o/p.png") + "' is also the file of --plot 'o/p.png'"),
            std::string::npos)
      << run.err;
  EXPECT_TRUE(entries("o").empty());
}

TEST_F(OutputPaths, AnOutputOverAnInputIsRefused) {
  const std::string before = text_of("x.npy");
  for (const std::string& spelling : {std::string("x.npy"), std::string("./o/../x.npy")}) {
    SCOPED_TRACE(spelling);
    const CliRun run = emflow(attend() + " --out " + spelling);
    EXPECT_EQ(run.status, 1) << run.err;
    EXPECT_EQ(run.err, "emflow: error: --out '" + spelling + "' is the input file of --x '" +
                           path("x.npy") + "' (both are '" + path("x.npy") +
                           "'); an output may not replace an input of the same run\n");
  }
  CliRun run = emflow(attend() + " --out o/d.npy --lse " + path("m.npy"));
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--lse '" + path("m.npy") + "' is the input file of --m"),
            std::string::npos)
      << run.err;
  run = emflow("flow --layers 1 --x x.npy --out ./x.npy");
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_NE(run.err.find("--out './x.npy' is the input file of --x 'x.npy'"), std::string::npos)
      << run.err;
  EXPECT_EQ(text_of("x.npy"), before);
  EXPECT_TRUE(entries("o").empty());
}

TEST_F(OutputPaths, AFolderWhereAnOutputShouldGoKeepsTheOldFiles) {
  put("o/d.npy", "OLD");
  fs::create_directory(path("o/wdir"));
  const CliRun run = emflow(attend() + " --out o/d.npy --weights o/wdir");
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_EQ(run.err, "emflow: error: --weights 'o/wdir' is a folder; expected a file name\n");
  EXPECT_EQ(text_of("o/d.npy"), "OLD");
  EXPECT_EQ(entries("o"), (std::vector<std::string>{"d.npy", "wdir"}));
}

// Killed while the last temporary file is being flushed (the long part of a large --weights),
// the run leaves every old output as it was; the next run removes its temporary files.
TEST_F(OutputPaths, AKillBeforeTheRenamesLeavesEveryOldFile) {
  write_npy(path("x.npy"), cloud(1024, 4));  // the weights are 1024 x 1024 floats, 4 MiB
  for (const char* name : {"o/d.npy", "o/l.npy", "o/w.npy"}) put(name, std::string("OLD ") + name);
  const std::string arguments = attend() + " --out o/d.npy --lse o/l.npy --weights o/w.npy";
  const pid_t child = start(arguments, "w.npy");
  int raw = 0;
  ASSERT_EQ(::waitpid(child, &raw, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(raw)) << "the test hook did not stop the run: exit " << raw;
  // Every output is staged; no old file has been replaced.
  const std::string prefix = ".emflow-tmp-" + std::to_string(child) + "-";
  auto temporaries = [&] {
    int count = 0;
    for (const std::string& name : entries("o")) count += name.find(prefix) != std::string::npos;
    return count;
  };
  EXPECT_EQ(temporaries(), 3);
  for (const char* name : {"o/d.npy", "o/l.npy", "o/w.npy"}) EXPECT_TRUE(holds_old(name));
  ::kill(child, SIGKILL);
  ASSERT_EQ(::waitpid(child, &raw, 0), child);
  EXPECT_TRUE(WIFSIGNALED(raw));
  for (const char* name : {"o/d.npy", "o/l.npy", "o/w.npy"}) EXPECT_TRUE(holds_old(name));
  EXPECT_EQ(temporaries(), 3);  // SIGKILL cleans nothing up

  // The next run on the same targets writes every output and removes the leftovers.
  const CliRun run = emflow(arguments);
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(entries("o"), (std::vector<std::string>{"d.npy", "l.npy", "w.npy"}));
  EXPECT_EQ(read_npy<float>(path("o/d.npy")).shape(), (Shape{1, 1024, 4}));
  EXPECT_EQ(read_npy<float>(path("o/l.npy")).shape(), (Shape{1, 1, 1024}));
  const Tensor<float> weights = read_npy<float>(path("o/w.npy"));
  ASSERT_EQ(weights.shape(), (Shape{1, 1, 1024, 1024}));
  double row = 0;
  for (std::int64_t j = 0; j < 1024; ++j) row += weights[5 * 1024 + j];
  EXPECT_NEAR(row, 1.0, 1e-4);  // a row of attention weights sums to one
}

}  // namespace
}  // namespace emflow

// emflow::OutputFiles against hostile paths and failures: one file under two spellings (or two
// links) is refused, an output may not be an input, a folder target is refused up front, a
// failed rename brings the old files back, and the temporary files of dead processes are
// removed by the next write to their target.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "common/files.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"

namespace fs = std::filesystem;

namespace {

using emflow::testing::error_of;

class OutputCommit : public emflow::testing::FileFolder {
 protected:
  OutputCommit() : FileFolder("emflow_commit_") {}
  void TearDown() override {
    std::error_code ignored;
    fs::current_path(start_, ignored);
    FileFolder::TearDown();
  }

  // The temporary files beside `target` (a file name in folder_).
  std::vector<std::string> temporaries_of(const std::string& target) const {
    std::vector<std::string> found;
    for (const std::string& name : entries(".")) {
      if (name.rfind("." + target + ".emflow-tmp-", 0) == 0) found.push_back(name);
    }
    return found;
  }

  fs::path start_ = fs::current_path();
};

const emflow::Tensor<double> kArray({2, 3}, {1, 2, 3, 4, 5, 6.5});

// A pid that belonged to a process that has exited (and been reaped).
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

TEST_F(OutputCommit, OneFileUnderAnotherSpellingIsRefusedNamingBothOptionsAndTheFile) {
  fs::create_directory(path("sub"));
  fs::create_directory_symlink(folder_, path("link"));
  put("a.npy", "OLD");
  fs::create_hard_link(path("a.npy"), path("hard.npy"));
  fs::create_symlink(path("a.npy"), path("soft.npy"));
  fs::current_path(folder_);
  const std::string canonical = path("a.npy");
  const std::vector<std::string> spellings = {path("./a.npy"),    path("sub/../a.npy"),
                                              path("link/a.npy"), "a.npy",
                                              "./sub/../a.npy",   folder_.string() + "//a.npy"};
  for (const std::string& spelling : spellings) {
    SCOPED_TRACE(spelling);
    emflow::OutputFiles outputs;
    outputs.declare("--out", path("a.npy"));
    const std::string message =
        error_of(emflow::ErrorCode::invalid_argument, [&] { outputs.declare("--lse", spelling); });
    EXPECT_EQ(message, "--lse '" + spelling + "' is also the file of --out '" + path("a.npy") +
                           "' (both are '" + canonical + "'); each output needs its own file");
  }
  // Two names of one file on disk: a hard link and a symbolic link.
  for (const std::string& other : {path("hard.npy"), path("soft.npy")}) {
    SCOPED_TRACE(other);
    emflow::OutputFiles outputs;
    outputs.declare("--out", path("a.npy"));
    const std::string message =
        error_of(emflow::ErrorCode::invalid_argument, [&] { outputs.declare("--lse", other); });
    EXPECT_NE(message.find("--lse '" + other + "' is also the file of --out '" + path("a.npy")),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("are one file"), std::string::npos) << message;
  }
  EXPECT_EQ(text_of("a.npy"), "OLD");
}

TEST_F(OutputCommit, DifferentFilesAreAccepted) {
  put("a.npy", "OLD");
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.declare("--lse", path("a.npy2"));
  outputs.declare("--entropy", path(".a.npy"));
  outputs.declare_input("--x", path("b.npy"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.stage_npy(path("a.npy2"), kArray);
  outputs.stage_npy(path(".a.npy"), kArray);
  outputs.commit();
  EXPECT_EQ(entries("."), (std::vector<std::string>{".a.npy", "a.npy", "a.npy2"}));
  EXPECT_EQ(emflow::read_npy<double>(path("a.npy")).values(), kArray.values());
}

TEST_F(OutputCommit, AnOutputThatIsAnInputIsRefused) {
  emflow::write_npy(path("x.npy"), kArray);
  fs::create_symlink(path("x.npy"), path("to_x.npy"));
  for (const std::string& spelling : {path("x.npy"), path("./x.npy"), path("to_x.npy")}) {
    SCOPED_TRACE(spelling);
    {  // input first
      emflow::OutputFiles outputs;
      outputs.declare_input("--x", path("x.npy"));
      const std::string message = error_of(emflow::ErrorCode::invalid_argument,
                                           [&] { outputs.declare("--out", spelling); });
      EXPECT_EQ(message.rfind(
                    "--out '" + spelling + "' is the input file of --x '" + path("x.npy") + "'", 0),
                0u)
          << message;
      EXPECT_NE(message.find("an output may not replace an input"), std::string::npos);
    }
    {  // output first
      emflow::OutputFiles outputs;
      outputs.declare("--out", spelling);
      const std::string message = error_of(emflow::ErrorCode::invalid_argument,
                                           [&] { outputs.declare_input("--x", path("x.npy")); });
      EXPECT_NE(message.find("is the input file of --x"), std::string::npos) << message;
    }
  }
  EXPECT_EQ(emflow::read_npy<double>(path("x.npy")).values(), kArray.values());
}

TEST_F(OutputCommit, AFolderTargetIsRefusedUpFront) {
  fs::create_directory(path("wdir"));
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  EXPECT_EQ(error_of(emflow::ErrorCode::invalid_argument,
                     [&] { outputs.declare("--weights", path("wdir")); }),
            "--weights '" + path("wdir") + "' is a folder; expected a file name");
  EXPECT_EQ(error_of(emflow::ErrorCode::invalid_argument,
                     [&] { outputs.declare("--lse", path("wdir") + "/.."); }),
            "--lse '" + path("wdir") + "/..' is not a file name");
}

TEST_F(OutputCommit, AFailedRenameBringsBackTheOldFiles) {
  put("a.npy", "OLD-A");
  put("c.npy", "OLD-C");
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.declare("--lse", path("b.npy"));  // a new file
  outputs.declare("--weights", path("c.npy"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.stage_npy(path("b.npy"), kArray);
  outputs.stage_npy(path("c.npy"), kArray);
  // Another process removes the last temporary file: its rename fails after the others.
  const std::vector<std::string> last = temporaries_of("c.npy");
  ASSERT_EQ(last.size(), 1u);
  fs::remove(path(last[0]));
  const std::string message = error_of(emflow::ErrorCode::io, [&] { outputs.commit(); });
  EXPECT_EQ(message.rfind(
                "--weights: write_npy: cannot write '" + path("c.npy") + "': rename failed: ", 0),
            0u)
      << message;
  EXPECT_EQ(text_of("a.npy"), "OLD-A");
  EXPECT_EQ(text_of("c.npy"), "OLD-C");
  EXPECT_EQ(entries("."), (std::vector<std::string>{"a.npy", "c.npy"}));  // no backup, no temporary
}

TEST_F(OutputCommit, AFolderAppearingAfterDeclareIsRefusedBeforeAnyRename) {
  put("a.npy", "OLD-A");
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.declare("--weights", path("w.npy"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.stage_npy(path("w.npy"), kArray);
  fs::create_directory(path("w.npy"));
  const std::string message = error_of(emflow::ErrorCode::io, [&] { outputs.commit(); });
  EXPECT_EQ(message, "--weights: write_npy: cannot write '" + path("w.npy") +
                         "': it is a folder: Is a directory");
  EXPECT_EQ(text_of("a.npy"), "OLD-A");
  EXPECT_EQ(entries("."), (std::vector<std::string>{"a.npy", "w.npy"}));
  EXPECT_TRUE(fs::is_empty(path("w.npy")));
}

TEST_F(OutputCommit, TemporariesAreNamedForTheirTargetAndTheProcess) {
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.stage_npy(path("a.npy"), kArray);
  const std::vector<std::string> staged = temporaries_of("a.npy");
  ASSERT_EQ(staged.size(), 1u);
  const std::string prefix = ".a.npy.emflow-tmp-" + std::to_string(::getpid()) + "-";
  ASSERT_EQ(staged[0].rfind(prefix, 0), 0u) << staged[0];
  const std::string word = staged[0].substr(prefix.size());
  EXPECT_FALSE(word.empty());
  EXPECT_EQ(word.find_first_not_of("0123456789abcdef"), std::string::npos) << word;
  outputs.commit();
  EXPECT_EQ(entries("."), std::vector<std::string>{"a.npy"});
}

TEST_F(OutputCommit, LeftoversOfDeadProcessesAreRemovedByTheNextWriteToTheirTarget) {
  const std::string dead = std::to_string(dead_pid());
  const std::string alive = std::to_string(::getppid());  // the process that runs this test
  const std::vector<std::string> stale = {".a.npy.emflow-tmp-" + dead + "-1f2e",
                                          ".a.npy.emflow-bak-" + dead + "-3c"};
  const std::vector<std::string> kept = {
      ".a.npy.emflow-tmp-" + alive + "-1f2e",  // its writer may still be running
      ".b.npy.emflow-tmp-" + dead + "-1f2e",   // another target
      ".a.npy.emflow-tmp-" + dead + "-xyz",    // not a name emflow gives
      "a.npy.emflow-tmp-" + dead + "-1f"};
  for (const std::string& name : stale) put(name, "partial");
  for (const std::string& name : kept) put(name, "partial");

  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.commit();
  std::vector<std::string> expected = kept;
  expected.push_back("a.npy");
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(entries("."), expected);

  // write_npy of one file cleans up the same way.
  put(".b.npy.emflow-tmp-" + dead + "-9", "partial");
  emflow::write_npy(path("b.npy"), kArray);
  for (const std::string& name : entries(".")) {
    EXPECT_EQ(name.find(".b.npy.emflow-tmp-" + dead), std::string::npos) << name;
  }
}

}  // namespace

// emflow::OutputFiles: several outputs written all or none, errors that start with the name of
// the target, and no temporary file left behind whatever happens.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/files.hpp"
#include "emflow/error.hpp"
#include "emflow/io.hpp"

namespace fs = std::filesystem;

namespace {

using emflow::testing::error_of;

class OutputFilesTest : public emflow::testing::FileFolder {
 protected:
  OutputFilesTest() : FileFolder("emflow_outputs_") {}
};

const emflow::Tensor<double> kArray({2, 3}, {1, 2, 3, 4, 5, 6.5});

TEST_F(OutputFilesTest, CommitWritesEveryStagedFile) {
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.declare("--csv", path("b.csv"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.stage_bytes(path("b.csv"), "x,y\n1,2\n");
  EXPECT_EQ(entries(".").size(), 2u);  // two temporary files, no target yet
  outputs.commit();
  EXPECT_EQ(entries("."), (std::vector<std::string>{"a.npy", "b.csv"}));
  const emflow::Tensor<double> back = emflow::read_npy<double>(path("a.npy"));
  EXPECT_EQ(back.shape(), kArray.shape());
  EXPECT_EQ(back.values(), kArray.values());
  std::ifstream csv(path("b.csv"));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(csv), {}), "x,y\n1,2\n");
}

TEST_F(OutputFilesTest, AFailedRenameTakesBackTheTargetsAlreadyInPlace) {
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  outputs.declare("--weights", path("taken"));
  outputs.stage_npy(path("a.npy"), kArray);
  outputs.stage_npy(path("taken"), kArray);
  fs::create_directory(path("taken"));  // after declare(), which refuses a folder
  const std::string message = error_of(emflow::ErrorCode::io, [&] { outputs.commit(); });
  EXPECT_EQ(message.rfind("--weights: write_npy: cannot write '" + path("taken") + "'", 0), 0u)
      << message;
  EXPECT_EQ(entries("."), std::vector<std::string>{"taken"});
  EXPECT_TRUE(fs::is_empty(path("taken")));
}

TEST_F(OutputFilesTest, WithoutCommitNothingIsWritten) {
  {
    emflow::OutputFiles outputs;
    outputs.declare("--out", path("a.npy"));
    outputs.stage_npy(path("a.npy"), kArray);
  }
  EXPECT_TRUE(entries(".").empty());
}

TEST_F(OutputFilesTest, DeclareRefusesBadTargetsNamingThem) {
  emflow::OutputFiles outputs;
  outputs.declare("--out", path("a.npy"));
  using emflow::ErrorCode;
  EXPECT_EQ(error_of(ErrorCode::invalid_argument, [&] { outputs.declare("--lse", ""); }),
            "--lse needs a file name, got ''");
  EXPECT_EQ(error_of(ErrorCode::invalid_argument, [&] { outputs.declare("--lse", path("a.npy")); }),
            "--lse '" + path("a.npy") + "' is also the file of --out '" + path("a.npy") +
                "' (both are '" + fs::weakly_canonical(path("a.npy")).string() +
                "'); each output needs its own file");
  EXPECT_EQ(
      error_of(ErrorCode::invalid_argument, [&] { outputs.declare("--lse", path("no/l.npy")); }),
      "--lse '" + path("no/l.npy") + "': the folder '" + path("no") + "' does not exist");
  const std::string undeclared =
      error_of(ErrorCode::invalid_argument, [&] { outputs.stage_npy(path("b.npy"), kArray); });
  EXPECT_NE(undeclared.find("was not declared"), std::string::npos) << undeclared;
  EXPECT_TRUE(entries(".").empty());
}

}  // namespace

// The distributed suites run under mpirun, every rank running every test: a test passes only
// when it passes on every rank (mpirun's exit status is nonzero if any rank's is). Only rank 0
// prints gtest's report; the others print their failures only, prefixed by their rank.
#include <gtest/gtest.h>

#include <iostream>
#include <memory>

#include "comm.hpp"
#include "emflow/distributed.hpp"

namespace emflow::testing {

distributed::Communicator& comm() { return *world_communicator(); }

std::unique_ptr<distributed::Communicator>& world_communicator() {
  static std::unique_ptr<distributed::Communicator> world;
  return world;
}

namespace {

class RankFailures : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailures(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::cerr << "[rank " << rank_ << "] " << result.file_name() << ":" << result.line_number()
                << ": " << result.summary() << "\n";
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace emflow::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
#if EMFLOW_WITH_MPI
  emflow::testing::world_communicator() = emflow::distributed::world(&argc, &argv);
#else
  emflow::testing::world_communicator() = std::make_unique<emflow::distributed::SingleProcess>();
#endif
  const int rank = emflow::testing::comm().rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new emflow::testing::RankFailures(rank));
  }
  const int status = RUN_ALL_TESTS();
  emflow::testing::world_communicator().reset();
  return status;
}

// The NCCL communicator, bootstrapped over the job's MPI communicator, on device buffers: a ring
// shift, the reductions, a broadcast and a gather. Built with NCCL; each rank needs a GPU of its
// own (NCCL refuses two ranks on one device), so the test skips on every rank when the machine
// has fewer GPUs than the job has ranks, and everywhere without a GPU.
#if EMFLOW_WITH_NCCL && EMFLOW_WITH_MPI
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm.hpp"
#include "emflow/distributed_nccl.hpp"

namespace emflow::testing {
namespace {

class NcclCommunicator : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    if (devices < comm().size()) {
      GTEST_SKIP() << "needs one GPU per rank: " << devices << " GPU(s) for " << comm().size()
                   << " rank(s)";
    }
    ASSERT_EQ(cudaSetDevice(comm().rank()), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    nccl_ = distributed::make_nccl_communicator(comm(), stream_);
  }
  void TearDown() override {
    nccl_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  template <class T>
  T* device(std::size_t count) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
    allocations_.push_back(p);
    return static_cast<T*>(p);
  }
  ~NcclCommunicator() override {
    for (void* p : allocations_) cudaFree(p);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<distributed::Communicator> nccl_;
  std::vector<void*> allocations_;
};

TEST_F(NcclCommunicator, RanksMatchTheHostCommunicator) {
  EXPECT_EQ(nccl_->rank(), comm().rank());
  EXPECT_EQ(nccl_->size(), comm().size());
  EXPECT_EQ(nccl_->memory(), distributed::Memory::device);
}

TEST_F(NcclCommunicator, RingShiftOverlapsTheStreamAndDeliversThePreviousRanksBytes) {
  const int P = nccl_->size(), r = nccl_->rank();
  const std::size_t n = 1 << 20;
  std::vector<std::int32_t> mine(n);
  for (std::size_t i = 0; i < n; ++i) mine[i] = static_cast<std::int32_t>(i * 3 + r);
  auto* send = device<std::int32_t>(n);
  auto* recv = device<std::int32_t>(n);
  ASSERT_EQ(cudaMemcpyAsync(send, mine.data(), n * 4, cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
  auto transfer = nccl_->start_shift(send, n * 4, recv, n * 4);
  nccl_->wait(*transfer);
  std::vector<std::int32_t> got(n);
  ASSERT_EQ(cudaMemcpyAsync(got.data(), recv, n * 4, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const int from = (r + P - 1) % P;
  for (std::size_t i = 0; i < n; i += 4099) {
    ASSERT_EQ(got[i], static_cast<std::int32_t>(i * 3 + from)) << i;
  }
}

TEST_F(NcclCommunicator, SumsAreInRankOrderAndIntegersExact) {
  const int P = nccl_->size(), r = nccl_->rank();
  std::vector<double> values = {(r % 2 ? -1e16 : 1e16) + r, 0.5 * r};
  nccl_->allreduce_sum(values.data(), 2);
  double expected0 = 1e16, expected1 = 0.0;
  for (int k = 1; k < P; ++k) {
    expected0 += (k % 2 ? -1e16 : 1e16) + k;
    expected1 += 0.5 * k;
  }
  EXPECT_EQ(values[0], expected0);
  EXPECT_EQ(values[1], expected1);
  std::vector<std::int64_t> counts = {r, 1};
  nccl_->allreduce_sum(counts.data(), 2);
  EXPECT_EQ(counts, (std::vector<std::int64_t>{P * (P - 1) / 2, P}));
  std::vector<std::int64_t> low = {10 - r};
  nccl_->allreduce_min(low.data(), 1);
  EXPECT_EQ(low[0], 10 - (P - 1));
}

TEST_F(NcclCommunicator, BroadcastAndGatherOnDeviceMemory) {
  const int P = nccl_->size(), r = nccl_->rank();
  auto* word = device<std::int64_t>(1);
  const std::int64_t value = 1000 + r;
  ASSERT_EQ(cudaMemcpyAsync(word, &value, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  nccl_->broadcast(word, 8, P - 1);
  std::int64_t got = 0;
  ASSERT_EQ(cudaMemcpyAsync(&got, word, 8, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(got, 1000 + P - 1);

  auto* all = device<std::int64_t>(static_cast<std::size_t>(P));
  ASSERT_EQ(cudaMemcpyAsync(word, &value, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  nccl_->gather(word, all, std::vector<std::size_t>(static_cast<std::size_t>(P), 8), 0);
  std::vector<std::int64_t> host(static_cast<std::size_t>(P));
  ASSERT_EQ(cudaMemcpyAsync(host.data(), all, 8 * host.size(), cudaMemcpyDeviceToHost, stream_),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  if (r == 0) {
    for (int k = 0; k < P; ++k) EXPECT_EQ(host[static_cast<std::size_t>(k)], 1000 + k);
  }
}

}  // namespace
}  // namespace emflow::testing
#endif

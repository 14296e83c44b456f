// The NCCL communicator (emflow/distributed_nccl.hpp).
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "emflow/distributed.hpp"
#include "emflow/distributed_nccl.hpp"

namespace emflow::distributed {

namespace {

void check_nccl(ncclResult_t status, const char* call) {
  if (status != ncclSuccess) {
    detail::fail(ErrorCode::device, "distributed: ", call, " failed: ", ncclGetErrorString(status));
  }
}

void check_cuda(cudaError_t status, const char* call) {
  if (status == cudaErrorMemoryAllocation) {
    detail::fail(ErrorCode::out_of_memory, "distributed: ", call, ": out of device memory");
  }
  if (status != cudaSuccess) {
    detail::fail(ErrorCode::device, "distributed: ", call, " failed: ", cudaGetErrorString(status));
  }
}

struct NcclTransfer final : Transfer {
  cudaEvent_t done = nullptr;
  ~NcclTransfer() override {
    if (done) cudaEventDestroy(done);
  }
};

// Device scratch of at least `bytes`, kept between calls.
class Scratch {
 public:
  ~Scratch() {
    if (data_) cudaFree(data_);
  }
  void* get(std::size_t bytes) {
    if (bytes > size_) {
      if (data_) check_cuda(cudaFree(data_), "cudaFree");
      data_ = nullptr;
      size_ = 0;
      check_cuda(cudaMalloc(&data_, bytes), "cudaMalloc");
      size_ = bytes;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, bool owns)
      : comm_(comm), stream_(stream), owns_(owns) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
    check_cuda(cudaStreamCreateWithFlags(&transfers_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(transfers_);
    cudaStreamDestroy(transfers_);
    if (owns_) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::device; }

  std::unique_ptr<Transfer> start_shift(const void* send, std::size_t send_bytes, void* recv,
                                        std::size_t recv_bytes) override {
    auto transfer = std::make_unique<NcclTransfer>();
    cudaEvent_t ready = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&transfer->done, cudaEventDisableTiming),
               "cudaEventCreate");
    // The second stream starts once the compute stream has produced what is sent.
    cudaError_t status = cudaEventRecord(ready, stream_);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(transfers_, ready, 0);
    cudaEventDestroy(ready);
    check_cuda(status, "cudaStreamWaitEvent");
    if (size_ == 1) {
      if (send_bytes != recv_bytes) detail::fail(ErrorCode::internal, "shift: sizes differ");
      if (send_bytes > 0 && send != recv) {
        check_cuda(cudaMemcpyAsync(recv, send, send_bytes, cudaMemcpyDeviceToDevice, transfers_),
                   "cudaMemcpyAsync");
      }
    } else {
      const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      if (send_bytes > 0)
        check_nccl(ncclSend(send, send_bytes, ncclChar, next, comm_, transfers_), "ncclSend");
      if (recv_bytes > 0)
        check_nccl(ncclRecv(recv, recv_bytes, ncclChar, previous, comm_, transfers_), "ncclRecv");
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    }
    check_cuda(cudaEventRecord(transfer->done, transfers_), "cudaEventRecord");
    return transfer;
  }

  void wait(Transfer& transfer) override {
    auto& t = static_cast<NcclTransfer&>(transfer);
    check_cuda(cudaStreamWaitEvent(stream_, t.done, 0), "cudaStreamWaitEvent");
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    check_nccl(async, "a ring transfer");
  }

  void allreduce_sum(double* values, std::int64_t count) override {
    if (count <= 0) return;
    // Gathered, then added in rank order on the host (NCCL's ring or tree adds in an order of
    // its own).
    const std::size_t n = static_cast<std::size_t>(count);
    std::vector<double> all(n * static_cast<std::size_t>(size_));
    auto* device = static_cast<double*>(scratch_.get(all.size() * sizeof(double)));
    double* mine = device + n * static_cast<std::size_t>(rank_);
    check_cuda(cudaMemcpyAsync(mine, values, n * sizeof(double), cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync");
    check_nccl(ncclAllGather(mine, device, n, ncclFloat64, comm_, stream_), "ncclAllGather");
    check_cuda(cudaMemcpyAsync(all.data(), device, all.size() * sizeof(double),
                               cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    for (std::size_t i = 0; i < n; ++i) {
      double sum = all[i];
      for (int r = 1; r < size_; ++r) sum += all[static_cast<std::size_t>(r) * n + i];
      values[i] = sum;
    }
  }

  void allreduce_sum(std::int64_t* values, std::int64_t count) override {
    reduce(values, count, ncclSum);
  }
  void allreduce_min(std::int64_t* values, std::int64_t count) override {
    reduce(values, count, ncclMin);
  }

  void broadcast(void* data, std::size_t bytes, int root) override {
    if (bytes == 0) return;
    check_nccl(ncclBroadcast(data, data, bytes, ncclChar, root, comm_, stream_), "ncclBroadcast");
  }

  void gather(const void* send, void* recv, const std::vector<std::size_t>& counts,
              int root) override {
    if (counts.size() != static_cast<std::size_t>(size_)) {
      detail::fail(ErrorCode::internal, "gather: ", counts.size(), " counts for ", size_, " ranks");
    }
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    if (rank_ == root) {
      char* out = static_cast<char*>(recv);
      for (int r = 0; r < size_; ++r) {
        const std::size_t bytes = counts[static_cast<std::size_t>(r)];
        if (r == rank_) {
          if (bytes > 0) {
            check_cuda(cudaMemcpyAsync(out, send, bytes, cudaMemcpyDeviceToDevice, stream_),
                       "cudaMemcpyAsync");
          }
        } else if (bytes > 0) {
          check_nccl(ncclRecv(out, bytes, ncclChar, r, comm_, stream_), "ncclRecv");
        }
        out += bytes;
      }
    } else if (counts[static_cast<std::size_t>(rank_)] > 0) {
      check_nccl(
          ncclSend(send, counts[static_cast<std::size_t>(rank_)], ncclChar, root, comm_, stream_),
          "ncclSend");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  void reduce(std::int64_t* values, std::int64_t count, ncclRedOp_t op) {
    if (count <= 0) return;
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(std::int64_t);
    void* device = scratch_.get(bytes);
    check_cuda(cudaMemcpyAsync(device, values, bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync");
    check_nccl(ncclAllReduce(device, device, static_cast<std::size_t>(count), ncclInt64, op, comm_,
                             stream_),
               "ncclAllReduce");
    check_cuda(cudaMemcpyAsync(values, device, bytes, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaStream_t transfers_ = nullptr;
  bool owns_;
  int rank_ = 0;
  int size_ = 1;
  Scratch scratch_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream) {
  return std::make_unique<NcclCommunicator>(comm, stream, false);
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, cudaStream_t stream) {
  if (host.memory() != Memory::host) {
    detail::fail(ErrorCode::invalid_argument,
                 "distributed: the NCCL bootstrap needs a host "
                 "communicator (MPI)");
  }
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  agreed(host, [&] {
    if (host.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  });
  host.broadcast(&id, sizeof id, 0);
  ncclComm_t comm = nullptr;
  try {
    agreed(host, [&] {
      check_nccl(ncclCommInitRank(&comm, host.size(), id, host.rank()), "ncclCommInitRank");
    });
  } catch (...) {
    if (comm) ncclCommDestroy(comm);
    throw;
  }
  try {
    return std::make_unique<NcclCommunicator>(comm, stream, true);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

}  // namespace emflow::distributed

// The MPI communicator (emflow/distributed_mpi.hpp) and the world() communicator of programs
// that do not use MPI themselves.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "emflow/distributed.hpp"
#include "emflow/distributed_mpi.hpp"

namespace emflow::distributed {

namespace {

// MPI counts are int: larger buffers travel as several messages of at most this many bytes,
// which MPI keeps in order (same source, tag and communicator).
constexpr std::size_t kChunk = std::size_t{1} << 30;
constexpr int kShiftTag = 0x656d;
constexpr int kGatherTag = 0x656e;

void check(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  detail::fail(ErrorCode::io, "distributed: ", call, " failed: ", std::string(text, length));
}

int chunk_count(std::size_t bytes) { return static_cast<int>((bytes + kChunk - 1) / kChunk); }
int chunk_size(std::size_t bytes, int k) {
  return static_cast<int>(std::min(kChunk, bytes - static_cast<std::size_t>(k) * kChunk));
}

struct MpiTransfer final : Transfer {
  std::vector<MPI_Request> requests;
};

class MpiCommunicator : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      detail::fail(ErrorCode::invalid_argument, "distributed: MPI is not initialised");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override { free_comm(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::host; }

  std::unique_ptr<Transfer> start_shift(const void* send, std::size_t send_bytes, void* recv,
                                        std::size_t recv_bytes) override {
    auto transfer = std::make_unique<MpiTransfer>();
    const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
    for (int k = 0; k < chunk_count(recv_bytes); ++k) {
      MPI_Request request;
      check(MPI_Irecv(static_cast<char*>(recv) + static_cast<std::size_t>(k) * kChunk,
                      chunk_size(recv_bytes, k), MPI_BYTE, previous, kShiftTag, comm_, &request),
            "MPI_Irecv");
      transfer->requests.push_back(request);
    }
    for (int k = 0; k < chunk_count(send_bytes); ++k) {
      MPI_Request request;
      check(MPI_Isend(static_cast<const char*>(send) + static_cast<std::size_t>(k) * kChunk,
                      chunk_size(send_bytes, k), MPI_BYTE, next, kShiftTag, comm_, &request),
            "MPI_Isend");
      transfer->requests.push_back(request);
    }
    return transfer;
  }

  void wait(Transfer& transfer) override {
    auto& requests = static_cast<MpiTransfer&>(transfer).requests;
    if (requests.empty()) return;
    check(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
    requests.clear();
  }

  void poll(Transfer& transfer) override {
    auto& requests = static_cast<MpiTransfer&>(transfer).requests;
    if (requests.empty()) return;
    int done = 0;
    check(
        MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE),
        "MPI_Testall");
  }

  void allreduce_sum(double* values, std::int64_t count) override {
    if (count <= 0) return;
    // Every rank's values, then the sum in rank order: MPI_Allreduce may add in any order (and
    // differently from run to run with some algorithms), this one cannot.
    if (count > INT_MAX / size_)
      detail::fail(ErrorCode::invalid_argument, "allreduce: too many values");
    std::vector<double> all(static_cast<std::size_t>(count) * static_cast<std::size_t>(size_));
    check(MPI_Allgather(values, static_cast<int>(count), MPI_DOUBLE, all.data(),
                        static_cast<int>(count), MPI_DOUBLE, comm_),
          "MPI_Allgather");
    for (std::int64_t i = 0; i < count; ++i) {
      double sum = all[static_cast<std::size_t>(i)];
      for (int r = 1; r < size_; ++r) sum += all[static_cast<std::size_t>(r * count + i)];
      values[i] = sum;
    }
  }

  void allreduce_sum(std::int64_t* values, std::int64_t count) override {
    reduce(values, count, MPI_SUM);
  }
  void allreduce_min(std::int64_t* values, std::int64_t count) override {
    reduce(values, count, MPI_MIN);
  }

  void broadcast(void* data, std::size_t bytes, int root) override {
    for (int k = 0; k < chunk_count(bytes); ++k) {
      check(MPI_Bcast(static_cast<char*>(data) + static_cast<std::size_t>(k) * kChunk,
                      chunk_size(bytes, k), MPI_BYTE, root, comm_),
            "MPI_Bcast");
    }
  }

  void gather(const void* send, void* recv, const std::vector<std::size_t>& counts,
              int root) override {
    if (counts.size() != static_cast<std::size_t>(size_)) {
      detail::fail(ErrorCode::internal, "gather: ", counts.size(), " counts for ", size_, " ranks");
    }
    const std::size_t own = counts[static_cast<std::size_t>(rank_)];
    if (rank_ != root) {
      for (int k = 0; k < chunk_count(own); ++k) {
        check(MPI_Send(static_cast<const char*>(send) + static_cast<std::size_t>(k) * kChunk,
                       chunk_size(own, k), MPI_BYTE, root, kGatherTag, comm_),
              "MPI_Send");
      }
      return;
    }
    // Point to point rather than MPI_Gatherv, whose int displacements stop at 2 GiB.
    char* out = static_cast<char*>(recv);
    for (int r = 0; r < size_; ++r) {
      const std::size_t bytes = counts[static_cast<std::size_t>(r)];
      if (r == rank_) {
        if (bytes > 0) std::memcpy(out, send, bytes);
      } else {
        for (int k = 0; k < chunk_count(bytes); ++k) {
          check(MPI_Recv(out + static_cast<std::size_t>(k) * kChunk, chunk_size(bytes, k), MPI_BYTE,
                         r, kGatherTag, comm_, MPI_STATUS_IGNORE),
                "MPI_Recv");
        }
      }
      out += bytes;
    }
  }

 protected:
  void free_comm() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

 private:
  void reduce(std::int64_t* values, std::int64_t count, MPI_Op op) {
    if (count <= 0) return;
    if (count > INT_MAX) detail::fail(ErrorCode::invalid_argument, "allreduce: too many values");
    check(MPI_Allreduce(MPI_IN_PLACE, values, static_cast<int>(count), MPI_INT64_T, op, comm_),
          "MPI_Allreduce");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// MPI_COMM_WORLD, finalising MPI at the end if it started it.
class WorldCommunicator final : public MpiCommunicator {
 public:
  WorldCommunicator(MPI_Comm comm, bool owns) : MpiCommunicator(comm), owns_(owns) {}
  ~WorldCommunicator() override {
    if (owns_) {
      free_comm();
      MPI_Finalize();
    }
  }

 private:
  bool owns_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

std::unique_ptr<Communicator> world(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  }
  return std::make_unique<WorldCommunicator>(MPI_COMM_WORLD, !initialized);
}

void abort_job(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace emflow::distributed

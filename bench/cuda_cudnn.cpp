// cuDNN's fused attention beside emflow's (Google Benchmark, CUDA-event timing).
//
//   emflow_bench_cuda --benchmark_filter=CudnnSdpa
//
// BM_CudnnSdpa times cuDNN 9's fused flash-attention forward on the factored problem of
// BM_Fused in bf16: per cloud and head, queries Q = beta X M (N x d), keys K = X (N x d) and
// values V = C = X F^T (N x d), so one call is softmax(Q K^T) V with the scale 1/sqrt(d), the
// causal mask or none, and the softmax statistics (lse) written in fp32. Q, K and V are random
// bf16 arrays of those shapes (the speed does not depend on the values) and are not rotated: at
// most 13 MB, they stay in L2 between calls. Shapes as BM_Fused: N = 4k to 16k, d = 64 and 128,
// B = max(1, 16384 / N) clouds of one head; the same FLOP count (4 B H N^2 d, halved for the
// causal mask), so scripts/device-check.sh prints emflow / cuDNN per shape. BM_Fused's time also
// holds the projections R = X M and C = X F^T (4 B H N d^2, d / N of the attention's FLOP: 3 % or
// less here), which cuDNN is not asked to do; the ratio is that much in cuDNN's favour.
//
// The graph is written with the backend API of cudnn_graph.h (no frontend header): Q K^T matmul,
// scale, [row >= column index select], max reduction, subtract, exp, sum reduction, log and add
// for the statistics, divide, P V matmul; bf16 tensors, fp32 compute. cuDNN's heuristics list the
// engines for the graph and the first whose execution plan finalises is timed. The graph is built
// once per shape, outside the timed loop; each iteration is one cudnnBackendExecute on the
// benchmark's stream bracketed by CUDA events, after two warm-up calls.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cuda_timing.hpp"
#include "emflow/precision.hpp"

namespace {

constexpr std::int64_t kTokensPerCase = 16384;

// A cuDNN call that failed: its status string and cuDNN's own last message.
struct CudnnFailure {
  std::string what;
};

void check(cudnnStatus_t status, const char* call) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof(detail));
  throw CudnnFailure{std::string(call) + ": " + cudnnGetErrorString(status) +
                     (detail[0] != '\0' ? std::string(" (") + detail + ")" : std::string())};
}

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &handle_), "cudnnBackendCreateDescriptor");
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor(Descriptor&& other) noexcept : handle_(other.handle_) { other.handle_ = nullptr; }
  ~Descriptor() {
    if (handle_ != nullptr) cudnnBackendDestroyDescriptor(handle_);
  }
  cudnnBackendDescriptor_t get() const { return handle_; }

  template <class T>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  const T& value) {
    // The value's address, as cuDNN takes every attribute (a pointer's address for handles).
    check(cudnnBackendSetAttribute(handle_, name, type, 1, static_cast<const void*>(&value)),
          "cudnnBackendSetAttribute");
    return *this;
  }
  template <class T>
  Descriptor& set_array(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                        const std::vector<T>& values) {
    check(cudnnBackendSetAttribute(handle_, name, type, static_cast<std::int64_t>(values.size()),
                                   static_cast<const void*>(values.data())),
          "cudnnBackendSetAttribute");
    return *this;
  }
  Descriptor& finalize(const char* what) {
    check(cudnnBackendFinalize(handle_), what);
    return *this;
  }

 private:
  cudnnBackendDescriptor_t handle_ = nullptr;
};

using Dims = std::vector<std::int64_t>;

// A tensor of the graph; uid 0 marks a virtual one (an intermediate cuDNN keeps on chip).
Descriptor tensor(std::int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                  bool by_value = false) {
  static std::int64_t next_virtual = 1000;
  const bool is_virtual = uid == 0;
  Descriptor t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type)
      .set_array(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims)
      .set_array(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides)
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, is_virtual ? next_virtual++ : uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, std::int64_t{16})
      .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual)
      .set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, by_value);
  t.finalize("tensor descriptor");
  return t;
}

// The operations of one graph and the descriptors they refer to (kept alive until the plan is
// built; a deque, so references to held tensors survive later insertions).
struct Graph {
  std::deque<Descriptor> keep;
  std::vector<Descriptor> ops;

  void pointwise(cudnnPointwiseMode_t mode, const Descriptor& x, const Descriptor* b,
                 const Descriptor& y, const Descriptor* t = nullptr, std::int64_t axis = -1,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT) {
    Descriptor desc(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    desc.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, math);
    if (axis >= 0) desc.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    desc.finalize("pointwise descriptor");
    Descriptor op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, desc.get())
        .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x.get());
    if (b != nullptr) {
      op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b->get());
    }
    if (t != nullptr) {
      op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, t->get());
    }
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y.get());
    op.finalize("pointwise operation");
    keep.push_back(std::move(desc));
    ops.push_back(std::move(op));
  }

  void reduction(cudnnReduceTensorOp_t mode, const Descriptor& x, const Descriptor& y) {
    Descriptor desc(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    desc.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode)
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT)
        .finalize("reduction descriptor");
    Descriptor op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x.get())
        .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y.get())
        .set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, desc.get())
        .finalize("reduction operation");
    keep.push_back(std::move(desc));
    ops.push_back(std::move(op));
  }

  void matmul(const Descriptor& a, const Descriptor& b, const Descriptor& c) {
    Descriptor desc(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    desc.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT)
        .finalize("matmul descriptor");
    Descriptor op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, a.get())
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b.get())
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, c.get())
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, desc.get())
        .finalize("matmul operation");
    keep.push_back(std::move(desc));
    ops.push_back(std::move(op));
  }

  const Descriptor& hold(Descriptor d) {
    keep.push_back(std::move(d));
    return keep.back();
  }
};

enum Uid : std::int64_t { kQ = 1, kK = 2, kV = 3, kO = 4, kStats = 5, kScale = 6, kMaskValue = 7 };

// The execution plan of softmax(scale Q K^T [masked]) V for b x h x n x d and its workspace
// size. Every descriptor the plan was made from stays alive as long as the plan.
struct Plan {
  Graph g;
  std::deque<Descriptor> configs;
  std::optional<Descriptor> plan;
  std::int64_t workspace = 0;
};

// Fills `out`; throws CudnnFailure when no engine supports the graph.
void build_plan(Plan& out, cudnnHandle_t handle, std::int64_t b, std::int64_t h, std::int64_t n,
                std::int64_t d, bool causal) {
  Graph& g = out.g;
  const Dims qkv_dims{b, h, n, d}, qkv_strides{h * n * d, n * d, d, 1};
  const Dims kt_dims{b, h, d, n}, kt_strides{h * n * d, n * d, 1, d};  // K read as its transpose
  const Dims s_dims{b, h, n, n}, s_strides{h * n * n, n * n, n, 1};
  const Dims r_dims{b, h, n, 1}, r_strides{h * n, n, 1, 1};
  const Dims one{1, 1, 1, 1};
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, bf16 = CUDNN_DATA_BFLOAT16;
  auto& q = g.hold(tensor(kQ, bf16, qkv_dims, qkv_strides));
  auto& kt = g.hold(tensor(kK, bf16, kt_dims, kt_strides));
  auto& v = g.hold(tensor(kV, bf16, qkv_dims, qkv_strides));
  auto& o = g.hold(tensor(kO, bf16, qkv_dims, qkv_strides));
  auto& stats = g.hold(tensor(kStats, f32, r_dims, r_strides));
  auto& scale = g.hold(tensor(kScale, f32, one, one, true));

  auto& s = g.hold(tensor(0, f32, s_dims, s_strides));
  g.matmul(q, kt, s);
  auto& scaled = g.hold(tensor(0, f32, s_dims, s_strides));
  g.pointwise(CUDNN_POINTWISE_MUL, s, &scale, scaled);
  const Descriptor* logits = &scaled;
  if (causal) {
    auto& row = g.hold(tensor(0, CUDNN_DATA_INT32, s_dims, s_strides));
    auto& col = g.hold(tensor(0, CUDNN_DATA_INT32, s_dims, s_strides));
    auto& keep = g.hold(tensor(0, CUDNN_DATA_BOOLEAN, s_dims, s_strides));
    auto& masked = g.hold(tensor(0, f32, s_dims, s_strides));
    auto& fill = g.hold(tensor(kMaskValue, f32, one, one, true));
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, row, nullptr, 2, CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, col, nullptr, 3, CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, keep, nullptr, -1, CUDNN_DATA_BOOLEAN);
    // Where keep holds the score stays, elsewhere the fill value replaces it.
    g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scaled, &fill, masked, &keep);
    logits = &masked;
  }
  auto& max = g.hold(tensor(0, f32, r_dims, r_strides));
  auto& shifted = g.hold(tensor(0, f32, s_dims, s_strides));
  auto& exp = g.hold(tensor(0, f32, s_dims, s_strides));
  auto& sum = g.hold(tensor(0, f32, r_dims, r_strides));
  auto& log_sum = g.hold(tensor(0, f32, r_dims, r_strides));
  // The second product reads P in the inputs' type: the fused engine requires it.
  auto& p = g.hold(tensor(0, bf16, s_dims, s_strides));
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, *logits, max);
  g.pointwise(CUDNN_POINTWISE_SUB, *logits, &max, shifted);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, exp);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, exp, sum);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, max, &log_sum, stats);  // lse, as emflow writes it
  g.pointwise(CUDNN_POINTWISE_DIV, exp, &sum, p);
  g.matmul(p, v, o);

  std::vector<cudnnBackendDescriptor_t> ops;
  ops.reserve(g.ops.size());
  for (const Descriptor& op : g.ops) ops.push_back(op.get());
  Descriptor& graph = out.configs.emplace_back(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle)
      .set_array(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops)
      .finalize("operation graph");

  Descriptor& heuristics = out.configs.emplace_back(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, graph.get())
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, CUDNN_HEUR_MODE_A)
      .finalize("engine heuristics");
  std::int64_t count = 0;
  check(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "engine heuristics results");
  if (count == 0) throw CudnnFailure{"cuDNN's heuristics list no engine for this graph"};
  std::vector<cudnnBackendDescriptor_t> config_handles;
  config_handles.reserve(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    config_handles.push_back(out.configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
  }
  std::int64_t returned = 0;
  check(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                                 static_cast<void*>(config_handles.data())),
        "engine heuristics results");

  std::string last = "no engine configuration";
  for (std::int64_t i = 0; i < returned; ++i) {
    try {
      Descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
          .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR,
               config_handles[static_cast<std::size_t>(i)])
          .finalize("execution plan");
      std::int64_t got = 0;
      check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &got, &out.workspace),
            "execution plan workspace size");
      out.plan.emplace(std::move(plan));
      return;
    } catch (const CudnnFailure& failure) {
      last = failure.what;
    }
  }
  throw CudnnFailure{"no engine of " + std::to_string(returned) +
                     " supports the graph; last: " + last};
}

struct DeviceMemory {
  void* data = nullptr;
  explicit DeviceMemory(std::size_t bytes) {
    if (bytes != 0 && cudaMalloc(&data, bytes) != cudaSuccess) {
      data = nullptr;
      throw CudnnFailure{"cudaMalloc of " + std::to_string(bytes) + " bytes failed"};
    }
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { cudaFree(data); }
};

// bf16 values uniform in [-1, 1) (cuda_timing.hpp), copied to the device.
void fill_random(void* device, std::size_t count, std::uint64_t seed) {
  const std::vector<emflow::bfloat16> host =
      emflow::bench::random_stored<emflow::bfloat16>(count, seed, 1.f);
  if (cudaMemcpy(device, host.data(), count * sizeof(emflow::bfloat16), cudaMemcpyHostToDevice) !=
      cudaSuccess) {
    throw CudnnFailure{"cudaMemcpy to the device failed"};
  }
}

void BM_CudnnSdpa(benchmark::State& state) {
  const std::int64_t n = state.range(0), d = state.range(1), heads = 1;
  const bool causal = state.range(2) != 0;
  const std::int64_t batch = std::max<std::int64_t>(1, kTokensPerCase / n);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  std::optional<emflow::bench::CudaTiming> timing;  // outlives the handle bound to its stream
  cudnnHandle_t handle = nullptr;
  try {
    const cudaStream_t stream = timing.emplace().stream();
    check(cudnnCreate(&handle), "cudnnCreate");
    check(cudnnSetStream(handle, stream), "cudnnSetStream");
    Plan plan;
    build_plan(plan, handle, batch, heads, n, d, causal);

    const auto elements = static_cast<std::size_t>(batch * heads * n * d);
    DeviceMemory q(elements * 2), k(elements * 2), v(elements * 2), o(elements * 2);
    DeviceMemory stats(static_cast<std::size_t>(batch * heads * n) * sizeof(float));
    DeviceMemory workspace(static_cast<std::size_t>(plan.workspace));
    fill_random(q.data, elements, 1);
    fill_random(k.data, elements, 2);
    fill_random(v.data, elements, 3);
    float scale = 1.f / std::sqrt(static_cast<float>(d));
    // -inf, as cuDNN's own frontend fills masked scores from 9.10 on; no row is fully masked
    // (the diagonal stays), so the softmax stays finite.
    float mask_value = -std::numeric_limits<float>::infinity();

    std::vector<std::int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
    std::vector<void*> pointers{q.data, k.data, v.data, o.data, stats.data, &scale};
    if (causal) {
      uids.push_back(kMaskValue);
      pointers.push_back(&mask_value);
    }
    Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set_array(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids)
        .set_array(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers)
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace.data)
        .finalize("variant pack");

    auto execute = [&] {
      check(cudnnBackendExecute(handle, plan.plan->get(), pack.get()), "cudnnBackendExecute");
    };
    for (int warm = 0; warm < 2; ++warm) execute();
    if (cudaStreamSynchronize(stream) != cudaSuccess) {
      throw CudnnFailure{"the warm-up run failed on the device"};
    }
    for (auto _ : state) state.SetIterationTime(timing->seconds(execute));
    const double full = 4.0 * static_cast<double>(batch * heads) * static_cast<double>(n * n * d);
    state.counters["TFLOP/s"] = benchmark::Counter((causal ? full / 2 : full) * 1e-12,
                                                   benchmark::Counter::kIsIterationInvariantRate);
    state.counters["B"] = static_cast<double>(batch);
    state.SetBytesProcessed(static_cast<std::int64_t>(4 * elements * 2) * state.iterations());
  } catch (const CudnnFailure& failure) {
    state.SkipWithError(("cuDNN: " + failure.what).c_str());
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
  if (handle != nullptr) cudnnDestroy(handle);
}

void cudnn_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t causal : {0, 1}) {
    for (std::int64_t dim : {64, 128}) {
      for (std::int64_t tokens = 4096; tokens <= 16384; tokens *= 2) b->Args({tokens, dim, causal});
    }
  }
  b->ArgNames({"N", "d", "causal"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_CudnnSdpa)->Apply(cudnn_sizes);

}  // namespace

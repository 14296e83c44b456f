// The factored form expanded to dense operators by cuBLAS, then a dense strategy (expanded.hpp).
#include "expanded.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/check.hpp"
#include "cublas_handles.hpp"
#include "cublas_loader.hpp"

namespace emflow::detail {

namespace {

// cuBLAS's scratch for the expansion: H batched products of d x r by r x d, whose kernels need
// little (4 MiB is cuBLAS's default before Hopper).
constexpr std::int64_t kExpansionCublasBytes = std::int64_t{4} << 20;

}  // namespace

template <class T>
ExpandedStrategy<T>::ExpandedStrategy(const Problem& p, std::unique_ptr<PlanStrategy<T>> dense,
                                      const char* operation)
    : dense_(std::move(dense)),
      dim_(static_cast<int>(p.dim)),
      heads_(static_cast<int>(p.heads)),
      rank_(static_cast<int>(p.rank)) {
  const std::int64_t dense_operator = checked_multiply(
      operation, "relevance", checked_multiply(operation, "relevance", p.heads, p.dim), p.dim);
  WorkspaceCursor at(operation);
  relevance_ = at.take(dense_operator, sizeof(T), "expanded relevance");
  content_ = at.take(dense_operator, sizeof(T), "expanded content");
  cublas_region_ = at.take(kExpansionCublasBytes, 1, "expansion cublas");
  const std::size_t dense_bytes = dense_->workspace_bytes();
  dense_region_ = at.take(static_cast<std::int64_t>(dense_bytes), 1, "dense workspace");
  total_ = at.total();
}

template <class T>
void ExpandedStrategy<T>::bind(int device, bool prepare, const char* operation) {
  dense_->bind(device, prepare, operation);
  if (prepare) cublas_ = &cublas_api(operation);
  device_ = device;
}

template <class T>
void ExpandedStrategy<T>::run(const PlanCall<T>& call, unsigned char* base, cudaStream_t stream,
                              const char* operation) const {
  const FactoredLayer<T>& layer = *call.layer;
  const CublasApi& api = *cublas_;
  const int d = dim_, r = rank_, H = heads_;
  T* const relevance = reinterpret_cast<T*>(base + relevance_);
  T* const content = reinterpret_cast<T*>(base + content_);
  cublasHandle_t handle = cublas_for_stream(api, device_, stream, base + cublas_region_,
                                            dense_region_ - cublas_region_, operation);
  const T one = 1, zero = 0;
  const long long factor = static_cast<long long>(r) * d, square = static_cast<long long>(d) * d;
  // Row-major arrays read column-major are their transposes. M_h = A_h^T B_h, so
  // M_h^T = B_h^T A_h: B_h^T (d x r) times (A_h^T)^T, A_h^T being d x r as stored.
  gemm_strided_batched<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_T, d, d, r, &one, layer.key_factor, d,
                          factor, layer.query_factor, d, factor, &zero, relevance, d, square, H,
                          operation, "cublasGemmStridedBatched (relevance M = A^T B)");
  // F_h = U_h V_h, so F_h^T = V_h^T U_h^T: V_h^T (d x r, ld d) times U_h^T (r x d, ld r).
  gemm_strided_batched<T>(api, handle, CUBLAS_OP_N, CUBLAS_OP_N, d, d, r, &one, layer.content_down,
                          d, factor, layer.content_up, r, factor, &zero, content, d, square, H,
                          operation, "cublasGemmStridedBatched (content F = U V)");

  AttentionInput<T> dense = *call.input;
  dense.layer.heads = layer.heads;
  dense.layer.relevance = relevance;
  dense.layer.content = content;
  dense.layer.key_bias = layer.key_bias;
  dense.layer.offset = layer.offset;
  PlanCall<T> on_dense = call;
  on_dense.input = &dense;
  on_dense.layer = nullptr;
  dense_->run(on_dense, base + dense_region_, stream, operation);
}

template class ExpandedStrategy<float>;
template class ExpandedStrategy<double>;

}  // namespace emflow::detail

// The flow over part of every cloud (emflow/flow_parts.hpp): the recorded run of stepper.hpp
// with the host operations of host_ops.hpp, except the three that need the rows of the other
// parts, which go to the caller's PartOperations; and the observables as sums over parts.
#include <algorithm>
#include <vector>

#include "core/check.hpp"
#include "core/parallel.hpp"
#include "emflow/flow_parts.hpp"
#include "host_ops.hpp"
#include "internal.hpp"
#include "stepper.hpp"

namespace emflow::flow {

namespace {

using emflow::detail::fail_argument;

// HostOps with the attention, the entropy sums and the records of the caller.
template <class T>
class PartOps : public detail::HostOps<T> {
 public:
  PartOps(PartOperations<T>& caller, double norm_eps, std::int64_t cloud_tokens)
      : detail::HostOps<T>(ExecutionOptions{}, norm_eps),
        caller_(caller),
        cloud_tokens_(cloud_tokens) {}

  void attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) {
    caller_.attend(in, out);
  }

  // The single-process order within the part (heads, then tokens), then across the parts.
  void mean_entropy(const T* entropy, std::int64_t batch, std::int64_t heads, std::int64_t tokens,
                    std::int64_t cloud_stride, std::int64_t head_stride, detail::EntropySink sink) {
    std::vector<double> sums(static_cast<std::size_t>(batch), 0.0);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const T* e = entropy + h * head_stride + b * cloud_stride;
        for (std::int64_t i = 0; i < tokens; ++i) {
          sums[static_cast<std::size_t>(b)] += static_cast<double>(e[i]);
        }
      }
    }
    caller_.sum_over_parts(sums.data(), batch);
    for (std::int64_t b = 0; b < batch; ++b) {
      sink.at[b * sink.stride] =
          sums[static_cast<std::size_t>(b)] / static_cast<double>(heads * cloud_tokens_);
    }
  }

  detail::EntropySink record(const T* x, std::int64_t r, FlowResult<T>& result) {
    const Shape& shape = result.trajectory.shape();
    const std::int64_t B = shape[1], rows = B * shape[2] * shape[3];
    std::copy(x, x + rows, result.trajectory.data() + r * rows);
    caller_.observe(x, r, result.observables.data() + r * B);
    return {this->entropies_.data() + r * B, 1};
  }

 private:
  PartOperations<T>& caller_;
  std::int64_t cloud_tokens_;
};

}  // namespace

std::vector<PairSums> pair_sums(const double* clouds, std::int64_t batch, std::int64_t tokens,
                                std::int64_t dim, const std::vector<double>& betas,
                                double cluster_eps, const std::vector<RowRun>& rows) {
  const char* op = "pair_sums";
  emflow::detail::expect_positive(op, "batch", batch);
  emflow::detail::expect_positive(op, "tokens", tokens);
  emflow::detail::expect_positive(op, "dim", dim);
  emflow::detail::expect_not_null(op, "clouds", clouds);
  if (static_cast<std::int64_t>(betas.size()) != batch) {
    fail_argument(op, "betas", "has ", betas.size(), " entries, expected ", batch);
  }
  for (const RowRun& run : rows) {
    if (run.first < 0 || run.count < 0 || run.first > tokens - run.count) {
      fail_argument(op, "rows", "run [", run.first, ", ", run.first + run.count,
                    ") lies outside the ", tokens, " tokens");
    }
  }
  const std::int64_t N = tokens, d = dim;
  std::vector<PairSums> parts(static_cast<std::size_t>(batch));
  ::emflow::detail::ParallelErrors errors;  // the sums allocate
#pragma omp parallel for schedule(dynamic) if (batch > 1 && batch * N * N * d > (1 << 16))
  for (std::int64_t b = 0; b < batch; ++b) {
    errors.run([&] {
      const double* cloud = clouds + b * N * d;
      const std::vector<double> norms = detail::token_norms(cloud, N, d);
      detail::PairPart part = detail::pair_part(
          cloud, norms.data(), N, d, betas[static_cast<std::size_t>(b)], cluster_eps, rows);
      PairSums& sums = parts[static_cast<std::size_t>(b)];
      sums.min_inner = part.min_inner;
      sums.sum_inner = part.sum_inner;
      sums.energy = part.energy;
      sums.diameter_sq = part.diameter_sq;
      sums.clustered = part.clustered;
      sums.forest = std::move(part.parent);
    });
  }
  errors.rethrow();
  return parts;
}

Observables observables_from_parts(const std::vector<const PairSums*>& parts, std::int64_t tokens,
                                   double beta) {
  const char* op = "observables_from_parts";
  if (parts.empty()) fail_argument(op, "parts", "must hold at least one part, got none");
  detail::PairPart sums;
  std::vector<const std::int64_t*> forests;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const PairSums& part = *parts[p];
    if (static_cast<std::int64_t>(part.forest.size()) != tokens) {
      fail_argument(op, "parts", "entry ", p, " has a forest of ", part.forest.size(),
                    " entries, expected ", tokens);
    }
    sums.min_inner = std::min(sums.min_inner, part.min_inner);
    sums.sum_inner += part.sum_inner;
    sums.energy += part.energy;
    sums.diameter_sq = std::max(sums.diameter_sq, part.diameter_sq);
    sums.clustered += part.clustered;
    forests.push_back(part.forest.data());
  }
  sums.joins = detail::merged_joins(tokens, forests);
  return detail::finish_observables(sums, tokens, beta);
}

template <class T>
PartRun<T>::PartRun(const Shape& clouds, std::int64_t part_tokens, const std::vector<double>& betas,
                    const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings)
    : clouds_(clouds),
      betas_(detail::validate_flow(clouds, betas, layers, settings)),
      layers_(layers),
      settings_(settings) {
  const std::int64_t B = clouds[0], N = clouds[1], d = clouds[2];
  if (part_tokens < 1 || part_tokens > N) {
    fail_argument("run_flow", "part_tokens", "must be in [1, ", N, "], got ", part_tokens);
  }
  const std::int64_t R = detail::record_count(step_count(settings), settings.record_every);
  checked_element_count(Shape{R, B, N, d}, "trajectory", std::int64_t{1} << 31);
  result_ = detail::allocate_result<T>(B, part_tokens, d, settings);
}

template <class T>
std::int64_t PartRun<T>::records() const noexcept {
  return result_.trajectory.extent(0);
}

template <class T>
const std::vector<double>& PartRun<T>::betas() const noexcept {
  return betas_;
}

template <class T>
FlowResult<T> PartRun<T>::run(PartOperations<T>& operations, const T* rows,
                              const Progress& progress) {
  if (ran_) emflow::detail::fail(ErrorCode::invalid_argument, "PartRun::run: runs once");
  emflow::detail::expect_not_null("run_flow", "rows", rows);
  ran_ = true;
  const Shape& part = result_.trajectory.shape();
  std::vector<T> state(rows, rows + part[1] * part[2] * part[3]);
  PartOps<T> ops(operations, settings_.norm_eps, clouds_[1]);
  ops.record_into(betas_, settings_.cluster_eps, result_.times.size());
  std::vector<detail::LayerView<T>> views;
  for (const FlowLayer<T>& layer : layers_) views.push_back(detail::host_view(layer));
  detail::run_recorded(ops, state.data(), views, betas_, settings_, result_, progress, clouds_[1]);
  ops.finish(result_);
  return std::move(result_);
}

template class PartRun<float>;
template class PartRun<double>;

}  // namespace emflow::flow

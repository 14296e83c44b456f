// emflow::flow over part of every cloud: the seam of a flow whose clouds are split among
// processes (emflow::distributed::run_flow is built on it, docs/FLOW.md).
//
// A PartRun advances some rows of every cloud with the stepper of flow::run_flow (the layers,
// norms, integrators and the sphere projection act on each row where it lives, exactly as in
// one process) and leaves to its caller what needs the rows it does not hold, through
// PartOperations: the attention of its rows against their whole clouds, the sums of the mean
// entropies across the parts, and the observables of a record. The observables are sums over
// the pairs of a cloud (docs/MATH.md §5), so each part may sum the pairs of its own rows of the
// whole cloud (pair_sums) and the parts are added up exactly, in a fixed order
// (observables_from_parts): the same result, to rounding, as flow::observe of the whole cloud.
//
// Errors are emflow::Error naming the argument, as run_flow's.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow {

/// Rows [first, first + count) of a cloud.
struct RowRun {
  std::int64_t first = 0;
  std::int64_t count = 0;
};

/// What the pairs (i, j > i) with i in some rows of a cloud of N tokens contribute to its
/// observables. Parts whose rows cover the cloud once add up to the whole: minima, sums,
/// maxima and counts, and the forests joined.
struct PairSums {
  double min_inner = std::numeric_limits<double>::infinity();
  double sum_inner = 0.0;
  double energy = 0.0;         ///< exp(beta |x_i|^2) of the rows, then 2 exp(beta <x_i, x_j>)
  double diameter_sq = 0.0;    ///< max ||x_i - x_j||^2
  std::int64_t clustered = 0;  ///< clustered pairs
  /// N entries: a forest over the whole cloud whose trees join the clustered pairs found.
  std::vector<std::int64_t> forest;
};

/// The sums of the rows `rows` of each of the `batch` clouds (batch, tokens, dim) in double, at
/// betas[b] (batch entries) and `cluster_eps` as flow::observe takes it; OpenMP over the
/// clouds. Each sum runs over the rows in the order given, j ascending: with the rows
/// {{0, tokens}} the part is the whole, and observables_from_parts of it is flow::observe.
std::vector<PairSums> pair_sums(const double* clouds, std::int64_t batch, std::int64_t tokens,
                                std::int64_t dim, const std::vector<double>& betas,
                                double cluster_eps, const std::vector<RowRun>& rows);

/// The observables (entropy 0) of a cloud of `tokens` tokens at `beta` from the sums of parts
/// whose rows cover it once, added in the order given (a fixed order gives the same bits every
/// time). Throws emflow::Error (invalid_argument) naming 'parts' when none is given or a forest
/// does not hold `tokens` entries.
Observables observables_from_parts(const std::vector<const PairSums*>& parts, std::int64_t tokens,
                                   double beta);

/// What a PartRun leaves to its caller. Every call comes in the same order on every part.
template <class T>
class PartOperations {
 public:
  virtual ~PartOperations() = default;
  /// One attention evaluation of the part's rows: in.cloud holds them (in.batch clouds of
  /// in.tokens rows each, the rows of this part), to be attended against their whole clouds;
  /// writes out.update (batch, tokens, dim) and, when not null, out.lse and out.entropy
  /// (batch, heads, tokens) for these rows.
  virtual void attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) = 0;
  /// values[i] becomes the sum of values[i] over all parts, the same on every part.
  virtual void sum_over_parts(double* values, std::int64_t count) = 0;
  /// Record `record` of the state: `rows` holds this part's rows of every cloud
  /// (batch, part_tokens, dim); writes the observables of the whole clouds (entropy left 0)
  /// into observables[0, batch), the same on every part.
  virtual void observe(const T* rows, std::int64_t record, Observables* observables) = 0;
};

/// run_flow over `part_tokens` rows of each cloud of `clouds` = (B, N, d): checked and
/// allocated when made, then run once.
template <class T>
class PartRun {
 public:
  /// Checks the arguments as run_flow does for initial clouds of shape `clouds`, and
  /// 1 <= part_tokens <= N; refuses a whole trajectory (R, B, N, d) beyond 2^31 values; then
  /// allocates the result of the part. Throws emflow::Error naming the first bad argument,
  /// before anything else.
  PartRun(const Shape& clouds, std::int64_t part_tokens, const std::vector<double>& betas,
          const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings);

  std::int64_t records() const noexcept;              ///< R: the records of the run
  const std::vector<double>& betas() const noexcept;  ///< one per cloud

  /// Runs from this part's rows `rows` (B, part_tokens, d), every evaluation of what it does
  /// not hold through `operations`. Returns the times, the steps and the observables of the
  /// whole clouds, and the trajectory of the part's rows (R, B, part_tokens, d). The mean
  /// entropy of a record is that of the whole clouds: each part's sums over its rows (heads,
  /// then rows, in order) added by sum_over_parts, over H N. A second call throws.
  FlowResult<T> run(PartOperations<T>& operations, const T* rows, const Progress& progress = {});

 private:
  Shape clouds_;
  std::vector<double> betas_;
  std::vector<FlowLayer<T>> layers_;
  FlowSettings settings_;
  FlowResult<T> result_;
  bool ran_ = false;
};

extern template class PartRun<float>;
extern template class PartRun<double>;

}  // namespace emflow::flow

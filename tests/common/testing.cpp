#include "testing.hpp"

#include <cmath>

#include "core/backends.hpp"

namespace emflow::testing {

std::vector<double> uniform(std::size_t count, std::uint64_t seed, double lo, double hi) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> out(count);
  for (double& v : out) v = static_cast<double>(static_cast<float>(dist(engine)));
  return out;
}

Problem Problem::random(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                        std::int64_t heads, std::uint64_t seed, double scale) {
  Problem p;
  p.batch = batch;
  p.tokens = tokens;
  p.dim = dim;
  p.heads = heads;
  const double s = scale / std::sqrt(static_cast<double>(dim));
  p.cloud = uniform(static_cast<std::size_t>(batch * tokens * dim), seed * 7 + 1);
  p.relevance = uniform(static_cast<std::size_t>(heads * dim * dim), seed * 7 + 2, -s, s);
  p.content = uniform(static_cast<std::size_t>(heads * dim * dim), seed * 7 + 3, -s, s);
  p.bias = uniform(static_cast<std::size_t>(heads * dim), seed * 7 + 4);
  p.shift = uniform(static_cast<std::size_t>(dim), seed * 7 + 5);
  return p;
}

template <class T>
Buffers<T>::Buffers(const Problem& p, bool with_weights, bool with_stats)
    : cloud(p.cloud.begin(), p.cloud.end()),
      relevance(p.relevance.begin(), p.relevance.end()),
      content(p.content.begin(), p.content.end()),
      bias(p.bias.begin(), p.bias.end()),
      shift(p.shift.begin(), p.shift.end()),
      key_lengths(p.key_lengths) {
  const auto rows = static_cast<std::size_t>(p.batch * p.heads * p.tokens);
  update.resize(static_cast<std::size_t>(p.batch * p.tokens * p.dim));
  if (with_stats) {
    lse.resize(rows);
    entropy.resize(rows);
  }
  if (with_weights) weights.resize(rows * static_cast<std::size_t>(p.tokens));
  input.cloud = cloud.data();
  input.batch = p.batch;
  input.tokens = p.tokens;
  input.dim = p.dim;
  input.layer.heads = p.heads;
  input.layer.relevance = relevance.data();
  input.layer.content = content.data();
  input.layer.key_bias = p.key_bias ? bias.data() : nullptr;
  input.layer.offset = p.offset ? shift.data() : nullptr;
  input.beta = p.beta;
  input.mask = p.mask;
  input.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
  output.update = update.data();
  output.lse = lse.empty() ? nullptr : lse.data();
  output.entropy = entropy.empty() ? nullptr : entropy.data();
  output.weights = weights.empty() ? nullptr : weights.data();
  poison();
}

template <class T>
void Buffers<T>::poison() {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (auto* v : {&update, &lse, &entropy, &weights}) std::fill(v->begin(), v->end(), nan);
}

template struct Buffers<float>;
template struct Buffers<double>;

namespace {
bool same_infinity(double a, double b) { return std::isinf(a) && std::isinf(b) && a == b; }
}  // namespace

template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
    if (same_infinity(x, y)) continue;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

template <class A, class B>
double max_abs_difference(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
    if (same_infinity(x, y)) continue;
    worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}

template double relative_error(const std::vector<float>&, const std::vector<double>&);
template double relative_error(const std::vector<double>&, const std::vector<double>&);
template double relative_error(const std::vector<float>&, const std::vector<float>&);
template double max_abs_difference(const std::vector<float>&, const std::vector<double>&);
template double max_abs_difference(const std::vector<double>&, const std::vector<double>&);
template double max_abs_difference(const std::vector<float>&, const std::vector<float>&);

template <class T>
::testing::AssertionResult all_finite_or_neg_inf(const std::vector<T>& values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const T v = values[i];
    if (std::isnan(v) || v == std::numeric_limits<T>::infinity()) {
      return ::testing::AssertionFailure() << "entry " << i << " is " << v;
    }
  }
  return ::testing::AssertionSuccess();
}
template ::testing::AssertionResult all_finite_or_neg_inf(const std::vector<float>&);
template ::testing::AssertionResult all_finite_or_neg_inf(const std::vector<double>&);

bool cuda_available(std::string* reason) { return detail::cuda_device_available(reason); }

}  // namespace emflow::testing

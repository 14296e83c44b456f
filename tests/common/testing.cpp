#include "testing.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <system_error>
#include <utility>

#include "core/backends.hpp"

namespace emflow::testing {
namespace {

// ctest runs the CPU engine's suites again with EMFLOW_CPU_PATH naming each lower path, avx2 and
// avx512 (tests/CMakeLists.txt, emflow_test_on_path, which sets EMFLOW_TEST_ON_PATH=1). Where the
// processor lacks that path, or the path is the one the process takes without the variable (so
// the suite's own run has tested it), the run is skipped as a whole, with the reason, before any
// case computes its references: every case would otherwise fail at its first engine call, or
// repeat the suite's run case for case.
class ForcedCpuPath : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* forced = std::getenv("EMFLOW_CPU_PATH");
    const char* on_path = std::getenv("EMFLOW_TEST_ON_PATH");
    if (forced == nullptr || on_path == nullptr || std::string(on_path) != "1") return;
    const std::vector<std::string> usable =
        detail::usable_cpu_features(detail::probe_cpu(std::getenv("EMFLOW_CPU_DISABLE")));
    const detail::CpuPath by_default = detail::choose_cpu_path(usable, nullptr);
    // A name this build does not hold is left to fail in every case, with the library's error.
    if (std::find(by_default.built.begin(), by_default.built.end(), forced) ==
        by_default.built.end()) {
      return;
    }
    try {
      (void)detail::choose_cpu_path(usable, forced);
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();  // "... which needs <extensions> that this processor lacks"
    }
    if (by_default.name == forced) {
      GTEST_SKIP() << "EMFLOW_CPU_PATH names '" << forced
                   << "', the path this processor takes by default: the suite's own run tests it";
    }
  }
};

[[maybe_unused]] ::testing::Environment* const forced_cpu_path =
    ::testing::AddGlobalTestEnvironment(new ForcedCpuPath);

}  // namespace

std::vector<double> uniform(std::size_t count, std::uint64_t seed, double lo, double hi) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> out(count);
  for (double& v : out) v = static_cast<double>(static_cast<float>(dist(engine)));
  return out;
}

Tensor<double> random_tensor(const Shape& shape, std::uint64_t seed, double lo, double hi) {
  const auto n = static_cast<std::size_t>(checked_element_count(shape));
  return Tensor<double>(shape, uniform(n, seed, lo, hi));
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
  // Every member in declaration order (attention.hpp).
  const LayerOperators<T> layer{p.heads, relevance.data(), content.data(),
                                p.key_bias ? bias.data() : nullptr,
                                p.offset ? shift.data() : nullptr};
  input = AttentionInput<T>{
      cloud.data(), p.batch, p.tokens, p.dim,
      layer,        p.beta,  p.mask,   key_lengths.empty() ? nullptr : key_lengths.data()};
  output = AttentionOutput<T>{update.data(), lse.empty() ? nullptr : lse.data(),
                              entropy.empty() ? nullptr : entropy.data(),
                              weights.empty() ? nullptr : weights.data()};
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

template <class A, class B>
::testing::AssertionResult close_to(const std::vector<A>& actual, const std::vector<B>& expected,
                                    double tolerance) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << actual.size() << " values, expected " << expected.size();
  }
  const double error = relative_error(actual, expected);
  if (error < tolerance) return ::testing::AssertionSuccess() << "relative error " << error;
  double squares = 0.0;
  for (const B& y : expected) {
    if (std::isfinite(static_cast<double>(y))) squares += static_cast<double>(y) * y;
  }
  const double rms = expected.empty() ? 0.0 : std::sqrt(squares / expected.size());
  std::size_t first = 0, worst = 0;
  bool found = false;
  double worst_diff = -1.0;
  for (std::size_t i = 0; i < actual.size() && !found; ++i) {
    const double x = static_cast<double>(actual[i]), y = static_cast<double>(expected[i]);
    if (same_infinity(x, y)) continue;
    const double diff = std::abs(x - y);
    if (std::isnan(x) != std::isnan(y) || std::isinf(x) || std::isinf(y) || std::isnan(diff) ||
        diff > tolerance * std::max(std::abs(y), rms)) {
      first = i;
      found = true;
    } else if (diff > worst_diff) {
      worst_diff = diff;
      worst = i;
    }
  }
  const std::size_t at = found ? first : worst;
  return ::testing::AssertionFailure()
         << "relative error " << error << " (tolerance " << tolerance << ") over " << actual.size()
         << " values; " << (found ? "first mismatch" : "largest difference") << " at index " << at
         << ": " << static_cast<double>(actual[at]) << " vs expected "
         << static_cast<double>(expected[at]);
}

template ::testing::AssertionResult close_to(const std::vector<float>&, const std::vector<double>&,
                                             double);
template ::testing::AssertionResult close_to(const std::vector<double>&, const std::vector<double>&,
                                             double);
template ::testing::AssertionResult close_to(const std::vector<float>&, const std::vector<float>&,
                                             double);

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

void ScratchFolder::SetUp() {
  // A parameterized test's name holds a '/' ("Case/3"): one folder per test, never a nested one
  // that TearDown would leave behind empty.
  std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(name.begin(), name.end(), '/', '_');
  folder_ =
      std::filesystem::temp_directory_path() / (prefix_ + std::to_string(::getpid()) + "_" + name);
  std::filesystem::create_directories(folder_);
}

void ScratchFolder::TearDown() {
  std::error_code ignored;
  std::filesystem::remove_all(folder_, ignored);
}

std::string name_part(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') out += c;
  }
  return out;
}

std::string shape_name(std::int64_t batch, std::int64_t heads, std::int64_t tokens,
                       std::int64_t dim, const Mask& mask) {
  return "B" + std::to_string(batch) + "_H" + std::to_string(heads) + "_N" +
         std::to_string(tokens) + "_d" + std::to_string(dim) + "_" + name_part(to_string(mask));
}

bool cuda_available(std::string* reason) { return detail::cuda_device_available(reason); }

}  // namespace emflow::testing

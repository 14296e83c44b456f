// Eigenvalues through LAPACK's Fortran interface (the reference LAPACK Debian ships beside
// OpenBLAS). A row-major matrix is its transpose in Fortran's column order: the same
// eigenvalues.
#include "tools/spectrum.hpp"

#include <algorithm>
#include <cstddef>
#include <string>

#include "emflow/error.hpp"

extern "C" {
// The trailing size_t arguments are the hidden lengths of the character arguments.
void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
            double* work, const int* lwork, int* info, std::size_t, std::size_t);
void dgeev_(const char* jobvl, const char* jobvr, const int* n, double* a, const int* lda,
            double* wr, double* wi, double* vl, const int* ldvl, double* vr, const int* ldvr,
            double* work, const int* lwork, int* info, std::size_t, std::size_t);
}

namespace emflow::tools {
namespace {

void check(int info, const char* routine) {
  if (info != 0) {
    throw Error(ErrorCode::internal,
                std::string(routine) + " failed (info = " + std::to_string(info) + ")");
  }
}

}  // namespace

std::vector<double> symmetric_part(const double* a, std::int64_t n) {
  std::vector<double> s(static_cast<std::size_t>(n * n));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) s[i * n + j] = 0.5 * (a[i * n + j] + a[j * n + i]);
  return s;
}

std::vector<double> symmetric_eigenvalues(const std::vector<double>& a, std::int64_t n) {
  std::vector<double> m = a, w(static_cast<std::size_t>(n));
  const int size = static_cast<int>(n);
  int info = 0, query = -1;
  double optimal = 0;
  dsyev_("N", "U", &size, m.data(), &size, w.data(), &optimal, &query, &info, 1, 1);
  check(info, "dsyev");
  const int lwork = std::max(1, static_cast<int>(optimal));
  std::vector<double> work(static_cast<std::size_t>(lwork));
  dsyev_("N", "U", &size, m.data(), &size, w.data(), work.data(), &lwork, &info, 1, 1);
  check(info, "dsyev");
  return w;
}

std::vector<std::complex<double>> eigenvalues(const std::vector<double>& a, std::int64_t n) {
  std::vector<double> m = a, wr(static_cast<std::size_t>(n)), wi(static_cast<std::size_t>(n));
  const int size = static_cast<int>(n), one = 1;
  int info = 0, query = -1;
  double optimal = 0, unused = 0;
  dgeev_("N", "N", &size, m.data(), &size, wr.data(), wi.data(), &unused, &one, &unused, &one,
         &optimal, &query, &info, 1, 1);
  check(info, "dgeev");
  const int lwork = std::max(1, static_cast<int>(optimal));
  std::vector<double> work(static_cast<std::size_t>(lwork));
  dgeev_("N", "N", &size, m.data(), &size, wr.data(), wi.data(), &unused, &one, &unused, &one,
         work.data(), &lwork, &info, 1, 1);
  check(info, "dgeev");
  std::vector<std::complex<double>> values;
  for (std::int64_t i = 0; i < n; ++i) values.emplace_back(wr[i], wi[i]);
  std::sort(values.begin(), values.end(), [](const auto& x, const auto& y) {
    return x.real() != y.real() ? x.real() > y.real() : x.imag() > y.imag();
  });
  return values;
}

}  // namespace emflow::tools

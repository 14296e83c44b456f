// The MMA layer of the tensor-core kernels (kernels/mma.cuh): one instruction of each kind
// against a plain matrix product of the same 16-bit (or TF32) values in double. The values are
// distinct per element and small dyadic numbers, so every product and sum is exact in float and
// the instruction must give the product exactly: a fragment layout that differs from the
// hardware's (on a GPU) or from the PTX ISA's (the emulation's model) changes the result. The
// first GPU tests of a device check (scripts/device-check.sh); skipped without a device. The
// kind tf32_pairs is the TF32 instruction on the operands of the attention's P V (an accumulator
// tile as A and row-major values as B, the keys of both permuted): the plain product of a and a
// row-major b. MmaLoads: the shared-memory loads (ldmatrix and the fragment loads built on it,
// cp.async with its zero fill) against the PTX ISA's layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/precision.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#include "kernels/tc_attention.hpp"

namespace emflow::testing {
namespace {

using detail::MmaKind;

constexpr int kM = 16, kN = 8;

bool tf32_kind(MmaKind kind) { return kind == MmaKind::tf32 || kind == MmaKind::tf32_pairs; }
int depth(MmaKind kind) { return tf32_kind(kind) ? 8 : 16; }

// Distinct values: A[r][k] = (r * K + k - 128) / 64, B[k][n] = (n * K + k - 64) / 32 (as B is
// stored, column-major), C[r][n] = (r * 8 + n - 64) / 16; exact in bf16, fp16 and TF32.
struct Operands {
  std::vector<float> a, b, c;  // a row-major 16 x K, b column-major K x 8, c row-major 16 x 8
};
Operands operands(MmaKind kind) {
  const int K = depth(kind);
  Operands o;
  for (int i = 0; i < kM * K; ++i) o.a.push_back(static_cast<float>(i - 128) / 64.f);
  for (int i = 0; i < kN * K; ++i) o.b.push_back(static_cast<float>(i - 64) / 32.f);
  for (int i = 0; i < kM * kN; ++i) o.c.push_back(static_cast<float>(i - 64) / 16.f);
  return o;
}

// d = a b + c in double, b read as the kind stores it (column-major; tf32_pairs: row-major), or
// with `swapped`, the other way (the wrong layout).
std::vector<double> product(MmaKind kind, const Operands& o, bool swapped = false) {
  const int K = depth(kind);
  const bool b_row_major = (kind == MmaKind::tf32_pairs) != swapped;
  std::vector<double> d(kM * kN);
  for (int r = 0; r < kM; ++r) {
    for (int n = 0; n < kN; ++n) {
      double sum = o.c[r * kN + n];
      for (int k = 0; k < K; ++k) {
        const double b = b_row_major ? o.b[k * kN + n] : o.b[n * K + k];
        sum += static_cast<double>(o.a[r * K + k]) * b;
      }
      d[r * kN + n] = sum;
    }
  }
  return d;
}

template <class T, class Convert>
std::vector<T> converted(const std::vector<float>& values, Convert convert) {
  std::vector<T> out;
  for (float v : values) out.push_back(convert(v));
  return out;
}

// Runs one instruction on the device (or the emulation).
std::vector<float> run_mma(MmaKind kind, const Operands& o) {
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::size_t a_count = o.a.size(), b_count = o.b.size();
  cuda::DeviceBuffer<float> c(kM * kN), d(kM * kN), a32(a_count), b32(b_count);
  cuda::DeviceBuffer<std::uint16_t> a16(a_count), b16(b_count);
  std::vector<std::uint16_t> a_bits, b_bits;
  const auto bits = [&](float v) {
    return kind == MmaKind::bf16 ? to_bfloat16(v).bits : to_float16(v).bits;
  };
  for (float v : o.a) a_bits.push_back(bits(v));
  for (float v : o.b) b_bits.push_back(bits(v));
  const std::vector<float> poison(kM * kN, std::nanf(""));
  c.copy_from_host(o.c.data(), o.c.size(), stream);
  d.copy_from_host(poison.data(), poison.size(), stream);
  const void* a = a32.data();
  const void* b = b32.data();
  if (tf32_kind(kind)) {
    a32.copy_from_host(o.a.data(), a_count, stream);
    b32.copy_from_host(o.b.data(), b_count, stream);
  } else {
    a16.copy_from_host(a_bits.data(), a_count, stream);
    b16.copy_from_host(b_bits.data(), b_count, stream);
    a = a16.data();
    b = b16.data();
  }
  detail::launch_mma_check(kind, a, b, c.data(), d.data(), stream, "mma check");
  std::vector<float> out(kM * kN);
  d.copy_to_host(out.data(), out.size(), stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  return out;
}

const char* name(MmaKind kind) {
  return kind == MmaKind::bf16   ? "bf16 m16n8k16"
         : kind == MmaKind::f16  ? "f16 m16n8k16"
         : kind == MmaKind::tf32 ? "tf32 m16n8k8"
                                 : "tf32 m16n8k8, P V operands with paired keys";
}

// How many of the 128 outputs equal `expected` exactly.
int matches(const std::vector<float>& got, const std::vector<double>& expected) {
  int n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) n += static_cast<double>(got[i]) == expected[i];
  return n;
}

class Mma : public ::testing::TestWithParam<MmaKind> {};

TEST_P(Mma, OneInstructionIsThePlainMatrixProduct) {
  EMFLOW_REQUIRE_CUDA();
  const MmaKind kind = GetParam();
  const Operands o = operands(kind);
  const std::vector<float> got = run_mma(kind, o);
  const std::vector<double> expected = product(kind, o);
  for (int r = 0; r < kM; ++r) {
    for (int n = 0; n < kN; ++n) {
      ASSERT_EQ(static_cast<double>(got[r * kN + n]), expected[r * kN + n])
          << name(kind) << ": D[" << r << "][" << n << "]";
    }
  }
}

// The comparison above catches a layout swap: the same values read with B row-major (its rows
// and columns exchanged) give a product that differs from the instruction's almost everywhere,
// and the expected product is not degenerate (not zero, and not the same under the swap).
TEST_P(Mma, AWrongFragmentLayoutIsCaught) {
  EMFLOW_REQUIRE_CUDA();
  const MmaKind kind = GetParam();
  const Operands o = operands(kind);
  const std::vector<float> got = run_mma(kind, o);
  const std::vector<double> right = product(kind, o), wrong = product(kind, o, true);
  EXPECT_EQ(matches(got, right), kM * kN) << name(kind);
  EXPECT_LT(matches(got, wrong), kM * kN / 8) << name(kind);
  int nonzero = 0;
  for (double v : right) nonzero += v != 0.0;
  EXPECT_GT(nonzero, kM * kN - 8);
}

INSTANTIATE_TEST_SUITE_P(Kinds, Mma,
                         ::testing::Values(MmaKind::bf16, MmaKind::f16, MmaKind::tf32,
                                           MmaKind::tf32_pairs),
                         [](const ::testing::TestParamInfo<MmaKind>& info) {
                           return std::string(info.param == MmaKind::bf16   ? "bf16"
                                              : info.param == MmaKind::f16  ? "f16"
                                              : info.param == MmaKind::tf32 ? "tf32"
                                                                            : "tf32_pairs");
                         });

// --- ldmatrix and cp.async ---------------------------------------------------------------------
// The shared-memory loads of the layer against the PTX ISA's tables, register by register: the
// raw ldmatrix.x4 (lane (g, t) receives in register i the pair (row g, columns 2t, 2t + 1) of
// matrix i; .trans: rows 2t, 2t + 1 of column g), and each *_ldsm helper against the fragment
// layout of the MMA operand it loads (the table at the top of kernels/mma.cuh). The tiles are
// distinct values, so a register from the wrong row, column or half differs.

constexpr int kRegisters = detail::kFragmentLoadRegisters;

std::uint16_t half_at(int r, int c) { return static_cast<std::uint16_t>(r * 32 + c + 1); }
float float_at(int r, int c) { return static_cast<float>(r * 16 + c + 1); }  // exact in TF32
std::uint32_t pair(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}
std::uint32_t float_register(int r, int c) { return detail::float_bits(float_at(r, c)); }

// What lane (g, t) must hold in each register of the check (kernels/tc_attention.hpp).
std::vector<std::uint32_t> expected_registers(int lane) {
  const int g = lane / 4, t = lane % 4;
  std::vector<std::uint32_t> e(kRegisters);
  for (int i = 0; i < 4; ++i) {
    e[i] = pair(half_at(8 * i + g, 2 * t), half_at(8 * i + g, 2 * t + 1));
    e[4 + i] = pair(half_at(8 * i + 2 * t, g), half_at(8 * i + 2 * t + 1, g));
  }
  // A (16 x 16): x[0] = A[g][2t, 2t+1], x[1] = A[g+8][...], x[2] = A[g][2t+8, ...], x[3].
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
    e[8 + i] = pair(half_at(row, col), half_at(row, col + 1));
  }
  // B column-major, B[k][n] = tile[n][k]: x[0] = B[2t, 2t+1][n], x[1] = B[2t+8, 2t+9][n], with
  // n = g (first) and g + 8 (second).
  for (int i = 0; i < 4; ++i) {
    const int n = g + 8 * (i / 2), k = 2 * t + 8 * (i % 2);
    e[12 + i] = pair(half_at(n, k), half_at(n, k + 1));
    e[16 + i] = pair(half_at(k, n), half_at(k + 1, n));  // row-major: B[k][n] = tile[k][n]
  }
  // TF32 A (16 x 8): x[0] = A[g][t], x[1] = A[g+8][t], x[2] = A[g][t+4], x[3] = A[g+8][t+4].
  for (int i = 0; i < 4; ++i) e[20 + i] = float_register(g + 8 * (i % 2), t + 4 * (i / 2));
  // TF32 B column-major, B[k][n] = tile[n][k]: x[0] = B[t][n], x[1] = B[t+4][n].
  for (int i = 0; i < 4; ++i) e[24 + i] = float_register(g + 8 * (i / 2), t + 4 * (i % 2));
  return e;
}

const char* register_name(int i) {
  static const char* const names[] = {"ldmatrix",
                                      "ldmatrix.trans",
                                      "load_a_ldsm",
                                      "load_b_col_pair_ldsm",
                                      "load_b_row_pair_ldsm",
                                      "load_a_tf32_ldsm",
                                      "load_b_col_pair_tf32_ldsm"};
  return names[i / 4];
}

TEST(MmaLoads, LdmatrixAndTheFragmentLoadsBuiltOnItFollowThePtxLayout) {
  EMFLOW_REQUIRE_CUDA();
  std::vector<std::uint16_t> halves(32 * 32);
  for (int r = 0; r < 32; ++r) {
    for (int c = 0; c < 32; ++c) halves[r * 32 + c] = half_at(r, c);
  }
  std::vector<float> floats(16 * 16);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) floats[r * 16 + c] = float_at(r, c);
  }
  // Host arrays before the device buffers, so that they outlive the copies a failure leaves.
  const std::vector<std::uint32_t> zeros(32 * kRegisters, 0u);
  std::vector<std::uint32_t> got(32 * kRegisters);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::DeviceBuffer<std::uint16_t> h(halves.size());
  cuda::DeviceBuffer<float> f(floats.size());
  cuda::DeviceBuffer<std::uint32_t> out(32 * kRegisters);
  h.copy_from_host(halves.data(), halves.size(), stream);
  f.copy_from_host(floats.data(), floats.size(), stream);
  out.copy_from_host(zeros.data(), zeros.size(), stream);
  detail::launch_fragment_load_check(h.data(), f.data(), out.data(), stream, "ldmatrix check");
  out.copy_to_host(got.data(), got.size(), stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  for (int lane = 0; lane < 32; ++lane) {
    const std::vector<std::uint32_t> e = expected_registers(lane);
    for (int i = 0; i < kRegisters; ++i) {
      ASSERT_EQ(got[lane * kRegisters + i], e[i])
          << register_name(i) << ", register " << i % 4 << " of lane " << lane;
    }
  }
}

TEST(MmaLoads, AsyncCopiesLandWithTheirZeroFill) {
  EMFLOW_REQUIRE_CUDA();
  constexpr int kBytes = detail::kAsyncCopyBytes;
  std::vector<unsigned char> source(kBytes);
  for (int b = 0; b < kBytes; ++b) source[b] = static_cast<unsigned char>(b % 251 + 1);  // no 0
  const std::vector<unsigned char> filler(kBytes, 0xAB);  // before the buffers, as above
  std::vector<unsigned char> got(kBytes);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::DeviceBuffer<unsigned char> src(kBytes), out(kBytes);
  src.copy_from_host(source.data(), kBytes, stream);
  out.copy_from_host(filler.data(), kBytes, stream);
  detail::launch_async_copy_check(src.data(), out.data(), stream, "cp.async check");
  out.copy_to_host(got.data(), kBytes, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  // Region start, copy size, and how many source bytes lane i's copy reads.
  struct Region {
    int start, size, modulus;
  };
  for (const Region& region : {Region{0, 16, 17}, Region{512, 4, 5}, Region{640, 8, 9}}) {
    for (int lane = 0; lane < 32; ++lane) {
      const int read = lane % region.modulus;
      for (int b = 0; b < region.size; ++b) {
        const int at = region.start + region.size * lane + b;
        ASSERT_EQ(static_cast<int>(got[at]), b < read ? static_cast<int>(source[at]) : 0)
            << region.size << "-byte copy of lane " << lane << " reading " << read
            << " bytes, byte " << b;
      }
    }
  }
}

}  // namespace
}  // namespace emflow::testing
#endif

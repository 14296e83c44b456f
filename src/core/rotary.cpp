// Rotary positions (factored.hpp, rotary.hpp): the inverse frequencies of each scaling, written
// as transformers' _compute_*_parameters write them (docs/MATH.md §2.4), the checks of the
// fields, and the resolution of one call.
#include "rotary.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "check.hpp"

namespace emflow {

namespace {

/// Rotary positions stay within +-2^60, as the masks' (validate.cpp).
constexpr std::int64_t kRotaryPositionLimit = std::int64_t{1} << 60;

bool at_least_one(double value) { return std::isfinite(value) && value >= 1.0; }

/// The frequencies of `r` (validated here, errors under `op` naming "rotary.<field>") for a call
/// whose longest sequence is `sequence_length`; `read_explicit`: whether the explicit array may be
/// read (host memory).
std::vector<double> frequencies(const Rotary& r, std::int64_t sequence_length, const char* op,
                                bool read_explicit) {
  using detail::fail_argument;
  if (r.dim < 2 || r.dim % 2 != 0) {
    fail_argument(op, "rotary.dim", "must be even and >= 2 to have frequencies, got ", r.dim);
  }
  const std::int64_t half = r.dim / 2;
  std::vector<double> inv(static_cast<std::size_t>(half));
  if (r.inverse_frequencies != nullptr) {
    if (r.scaling != RotaryScaling::none) {
      fail_argument(op, "rotary.scaling",
                    "must be none (\"default\") with explicit inverse_frequencies, which are the "
                    "final frequencies, got ",
                    to_string(r.scaling));
    }
    if (!read_explicit) return inv;
    for (std::int64_t t = 0; t < half; ++t) {
      const double f = r.inverse_frequencies[t];
      if (!std::isfinite(f)) {
        fail_argument(op, "rotary.inverse_frequencies", "entry ", t, " must be finite, got ", f);
      }
      inv[static_cast<std::size_t>(t)] = f;
    }
    return inv;
  }
  if (!std::isfinite(r.base) || r.base <= 1.0) {
    fail_argument(op, "rotary.base", "must be finite and > 1, got ", r.base);
  }
  const auto needs_factor = [&] {
    if (!at_least_one(r.factor)) {
      fail_argument(op, "rotary.factor", "must be finite and >= 1 for the ", to_string(r.scaling),
                    " scaling, got ", r.factor);
    }
  };
  const auto needs_original = [&] {
    if (r.original_max_positions < 1) {
      fail_argument(op, "rotary.original_max_positions", "must be >= 1 for the ",
                    to_string(r.scaling), " scaling, got ", r.original_max_positions);
    }
  };
  const auto dim = static_cast<double>(r.dim);
  double base = r.base;
  switch (r.scaling) {
    case RotaryScaling::none:
    case RotaryScaling::linear:
    case RotaryScaling::llama3:
      break;
    case RotaryScaling::dynamic_ntk: {
      needs_factor();
      needs_original();
      if (r.dim < 4) {
        fail_argument(
            op, "rotary.dim",
            "must be >= 4 for the dynamic scaling (its exponent is dim / (dim - 2)), got ", r.dim);
      }
      // _compute_dynamic_ntk_parameters: seq_len = max(seq_len, max_position_embeddings),
      // base *= (factor seq_len / max_position_embeddings - (factor - 1))^(dim / (dim - 2)).
      const auto original = static_cast<double>(r.original_max_positions);
      const double length = std::max(static_cast<double>(sequence_length), original);
      base *= std::pow(r.factor * length / original - (r.factor - 1.0), dim / (dim - 2.0));
      break;
    }
    default:
      fail_argument(op, "rotary.scaling", "must be none, linear, dynamic_ntk or llama3, got ",
                    static_cast<int>(r.scaling));
  }
  // _compute_default_rope_parameters: inv_freq_t = 1 / base^(2t / dim).
  for (std::int64_t t = 0; t < half; ++t) {
    inv[static_cast<std::size_t>(t)] = 1.0 / std::pow(base, static_cast<double>(2 * t) / dim);
  }
  if (r.scaling == RotaryScaling::linear) {
    needs_factor();
    for (double& f : inv) f /= r.factor;  // _compute_linear_scaling_rope_parameters
  } else if (r.scaling == RotaryScaling::llama3) {
    needs_factor();
    needs_original();
    if (!std::isfinite(r.low_freq_factor) || r.low_freq_factor <= 0.0) {
      fail_argument(op, "rotary.low_freq_factor", "must be finite and > 0, got ",
                    r.low_freq_factor);
    }
    if (!std::isfinite(r.high_freq_factor) || r.high_freq_factor <= r.low_freq_factor) {
      fail_argument(op, "rotary.high_freq_factor", "must be finite and > low_freq_factor (",
                    r.low_freq_factor, "), got ", r.high_freq_factor);
    }
    // _compute_llama3_parameters: wavelengths below old_context / high_freq_factor kept, above
    // old_context / low_freq_factor divided by factor, and a smooth mix in between.
    const auto old_context = static_cast<double>(r.original_max_positions);
    const double low_freq_wavelen = old_context / r.low_freq_factor;
    const double high_freq_wavelen = old_context / r.high_freq_factor;
    const double pi = std::acos(-1.0);
    for (double& f : inv) {
      const double wavelen = 2.0 * pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= r.factor;
      } else if (!(wavelen < high_freq_wavelen)) {
        const double smooth =
            (old_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1.0 - smooth) * f / r.factor + smooth * f;
      }
    }
  }
  return inv;
}

void check_positions(const char* op, const char* argument, const std::int64_t* positions,
                     std::int64_t count) {
  for (std::int64_t k = 0; positions != nullptr && k < count; ++k) {
    if (positions[k] < -kRotaryPositionLimit || positions[k] > kRotaryPositionLimit) {
      detail::fail_argument(op, argument, "entry ", k, " must be within +-2^60 (",
                            kRotaryPositionLimit, "), got ", positions[k]);
    }
  }
}

}  // namespace

std::vector<double> rotary_inverse_frequencies(const Rotary& rotary, std::int64_t sequence_length) {
  return frequencies(rotary, sequence_length, "rotary_inverse_frequencies", true);
}

const char* to_string(RotaryPairing pairing) noexcept {
  switch (pairing) {
    case RotaryPairing::half_split:
      return "half_split";
    case RotaryPairing::interleaved:
      return "interleaved";
  }
  return "unknown";
}

const char* to_string(RotaryScaling scaling) noexcept {
  switch (scaling) {
    case RotaryScaling::none:
      return "default";
    case RotaryScaling::linear:
      return "linear";
    case RotaryScaling::dynamic_ntk:
      return "dynamic";
    case RotaryScaling::llama3:
      return "llama3";
  }
  return "unknown";
}

RotaryScaling rotary_scaling_from_string(std::string_view name) {
  if (name == "default" || name == "none") return RotaryScaling::none;
  if (name == "linear") return RotaryScaling::linear;
  if (name == "dynamic") return RotaryScaling::dynamic_ntk;
  if (name == "llama3") return RotaryScaling::llama3;
  detail::fail(ErrorCode::unsupported, "rotary_scaling_from_string: the rope_type '",
               std::string(name),
               "' is not supported (supported: default, linear, dynamic, llama3)");
}

RotaryPairing rotary_pairing_from_string(std::string_view name) {
  if (name == "half_split") return RotaryPairing::half_split;
  if (name == "interleaved") return RotaryPairing::interleaved;
  detail::fail_argument("rotary_pairing_from_string", "name",
                        "must be half_split or interleaved, got '", std::string(name), "'");
}

RotaryDrift rotary_drift(const double* query_factor, const double* key_factor, std::int64_t rank,
                         std::int64_t width, const Rotary& rotary,
                         const std::vector<std::int64_t>& offsets) {
  const char* op = "rotary_drift";
  detail::expect_not_null(op, "query_factor", query_factor);
  detail::expect_not_null(op, "key_factor", key_factor);
  detail::expect_positive(op, "rank", rank);
  detail::expect_positive(op, "width", width);
  std::int64_t longest = 0;
  for (std::size_t k = 0; k < offsets.size(); ++k) {
    if (offsets[k] < 0) {
      detail::fail_argument(op, "offsets", "must be >= 0, got ", offsets[k], " at entry ", k);
    }
    longest = std::max(longest, offsets[k]);
  }
  Rotary plain = rotary;  // only the frequencies and the pairing are read
  plain.key_positions = plain.query_positions = nullptr;
  detail::check_grouping_and_rotary(1, rank, 0, plain, 1, 1, 1, op, detail::Lengths::host);

  // Gram matrices G_A = A A^T and G_B = B B^T (rank x rank). With R(t) orthogonal,
  //   <M(t), M(0)> = tr(B^T R(-t)^T A A^T B) = tr(R(t) G_A G_B),
  //   ||M(t)||^2  = tr(R(t) G_A R(t)^T G_B),
  // so X = R(t) G_A (each column rotated) and Y = X R(t)^T (each row of X rotated) suffice.
  const auto gram = [&](const double* f) {
    std::vector<double> g(static_cast<std::size_t>(rank * rank), 0.0);
    for (std::int64_t a = 0; a < rank; ++a) {
      for (std::int64_t b = 0; b < rank; ++b) {
        double sum = 0.0;
        for (std::int64_t c = 0; c < width; ++c) sum += f[a * width + c] * f[b * width + c];
        g[static_cast<std::size_t>(a * rank + b)] = sum;
      }
    }
    return g;
  };
  const std::vector<double> ga = gram(query_factor), gb = gram(key_factor);
  const auto trace_with_gb = [&](const std::vector<double>& x) {
    double sum = 0.0;
    for (std::int64_t a = 0; a < rank; ++a) {
      for (std::int64_t b = 0; b < rank; ++b) {
        sum +=
            x[static_cast<std::size_t>(a * rank + b)] * gb[static_cast<std::size_t>(b * rank + a)];
      }
    }
    return sum;
  };
  detail::RotaryCall call;
  call.dim = plain.dim;
  call.interleaved = plain.pairing == RotaryPairing::interleaved;
  if (plain.dim > 0) call.inverse_frequencies = rotary_inverse_frequencies(plain, longest + 1);
  const double norm0 = std::sqrt(std::max(trace_with_gb(ga), 0.0));

  RotaryDrift drift;
  std::vector<double> cos(static_cast<std::size_t>(plain.dim / 2));
  std::vector<double> sin(cos.size()), x(ga.size()), column(static_cast<std::size_t>(rank));
  for (const std::int64_t t : offsets) {
    call.angles(t, cos.data(), sin.data());
    for (std::int64_t c = 0; c < rank; ++c) {  // X = R(t) G_A, column by column
      for (std::int64_t a = 0; a < rank; ++a)
        column[a] = ga[static_cast<std::size_t>(a * rank + c)];
      call.rotate(column.data(), cos.data(), sin.data());
      for (std::int64_t a = 0; a < rank; ++a) x[static_cast<std::size_t>(a * rank + c)] = column[a];
    }
    const double inner = trace_with_gb(x);
    std::vector<double> y = x;  // Y = X R(t)^T: each row of X rotated
    for (std::int64_t a = 0; a < rank; ++a) {
      call.rotate(y.data() + a * rank, cos.data(), sin.data());
    }
    const double norm = std::sqrt(std::max(trace_with_gb(y), 0.0));
    // ||M(t) - M(0)||^2 = tr((R(t) - I) G_A (R(t) - I)^T G_B), formed as such rather than as
    // norm^2 + norm0^2 - 2 inner, which cancels to sqrt(epsilon) at small offsets.
    std::vector<double> z(x.size());
    for (std::size_t e = 0; e < z.size(); ++e) z[e] = x[e] - ga[e];
    std::vector<double> rotated = z;
    for (std::int64_t a = 0; a < rank; ++a) {
      call.rotate(rotated.data() + a * rank, cos.data(), sin.data());
    }
    for (std::size_t e = 0; e < z.size(); ++e) z[e] = rotated[e] - z[e];
    const double change2 = std::max(trace_with_gb(z), 0.0);
    drift.offsets.push_back(t);
    drift.relative_change.push_back(norm0 > 0.0 ? std::sqrt(change2) / norm0 : 0.0);
    drift.cosine.push_back(norm0 > 0.0 && norm > 0.0 ? inner / (norm * norm0) : 0.0);
  }
  return drift;
}

namespace detail {

void check_grouping_and_rotary(std::int64_t heads, std::int64_t rank, std::int64_t kv_heads,
                               const Rotary& rotary, std::int64_t batch, std::int64_t tokens,
                               std::int64_t query_tokens, const char* op, Lengths lengths) {
  if (kv_heads < 0 || kv_heads > heads || (kv_heads > 0 && heads % kv_heads != 0)) {
    fail_argument(op, "kv_heads", "must be 0 (heads) or divide heads (", heads, "), got ",
                  kv_heads);
  }
  if (rotary.dim == 0) {
    // No rotation: nothing else of the embedding may be set, or it would be ignored.
    if (rotary.inverse_frequencies != nullptr) {
      fail_argument(op, "rotary.inverse_frequencies", "needs rotary.dim > 0 (0 means no rotation)");
    }
    if (rotary.key_positions != nullptr) {
      fail_argument(op, "rotary.key_positions", "needs rotary.dim > 0 (0 means no rotation)");
    }
    if (rotary.query_positions != nullptr) {
      fail_argument(op, "rotary.query_positions", "needs rotary.dim > 0 (0 means no rotation)");
    }
    if (rotary.scaling != RotaryScaling::none) {
      fail_argument(op, "rotary.scaling", "needs rotary.dim > 0 (0 means no rotation), got ",
                    to_string(rotary.scaling));
    }
    return;
  }
  if (rotary.dim < 0 || rotary.dim % 2 != 0 || rotary.dim > rank) {
    fail_argument(op, "rotary.dim", "must be 0 (none) or even and in [2, rank (", rank, ")], got ",
                  rotary.dim);
  }
  if (rotary.pairing != RotaryPairing::half_split && rotary.pairing != RotaryPairing::interleaved) {
    fail_argument(op, "rotary.pairing", "must be half_split or interleaved, got ",
                  static_cast<int>(rotary.pairing));
  }
  frequencies(rotary, 1, op, lengths == Lengths::host);
  if (lengths == Lengths::host) {
    check_positions(op, "rotary.key_positions", rotary.key_positions, batch * tokens);
    check_positions(op, "rotary.query_positions", rotary.query_positions, batch * query_tokens);
  }
}

void check_fixed_frequencies(const Rotary& rotary, const char* op, const char* why) {
  if (rotary.dim != 0 && rotary.scaling == RotaryScaling::dynamic_ntk &&
      rotary.inverse_frequencies == nullptr) {
    fail(ErrorCode::unsupported, op,
         ": argument 'rotary.scaling' dynamic is not supported here: ", why,
         " (pass the frequencies of the whole sequence as rotary.inverse_frequencies, with "
         "scaling none)");
  }
}

template <class T>
RotaryCall rotary_call(const AttentionInput<T>& input, const Rotary& rotary) {
  RotaryCall call;
  call.dim = rotary.dim;
  if (call.dim == 0) return call;
  call.interleaved = rotary.pairing == RotaryPairing::interleaved;
  call.key_positions = rotary.key_positions;
  call.query_positions = rotary.query_positions;
  call.tokens = input.tokens;
  call.query_tokens = query_count(input);
  std::int64_t longest = 1;
  if (rotary.scaling == RotaryScaling::dynamic_ntk && rotary.inverse_frequencies == nullptr) {
    // transformers: seq_len = max(position_ids) + 1, over every key and query rotated.
    std::int64_t largest = INT64_MIN;
    for (std::int64_t b = 0; b < input.batch; ++b) {
      const QueryRule rule = query_rule(input, b);
      // Without explicit positions the last key sits highest.
      for (std::int64_t j = call.key_positions != nullptr ? 0 : call.tokens - 1; j < call.tokens;
           ++j) {
        largest = std::max(largest, call.key_position(b, rule, j));
      }
      for (std::int64_t i = 0; i < call.query_tokens; ++i) {
        largest = std::max(largest, call.query_position(b, rule, i));
      }
    }
    longest = largest + 1;
  }
  call.inverse_frequencies = frequencies(rotary, longest, "attend_factored", true);
  return call;
}

template RotaryCall rotary_call<float>(const AttentionInput<float>&, const Rotary&);
template RotaryCall rotary_call<double>(const AttentionInput<double>&, const Rotary&);
template RotaryCall rotary_call<bfloat16>(const AttentionInput<bfloat16>&, const Rotary&);
template RotaryCall rotary_call<float16>(const AttentionInput<float16>&, const Rotary&);

}  // namespace detail

}  // namespace emflow

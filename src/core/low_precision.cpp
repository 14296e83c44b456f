// The host kernels of a routed call for every storage type (low_precision.hpp, docs/MATH.md §7).
//
// Widening is exact (precision.hpp), so Kernel::cpu_fused computes the float32 result of exactly
// the stored values and Kernel::reference the double one. The statistics are float32 for float
// and both 16-bit types (Stat<T>), so a float kernel writes them in place; only the update,
// stored in T, passes through a float buffer and is rounded to nearest even once. A storage type
// that is the kernel's own type passes its arrays straight through.
#include "low_precision.hpp"

#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "queries.hpp"

namespace emflow::detail {

namespace {

/// A stored value as U (exact for every storage type).
template <class U, class T>
U widen(T value) {
  if constexpr (is_16bit_v<T>) {
    return static_cast<U>(to_float(value));
  } else {
    return static_cast<U>(value);
  }
}

/// `count` stored values as U, or `values` itself when T is U; null for null.
template <class U, class T>
class Widened {
 public:
  Widened(const T* values, std::int64_t count) {
    if constexpr (std::is_same_v<U, T>) {
      data_ = values;
    } else if (values != nullptr) {
      copy_.resize(static_cast<std::size_t>(count));
      for (std::size_t i = 0; i < copy_.size(); ++i) copy_[i] = widen<U>(values[i]);
      data_ = copy_.data();
    }
  }
  Widened(const Widened&) = delete;
  Widened& operator=(const Widened&) = delete;
  const U* data() const { return data_; }

 private:
  std::vector<U> copy_;
  const U* data_ = nullptr;
};

/// The clouds of `in` as U, and `in` itself over them with `layer`.
template <class U, class T>
struct WideInput {
  Widened<U, T> cloud, queries;
  AttentionInput<U> input;

  WideInput(const AttentionInput<T>& in, const LayerOperators<U>& layer)
      : cloud(in.cloud, in.batch * in.tokens * in.dim),
        queries(in.queries, in.batch * query_count(in) * in.dim),
        input(with_arrays(in, cloud.data(), queries.data(), layer)) {}
};

/// The dense operators of `in` as U.
template <class U, class T>
struct WideLayer {
  Widened<U, T> relevance, content, key_bias, offset;
  LayerOperators<U> layer;

  explicit WideLayer(const AttentionInput<T>& in)
      : relevance(in.layer.relevance, in.layer.heads * in.dim * in.dim),
        content(in.layer.content, in.layer.heads * in.dim * in.dim),
        key_bias(in.layer.key_bias, in.layer.heads * in.dim),
        offset(in.layer.offset, in.dim),
        layer{in.layer.heads, relevance.data(), content.data(), key_bias.data(), offset.data()} {}
};

/// The factors of `f` as U.
template <class U, class T>
struct WideFactors {
  Widened<U, T> A, B, Up, V, key_bias, offset;
  FactoredLayer<U> layer;

  WideFactors(const FactoredLayer<T>& f, std::int64_t d)
      : A(f.query_factor, f.heads * f.rank * d),
        B(f.key_factor, f.key_heads() * f.rank * d),
        Up(f.content_up, f.heads * d * f.rank),
        V(f.content_down, f.key_heads() * f.rank * d),
        key_bias(f.key_bias, f.heads * d),
        offset(f.offset, d),
        layer{f.heads,  f.rank,          A.data(),      B.data(),   Up.data(),
              V.data(), key_bias.data(), offset.data(), f.kv_heads, f.rotary} {}
};

/// Outputs in U for a call whose outputs are T: `output` itself when U is T; else the update
/// through a buffer, and the statistics in place when U is Stat<T> (float for the 16-bit types),
/// through buffers otherwise. write_back() stores the buffers.
template <class U, class T>
class WideOutput {
 public:
  /// `in`: the call as the kernel sees it (its heads are those of the operators it runs).
  WideOutput(const AttentionInput<U>& in, const AttentionOutput<T>& out) : target_(out) {
    if constexpr (std::is_same_v<U, T>) {
      output_ = out;
    } else {
      const auto rows = static_cast<std::size_t>(in.batch * in.layer.heads * query_count(in));
      update_.resize(static_cast<std::size_t>(in.batch * query_count(in) * in.dim));
      output_.update = update_.data();
      if constexpr (std::is_same_v<Stat<U>, Stat<T>>) {
        output_.lse = out.lse;
        output_.entropy = out.entropy;
        output_.weights = out.weights;
      } else {
        output_.lse = buffer(lse_, out.lse, rows);
        output_.entropy = buffer(entropy_, out.entropy, rows);
        output_.weights = buffer(weights_, out.weights, rows * static_cast<std::size_t>(in.tokens));
      }
    }
  }

  const AttentionOutput<U>& output() const { return output_; }

  void write_back() const {
    for (std::size_t i = 0; i < update_.size(); ++i) target_.update[i] = narrow<T>(update_[i]);
    copy(lse_, target_.lse);
    copy(entropy_, target_.entropy);
    copy(weights_, target_.weights);
  }

 private:
  static Stat<U>* buffer(std::vector<Stat<U>>& values, const Stat<T>* given, std::size_t count) {
    if (given == nullptr) return nullptr;
    values.resize(count);
    return values.data();
  }
  static void copy(const std::vector<Stat<U>>& values, Stat<T>* into) {
    for (std::size_t i = 0; i < values.size(); ++i) into[i] = static_cast<Stat<T>>(values[i]);
  }

  const AttentionOutput<T>& target_;
  AttentionOutput<U> output_;
  std::vector<U> update_;
  std::vector<Stat<U>> lse_, entropy_, weights_;
};

/// Runs `body` (a kernel called on AttentionInput<U>, AttentionOutput<U>) on `in` and `layer`
/// as U.
template <class U, class T, class Body>
void run_in(const AttentionInput<T>& in, const LayerOperators<U>& layer,
            const AttentionOutput<T>& out, Body&& body) {
  const WideInput<U, T> wide(in, layer);
  const WideOutput<U, T> sink(wide.input, out);
  body(wide.input, sink.output());
  sink.write_back();
}

}  // namespace

template <class U>
template <class T>
ExpandedLayer<U>::ExpandedLayer(const FactoredLayer<T>& f, std::int64_t d) : heads(f.heads) {
  if (f.rotary.dim != 0) {
    fail(ErrorCode::unsupported,
         "attend_factored: a rotary layer has no single M_h (M_h(p_j - p_i) = A_h^T R(p_j - p_i) "
         "B_h depends on the offset), so it has no dense form; use attend_factored");
  }
  const std::int64_t H = f.heads, r = f.rank, group = f.heads / f.key_heads();
  relevance.assign(static_cast<std::size_t>(H * d * d), U(0));
  content.assign(relevance.size(), U(0));
  for (std::int64_t h = 0; h < H; ++h) {
    // Grouped heads: head h reads kv head h / group (B and V repeated, as repeat_kv).
    const T* A = f.query_factor + h * r * d;
    const T* B = f.key_factor + (h / group) * r * d;
    const T* Up = f.content_up + h * d * r;
    const T* V = f.content_down + (h / group) * r * d;
    U* M = relevance.data() + h * d * d;
    U* F = content.data() + h * d * d;
    for (std::int64_t a = 0; a < d; ++a) {
      for (std::int64_t b = 0; b < d; ++b) {
        double m = 0.0, c = 0.0;
        for (std::int64_t k = 0; k < r; ++k) {
          m += widen<double>(A[k * d + a]) * widen<double>(B[k * d + b]);
          c += widen<double>(Up[a * r + k]) * widen<double>(V[k * d + b]);
        }
        M[a * d + b] = static_cast<U>(m);
        F[a * d + b] = static_cast<U>(c);
      }
    }
  }
  for (std::int64_t i = 0; f.key_bias != nullptr && i < H * d; ++i) {
    key_bias.push_back(widen<U>(f.key_bias[i]));
  }
  for (std::int64_t i = 0; f.offset != nullptr && i < d; ++i)
    offset.push_back(widen<U>(f.offset[i]));
}

template <class T>
void attend_on_host(const AttentionInput<T>& in, const AttentionOutput<T>& out, const Route& route,
                    int threads) {
  // The reference of float storage computes in double inside reference_attend<float>; so does
  // its float form for the 16-bit types, whose values float holds exactly.
  using Wide = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const WideLayer<Wide, T> layer(in);
  switch (route.kernel) {
    case Kernel::reference:
      run_in(in, layer.layer, out,
             [](const AttentionInput<Wide>& i, const AttentionOutput<Wide>& o) {
               reference_attend(i, o);
             });
      return;
    case Kernel::cpu_fused:
      if constexpr (std::is_same_v<Wide, float>) {
        run_in(in, layer.layer, out,
               [threads](const AttentionInput<float>& i, const AttentionOutput<float>& o) {
                 cpu_attend(i, o, threads);
               });
        return;
      }
      break;
    case Kernel::cpu_bf16:
      if constexpr (std::is_same_v<T, bfloat16>) {
        // Writes the bfloat16 update and the float32 statistics itself.
        const WideInput<float, T> wide(in, layer.layer);
        cpu_attend_bf16(wide.input, out, threads);
        return;
      }
      break;
    default:
      break;
  }
  fail(ErrorCode::internal, "attend: no host kernel for the route ", to_string(route));
}

template <class T>
void attend_factored_on_host(const AttentionInput<T>& in, const FactoredLayer<T>& layer,
                             const AttentionOutput<T>& out, const Route& route, int threads) {
  if (route.kernel == Kernel::reference && route.expanded) {
    // M_h and F_h in double, and the reference on the double values of the clouds.
    const ExpandedLayer<double> dense(layer, in.dim);
    run_in(in, dense.operators(), out,
           [](const AttentionInput<double>& i, const AttentionOutput<double>& o) {
             reference_attend(i, o);
           });
    return;
  }
  if (route.kernel == Kernel::reference) {
    // The factored form in double (a rotary layer, which has no dense form).
    const WideFactors<double, T> factors(layer, in.dim);
    run_in(in, LayerOperators<double>{layer.heads}, out,
           [&](const AttentionInput<double>& i, const AttentionOutput<double>& o) {
             reference_attend_factored(i, factors.layer, o);
           });
    return;
  }
  if constexpr (!std::is_same_v<T, double>) {
    if (route.kernel == Kernel::cpu_fused && !route.expanded) {
      const WideFactors<float, T> factors(layer, in.dim);
      run_in(in, LayerOperators<float>{layer.heads}, out,
             [&](const AttentionInput<float>& i, const AttentionOutput<float>& o) {
               cpu_attend_factored(i, factors.layer, o, threads);
             });
      return;
    }
  }
  fail(ErrorCode::internal, "attend_factored: no host kernel for the route ", to_string(route));
}

template <class T>
void partial_factored_on_host(const AttentionInput<T>& in, const FactoredLayer<T>& layer,
                              const PartialOutput<T>& out) {
  const WideFactors<double, T> factors(layer, in.dim);
  const WideInput<double, T> wide(in, LayerOperators<double>{layer.heads});
  if constexpr (std::is_same_v<T, double>) {
    reference_attend_factored(wide.input, factors.layer, AttentionOutput<double>{}, &out);
  } else {
    const auto rows = static_cast<std::size_t>(in.batch * layer.heads * query_count(in));
    std::vector<double> heads(rows * static_cast<std::size_t>(in.dim)), lse(rows), entropy(rows);
    const PartialOutput<double> state{heads.data(), lse.data(), entropy.data()};
    reference_attend_factored(wide.input, factors.layer, AttentionOutput<double>{}, &state);
    for (std::size_t i = 0; i < heads.size(); ++i) out.heads[i] = static_cast<T>(heads[i]);
    for (std::size_t i = 0; i < rows; ++i) {
      out.lse[i] = static_cast<Stat<T>>(lse[i]);
      out.entropy[i] = static_cast<Stat<T>>(entropy[i]);
    }
  }
}

template void partial_factored_on_host<float>(const AttentionInput<float>&,
                                              const FactoredLayer<float>&,
                                              const PartialOutput<float>&);
template void partial_factored_on_host<double>(const AttentionInput<double>&,
                                               const FactoredLayer<double>&,
                                               const PartialOutput<double>&);

#define EMFLOW_HOST_KERNELS(T)                                                                \
  template void attend_on_host<T>(const AttentionInput<T>&, const AttentionOutput<T>&,        \
                                  const Route&, int);                                         \
  template void attend_factored_on_host<T>(const AttentionInput<T>&, const FactoredLayer<T>&, \
                                           const AttentionOutput<T>&, const Route&, int);     \
  template ExpandedLayer<double>::ExpandedLayer(const FactoredLayer<T>&, std::int64_t);
EMFLOW_HOST_KERNELS(float)
EMFLOW_HOST_KERNELS(double)
EMFLOW_HOST_KERNELS(bfloat16)
EMFLOW_HOST_KERNELS(float16)
#undef EMFLOW_HOST_KERNELS
template ExpandedLayer<float>::ExpandedLayer(const FactoredLayer<float>&, std::int64_t);

}  // namespace emflow::detail

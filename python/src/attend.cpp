// emflow Python module: emflow.attend and emflow.attend_factored on the caller's arrays, and
// their backward passes (emflow/backward.hpp) on host arrays.
//
// The Python layer (emflow/__init__.py) parses the keyword arguments, makes copies when asked
// (copy=True) and allocates the outputs with the caller's framework; these functions check every
// array against the shapes of 'x' and the operators and run the C++ call on the arrays' memory
// with the GIL released. CUDA arrays run through emflow::cuda::attend_async on the stream the
// caller names, with a workspace the caller's allocator returns (torch's caching allocator).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <chrono>

#include "arrays.hpp"
#include "bindings.hpp"
#include "emflow/attention.hpp"
#include "emflow/backward.hpp"
#include "emflow/factored.hpp"
#ifdef EMFLOW_WITH_CUDA
#include "emflow/cuda.hpp"
#endif

namespace emflow::python {
namespace {

using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

/// The shapes a call implies: B, H and N, and whether 'x' / the operators carried B and H.
struct Dims {
  bool batched = false, multihead = false;
  std::int64_t batch = 1, heads = 1, tokens = 0, dim = 0;

  Shape per_head(std::int64_t last) const {  // lse/entropy (last = 0) and weights (last = N)
    Shape shape;
    if (batched) shape.push_back(batch);
    if (multihead) shape.push_back(heads);
    shape.push_back(tokens);
    if (last) shape.push_back(last);
    return shape;
  }
  Shape op(std::int64_t rows, std::int64_t cols) const {
    return multihead ? Shape{heads, rows, cols} : Shape{rows, cols};
  }
  Shape bias() const { return multihead ? Shape{heads, dim} : Shape{dim}; }
};

Dims dims_of(const char* operation, const InArray& x, const InArray& op, const char* op_name,
             int op_rank) {
  Dims dims;
  if (x.ndim() != 2 && x.ndim() != 3) {
    refuse(operation, "x", "has shape " + shape_string(x) + ", expected (N, d) or (B, N, d)");
  }
  dims.batched = x.ndim() == 3;
  dims.batch = dims.batched ? static_cast<std::int64_t>(x.shape(0)) : 1;
  dims.tokens = static_cast<std::int64_t>(x.shape(x.ndim() - 2));
  dims.dim = static_cast<std::int64_t>(x.shape(x.ndim() - 1));
  if (op.ndim() != static_cast<std::size_t>(op_rank) &&
      op.ndim() != static_cast<std::size_t>(op_rank) + 1) {
    refuse(operation, op_name,
           "has shape " + shape_string(op) + ", expected " + std::to_string(op_rank) +
               " axes, or " + std::to_string(op_rank + 1) + " with the heads first");
  }
  dims.multihead = op.ndim() == static_cast<std::size_t>(op_rank) + 1;
  dims.heads = dims.multihead ? static_cast<std::int64_t>(op.shape(0)) : 1;
  return dims;
}

Placement placement_of(const char* operation, const InArray& x) {
  Placement place{operation, x.dtype(), x.device_type(), x.device_id()};
  if (x.dtype() != nb::dtype<float>() && x.dtype() != nb::dtype<double>()) {
    refuse(operation, "x",
           "has dtype " + dtype_name(x.dtype()) +
               ", expected float32 or float64; pass "
               "copy=True to convert");
  }
  return place;
}

template <class T>
AttentionOutput<T> outputs(const Placement& place, const Dims& dims, OutArray& update,
                           const OptOut& lse, const OptOut& entropy, const OptOut& weights) {
  AttentionOutput<T> out;
  const Shape cloud =
      dims.batched ? Shape{dims.batch, dims.tokens, dims.dim} : Shape{dims.tokens, dims.dim};
  out.update = optional_output<T>(place, "out", update, cloud);
  out.lse = optional_output<T>(place, "lse", lse, dims.per_head(0));
  out.entropy = optional_output<T>(place, "entropy", entropy, dims.per_head(0));
  out.weights = optional_output<T>(place, "weights", weights, dims.per_head(dims.tokens));
  return out;
}

/// The cloud's part of the input: 'x' itself checked like every other array (its layout above
/// all: a strided or transposed view must not be read as if it were dense), the mask parsed by
/// the library's parser from its text.
template <class T>
AttentionInput<T> cloud_input(const Placement& place, const Dims& dims, const InArray& x,
                              double beta, const std::string& mask, const OptIn& lengths) {
  AttentionInput<T> in;
  const Shape cloud =
      dims.batched ? Shape{dims.batch, dims.tokens, dims.dim} : Shape{dims.tokens, dims.dim};
  in.cloud = input<T>(place, "x", x, cloud);
  in.batch = dims.batch;
  in.tokens = dims.tokens;
  in.dim = dims.dim;
  in.beta = beta;
  in.mask = parse_mask(mask, "mask");
  in.key_lengths = key_lengths(place, lengths, dims.batch);
  return in;
}

#ifdef EMFLOW_WITH_CUDA
template <class T>
void attend_cuda(const AttentionInput<T>& in, const AttentionOutput<T>& out, std::uintptr_t stream,
                 const nb::object& allocate) {
  const std::size_t bytes = cuda::attend_workspace_size(in, out);
  void* workspace = nullptr;
  nb::object buffer;  // keeps the workspace alive until the work is enqueued
  if (bytes) {
    if (!allocate.is_valid() || allocate.is_none()) {
      throw Error(ErrorCode::unsupported,
                  "attend: CUDA arrays other than torch tensors need a workspace allocator");
    }
    buffer = allocate(bytes);
    OutArray array = nb::cast<OutArray>(buffer);
    if (array.nbytes() < bytes) {
      throw Error(ErrorCode::internal, "attend: the workspace allocator returned too few bytes");
    }
    workspace = array.data();
  }
  nb::gil_scoped_release release;
  cuda::attend_async(in, out, workspace, bytes, reinterpret_cast<cuda::Stream>(stream));
}
#endif

template <class T>
void attend_dense(const Placement& place, const InArray& x, const InArray& relevance,
                  const InArray& content, const OptIn& key_bias, const OptIn& offset, double beta,
                  const std::string& mask, const OptIn& lengths, OutArray& update,
                  const OptOut& lse, const OptOut& entropy, const OptOut& weights,
                  const std::string& device, std::int64_t threads, std::uintptr_t stream,
                  const nb::object& allocate) {
  const Dims dims = dims_of("attend", x, relevance, "relevance", 2);
  AttentionInput<T> in = cloud_input<T>(place, dims, x, beta, mask, lengths);
  in.layer.heads = dims.heads;
  in.layer.relevance = input<T>(place, "relevance", relevance, dims.op(dims.dim, dims.dim));
  in.layer.content = input<T>(place, "content", content, dims.op(dims.dim, dims.dim));
  in.layer.key_bias = optional_input<T>(place, "key_bias", key_bias, dims.bias());
  in.layer.offset = optional_input<T>(place, "offset", offset, Shape{dims.dim});
  const AttentionOutput<T> out = outputs<T>(place, dims, update, lse, entropy, weights);
  const ExecutionOptions options{parse_device(device), check_threads(threads, "attend")};
  if (place.device_type == nb::device::cuda::value) {
    if (options.device != Device::automatic && options.device != Device::cuda) {
      throw Error(ErrorCode::invalid_argument, std::string("attend: argument 'device' is '") +
                                                   device + "' but the arrays are CUDA arrays");
    }
#ifdef EMFLOW_WITH_CUDA
    attend_cuda(in, out, stream, allocate);
#else
    (void)stream;
    (void)allocate;
    throw Error(ErrorCode::unsupported, "attend: CUDA arrays need emflow built with CUDA");
#endif
    return;
  }
  if (place.device_type != nb::device::cpu::value) {
    refuse("attend", "x", "is neither in host memory nor a CUDA array");
  }
  nb::gil_scoped_release release;
  attend(in, out, options);
}

/// The rotary positions and kv heads of attend_factored (FactoredLayer::rotary, kv_heads), as
/// the Python layer passes them.
struct RotaryArguments {
  std::int64_t kv_heads = 0;
  std::int64_t dim = 0;
  double base = 10000.0;
  std::string pairing = "half_split";
  std::string scaling = "default";
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  std::int64_t original_max_positions = 0;
  OptIn inverse_frequencies;
};

template <class T>
void attend_factored_host(const Placement& place, const InArray& x, const InArray& query_factor,
                          const InArray& key_factor, const InArray& content_up,
                          const InArray& content_down, const OptIn& key_bias, const OptIn& offset,
                          double beta, const std::string& mask, const OptIn& lengths,
                          OutArray& update, const OptOut& lse, const OptOut& entropy,
                          const OptOut& weights, const std::string& device, std::int64_t threads,
                          const RotaryArguments& rotary) {
  const Dims dims = dims_of("attend_factored", x, query_factor, "query_factor", 2);
  const auto rank = static_cast<std::int64_t>(query_factor.shape(query_factor.ndim() - 2));
  if (place.device_type != nb::device::cpu::value) {
    refuse("attend_factored", "x", "is not in host memory");
  }
  const AttentionInput<T> in = cloud_input<T>(place, dims, x, beta, mask, lengths);
  FactoredLayer<T> layer;
  layer.heads = dims.heads;
  layer.rank = rank;
  layer.kv_heads = rotary.kv_heads;
  // B and V hold the kv heads (the heads when kv_heads is 0; attend_factored checks the count).
  const std::int64_t kv = rotary.kv_heads > 0 ? rotary.kv_heads : dims.heads;
  const Shape shared = dims.multihead ? Shape{kv, rank, dims.dim} : Shape{rank, dims.dim};
  layer.query_factor = input<T>(place, "query_factor", query_factor, dims.op(rank, dims.dim));
  layer.key_factor = input<T>(place, "key_factor", key_factor, shared);
  layer.content_up = input<T>(place, "content_up", content_up, dims.op(dims.dim, rank));
  layer.content_down = input<T>(place, "content_down", content_down, shared);
  layer.rotary.dim = rotary.dim;
  layer.rotary.base = rotary.base;
  layer.rotary.pairing = rotary_pairing_from_string(rotary.pairing);
  layer.rotary.scaling = rotary_scaling_from_string(rotary.scaling);
  layer.rotary.factor = rotary.factor;
  layer.rotary.low_freq_factor = rotary.low_freq_factor;
  layer.rotary.high_freq_factor = rotary.high_freq_factor;
  layer.rotary.original_max_positions = rotary.original_max_positions;
  Placement frequencies = place;
  frequencies.dtype = nb::dtype<double>();
  frequencies.like = "float64 (the inverse frequencies are double)";
  layer.rotary.inverse_frequencies =
      optional_input<double>(frequencies, "inverse_frequencies", rotary.inverse_frequencies,
                             Shape{rotary.dim > 0 ? rotary.dim / 2 : 0});
  layer.key_bias = optional_input<T>(place, "key_bias", key_bias, dims.bias());
  layer.offset = optional_input<T>(place, "offset", offset, Shape{dims.dim});
  const AttentionOutput<T> out = outputs<T>(place, dims, update, lse, entropy, weights);
  const ExecutionOptions options{parse_device(device), check_threads(threads, "attend_factored")};
  nb::gil_scoped_release release;
  attend_factored(in, layer, out, options);
}

/// The upstream gradients of a layer's outputs: dDelta (the update's shape), dlse and dH
/// (per head), each optional.
template <class T>
UpstreamGradients<T> upstream_of(const Placement& place, const Dims& dims, const OptIn& d_update,
                                 const OptIn& d_lse, const OptIn& d_entropy) {
  const Shape cloud =
      dims.batched ? Shape{dims.batch, dims.tokens, dims.dim} : Shape{dims.tokens, dims.dim};
  UpstreamGradients<T> upstream;
  upstream.update = optional_input<T>(place, "d_update", d_update, cloud);
  upstream.lse = optional_input<T>(place, "d_lse", d_lse, dims.per_head(0));
  upstream.entropy = optional_input<T>(place, "d_entropy", d_entropy, dims.per_head(0));
  return upstream;
}

void host_only(const Placement& place) {
  if (place.device_type == nb::device::cuda::value) {
    throw Error(ErrorCode::unsupported, std::string(place.operation) +
                                            ": CUDA arrays: no GPU path computes the backward "
                                            "pass yet (host arrays only)");
  }
  if (place.device_type != nb::device::cpu::value)
    refuse(place.operation, "x", "is not in host memory");
}

template <class T>
double attend_backward_host(const Placement& place, const InArray& x, const InArray& relevance,
                            const InArray& content, const OptIn& key_bias, const OptIn& offset,
                            double beta, const std::string& mask, const OptIn& lengths,
                            const OptIn& d_update, const OptIn& d_lse, const OptIn& d_entropy,
                            const OptOut& d_x, const OptOut& d_relevance, const OptOut& d_content,
                            const OptOut& d_key_bias, const OptOut& d_offset,
                            const std::string& device, std::int64_t threads) {
  host_only(place);
  const Dims dims = dims_of(place.operation, x, relevance, "relevance", 2);
  AttentionInput<T> in = cloud_input<T>(place, dims, x, beta, mask, lengths);
  in.layer.heads = dims.heads;
  in.layer.relevance = input<T>(place, "relevance", relevance, dims.op(dims.dim, dims.dim));
  in.layer.content = input<T>(place, "content", content, dims.op(dims.dim, dims.dim));
  in.layer.key_bias = optional_input<T>(place, "key_bias", key_bias, dims.bias());
  in.layer.offset = optional_input<T>(place, "offset", offset, Shape{dims.dim});
  const UpstreamGradients<T> upstream = upstream_of<T>(place, dims, d_update, d_lse, d_entropy);
  const Shape cloud =
      dims.batched ? Shape{dims.batch, dims.tokens, dims.dim} : Shape{dims.tokens, dims.dim};
  double d_beta = 0.0;
  LayerGradientOutput<T> gradients;
  gradients.cloud = optional_output<T>(place, "d_x", d_x, cloud);
  gradients.relevance =
      optional_output<T>(place, "d_relevance", d_relevance, dims.op(dims.dim, dims.dim));
  gradients.content =
      optional_output<T>(place, "d_content", d_content, dims.op(dims.dim, dims.dim));
  gradients.key_bias = optional_output<T>(place, "d_key_bias", d_key_bias, dims.bias());
  gradients.offset = optional_output<T>(place, "d_offset", d_offset, Shape{dims.dim});
  gradients.beta = &d_beta;
  const ExecutionOptions options{parse_device(device), check_threads(threads, place.operation)};
  {
    nb::gil_scoped_release release;
    attend_backward(in, upstream, gradients, options);
  }
  return d_beta;
}

template <class T>
double factored_backward_host(const Placement& place, const InArray& x, const InArray& query_factor,
                              const InArray& key_factor, const InArray& content_up,
                              const InArray& content_down, const OptIn& key_bias,
                              const OptIn& offset, double beta, const std::string& mask,
                              const OptIn& lengths, const OptIn& d_update, const OptIn& d_lse,
                              const OptIn& d_entropy, const OptOut& d_x,
                              const OptOut& d_query_factor, const OptOut& d_key_factor,
                              const OptOut& d_content_up, const OptOut& d_content_down,
                              const OptOut& d_key_bias, const OptOut& d_offset,
                              const std::string& device, std::int64_t threads) {
  host_only(place);
  const Dims dims = dims_of(place.operation, x, query_factor, "query_factor", 2);
  const auto rank = static_cast<std::int64_t>(query_factor.shape(query_factor.ndim() - 2));
  const AttentionInput<T> in = cloud_input<T>(place, dims, x, beta, mask, lengths);
  FactoredLayer<T> layer;
  layer.heads = dims.heads;
  layer.rank = rank;
  layer.query_factor = input<T>(place, "query_factor", query_factor, dims.op(rank, dims.dim));
  layer.key_factor = input<T>(place, "key_factor", key_factor, dims.op(rank, dims.dim));
  layer.content_up = input<T>(place, "content_up", content_up, dims.op(dims.dim, rank));
  layer.content_down = input<T>(place, "content_down", content_down, dims.op(rank, dims.dim));
  layer.key_bias = optional_input<T>(place, "key_bias", key_bias, dims.bias());
  layer.offset = optional_input<T>(place, "offset", offset, Shape{dims.dim});
  const UpstreamGradients<T> upstream = upstream_of<T>(place, dims, d_update, d_lse, d_entropy);
  const Shape cloud =
      dims.batched ? Shape{dims.batch, dims.tokens, dims.dim} : Shape{dims.tokens, dims.dim};
  double d_beta = 0.0;
  FactoredGradientOutput<T> gradients;
  gradients.cloud = optional_output<T>(place, "d_x", d_x, cloud);
  gradients.query_factor =
      optional_output<T>(place, "d_query_factor", d_query_factor, dims.op(rank, dims.dim));
  gradients.key_factor =
      optional_output<T>(place, "d_key_factor", d_key_factor, dims.op(rank, dims.dim));
  gradients.content_up =
      optional_output<T>(place, "d_content_up", d_content_up, dims.op(dims.dim, rank));
  gradients.content_down =
      optional_output<T>(place, "d_content_down", d_content_down, dims.op(rank, dims.dim));
  gradients.key_bias = optional_output<T>(place, "d_key_bias", d_key_bias, dims.bias());
  gradients.offset = optional_output<T>(place, "d_offset", d_offset, Shape{dims.dim});
  gradients.beta = &d_beta;
  const ExecutionOptions options{parse_device(device), check_threads(threads, place.operation)};
  {
    nb::gil_scoped_release release;
    attend_factored_backward(in, layer, upstream, gradients, options);
  }
  return d_beta;
}

/// Seconds per emflow::attend call on host arrays, timed in C++ over `repeats` calls: the
/// baseline of bench/python_overhead.py.
double time_attend(const InArray& x, const InArray& relevance, const InArray& content,
                   OutArray& update, std::int64_t threads, std::int64_t repeats) {
  const Placement place = placement_of("attend", x);
  if (place.dtype != nb::dtype<float>()) refuse("attend", "x", "must be float32 here");
  const Dims dims = dims_of("attend", x, relevance, "relevance", 2);
  AttentionInput<float> in = cloud_input<float>(place, dims, x, 1.0, "none", std::nullopt);
  in.layer.heads = dims.heads;
  in.layer.relevance = input<float>(place, "relevance", relevance, dims.op(dims.dim, dims.dim));
  in.layer.content = input<float>(place, "content", content, dims.op(dims.dim, dims.dim));
  const AttentionOutput<float> out =
      outputs<float>(place, dims, update, std::nullopt, std::nullopt, std::nullopt);
  const ExecutionOptions options{Device::cpu, check_threads(threads, "time_attend")};
  nb::gil_scoped_release release;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < repeats; ++i) attend(in, out, options);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(repeats);
}

}  // namespace

void bind_attend(nb::module_& m) {
  m.def(
      "attend",
      [](const InArray& x, const InArray& relevance, const InArray& content, const OptIn& key_bias,
         const OptIn& offset, double beta, const std::string& mask, const OptIn& lengths,
         OutArray update, const OptOut& lse, const OptOut& entropy, const OptOut& weights,
         const std::string& device, std::int64_t threads, std::uintptr_t stream,
         const nb::object& allocate) {
        const Placement place = placement_of("attend", x);
        if (place.dtype == nb::dtype<float>()) {
          attend_dense<float>(place, x, relevance, content, key_bias, offset, beta, mask, lengths,
                              update, lse, entropy, weights, device, threads, stream, allocate);
        } else {
          attend_dense<double>(place, x, relevance, content, key_bias, offset, beta, mask, lengths,
                               update, lse, entropy, weights, device, threads, stream, allocate);
        }
      },
      nb::arg("x"), nb::arg("relevance"), nb::arg("content"), nb::arg("key_bias").none(),
      nb::arg("offset").none(), nb::arg("beta"), nb::arg("mask"), nb::arg("key_lengths").none(),
      nb::arg("update"), nb::arg("lse").none(), nb::arg("entropy").none(),
      nb::arg("weights").none(), nb::arg("device"), nb::arg("threads"), nb::arg("stream"),
      nb::arg("allocate").none(),
      "emflow::attend (or emflow::cuda::attend_async for CUDA arrays) on the given arrays, "
      "written into the given outputs. Use emflow.attend.");
  m.def(
      "attend_factored",
      [](const InArray& x, const InArray& a, const InArray& b, const InArray& u, const InArray& v,
         const OptIn& key_bias, const OptIn& offset, double beta, const std::string& mask,
         const OptIn& lengths, OutArray update, const OptOut& lse, const OptOut& entropy,
         const OptOut& weights, const std::string& device, std::int64_t threads,
         std::int64_t kv_heads, std::int64_t rotary_dim, double rotary_base,
         const std::string& rotary_pairing, const std::string& rotary_scaling, double rotary_factor,
         double low_freq_factor, double high_freq_factor, std::int64_t original_max_positions,
         const OptIn& inverse_frequencies) {
        const Placement place = placement_of("attend_factored", x);
        const RotaryArguments rotary{kv_heads,           rotary_dim,       rotary_base,
                                     rotary_pairing,     rotary_scaling,   rotary_factor,
                                     low_freq_factor,    high_freq_factor, original_max_positions,
                                     inverse_frequencies};
        if (place.dtype == nb::dtype<float>()) {
          attend_factored_host<float>(place, x, a, b, u, v, key_bias, offset, beta, mask, lengths,
                                      update, lse, entropy, weights, device, threads, rotary);
        } else {
          attend_factored_host<double>(place, x, a, b, u, v, key_bias, offset, beta, mask, lengths,
                                       update, lse, entropy, weights, device, threads, rotary);
        }
      },
      nb::arg("x"), nb::arg("query_factor"), nb::arg("key_factor"), nb::arg("content_up"),
      nb::arg("content_down"), nb::arg("key_bias").none(), nb::arg("offset").none(),
      nb::arg("beta"), nb::arg("mask"), nb::arg("key_lengths").none(), nb::arg("update"),
      nb::arg("lse").none(), nb::arg("entropy").none(), nb::arg("weights").none(),
      nb::arg("device"), nb::arg("threads"), nb::arg("kv_heads") = 0, nb::arg("rotary_dim") = 0,
      nb::arg("rotary_base") = 10000.0, nb::arg("rotary_pairing") = "half_split",
      nb::arg("rotary_scaling") = "default", nb::arg("rotary_factor") = 1.0,
      nb::arg("low_freq_factor") = 1.0, nb::arg("high_freq_factor") = 4.0,
      nb::arg("original_max_positions") = 0, nb::arg("inverse_frequencies").none() = nb::none(),
      "emflow::attend_factored on the given host arrays, written into the given outputs. Use "
      "emflow.attend_factored.");
  m.def(
      "attend_backward",
      [](const InArray& x, const InArray& relevance, const InArray& content, const OptIn& key_bias,
         const OptIn& offset, double beta, const std::string& mask, const OptIn& lengths,
         const OptIn& d_update, const OptIn& d_lse, const OptIn& d_entropy, const OptOut& d_x,
         const OptOut& d_relevance, const OptOut& d_content, const OptOut& d_key_bias,
         const OptOut& d_offset, const std::string& device, std::int64_t threads) {
        const Placement place = placement_of("attend_backward", x);
        if (place.dtype == nb::dtype<float>()) {
          return attend_backward_host<float>(
              place, x, relevance, content, key_bias, offset, beta, mask, lengths, d_update, d_lse,
              d_entropy, d_x, d_relevance, d_content, d_key_bias, d_offset, device, threads);
        }
        return attend_backward_host<double>(
            place, x, relevance, content, key_bias, offset, beta, mask, lengths, d_update, d_lse,
            d_entropy, d_x, d_relevance, d_content, d_key_bias, d_offset, device, threads);
      },
      nb::arg("x"), nb::arg("relevance"), nb::arg("content"), nb::arg("key_bias").none(),
      nb::arg("offset").none(), nb::arg("beta"), nb::arg("mask"), nb::arg("key_lengths").none(),
      nb::arg("d_update").none(), nb::arg("d_lse").none(), nb::arg("d_entropy").none(),
      nb::arg("d_x").none(), nb::arg("d_relevance").none(), nb::arg("d_content").none(),
      nb::arg("d_key_bias").none(), nb::arg("d_offset").none(), nb::arg("device"),
      nb::arg("threads"),
      "emflow::attend_backward on the given host arrays: the gradients asked for (each output "
      "optional) from the upstream gradients of the update, lse and entropy (each optional); "
      "returns dL/dbeta.");
  m.def(
      "attend_factored_backward",
      [](const InArray& x, const InArray& a, const InArray& b, const InArray& u, const InArray& v,
         const OptIn& key_bias, const OptIn& offset, double beta, const std::string& mask,
         const OptIn& lengths, const OptIn& d_update, const OptIn& d_lse, const OptIn& d_entropy,
         const OptOut& d_x, const OptOut& d_a, const OptOut& d_b, const OptOut& d_u,
         const OptOut& d_v, const OptOut& d_key_bias, const OptOut& d_offset,
         const std::string& device, std::int64_t threads) {
        const Placement place = placement_of("attend_factored_backward", x);
        if (place.dtype == nb::dtype<float>()) {
          return factored_backward_host<float>(place, x, a, b, u, v, key_bias, offset, beta, mask,
                                               lengths, d_update, d_lse, d_entropy, d_x, d_a, d_b,
                                               d_u, d_v, d_key_bias, d_offset, device, threads);
        }
        return factored_backward_host<double>(place, x, a, b, u, v, key_bias, offset, beta, mask,
                                              lengths, d_update, d_lse, d_entropy, d_x, d_a, d_b,
                                              d_u, d_v, d_key_bias, d_offset, device, threads);
      },
      nb::arg("x"), nb::arg("query_factor"), nb::arg("key_factor"), nb::arg("content_up"),
      nb::arg("content_down"), nb::arg("key_bias").none(), nb::arg("offset").none(),
      nb::arg("beta"), nb::arg("mask"), nb::arg("key_lengths").none(), nb::arg("d_update").none(),
      nb::arg("d_lse").none(), nb::arg("d_entropy").none(), nb::arg("d_x").none(),
      nb::arg("d_query_factor").none(), nb::arg("d_key_factor").none(),
      nb::arg("d_content_up").none(), nb::arg("d_content_down").none(),
      nb::arg("d_key_bias").none(), nb::arg("d_offset").none(), nb::arg("device"),
      nb::arg("threads"),
      "emflow::attend_factored_backward on the given host arrays, as attend_backward; returns "
      "dL/dbeta.");
  m.def("time_attend", &time_attend, nb::arg("x"), nb::arg("relevance"), nb::arg("content"),
        nb::arg("update"), nb::arg("threads") = 0, nb::arg("repeats") = 1,
        "Seconds per emflow::attend call (Device::cpu, float32), timed in C++: the baseline "
        "that bench/python_overhead.py compares emflow.attend with.");
}

}  // namespace emflow::python

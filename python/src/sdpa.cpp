// emflow Python module: the SDPA-shaped operator (include/emflow/sdpa.hpp), forward and backward,
// on the caller's host arrays.
//
// Queries (B, Hq, Nq, r), keys (B, Hkv, Nk, r) and values (B, Hkv, Nk, rv), float32, float64,
// bfloat16 or float16 (the statistics lse, entropy and their gradients float32 for the last two),
// every array checked as arrays.cpp checks them (dtype of 'query', host memory, C-contiguous,
// the shape the three imply) and the C++ call run on their memory with the GIL released. The
// Python layer (emflow.sdpa_attend, emflow.torch) allocates the outputs and the gradients. CUDA
// arrays (torch tensors on a GPU) run through cuda::sdpa_attend_async and sdpa_backward_async on
// the stream the Python layer passes, with a workspace from its allocator, without synchronising
// (dL/dscale, a device value there, is not returned: None).
#include "emflow/sdpa.hpp"

#ifdef EMFLOW_WITH_CUDA
#include "emflow/cuda.hpp"
#endif

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <type_traits>

#include "arrays.hpp"
#include "bindings.hpp"

namespace emflow::python {
namespace {

using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

Placement placement_of(const char* operation, const InArray& query) {
  Placement place{operation, query.dtype(), query.device_type(), query.device_id(), "query", false};
  if (query.dtype() != nb::dtype<float>() && query.dtype() != nb::dtype<double>() &&
      query.dtype() != nb::dtype<bfloat16>() && query.dtype() != nb::dtype<float16>()) {
    refuse(operation, "query",
           "has dtype " + dtype_name(query.dtype()) +
               ", expected float32, float64, bfloat16 or float16");
  }
  if (place.device_type != nb::device::cpu::value && place.device_type != nb::device::cuda::value) {
    refuse(operation, "query", "is neither in host memory nor a CUDA array");
  }
  return place;
}

bool on_gpu(const Placement& place, const std::string& device) {
  if (place.device_type != nb::device::cuda::value) return false;
  const Device asked = parse_device(device);
  if (asked != Device::automatic && asked != Device::cuda) {
    throw Error(ErrorCode::invalid_argument, std::string(place.operation) +
                                                 ": argument 'device' is '" + device +
                                                 "' but the arrays are CUDA arrays");
  }
#ifndef EMFLOW_WITH_CUDA
  throw Error(ErrorCode::unsupported,
              std::string(place.operation) + ": CUDA arrays need emflow built with CUDA");
#endif
  return true;
}

#ifdef EMFLOW_WITH_CUDA
[[noreturn]] void refuse_float64_on_gpu(const char* operation) {
  throw Error(ErrorCode::unsupported, std::string(operation) +
                                          ": float64 CUDA arrays: the GPU computes this operator "
                                          "in bfloat16, float16 or float32 (run float64 on the "
                                          "host)");
}

/// `bytes` of device workspace from the Python layer's allocator (a torch tensor of uint8 kept
/// alive in `keep` until the work is enqueued); null for none.
void* workspace_of(const char* operation, std::size_t bytes, const nb::object& allocate,
                   nb::object& keep) {
  if (bytes == 0) return nullptr;
  if (!allocate.is_valid() || allocate.is_none()) {
    throw Error(ErrorCode::unsupported, std::string(operation) +
                                            ": CUDA arrays other than torch tensors need a "
                                            "workspace allocator");
  }
  keep = allocate(bytes);
  OutArray array = nb::cast<OutArray>(keep);
  if (array.nbytes() < bytes) {
    throw Error(ErrorCode::internal,
                std::string(operation) + ": the workspace allocator returned too few bytes");
  }
  return array.data();
}
#endif

/// The placement of the statistics (lse, entropy and their gradients): Stat<T>, float32 for
/// the 16-bit types, whose message says so.
template <class T>
Placement statistics_of(const Placement& place) {
  Placement stats = place;
  if (!std::is_same_v<Stat<T>, T>) stats.dtype_note = "float32 for 16-bit storage";
  return stats;
}

/// Runs body(T{}) for the element type of `place` (placement_of admits these four).
template <class Body>
decltype(auto) for_dtype(const Placement& place, Body&& body) {
  if (place.dtype == nb::dtype<float>()) return body(float{});
  if (place.dtype == nb::dtype<double>()) return body(double{});
  if (place.dtype == nb::dtype<bfloat16>()) return body(bfloat16{});
  return body(float16{});
}

std::int64_t extent(const InArray& a, std::size_t axis) {
  return static_cast<std::int64_t>(a.shape(axis));
}

/// The operator's input from the three arrays: (B, Hq, Nq, r), (B, Hkv, Nk, r), (B, Hkv, Nk, rv).
template <class T>
SdpaInput<T> sdpa_input(const Placement& place, const InArray& query, const InArray& key,
                        const InArray& value, double scale, const std::string& mask,
                        const OptIn& key_lengths, const OptIn& query_lengths,
                        std::int64_t key_position,
                        const std::optional<std::int64_t>& query_position) {
  const char* op = place.operation;
  if (query.ndim() != 4) {
    refuse(op, "query", "has shape " + shape_string(query) + ", expected (B, Hq, Nq, r)");
  }
  if (key.ndim() != 4) {
    refuse(op, "key", "has shape " + shape_string(key) + ", expected (B, Hkv, Nk, r)");
  }
  if (value.ndim() != 4) {
    refuse(op, "value", "has shape " + shape_string(value) + ", expected (B, Hkv, Nk, rv)");
  }
  SdpaInput<T> in;
  in.batch = extent(query, 0);
  in.query_heads = extent(query, 1);
  in.query_tokens = extent(query, 2);
  in.rank = extent(query, 3);
  in.kv_heads = extent(key, 1);
  in.tokens = extent(key, 2);
  in.value_rank = extent(value, 3);
  in.queries = input<T>(place, "query", query, shape_of(query));
  in.keys = input<T>(place, "key", key, Shape{in.batch, in.kv_heads, in.tokens, in.rank});
  in.values =
      input<T>(place, "value", value, Shape{in.batch, in.kv_heads, in.tokens, extent(value, 3)});
  in.scale = scale;
  in.mask = parse_mask(mask, "mask");
  in.key_lengths = optional_input<std::int64_t>(place, "key_lengths", key_lengths, Shape{in.batch});
  in.query_lengths =
      optional_input<std::int64_t>(place, "query_lengths", query_lengths, Shape{in.batch});
  in.key_position = key_position;
  in.query_position = query_position ? *query_position : kAlignToEnd;
  return in;
}

template <class T>
void attend_host(const Placement& place, const InArray& query, const InArray& key,
                 const InArray& value, double scale, const std::string& mask,
                 const OptIn& key_lengths, const OptIn& query_lengths, std::int64_t key_position,
                 const std::optional<std::int64_t>& query_position, OutArray& output,
                 const OptOut& lse, const OptOut& entropy, const std::string& device,
                 std::int64_t threads, const std::string& precision, std::uintptr_t stream,
                 const nb::object& allocate) {
  const SdpaInput<T> in = sdpa_input<T>(place, query, key, value, scale, mask, key_lengths,
                                        query_lengths, key_position, query_position);
  const Shape stats{in.batch, in.query_heads, in.query_tokens};
  SdpaOutput<T> out;
  out.output = optional_output<T>(place, "output", output,
                                  Shape{in.batch, in.query_heads, in.query_tokens, in.value_rank});
  out.lse = optional_output<Stat<T>>(statistics_of<T>(place), "lse", lse, stats);
  out.entropy = optional_output<Stat<T>>(statistics_of<T>(place), "entropy", entropy, stats);
  const ExecutionOptions options{parse_device(device), check_threads(threads, place.operation),
                                 parse_precision(precision, "precision")};
  if (on_gpu(place, device)) {
#ifdef EMFLOW_WITH_CUDA
    if constexpr (std::is_same_v<T, double>) {
      refuse_float64_on_gpu(place.operation);
    } else {
      const cuda::PlanOptions plan{Algorithm::automatic, options.precision};
      const std::size_t bytes = cuda::sdpa_workspace_size(in, out, plan);
      nb::object keep;
      void* workspace = workspace_of(place.operation, bytes, allocate, keep);
      nb::gil_scoped_release release;
      cuda::sdpa_attend_async(in, out, workspace, bytes, reinterpret_cast<cuda::Stream>(stream),
                              plan);
    }
#endif
    return;
  }
  (void)stream;
  (void)allocate;
  nb::gil_scoped_release release;
  sdpa_attend(in, out, options);
}

template <class T>
std::optional<double> backward_host(
    const Placement& place, const InArray& query, const InArray& key, const InArray& value,
    double scale, const std::string& mask, const OptIn& key_lengths, const OptIn& query_lengths,
    std::int64_t key_position, const std::optional<std::int64_t>& query_position,
    const OptIn& output, const InArray& lse, const OptIn& entropy, const OptIn& d_output,
    const OptIn& d_lse, const OptIn& d_entropy, OutArray& d_query, OutArray& d_key,
    OutArray& d_value, const std::string& device, std::int64_t threads, std::uintptr_t stream,
    const nb::object& allocate, bool deterministic) {
  const SdpaInput<T> in = sdpa_input<T>(place, query, key, value, scale, mask, key_lengths,
                                        query_lengths, key_position, query_position);
  const Shape stats{in.batch, in.query_heads, in.query_tokens};
  const Shape out_shape{in.batch, in.query_heads, in.query_tokens, in.value_rank};
  SdpaSaved<T> saved;
  saved.output = optional_input<T>(place, "output", output, out_shape);
  const Placement statistics = statistics_of<T>(place);
  saved.lse = input<Stat<T>>(statistics, "lse", lse, stats);
  saved.entropy = optional_input<Stat<T>>(statistics, "entropy", entropy, stats);
  UpstreamGradients<T> upstream;
  upstream.update = optional_input<T>(place, "d_output", d_output, out_shape);
  upstream.lse = optional_input<Stat<T>>(statistics, "d_lse", d_lse, stats);
  upstream.entropy = optional_input<Stat<T>>(statistics, "d_entropy", d_entropy, stats);
  double d_scale = 0.0;
  SdpaGradientOutput<T> gradients;
  gradients.queries = optional_output<T>(place, "d_query", d_query, shape_of(query));
  gradients.keys = optional_output<T>(place, "d_key", d_key, shape_of(key));
  gradients.values = optional_output<T>(place, "d_value", d_value, shape_of(value));
  const ExecutionOptions options{parse_device(device), check_threads(threads, place.operation)};
  if (on_gpu(place, device)) {
#ifdef EMFLOW_WITH_CUDA
    // dL/dscale would be a device double here: not asked (None), so nothing waits for it.
    if constexpr (std::is_same_v<T, double>) {
      refuse_float64_on_gpu(place.operation);
    } else {
      cuda::SdpaBackwardOptions gpu;
      gpu.deterministic = deterministic;
      const std::size_t bytes = cuda::sdpa_backward_workspace_size(in, upstream, gradients, gpu);
      nb::object keep;
      void* workspace = workspace_of(place.operation, bytes, allocate, keep);
      nb::gil_scoped_release release;
      cuda::sdpa_backward_async(in, saved, upstream, gradients, workspace, bytes,
                                reinterpret_cast<cuda::Stream>(stream), gpu);
    }
#endif
    return std::nullopt;
  }
  (void)stream;
  (void)allocate;
  (void)deterministic;  // the host's backward is deterministic
  gradients.scale = &d_scale;
  {
    nb::gil_scoped_release release;
    sdpa_backward(in, saved, upstream, gradients, options);
  }
  return d_scale;
}

}  // namespace

void bind_sdpa(nb::module_& m) {
  m.def(
      "sdpa_attend",
      [](const InArray& query, const InArray& key, const InArray& value, double scale,
         const std::string& mask, const OptIn& key_lengths, const OptIn& query_lengths,
         std::int64_t key_position, const std::optional<std::int64_t>& query_position,
         OutArray output, const OptOut& lse, const OptOut& entropy, const std::string& device,
         std::int64_t threads, const std::string& precision, std::uintptr_t stream,
         const nb::object& allocate) {
        const Placement place = placement_of("sdpa_attend", query);
        for_dtype(place, [&](auto zero) {
          attend_host<decltype(zero)>(place, query, key, value, scale, mask, key_lengths,
                                      query_lengths, key_position, query_position, output, lse,
                                      entropy, device, threads, precision, stream, allocate);
        });
      },
      nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("scale"), nb::arg("mask"),
      nb::arg("key_lengths").none(), nb::arg("query_lengths").none(), nb::arg("key_position"),
      nb::arg("query_position").none(), nb::arg("output"), nb::arg("lse").none(),
      nb::arg("entropy").none(), nb::arg("device"), nb::arg("threads"),
      nb::arg("precision") = "fp32", nb::arg("stream") = 0, nb::arg("allocate") = nb::none(),
      "emflow::sdpa_attend on the given host arrays, written into the given outputs "
      "(query_position None: aligned to the end of the real keys); CUDA arrays through "
      "cuda::sdpa_attend_async on `stream` with a workspace from `allocate(nbytes)`. Use "
      "emflow.sdpa_attend.");
  m.def(
      "sdpa_backward",
      [](const InArray& query, const InArray& key, const InArray& value, double scale,
         const std::string& mask, const OptIn& key_lengths, const OptIn& query_lengths,
         std::int64_t key_position, const std::optional<std::int64_t>& query_position,
         const OptIn& output, const InArray& lse, const OptIn& entropy, const OptIn& d_output,
         const OptIn& d_lse, const OptIn& d_entropy, OutArray d_query, OutArray d_key,
         OutArray d_value, const std::string& device, std::int64_t threads, std::uintptr_t stream,
         const nb::object& allocate, bool deterministic) {
        const Placement place = placement_of("sdpa_backward", query);
        return for_dtype(place, [&](auto zero) {
          return backward_host<decltype(zero)>(
              place, query, key, value, scale, mask, key_lengths, query_lengths, key_position,
              query_position, output, lse, entropy, d_output, d_lse, d_entropy, d_query, d_key,
              d_value, device, threads, stream, allocate, deterministic);
        });
      },
      nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("scale"), nb::arg("mask"),
      nb::arg("key_lengths").none(), nb::arg("query_lengths").none(), nb::arg("key_position"),
      nb::arg("query_position").none(), nb::arg("output").none(), nb::arg("lse"),
      nb::arg("entropy").none(), nb::arg("d_output").none(), nb::arg("d_lse").none(),
      nb::arg("d_entropy").none(), nb::arg("d_query"), nb::arg("d_key"), nb::arg("d_value"),
      nb::arg("device"), nb::arg("threads"), nb::arg("stream") = 0,
      nb::arg("allocate") = nb::none(), nb::arg("deterministic") = true,
      "emflow::sdpa_backward on the given host arrays: dQ, dK and dV written into d_query, "
      "d_key and d_value from the saved output, lse (and entropy) and the upstream gradients "
      "(each optional); returns dL/dscale. CUDA arrays through cuda::sdpa_backward_async on "
      "`stream` (workspace from `allocate(nbytes)`), returning None (dL/dscale not computed); "
      "deterministic=False adds dQ by atomics there (cuda::SdpaBackwardOptions).");
}

}  // namespace emflow::python

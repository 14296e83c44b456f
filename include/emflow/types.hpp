// emflow: small value types shared by every operation (masks, devices, shapes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

/// Marks the few functions that GPU kernels call as well as host code: `__host__ __device__`
/// under nvcc, nothing for a plain C++ compiler (the CPU emulation of CUDA in
/// tests/cuda/emulation compiles kernels as host code, so it needs nothing either).
#if defined(__CUDACC__)
#define EMFLOW_HOST_DEVICE __host__ __device__
#else
#define EMFLOW_HOST_DEVICE
#endif

namespace emflow {

/// Which keys a query may attend to (docs/MATH.md §1). Per-cloud key lengths are given
/// separately (AttentionInput::key_lengths) and combine with any of these.
enum class MaskKind {
  none,    ///< every key j
  causal,  ///< keys j <= i
  window,  ///< sliding window of width w: i - w < j <= i
};

/// The keys a query sees: the interval [first, last) of key indices (empty when first >= last).
struct KeyRange {
  std::int64_t first = 0;
  std::int64_t last = 0;

  EMFLOW_HOST_DEVICE constexpr bool empty() const { return first >= last; }
  EMFLOW_HOST_DEVICE constexpr bool contains(std::int64_t j) const {
    return first <= j && j < last;
  }
};

/// The visibility rule of every backend (reference, CPU, CUDA): allows() and visible_keys() are
/// the only places it is written, and both compile for the host and the GPU.
struct Mask {
  MaskKind kind = MaskKind::none;
  std::int64_t window = 0;  ///< width w, only for MaskKind::window; must be >= 1

  static constexpr Mask none() { return {}; }
  static constexpr Mask causal() { return {MaskKind::causal, 0}; }
  static constexpr Mask sliding_window(std::int64_t w) { return {MaskKind::window, w}; }

  /// True when key j is visible to query i under this mask (key lengths aside).
  EMFLOW_HOST_DEVICE constexpr bool allows(std::int64_t i, std::int64_t j) const {
    return kind == MaskKind::none || (j <= i && (kind == MaskKind::causal || j > i - window));
  }

  /// The keys query i sees in a cloud whose first `length` tokens are real (its key length, or
  /// N without key lengths): the j in [0, length) that allows(i, j), as one interval
  /// [first, last); empty for a padding query (i >= length). Under every mask both ends are
  /// non-decreasing in i, so the keys that the real queries i0 <= i <= i1 see together lie in
  /// [visible_keys(i0).first, visible_keys(i1).last), and every key of
  /// [visible_keys(i1).first, visible_keys(i0).last) is seen by all of them.
  EMFLOW_HOST_DEVICE constexpr KeyRange visible_keys(std::int64_t i, std::int64_t length) const {
    if (i < 0 || i >= length) return {0, 0};
    const std::int64_t first = kind == MaskKind::window && i - window + 1 > 0 ? i - window + 1 : 0;
    return {first, kind == MaskKind::none ? length : i + 1};
  }

  /// The keys a query at sequence position `position` sees among `count` keys whose first sits
  /// at `key_position` and of which the first `length` are real, as local indices j in
  /// [0, count): the j < length with allows(position, key_position + j), one interval within
  /// [0, length] (empty when none). visible_keys(i, length) is visible_keys_at(i, 0, length).
  /// Callers decide separately whether the query itself is padding.
  EMFLOW_HOST_DEVICE constexpr KeyRange visible_keys_at(std::int64_t position,
                                                        std::int64_t key_position,
                                                        std::int64_t length) const {
    if (kind == MaskKind::none) return {0, length > 0 ? length : 0};
    // Absolute key positions p with p <= position (and p > position - window), made local.
    // Validated positions keep `relative` far from overflow; a window wider than it starts at 0.
    const std::int64_t relative = position - key_position;
    std::int64_t first = kind == MaskKind::window && window <= relative ? relative - window + 1 : 0;
    std::int64_t last = relative + 1;
    if (first < 0) first = 0;
    if (last > length) last = length;
    // Both ends stay in [0, length] and non-decreasing in `position`: a window that ends before
    // this block's real keys gives {length, length}, never a first past the keys that exist
    // (callers join the ranges of several rows into the key tiles to read).
    if (first > length) first = length;
    if (last < first) last = first;
    return {first, last};
  }
};
/// Parses "none", "causal" or "window:W" (W decimal digits only, >= 1); surrounding whitespace
/// is ignored (" causal " is causal), whitespace inside is refused ("window: 3"). Throws
/// emflow::Error naming `argument` otherwise.
Mask parse_mask(const std::string& text, const char* argument = "mask");
/// The inverse of parse_mask.
std::string to_string(const Mask& mask);

/// Where an operation runs.
enum class Device {
  automatic,  ///< CUDA when a device is present and emflow was built with CUDA, else cpu (the
              ///< reference on a processor none of the CPU engine's paths runs on)
  cpu,        ///< the fast multi-threaded CPU backend
  cuda,       ///< the CUDA backend; an error if no device is present
  reference,  ///< the double-precision CPU reference (slow, exact ground truth)
};

/// Parses "auto", "cpu", "cuda" or "reference"; throws emflow::Error naming `argument` otherwise.
Device parse_device(const std::string& text, const char* argument = "device");
const char* to_string(Device device) noexcept;

/// The most CPU threads one call may ask for (ExecutionOptions::threads, DecodeCache::attend's
/// threads, `--threads`): 4 per core of this machine (std::thread::hardware_concurrency(); 1024
/// when that is unknown). More threads than that only add overhead, and an OpenMP team of tens
/// of thousands of threads cannot start.
int max_threads() noexcept;
/// Checks a requested CPU thread count: 0 (the call chooses) to max_threads(). Returns it as an
/// int; throws emflow::Error (ErrorCode::invalid_argument) "<operation>: argument 'threads' must
/// be ..., got <threads>" otherwise. Every entry point that takes a thread count calls it first.
int check_threads(std::int64_t threads, const char* operation);

/// The element type of an array, the one enum of every part: attention storage (float64,
/// float32, bfloat16, float16) and the other types the files hold (.npy: float16, float32,
/// float64, int32, int64; safetensors checkpoints: all of them, the integers and 8-bit floats
/// accepted in a header but never read as values).
enum class Dtype {
  float32,
  float64,
  int64,
  int32,
  float16,
  bfloat16,
  boolean,
  uint8,
  int8,
  int16,
  uint16,
  uint32,
  uint64,
  float8_e4m3,
  float8_e5m2,
};
/// "float32", "float64", "int64", "int32", "float16", "bfloat16", "bool", "uint8", "int8",
/// "int16", "uint16", "uint32", "uint64", "float8_e4m3", "float8_e5m2".
const char* to_string(Dtype dtype) noexcept;
/// Bytes per element (1 for bool and the 8-bit types).
std::int64_t item_size(Dtype dtype) noexcept;

/// A dense row-major shape, e.g. {B, N, d}.
using Shape = std::vector<std::int64_t>;
/// "(2, 64, 32)"
std::string to_string(const Shape& shape);

}  // namespace emflow

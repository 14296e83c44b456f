// emflow: small value types shared by every operation (masks, devices, shapes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace emflow {

/// Which keys a query may attend to (REFERENCE.md §1). Per-cloud key lengths are given
/// separately (AttentionInput::key_lengths) and combine with any of these.
enum class MaskKind {
  none,    ///< every key j
  causal,  ///< keys j <= i
  window,  ///< sliding window of width w: i - w < j <= i
};

struct Mask {
  MaskKind kind = MaskKind::none;
  std::int64_t window = 0;  ///< width w, only for MaskKind::window; must be >= 1

  static Mask none() { return {}; }
  static Mask causal() { return {MaskKind::causal, 0}; }
  static Mask sliding_window(std::int64_t w) { return {MaskKind::window, w}; }

  /// True when key j is visible to query i under this mask (key lengths aside).
  bool allows(std::int64_t i, std::int64_t j) const {
    switch (kind) {
      case MaskKind::causal:
        return j <= i;
      case MaskKind::window:
        return j <= i && j > i - window;
      case MaskKind::none:
      default:
        return true;
    }
  }
};

/// Parses "none", "causal" or "window:W"; throws emflow::Error naming `argument` otherwise.
Mask parse_mask(const std::string& text, const char* argument = "mask");
/// The inverse of parse_mask.
std::string to_string(const Mask& mask);

/// Where an operation runs.
enum class Device {
  automatic,  ///< CUDA when a device is present and emflow was built with CUDA, else cpu
  cpu,        ///< the fast multi-threaded CPU backend
  cuda,       ///< the CUDA backend; an error if no device is present
  reference,  ///< the double-precision CPU reference (slow, exact ground truth)
};

/// Parses "auto", "cpu", "cuda" or "reference"; throws emflow::Error naming `argument` otherwise.
Device parse_device(const std::string& text, const char* argument = "device");
const char* to_string(Device device) noexcept;

/// A dense row-major shape, e.g. {B, N, d}.
using Shape = std::vector<std::int64_t>;
/// "(2, 64, 32)"
std::string to_string(const Shape& shape);

}  // namespace emflow

// 16-bit storage for the commands (docs/MATH.md §7): float32 arrays read from files rounded to
// bfloat16 or float16, the operation run on them, the update widened back (exactly) to float32.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/precision.hpp"

namespace emflow::cli {

/// `count` float values rounded to S (nearest even; float: copied); empty for null `values`.
template <class S>
std::vector<S> stored(const float* values, std::int64_t count);

/// The arrays of `input` rounded to S (nearest even), and the input that points at them.
template <class S>
struct StoredInput {
  std::vector<S> cloud, queries, relevance, content, key_bias, offset;
  AttentionInput<S> input;
  explicit StoredInput(const AttentionInput<float>& from);
};

/// emflow::attend with every input stored as `precision` (bf16 or fp16) and options.precision
/// set to it; output.update receives the stored update widened to float (exact), lse, entropy
/// and weights are written in place (float32 for both types).
void attend_stored(Precision precision, const AttentionInput<float>& input,
                   const AttentionOutput<float>& output, const ExecutionOptions& options);

extern template struct StoredInput<bfloat16>;
extern template struct StoredInput<float16>;

}  // namespace emflow::cli

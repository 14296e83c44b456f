// emflow: decoding through a stack of layers, one DecodeCache per layer (docs/FLOW.md).
//
// A decoder grows a cloud one token at a time through L layers. Each layer attends its new
// tokens causally to every token it has seen, so it keeps what those contribute in a
// DecodeCache (decode.hpp) and a new token costs O(L H N d) instead of a rerun of the stack over
// all N tokens. Layer l (its operators and norm: a flow::FlowLayer) moves a token x by
//
//   post-norm:  x <- N_l(x + Delta_l(x))       its cache holds the layer's inputs x
//   pre-norm:   x <- x + Delta_l(N_l(x))       its cache holds the normalised inputs N_l(x)
//
// with N_l one of the flow's normalisations (flow::normalize, with the layer's gain and bias)
// and Delta_l the layer's update under the causal mask at inverse temperature beta. Moving a
// prompt through a DecodingStack and then its new tokens one by one gives, row for row, the
// stack applied to the whole grown cloud at once: each layer an emflow::attend under
// Mask::causal() (the rows of the causal one-pass update, docs/MATH.md §1.6), then its norm.
//
//   DecodingStack stack(layers, dim, beta);   // one cache per layer, on the host
//   stack.forward(prompt, N);                 // the prompt: N x dim, moved in place
//   for (k = 0; k < K; ++k) {
//     next = choose(the last row of what forward returned);   // the caller's rule
//     stack.forward(next, 1);                 // one new token, against all N + k before it
//   }
//
// generate() is that loop with the flow's rule: each new token is the last output of the stack,
// fed back (`emflow flow --generate K`, docs/FLOW.md).
//
// Precision: float32 state; each layer's attention runs in its DecodeCache (the fused float32
// engine on the CPU, decode.hpp), the norms and residuals in float32 on the host
// (flow::normalize). Errors are emflow::Error naming the argument; sizes that cannot fit in
// memory are refused before anything is allocated (ErrorCode::out_of_memory, with the bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "emflow/decode.hpp"
#include "emflow/flow.hpp"
#include "emflow/tensor.hpp"

namespace emflow {

/// How a DecodingStack's layers run.
struct DecodingSettings {
  flow::Normalization norm = flow::Normalization::none;  ///< N of every layer
  bool pre_norm = false;   ///< x <- x + Delta(N(x)) instead of N(x + Delta(x))
  double norm_eps = 1e-5;  ///< the eps of layer and RMS norm: finite and > 0
  /// Where each layer's cache lives (decode.hpp): on the host by default. Device::cuda needs a
  /// capacity, the most tokens the cloud will hold (generate() sets it to N + K when 0).
  DecodeOptions cache = {Device::cpu, 0};
  int threads = 0;  ///< CPU threads of each attention call (0: all), >= 0
};

/// What forward() also records, per new token (null: not recorded).
struct DecodingTrace {
  /// (count, L + 1, dim): each token at the input of every layer, then after the last.
  float* paths = nullptr;
  /// (count, L): each token's attention entropy (nats) at each layer, the mean over its heads.
  double* entropy = nullptr;
};

/// A stack of L layers decoding one cloud causally, with one DecodeCache per layer. Movable,
/// not copyable (a moved-from stack may only be destroyed or assigned to). Not safe to call
/// from several threads at once.
class DecodingStack {
 public:
  /// `layers`: the L >= 1 layers of the stack in R^dim, one per layer (e.g. flow::layer_stack;
  /// a layer shared by the whole stack is given L times), copied. Each holds heads >= 1,
  /// relevance and content (heads, dim, dim), key_bias (heads, dim) or empty, offset (dim) or
  /// empty, norm_gain and norm_bias (dim) or empty. Throws emflow::Error (invalid_argument)
  /// naming 'layers' (with the layer and the part), 'dim', 'beta' (must be finite),
  /// 'norm_eps' or 'threads'; the errors of DecodeCache's constructor for settings.cache
  /// (e.g. ErrorCode::unsupported for Device::cuda without a usable device).
  DecodingStack(std::vector<flow::FlowLayer<float>> layers, std::int64_t dim, double beta = 1.0,
                const DecodingSettings& settings = {});
  ~DecodingStack();
  DecodingStack(DecodingStack&&) noexcept;
  DecodingStack& operator=(DecodingStack&&) noexcept;
  DecodingStack(const DecodingStack&) = delete;
  DecodingStack& operator=(const DecodingStack&) = delete;

  std::int64_t layers() const noexcept;  ///< L
  std::int64_t dim() const noexcept;
  double beta() const noexcept;
  const DecodingSettings& settings() const noexcept;
  /// Tokens the stack has moved: the position of the next token.
  std::int64_t size() const noexcept;
  /// Layer l's cache (0 <= l < L; throws invalid_argument naming 'layer' otherwise).
  const DecodeCache& cache(std::int64_t layer) const;

  /// Moves `count` >= 1 new tokens (count x dim, row-major) through every layer, in place: on
  /// return `tokens` holds the output of the last layer. They sit at positions size() ..
  /// size() + count - 1, and at each layer each attends causally to every token before it and
  /// to itself; each layer's attended tokens are appended to its cache. Throws emflow::Error
  /// (invalid_argument) naming 'tokens' (null) or 'count', the cache's refusal of a non-finite
  /// row or of more tokens than its capacity. Tokens that become non-finite at a later layer
  /// are refused there, after the layers before it have kept them: clear() the stack then.
  void forward(float* tokens, std::int64_t count, const DecodingTrace& trace = {});

  /// Drops every token of every cache (the layers stay).
  void clear() noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// What generate() records.
struct Generation {
  std::int64_t clouds = 0, prompt_tokens = 0, layers = 0, dim = 0, steps = 0;  ///< B, N, L, d, K
  /// (B, K, L + 1, d): each new token at the input of every layer and after the last.
  Tensor<float> paths;
  std::vector<double> entropy;  ///< (B, K, L): each new token's entropy per layer (heads' mean)
  std::vector<double> seconds;  ///< (K): wall-clock seconds of each step (all clouds)
};

/// The flow's generation (`emflow flow --layers L --generate K`): for each cloud b of
/// `prompts` (B, N, d), N >= 1, a DecodingStack of `layers` at betas[b] (one beta per cloud, or
/// one for all) moves the prompt through the stack, then takes K = `steps` >= 0 times the last
/// output of the stack as its next token and moves it through the stack against everything
/// before it. layers: L >= 1, one per layer as for DecodingStack.
///
/// Before any work the sizes are checked: the paths (B K (L + 1) d values), the entropies and
/// what the caches may grow to (at each layer l, B caches of up to 2 (N + K) tokens, each token
/// its key and its content per head: d + 16 ceil(d / 16) H_l floats as the CPU cache pads them)
/// are refused with ErrorCode::out_of_memory, naming the bytes, when they cannot fit in memory
/// (memory.hpp). Other errors as DecodingStack's, naming 'prompts', 'betas' or 'steps'.
Generation generate(const Tensor<float>& prompts, const std::vector<flow::FlowLayer<float>>& layers,
                    const std::vector<double>& betas, std::int64_t steps,
                    const DecodingSettings& settings = {});

}  // namespace emflow

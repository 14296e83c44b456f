// Greedy decoding of a llama model (emflow/model.hpp, generate_greedy): a Decoder holds one
// factored decode cache per layer for one prompt, and moves tokens through the pre-norm layers
// around them; the prompt once, then each new token against everything before it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"
#include "emflow/model.hpp"
#include "llama_layers.hpp"

namespace emflow::model {
namespace {

using detail::fail_argument;

constexpr const char* kOp = "generate_greedy";

// The layers of one llama model, decoding one cloud: per layer its factored cache (the factors
// copied into it), which holds the layer's normalised inputs as rotated keys and values.
// A Qwen2 layer (biases on q, k and v) runs in d + 1 with a last coordinate 1 (BiasedFactors).
// A float run on a processor the engine runs on takes a prompt (the first call, several tokens)
// through emflow::attend_factored, the fused engine, and only then fills the caches with it; its
// feed-forward blocks are products (layers::GatedFeedForwardProducts) of float32 weights, or of
// bfloat16 ones with GenerateSettings::products bf16.
template <class T>
class Decoder {
 public:
  Decoder(const Model& model, int threads, bool bf16) : model_(model), threads_(threads) {
    const std::int64_t d = model.dim;
    const auto L = model.layers.size();
    attention_.reserve(L);  // the FactoredLayers point into it
    ffn32_.reserve(L);
    ffn16_.reserve(L);
    for (const ModelLayer& layer : model.layers) {
      Attention& a = attention_.emplace_back();
      a.biased = layer.attention.query_bias.size() > 0;
      if (a.biased) {
        take(a, layers::BiasedFactors<T>(layer.attention, model.key_heads()));
      } else {
        take(a, layers::Factors<T>(layer.attention, model.key_heads()));
      }
      FactoredLayer<T>& f = a.layer;
      f.heads = model.heads;
      f.rank = model.head_dim;
      f.kv_heads = model.key_heads();
      f.rotary = model.rotary_embedding();
      caches_.emplace_back(f, a.biased ? d + 1 : d, 1.0,
                           DecodeOptions{Device::cpu, 0, Precision::fp32});
      if constexpr (std::is_same_v<T, float>) {
        if (layers::float_products() && bf16) {
          ffn16_.emplace_back(layer, model.activation, d);
        } else if (layers::float_products()) {
          ffn32_.emplace_back(layer, model.activation, d);
        }
      }
    }
    mask_ = model.sliding_window > 0 ? Mask::sliding_window(model.sliding_window) : Mask::causal();
  }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Moves `count` tokens (count x d, the cloud entering layer 0) through every layer, in place:
  // on return they are the cloud after the last layer, before the final norm.
  void forward(T* x, std::int64_t count) {
    const std::int64_t d = model_.dim, n = count * d;
    normed_.resize(static_cast<std::size_t>(n));
    update_.resize(static_cast<std::size_t>(n));
    for (std::size_t l = 0; l < caches_.size(); ++l) {
      const ModelLayer& layer = model_.layers[l];
      BasicDecodeCache<T>& cache = caches_[l];
      const Attention& a = attention_[l];
      const bool prompt = products() && count > 1 && cache.size() == 0;
      std::copy(x, x + n, normed_.begin());
      layers::rms_norm(normed_.data(), count, d, layer.norm1_gain, model_.norm_eps);
      const std::int64_t width = a.biased ? d + 1 : d;
      const T* tokens = normed_.data();
      T* update = update_.data();
      if (a.biased) {
        lifted_.assign(static_cast<std::size_t>(count * (d + 1)), T(1));
        lifted_update_.resize(lifted_.size());
        for (std::int64_t r = 0; r < count; ++r) {
          std::copy(normed_.begin() + r * d, normed_.begin() + (r + 1) * d,
                    lifted_.begin() + r * (d + 1));
        }
        tokens = lifted_.data();
        update = lifted_update_.data();
      }
      AttentionOutput<T> out;
      out.update = update;
      if (prompt) {  // self-attention of the prompt at positions 0..count-1, as the cache's
        AttentionInput<T> in;
        in.cloud = tokens;
        in.batch = 1;
        in.tokens = count;
        in.dim = width;
        in.mask = mask_;
        ExecutionOptions options;
        // The engine where it runs; elsewhere the reference, in double.
        options.device = this_machine().cpu_missing.empty() ? Device::cpu : Device::reference;
        options.threads = threads_;
        attend_factored(in, a.layer, out, options);
        cache.append(tokens, count);
      } else {
        cache.append(tokens, count);
        cache.attend(tokens, count, mask_, out, kAlignToEnd, threads_);
      }
      for (std::int64_t r = 0; r < count; ++r)
        for (std::int64_t c = 0; c < d; ++c) x[r * d + c] += update[r * width + c];
      std::copy(x, x + n, normed_.begin());
      layers::rms_norm(normed_.data(), count, d, layer.norm2_gain, model_.norm_eps);
      if constexpr (std::is_same_v<T, float>) {
        if (!ffn32_.empty()) ffn32_[l](normed_.data(), update_.data(), count, threads_, scratch_);
        if (!ffn16_.empty()) ffn16_[l](normed_.data(), update_.data(), count, threads_, scratch_);
      }
      if (!products()) {
        layers::gated_feed_forward(layer, model_.activation, normed_.data(), update_.data(), count,
                                   d);
      }
      for (std::int64_t k = 0; k < n; ++k) x[k] += update_[static_cast<std::size_t>(k)];
    }
  }

  void clear() noexcept {
    for (BasicDecodeCache<T>& cache : caches_) cache.clear();
  }

 private:
  // A layer's factors (the cache holds its own copy) and the FactoredLayer that points into them.
  struct Attention {
    std::vector<T> a, b, up, down;
    FactoredLayer<T> layer;
    bool biased = false;
  };

  template <class Factors>
  static void take(Attention& into, Factors&& factors) {
    into.a = std::move(factors.a);
    into.b = std::move(factors.b);
    into.up = std::move(factors.up);
    into.down = std::move(factors.down);
    into.layer.query_factor = into.a.data();
    into.layer.key_factor = into.b.data();
    into.layer.content_up = into.up.data();
    into.layer.content_down = into.down.data();
  }

  const Model& model_;
  int threads_;
  std::vector<Attention> attention_;
  std::vector<BasicDecodeCache<T>> caches_;
  // Float runs where layers::float_products(): the feed-forward blocks' weights in float32 or
  // in bfloat16 (one of the two is filled).
  bool products() const { return !ffn32_.empty() || !ffn16_.empty(); }
  std::vector<layers::GatedFeedForwardProducts<float>> ffn32_;
  std::vector<layers::GatedFeedForwardProducts<bfloat16>> ffn16_;
  Mask mask_ = Mask::causal();
  std::vector<T> normed_, update_, lifted_, lifted_update_;
  std::vector<float> scratch_;  // the float feed-forward blocks'
};

}  // namespace

template <class T>
Generated<T> generate_greedy(const Model& model, const Tensor<std::int64_t>& ids,
                             const std::vector<std::int64_t>& lengths,
                             const GenerateSettings& settings) {
  if (model.layout != Layout::llama) {
    fail_argument(kOp, "model", "is of the ", to_string(model.layout),
                  " layout; greedy generation needs the llama layout (a decoder with an "
                  "embedding, causal rotary layers and an unembedding)");
  }
  if (model.layers.empty()) fail_argument(kOp, "model", "has no layers");
  const std::int64_t V = model.vocab_size(), d = model.dim;
  if (V < 1 || model.embedding.extent(1) != d || model.output_matrix().extent(1) != d) {
    fail_argument(kOp, "model", "has no embedding (vocab, ", d,
                  ") and unembedding to turn ids into tokens and back");
  }
  if (ids.rank() != 2 || ids.extent(0) < 1 || ids.extent(1) < 1) {
    fail_argument(kOp, "ids", "has shape ", emflow::to_string(ids.shape()),
                  ", expected (B, N) with B, N >= 1 (token ids, prompts right-padded)");
  }
  const std::int64_t B = ids.extent(0), N = ids.extent(1), K = settings.new_tokens;
  if (!lengths.empty() && static_cast<std::int64_t>(lengths.size()) != B) {
    fail_argument(kOp, "lengths", "has ", lengths.size(), " entries, expected ", B,
                  " (one per prompt of ids)");
  }
  const auto length_of = [&](std::int64_t b) {
    return lengths.empty() ? N : lengths[static_cast<std::size_t>(b)];
  };
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t n = length_of(b);
    if (n < 1 || n > N) {
      fail_argument(kOp, "lengths", "holds ", n, " for prompt ", b, ", expected 1..", N,
                    " (N of ids)");
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t id = ids[b * N + i];
      if (id < 0 || id >= V) {
        fail_argument(kOp, "ids", "holds ", id, " at (", b, ", ", i, "), expected an id in [0, ", V,
                      ") (the vocabulary of the model)");
      }
    }
  }
  if (K < 1) fail_argument(kOp, "settings.new_tokens", "must be >= 1, got ", K);
  if (settings.products != Precision::fp32 && settings.products != Precision::bf16) {
    fail_argument(kOp, "settings.products", "must be fp32 or bf16, got ",
                  to_string(settings.products));
  }
  if (settings.products == Precision::bf16) {
    if (!std::is_same_v<T, float>) {
      fail_argument(kOp, "settings.products",
                    "is bf16, which a float64 run does not take (its products are double): "
                    "generate in float32");
    }
    if (!this_machine().avx512_bf16) {
      detail::fail(ErrorCode::unsupported, kOp,
                   ": 'settings.products' bf16 needs AVX512-BF16, which this processor lacks "
                   "(or EMFLOW_CPU_DISABLE names it): use fp32");
    }
  }
  check_threads(settings.threads, kOp);
  const std::int64_t logit_values =
      settings.keep_logits ? detail::checked_product(kOp, "settings.new_tokens", Shape{B, K, V})
                           : 0;
  detail::expect_fits_in_memory(kOp, "the logits of every step (B K vocab values)", logit_values,
                                sizeof(T));

  Generated<T> g;
  g.ids = Tensor<std::int64_t>(Shape{B, K});
  if (settings.keep_logits) g.logits = Tensor<T>(Shape{B, K, V});
  g.prefill_seconds.assign(static_cast<std::size_t>(B), 0.0);
  g.step_seconds.assign(static_cast<std::size_t>(B * K), 0.0);
  const Tensor<double>& embedding = model.embedding;
  const auto embed = [&](std::int64_t id, T* row) {
    for (std::int64_t a = 0; a < d; ++a) row[a] = static_cast<T>(embedding[id * d + a]);
  };
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point start) {
    return std::chrono::duration<double>(clock::now() - start).count();
  };
  const bool bf16 = settings.products == Precision::bf16;
  Decoder<T> decoder(model, settings.threads, bf16);
  // A float run's logits: the final norm, then the unembedding as a product of float32 weights
  // (or bfloat16 ones).
  std::unique_ptr<layers::UnembeddingProducts<float>> unembed32;
  std::unique_ptr<layers::UnembeddingProducts<bfloat16>> unembed16;
  if (std::is_same_v<T, float> && layers::float_products()) {
    if (bf16) {
      unembed16 = std::make_unique<layers::UnembeddingProducts<bfloat16>>(model.output_matrix());
    } else {
      unembed32 = std::make_unique<layers::UnembeddingProducts<float>>(model.output_matrix());
    }
  }
  Tensor<T> logits(Shape{1, V});
  const auto logits_of = [&](const Tensor<T>& last) {
    if constexpr (std::is_same_v<T, float>) {
      if (unembed32 || unembed16) {
        std::vector<float> h(last.values().begin(), last.values().end());
        layers::rms_norm(h.data(), 1, d, model.final_gain, model.norm_eps);
        if (unembed32) (*unembed32)(h.data(), logits.data(), settings.threads);
        if (unembed16) (*unembed16)(h.data(), logits.data(), settings.threads);
        return;
      }
    }
    logits = next_token_logits(model, last, {});
  };
  std::int64_t done = 0;
  const std::int64_t total = B * (K + 1);
  for (std::int64_t b = 0; b < B; ++b) {
    decoder.clear();
    const std::int64_t n = length_of(b);
    auto start = clock::now();
    std::vector<T> x(static_cast<std::size_t>(n * d));
    for (std::int64_t i = 0; i < n; ++i) embed(ids[b * N + i], x.data() + i * d);
    decoder.forward(x.data(), n);
    Tensor<T> last(Shape{1, 1, d}, std::vector<T>(x.end() - d, x.end()));
    g.prefill_seconds[static_cast<std::size_t>(b)] = seconds(start);
    if (settings.progress) settings.progress(++done, total);
    for (std::int64_t k = 0; k < K; ++k) {
      start = clock::now();
      logits_of(last);
      const T* row = logits.data();
      const std::int64_t at = std::max_element(row, row + V) - row;
      for (std::int64_t t = 0; t < V; ++t) {
        if (!std::isfinite(static_cast<double>(row[t]))) {
          fail_argument(kOp, "model", "gives the non-finite logit ", row[t], " for id ", t,
                        " at step ", k, " of prompt ", b, " (its weights or the prompt overflow)");
        }
      }
      g.ids[b * K + k] = at;
      if (settings.keep_logits) std::copy(row, row + V, g.logits.data() + (b * K + k) * V);
      if (k + 1 < K) {  // the last new token need not move through the layers
        embed(at, last.data());
        decoder.forward(last.data(), 1);
      }
      g.step_seconds[static_cast<std::size_t>(b * K + k)] = seconds(start);
      if (settings.progress) settings.progress(++done, total);
    }
  }
  return g;
}

template Generated<float> generate_greedy<float>(const Model&, const Tensor<std::int64_t>&,
                                                 const std::vector<std::int64_t>&,
                                                 const GenerateSettings&);
template Generated<double> generate_greedy<double>(const Model&, const Tensor<std::int64_t>&,
                                                   const std::vector<std::int64_t>&,
                                                   const GenerateSettings&);

}  // namespace emflow::model

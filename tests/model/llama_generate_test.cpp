// Greedy generation of a tiny random llama (emflow::model::generate_greedy, one decode cache per
// layer) against the whole grown sequence run again at every step through run_model and
// next_token_logits: the same logits (within 1e-12 in double, 1e-4 in float) and the same ids,
// with grouped kv heads, rotary positions, tied and untied unembeddings, Qwen2's q/k/v biases
// and Mistral's sliding window, on a right-padded batch; the refusals, naming the argument; and
// emflow generate on the model's operator folder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/files.hpp"
#include "common/testing.hpp"
#include "emflow/capability.hpp"
#include "emflow/io.hpp"
#include "emflow/model.hpp"
#include "tiny_llama.hpp"

namespace {

namespace fs = std::filesystem;
using emflow::Shape;
using emflow::Tensor;
using emflow::model::Layout;
using emflow::model::Model;
using emflow::model::ModelLayer;

using emflow::testing::tiny_llama::kDim;
using emflow::testing::tiny_llama::kFfn;
using emflow::testing::tiny_llama::kHead;
using emflow::testing::tiny_llama::kHeads;
using emflow::testing::tiny_llama::kKv;
using emflow::testing::tiny_llama::kLayers;

constexpr std::int64_t kVocab = 29;

Model make_llama(bool tied, bool biases = false, std::int64_t window = 0) {
  return emflow::testing::tiny_llama::random_llama(kVocab, tied, biases, window);
}

// The logits of the next token after `sequence`, the whole sequence run through every layer.
template <class T>
std::vector<T> rerun_logits(const Model& m, const std::vector<std::int64_t>& sequence) {
  const auto n = static_cast<std::int64_t>(sequence.size());
  Tensor<T> cloud(Shape{1, n, kDim});
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t a = 0; a < kDim; ++a)
      cloud[i * kDim + a] =
          static_cast<T>(m.embedding[sequence[static_cast<std::size_t>(i)] * kDim + a]);
  emflow::model::RunSettings settings;
  settings.factored = true;
  const auto trace = emflow::model::run_model(m, cloud, {}, settings);
  const Tensor<T> last(Shape{1, n, kDim}, std::vector<T>(trace.trajectory.values().end() - n * kDim,
                                                         trace.trajectory.values().end()));
  return emflow::model::next_token_logits(m, last, {}).values();
}

template <class T>
class LlamaGenerate : public ::testing::Test {};
TYPED_TEST_SUITE(LlamaGenerate, emflow::testing::FloatTypes);

TYPED_TEST(LlamaGenerate, EqualsRerunningTheGrownSequenceAtEveryStep) {
  using T = TypeParam;
  using emflow::model::Activation;
  struct Variant {
    bool tied, biases;
    std::int64_t window;
    Activation gate = Activation::silu;
  };
  const double tol = std::is_same<T, double>::value ? 1e-12 : 1e-4;
  for (const Variant v :
       {Variant{true, false, 0}, Variant{false, false, 0}, Variant{true, true, 0},
        Variant{false, false, 3}, Variant{true, false, 0, Activation::gelu_tanh}}) {
    Model m = make_llama(v.tied, v.biases, v.window);
    m.activation = v.gate;
    const std::int64_t B = 3, N = 5, K = 7;
    const Tensor<std::int64_t> ids(Shape{B, N},
                                   {3, 14, 1, 27, 8, 5, 22, 9, -1, -1, 17, -1, -1, -1, -1});
    const std::vector<std::int64_t> lengths{5, 3, 1};
    emflow::model::GenerateSettings settings;
    settings.new_tokens = K;
    settings.keep_logits = true;
    std::int64_t calls = 0;
    settings.progress = [&](std::int64_t done, std::int64_t total) {
      EXPECT_EQ(done, ++calls);
      EXPECT_EQ(total, B * (K + 1));
    };
    const auto g = emflow::model::generate_greedy<T>(m, ids, lengths, settings);
    ASSERT_EQ(g.ids.shape(), (Shape{B, K}));
    ASSERT_EQ(g.logits.shape(), (Shape{B, K, kVocab}));
    EXPECT_EQ(calls, B * (K + 1));
    EXPECT_EQ(g.prefill_seconds.size(), static_cast<std::size_t>(B));
    EXPECT_EQ(g.step_seconds.size(), static_cast<std::size_t>(B * K));
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<std::int64_t> sequence(ids.data() + b * N,
                                         ids.data() + b * N + lengths[static_cast<std::size_t>(b)]);
      for (std::int64_t k = 0; k < K; ++k) {
        const std::vector<T> want = rerun_logits<T>(m, sequence);
        double scale = 0, worst = 0;
        for (std::int64_t t = 0; t < kVocab; ++t) {
          scale = std::max(scale, std::abs(static_cast<double>(want[static_cast<std::size_t>(t)])));
          worst = std::max(worst, std::abs(static_cast<double>(g.logits[(b * K + k) * kVocab + t]) -
                                           static_cast<double>(want[static_cast<std::size_t>(t)])));
        }
        EXPECT_LT(worst, tol * scale)
            << "prompt " << b << " step " << k << " tied " << v.tied << " biases " << v.biases
            << " window " << v.window << " gate " << to_string(v.gate);
        const std::int64_t next = std::max_element(want.begin(), want.end()) - want.begin();
        EXPECT_EQ(g.ids[b * K + k], next) << "prompt " << b << " step " << k;
        sequence.push_back(g.ids[b * K + k]);
      }
    }
  }
}

TEST(LlamaGenerate, TheLogitsAreKeptOnlyWhenAsked) {
  const Model m = make_llama(true);
  emflow::model::GenerateSettings settings;
  settings.new_tokens = 2;
  const auto g = emflow::model::generate_greedy<double>(
      m, Tensor<std::int64_t>(Shape{1, 2}, {1, 2}), {}, settings);
  EXPECT_EQ(g.ids.shape(), (Shape{1, 2}));
  EXPECT_EQ(g.logits.size(), 0);
}

TEST(LlamaGenerate, BadArgumentsAreRefusedNamingThem) {
  const Model m = make_llama(true);
  const Tensor<std::int64_t> ids(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  emflow::model::GenerateSettings settings;
  settings.new_tokens = 2;
  const auto refused = [&](const Model& model, const Tensor<std::int64_t>& x,
                           const std::vector<std::int64_t>& lengths,
                           const emflow::model::GenerateSettings& s) {
    return emflow::testing::error_of(emflow::ErrorCode::invalid_argument, [&] {
      emflow::model::generate_greedy<float>(model, x, lengths, s);
    });
  };
  Model bert = m;
  bert.layout = Layout::bert;
  std::string message = refused(bert, ids, {}, settings);
  EXPECT_NE(message.find("'model'"), std::string::npos) << message;
  EXPECT_NE(message.find("bert"), std::string::npos) << message;
  Model no_embedding = m;
  no_embedding.embedding = Tensor<double>();
  message = refused(no_embedding, ids, {}, settings);
  EXPECT_NE(message.find("'model'"), std::string::npos) << message;
  message = refused(m, Tensor<std::int64_t>(Shape{2, 3}, {1, 2, 3, 4, kVocab, 6}), {}, settings);
  EXPECT_NE(message.find("'ids'"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kVocab)), std::string::npos) << message;
  message = refused(m, Tensor<std::int64_t>(Shape{6}, {1, 2, 3, 4, 5, 6}), {}, settings);
  EXPECT_NE(message.find("'ids'"), std::string::npos) << message;
  message = refused(m, ids, {3}, settings);
  EXPECT_NE(message.find("'lengths'"), std::string::npos) << message;
  message = refused(m, ids, {3, 0}, settings);
  EXPECT_NE(message.find("'lengths'"), std::string::npos) << message;
  message = refused(m, ids, {3, 4}, settings);
  EXPECT_NE(message.find("'lengths'"), std::string::npos) << message;
  // Padding is not read: an out-of-range id beyond a prompt's length is accepted.
  EXPECT_NO_THROW(emflow::model::generate_greedy<float>(
      m, Tensor<std::int64_t>(Shape{2, 3}, {1, 2, -1, 4, 5, 6}), {2, 3}, settings));
  emflow::model::GenerateSettings none = settings;
  none.new_tokens = 0;
  message = refused(m, ids, {}, none);
  EXPECT_NE(message.find("'settings.new_tokens'"), std::string::npos) << message;
}

// bfloat16 products (GenerateSettings::products bf16, on AVX512-BF16): the feed-forward blocks
// and the unembedding read bfloat16 weights and round their inputs, so the logits move from the
// float32 run's by bfloat16's rounding (a few parts in a thousand of their scale, compounded over
// the layers) and no more; a float64 run and other precisions are refused by name.
TEST(LlamaGenerate, Bf16ProductsStayWithinBfloat16RoundingOfTheFloat32Run) {
  const Model m = make_llama(false, false, 0);
  const Tensor<std::int64_t> ids(Shape{2, 5}, {3, 14, 1, 27, 8, 5, 22, 9, 0, 0});
  emflow::model::GenerateSettings settings;
  settings.new_tokens = 4;
  settings.keep_logits = true;
  emflow::model::GenerateSettings bf16 = settings;
  bf16.products = emflow::Precision::bf16;
  const auto refused = [&](const emflow::model::GenerateSettings& s, auto type) {
    return emflow::testing::error_of(emflow::ErrorCode::invalid_argument, [&] {
      emflow::model::generate_greedy<decltype(type)>(m, ids, {5, 3}, s);
    });
  };
  std::string message = refused(bf16, 0.0);
  EXPECT_NE(message.find("'settings.products'"), std::string::npos) << message;
  EXPECT_NE(message.find("float64"), std::string::npos) << message;
  emflow::model::GenerateSettings tf32 = settings;
  tf32.products = emflow::Precision::tf32;
  message = refused(tf32, 0.0f);
  EXPECT_NE(message.find("'settings.products'"), std::string::npos) << message;
  if (!emflow::this_machine().avx512_bf16) {
    EXPECT_TRUE(emflow::testing::throws_error(
        [&] {
          emflow::model::generate_greedy<float>(m, ids, {5, 3}, bf16);
        },
        emflow::ErrorCode::unsupported, {"'settings.products'", "AVX512-BF16"}));
    GTEST_SKIP() << "this processor has no AVX512-BF16 (or EMFLOW_CPU_DISABLE names it): the "
                    "refusal is checked, the bfloat16 products are not offered here";
  }
  if (!emflow::this_machine().cpu_missing.empty()) GTEST_SKIP() << "the engine cannot run here";
  const auto f32 = emflow::model::generate_greedy<float>(m, ids, {5, 3}, settings);
  const auto b16 = emflow::model::generate_greedy<float>(m, ids, {5, 3}, bf16);
  // The first step of each prompt: the same prompt in both runs (later steps may follow
  // different ids where two logits are within rounding of each other).
  for (std::int64_t b = 0; b < 2; ++b) {
    double scale = 0, worst = 0;
    for (std::int64_t t = 0; t < kVocab; ++t) {
      const double want = f32.logits[(b * 4) * kVocab + t];
      scale = std::max(scale, std::abs(want));
      worst =
          std::max(worst, std::abs(static_cast<double>(b16.logits[(b * 4) * kVocab + t]) - want));
    }
    EXPECT_GT(scale, 0.1);
    EXPECT_LT(worst, 0.05 * scale) << "prompt " << b;
    EXPECT_GT(worst, 1e-6 * scale) << "prompt " << b << ": the bf16 products did not run";
  }
}

// emflow generate on the tiny model's operator folder: the ids the library gives, written all or
// none; bad options refused naming them, leaving no output.
class GenerateCli : public emflow::testing::CliFolder {
 protected:
  GenerateCli() : CliFolder("emflow_generate_cli") {}
};

TEST_F(GenerateCli, WritesTheLibrarysIdsAndLogitsAndRefusesBadOptions) {
  const Model m = make_llama(false, false, 3);
  emflow::model::write_operators(m, path("ops"));
  const Tensor<std::int64_t> ids(Shape{2, 4}, {3, 14, 1, 27, 5, 22, 0, 0});
  emflow::write_npy(path("ids.npy"), ids);
  emflow::write_npy(path("lengths.npy"), Tensor<std::int64_t>(Shape{2}, {4, 2}));
  const std::string common = "generate --model '" + path("ops") + "' --ids '" + path("ids.npy") +
                             "' --lengths '" + path("lengths.npy") + "' --out '" + path("new.npy") +
                             "'";
  for (const char* precision : {"float32", "float64"}) {
    const auto run = emflow(common + " --new 5 --precision " + precision + " --logits '" +
                            path("logits.npy") + "'");
    ASSERT_EQ(run.status, 0) << run.err;
    emflow::model::GenerateSettings settings;
    settings.new_tokens = 5;
    const Model back = emflow::model::read_operators(path("ops"));
    const auto want = std::string(precision) == "float32"
                          ? emflow::model::generate_greedy<float>(back, ids, {4, 2}, settings).ids
                          : emflow::model::generate_greedy<double>(back, ids, {4, 2}, settings).ids;
    EXPECT_EQ(emflow::read_npy<std::int64_t>(path("new.npy")).values(), want.values()) << precision;
    EXPECT_EQ(emflow::read_npy<double>(path("logits.npy")).shape(), (Shape{2, 5, kVocab}));
  }
  fs::remove(path("new.npy"));
  for (const auto& [option, arguments] : std::vector<std::pair<std::string, std::string>>{
           {"--new", "--new 0"},
           {"--precision", "--new 2 --precision float16"},
           {"--products", "--new 2 --products fp16"},
           {"--products", "--new 2 --precision float64 --products bf16"}}) {
    const auto run = emflow(common + " " + arguments);
    EXPECT_EQ(run.status, 1) << arguments;
    EXPECT_NE(run.err.find(option), std::string::npos) << run.err;
    EXPECT_FALSE(fs::exists(path("new.npy"))) << arguments;
  }
  const auto refused = [&](const std::string& option, const std::string& file,
                           const Tensor<std::int64_t>& ids_file, const std::string& more) {
    emflow::write_npy(path(file), ids_file);
    const auto run = emflow("generate --model '" + path("ops") + "' --ids '" + path(file) +
                            "' --new 1 --out '" + path("new.npy") + "'" + more);
    EXPECT_EQ(run.status, 1) << file;
    EXPECT_NE(run.err.find(option), std::string::npos) << run.err;
    EXPECT_FALSE(fs::exists(path("new.npy"))) << file;
    return run.err;
  };
  EXPECT_NE(refused("--ids", "vocab.npy", Tensor<std::int64_t>(Shape{1, 2}, {1, kVocab}), "")
                .find(std::to_string(kVocab)),
            std::string::npos);
  refused("--ids", "rank3.npy", Tensor<std::int64_t>(Shape{1, 2, 1}, {1, 2}), "");
  emflow::write_npy(path("zero.npy"), Tensor<std::int64_t>(Shape{1}, {0}));
  refused("--lengths", "one.npy", Tensor<std::int64_t>(Shape{1, 2}, {1, 2}),
          " --lengths '" + path("zero.npy") + "'");
}

}  // namespace

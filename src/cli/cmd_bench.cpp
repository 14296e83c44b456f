// emflow bench: times the contextual update on a random problem and prints one JSON object per
// line. With --baseline the unfused BLAS attention and with --peak the machine's fp32 FMA rate
// are measured in the same run, so ratios come from one process on one machine state.
//
// FLOP are attention-equivalent (docs/MATH.md §2): 4 B H N^2 d for the whole score matrix,
// halved for a causal mask, 4 B H d (visible pairs) for a window; the projections are not
// counted. Every figure is the median of --repeats timed runs after one untimed warm-up run;
// With --queries-tokens NQ the decoding shapes are timed: NQ queries of their own against the
// cloud through emflow::attend (attend_queries, which projects the contents each call), through a
// DecodeCache holding them (decode_queries), and one token appended and attended (decode_token).
// the CPU measurements are timed in rounds (one run of each per round), so a change in load on
// a shared machine falls on all of them alike. cpu_ms_median is the process's CPU time per run
// (all threads, spinning included): on a loaded machine a one-thread run's CPU time is close to
// what the run would take alone.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "emflow/attention.hpp"
#include "emflow/decode.hpp"
#include "emflow/memory.hpp"
#include "emflow/precision.hpp"
#include "emflow/sdpa.hpp"
#include "machine.hpp"
#include "storage.hpp"
#include "tools/blas_baseline.hpp"
#include "tools/measure.hpp"
#include "tools/problem.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include "emflow/cuda.hpp"
#include "tools/cuda_timing.hpp"
#endif

namespace emflow::cli {
namespace {

struct BenchArguments {
  std::string device = "cpu";
  std::int64_t tokens = 4096, dim = 64, heads = 1, batch = 1;
  std::string mask = "none";
  std::int64_t query_tokens = 0;  // 0: self-attention; else Nq queries of their own
  std::int64_t self_tokens = 0;   // > 0: also time self-attention at this N in the same rounds
  int repeats = 5;
  int threads = 0;
  bool baseline = false, peak = false, backward = false;
  std::string precision = "fp32";  // comma-separated: fp32, tf32, bf16, fp16
};

/// The N x N matrix of the baseline is refused above this size.
constexpr double kBaselineLimitBytes = 8.0 * (1 << 30);

/// The seeded problem every timing uses (shared with bench/cpu_attention.cpp).
struct Problem : tools::BenchProblem {
  Problem(const BenchArguments& args, const Mask& mask)
      : BenchProblem(args.batch, args.tokens, args.dim, args.heads, mask) {}
};

/// The SDPA-shaped problem of --backward, stored as S: per head the queries Q_h = X M_h, the
/// keys X and the values X F_h^T of the seeded problem (the dense EMF update as SDPA with
/// scale 1, as bench/torch_sdpa.py builds it for torch), an upstream gradient dO uniform in
/// [-1, 1], and the forward pass's output and lse (computed once, untimed) for the backward.
template <class S>
struct SdpaProblem {
  std::vector<S> queries, keys, values, output, d_output, d_queries, d_keys, d_values;
  std::vector<Stat<S>> lse;
  SdpaInput<S> input;

  SdpaProblem(const Problem& p, const Mask& mask, const ExecutionOptions& options) {
    const std::int64_t B = p.input.batch, N = p.input.tokens, d = p.input.dim;
    const std::int64_t H = p.input.layer.heads;
    const auto size = static_cast<std::size_t>(B * H * N * d);
    std::vector<float> q(size), v(size), row(static_cast<std::size_t>(d));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < H; ++h) {
        const float* m = p.relevance.data() + h * d * d;
        const float* f = p.content.data() + h * d * d;
        for (std::int64_t i = 0; i < N; ++i) {
          const float* x = p.cloud.data() + (b * N + i) * d;
          float* qi = q.data() + ((b * H + h) * N + i) * d;
          float* vi = v.data() + ((b * H + h) * N + i) * d;
          for (std::int64_t a = 0; a < d; ++a) {  // q_i = M^T x_i, row by row of M
            for (std::int64_t c = 0; c < d; ++c) qi[c] += x[a] * m[a * d + c];
          }
          for (std::int64_t c = 0; c < d; ++c) {  // v_i = F x_i
            float sum = 0.0f;
            for (std::int64_t a = 0; a < d; ++a) sum += f[c * d + a] * x[a];
            vi[c] = sum;
          }
        }
      }
    }
    std::mt19937_64 engine(2025);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<float> upstream(size), k;
    for (float& e : upstream) e = unit(engine);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < H; ++h) {
        k.insert(k.end(), p.cloud.data() + b * N * d, p.cloud.data() + (b + 1) * N * d);
      }
    }
    const auto count = static_cast<std::int64_t>(size);
    queries = stored<S>(q.data(), count);
    keys = stored<S>(k.data(), count);
    values = stored<S>(v.data(), count);
    d_output = stored<S>(upstream.data(), count);
    output.resize(size);
    d_queries.resize(size);
    d_keys.resize(size);
    d_values.resize(size);
    lse.resize(static_cast<std::size_t>(B * H * N));
    input.queries = queries.data();
    input.keys = keys.data();
    input.values = values.data();
    input.batch = B;
    input.query_heads = H;
    input.kv_heads = H;
    input.query_tokens = N;
    input.tokens = N;
    input.rank = d;
    input.value_rank = d;
    input.scale = 1.0;
    input.mask = mask;
    forward(options);
  }
  SdpaProblem(const SdpaProblem&) = delete;
  SdpaProblem& operator=(const SdpaProblem&) = delete;

  void forward(const ExecutionOptions& options) {
    sdpa_attend(input, SdpaOutput<S>{output.data(), lse.data(), nullptr}, options);
  }
  void backward(const ExecutionOptions& options) {
    SdpaSaved<S> saved;
    saved.output = output.data();
    saved.lse = lse.data();
    UpstreamGradients<S> upstream;
    upstream.update = d_output.data();
    sdpa_backward(input, saved, upstream,
                  SdpaGradientOutput<S>{d_queries.data(), d_keys.data(), d_values.data()}, options);
  }
};

/// Median of `ms` (not empty).
double median(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

/// One CPU timing: `run` does the work once and returns the FLOP it did.
struct Measurement {
  Measurement(std::string name, bool problem_keys, std::string members,
              std::function<double()> body)
      : op(std::move(name)), shape(problem_keys), extra(std::move(members)), run(std::move(body)) {}

  std::string op;
  bool shape = true;  // false: the problem keys do not apply (the FMA peak)
  Precision precision = Precision::fp32;
  std::string extra;  // more JSON members, starting with ", "
  std::function<double()> run;
  std::vector<double> ms;
  std::vector<double> cpu_ms;  // CPU time of the process (all threads) per run
  double flop = 0.0;
};

/// CPU time consumed by this process so far, all threads, in milliseconds.
double process_cpu_ms() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return 1e3 * static_cast<double>(now.tv_sec) + 1e-6 * static_cast<double>(now.tv_nsec);
}

/// Times every measurement `repeats` times after one untimed warm-up each, in rounds (one run of
/// each per round), so a change in the machine's load falls on all of them alike.
void time_in_rounds(std::vector<Measurement>& measurements, int repeats) {
  for (Measurement& m : measurements) m.run();
  for (int r = 0; r < repeats; ++r) {
    for (Measurement& m : measurements) {
      const double cpu_start = process_cpu_ms();
      const auto start = std::chrono::steady_clock::now();
      m.flop = m.run();
      const auto stop = std::chrono::steady_clock::now();
      m.cpu_ms.push_back(process_cpu_ms() - cpu_start);
      m.ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    }
  }
}

/// Query-key pairs the mask lets through, for one cloud and head (the FLOP convention above).
double visible_pairs(std::int64_t tokens, const Mask& mask) {
  const double n = static_cast<double>(tokens);
  switch (mask.kind) {
    case MaskKind::causal:
      return n * n / 2.0;
    case MaskKind::window: {
      const double w = static_cast<double>(std::min(mask.window, tokens));
      return w * n - w * (w - 1.0) / 2.0;  // sum over i of min(i + 1, w)
    }
    case MaskKind::none:
    default:
      return n * n;
  }
}

/// Query-key pairs of Nq queries aligned bottom-right against N keys (docs/MATH.md §1.6).
double cross_pairs(std::int64_t queries, std::int64_t tokens, const Mask& mask) {
  double pairs = 0.0;
  for (std::int64_t i = 0; i < queries; ++i) {
    const KeyRange keys = mask.visible_keys_at(tokens - queries + i, 0, tokens);
    pairs += static_cast<double>(keys.last - keys.first);
  }
  return pairs;
}

/// One line of output; `shape` false prints null for the problem keys (the FMA peak has none).
void print_line(const std::string& op, const std::string& device, const BenchArguments& args,
                const Mask& mask, bool shape, int threads, const std::vector<double>& ms,
                double flop, const std::string& extra = "", const std::vector<double>& cpu_ms = {},
                Precision precision = Precision::fp32) {
  const double ms_median = median(ms);
  std::ostringstream out;
  out << std::setprecision(6);
  auto value = [&](std::int64_t v) { return shape ? std::to_string(v) : std::string("null"); };
  out << "{\"op\": \"" << op << "\", \"device\": \"" << device << "\", \"precision\": \""
      << to_string(precision) << "\""
      << ", \"batch\": " << value(args.batch) << ", \"heads\": " << value(args.heads)
      << ", \"tokens\": " << value(args.tokens) << ", \"dim\": " << value(args.dim)
      << ", \"mask\": " << (shape ? "\"" + to_string(mask) + "\"" : std::string("null"))
      << ", \"ms_median\": " << ms_median << ", \"gflops\": " << flop / (ms_median * 1e6)
      << ", \"ms_min\": " << *std::min_element(ms.begin(), ms.end()) << ", \"threads\": " << threads
      << ", \"repeats\": " << args.repeats;
  if (!cpu_ms.empty()) out << ", \"cpu_ms_median\": " << median(cpu_ms);
  out << extra << "}";
  std::cout << out.str() << std::endl;
}

#if defined(EMFLOW_WITH_CUDA)
/// Device time of emflow::cuda::attend_async (CUDA events on one stream, tools/cuda_timing.hpp),
/// inputs resident, in milliseconds.
std::vector<double> time_cuda(const Problem& p, int repeats) {
  // First, so that it is released last: after the buffers, whatever throws.
  tools::CudaTiming timing;
  const cudaStream_t stream = timing.stream();
  const AttentionInput<float>& host = p.input;
  cuda::DeviceBuffer<float> cloud(p.cloud.size()), relevance(p.relevance.size()),
      content(p.content.size()), update(p.update.size());
  cloud.copy_from_host(p.cloud.data(), p.cloud.size(), stream);
  relevance.copy_from_host(p.relevance.data(), p.relevance.size(), stream);
  content.copy_from_host(p.content.data(), p.content.size(), stream);
  AttentionInput<float> in = host;
  in.cloud = cloud.data();
  in.layer.relevance = relevance.data();
  in.layer.content = content.data();
  const AttentionOutput<float> out{update.data(), nullptr, nullptr, nullptr};
  const std::size_t bytes = cuda::attend_workspace_size(in, out);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  const auto enqueue = [&] { cuda::attend_async(in, out, workspace.data(), bytes, stream); };
  timing.seconds(enqueue);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) ms.push_back(1e3 * timing.seconds(enqueue));
  return ms;
}
#endif

/// Refuses, before any work or allocation, a run whose arrays cannot fit in memory, naming the
/// option whose arrays are the largest part and the bytes: the problem (cloud, update and
/// operators of --batch x --tokens x --dim, --heads), the queries of --queries-tokens (their
/// seeded problem, the copy and the update) and the decode cache of its keys, the problem of
/// --self-tokens, the 16-bit copies of --precision and the N x N matrix of --baseline.
/// Returns what the run needs, for the message of an allocation that fails all the same.
std::string check_bench_memory(const BenchArguments& args,
                               const std::vector<Precision>& precisions) {
  struct Part {
    const char* option;
    std::string what;
    double bytes;
  };
  const double B = static_cast<double>(args.batch), N = static_cast<double>(args.tokens),
               d = static_cast<double>(args.dim), H = static_cast<double>(args.heads),
               Nq = static_cast<double>(args.query_tokens),
               S = static_cast<double>(args.self_tokens);
  const double f = sizeof(float), operators = 2 * H * d * d * f;
  std::vector<Part> parts = {{"--tokens",
                              "the cloud and update of --batch x --tokens x --dim float32 values",
                              2 * B * N * d * f + operators}};
  double half = 0;
  for (Precision p : precisions) half += p == Precision::bf16 || p == Precision::fp16 ? 1 : 0;
  if (half > 0) {
    parts.push_back({"--precision", "the 16-bit copies of the problem",
                     half * (2 * B * N * d + 2 * H * d * d) * 2});
  }
  if (args.query_tokens > 0) {
    parts.push_back({"--queries-tokens",
                     "4 arrays of --batch x --queries-tokens x --dim float32 values (the queries "
                     "and their update)",
                     4 * B * Nq * d * f + operators});
    if (args.batch == 1) {
      parts.push_back({"--tokens",
                       "the decode cache's keys and contents (--heads x --tokens x "
                       "--dim, twice)",
                       2 * H * N * d * f});
    }
  }
  if (args.self_tokens > 0) {
    parts.push_back({"--self-tokens", "the cloud and update of --batch x --self-tokens x --dim",
                     2 * B * S * d * f + operators});
  }
  if (args.baseline) parts.push_back({"--baseline", "the N x N matrix", N * N * f});
  if (args.backward) {
    // Per precision: Q, K, V, O, dO, dQ, dK, dV of (batch, heads, tokens, dim), the four float
    // arrays (Q, K, V, dO) before rounding and the lse; the operator's working memory is O(N d)
    // per thread.
    const double n = static_cast<double>(precisions.size());
    parts.push_back({"--backward",
                     "the SDPA problem's 8 arrays of --batch x --heads x --tokens x --dim, per "
                     "precision",
                     n * (8 * B * H * N * d * f + 4 * B * H * N * d * f + B * H * N * f)});
  }
  double total = 0;
  const Part* largest = &parts.front();
  for (const Part& part : parts) {
    total += part.bytes;
    if (part.bytes > largest->bytes) largest = &part;
  }
  const auto bytes = [](double v) {
    return v < 9e18 ? std::to_string(static_cast<long long>(v)) : std::string("more than 9e18");
  };
  std::ostringstream needs;
  needs << "the run needs " << bytes(total) << " bytes, " << bytes(largest->bytes)
        << " of them for " << largest->what << " (--batch " << args.batch << ", --heads "
        << args.heads << ", --tokens " << args.tokens << ", --dim " << args.dim;
  if (args.query_tokens > 0) needs << ", --queries-tokens " << args.query_tokens;
  needs << ")";
  if (total > static_cast<double>(memory_limit_bytes())) {
    fail_option(largest->option, "is too large: ", needs.str(), ", more than the ",
                memory_limit_bytes(), " bytes of memory available");
  }
  return needs.str();
}

/// The precisions of --precision: a comma-separated list of fp32, tf32, bf16 and fp16, each once.
std::vector<Precision> bench_precisions(const BenchArguments& args) {
  std::vector<Precision> list;
  std::stringstream text(args.precision);
  for (std::string item; std::getline(text, item, ',');) {
    const Precision p = parse_precision(item, "--precision");
    if (std::find(list.begin(), list.end(), p) != list.end()) {
      fail_option("--precision", "names ", to_string(p), " twice");
    }
    list.push_back(p);
  }
  if (list.empty()) fail_option("--precision", "must name at least one precision");
  const bool only_fp32 = list.size() == 1 && list[0] == Precision::fp32;
  if (!only_fp32 && (args.device != "cpu" || args.query_tokens > 0)) {
    fail_option("--precision",
                "tf32, bf16 and fp16 time self-attention on the CPU alone (--device "
                "cpu, no --queries-tokens)");
  }
  return list;
}

void time_bench(const BenchArguments& args, const Mask& mask,
                const std::vector<Precision>& precisions, const ExecutionOptions& options);

void run_bench(const BenchArguments& args) {
  const Mask mask = parse_mask(args.mask, "--mask");
  const std::vector<Precision> precisions = bench_precisions(args);
  if (args.tokens < 1) fail_option("--tokens", "must be >= 1, got ", args.tokens);
  if (args.dim < 1) fail_option("--dim", "must be >= 1, got ", args.dim);
  if (args.heads < 1) fail_option("--heads", "must be >= 1, got ", args.heads);
  if (args.batch < 1) fail_option("--batch", "must be >= 1, got ", args.batch);
  if (args.repeats < 1) fail_option("--repeats", "must be >= 1, got ", args.repeats);
  if (args.device != "cpu" && args.device != "cuda") {
    fail_option("--device", "expects cpu or cuda, got '", args.device, "'");
  }
  const ExecutionOptions options = execution_options(args.device, args.threads);
  // A missing GPU is reported before any work.
  naming_option("--device", [&] { return resolve_device(options.device); });
  const double baseline_bytes =
      4.0 * static_cast<double>(args.tokens) * static_cast<double>(args.tokens);
  if (args.baseline && baseline_bytes > kBaselineLimitBytes) {
    fail_option("--baseline", "needs an N x N matrix of ", baseline_bytes / (1 << 30),
                " GiB for --tokens ", args.tokens, "; the limit is ",
                kBaselineLimitBytes / (1 << 30), " GiB");
  }

  if (args.query_tokens < 0)
    fail_option("--queries-tokens", "must be >= 0, got ", args.query_tokens);
  if (args.self_tokens < 0) fail_option("--self-tokens", "must be >= 0, got ", args.self_tokens);
  if (args.query_tokens > 0 && (args.baseline || args.device != "cpu")) {
    fail_option("--queries-tokens", "times the CPU backend alone (no --baseline, --device cpu)");
  }
  if (args.backward) {
    if (args.device != "cpu" || args.query_tokens > 0 || args.self_tokens > 0) {
      fail_option("--backward",
                  "times the SDPA-shaped operator on the CPU alone (--device cpu, no "
                  "--queries-tokens or --self-tokens)");
    }
    if (std::find(precisions.begin(), precisions.end(), Precision::tf32) != precisions.end()) {
      fail_option("--backward", "times fp32, bf16 and fp16; --precision names tf32");
    }
  }
  const std::string needs = check_bench_memory(args, precisions);
  try {
    time_bench(args, mask, precisions, options);
  } catch (const std::bad_alloc&) {
    fail(ErrorCode::out_of_memory, "bench: out of memory: ", needs);
  }
}

void time_bench(const BenchArguments& args, const Mask& mask,
                const std::vector<Precision>& precisions, const ExecutionOptions& options) {
  const int threads = args.threads > 0 ? args.threads : omp_get_max_threads();
  const double per_pair = 4.0 * static_cast<double>(args.batch * args.heads * args.dim);
  const double flop =
      per_pair * (args.query_tokens > 0 ? cross_pairs(args.query_tokens, args.tokens, mask)
                                        : visible_pairs(args.tokens, mask));
  const std::string isa = std::string(", \"isa\": \"") + tools::compiled_instruction_set() + "\"";

  std::vector<Measurement> measurements;
  if (args.peak) {
    // Calibrate to about 0.3 s per timed run.
    const auto start = std::chrono::steady_clock::now();
    tools::fma_peak_work(threads, 1 << 20);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto iterations = static_cast<std::int64_t>(
        std::max(1.0, std::ceil(static_cast<double>(1 << 20) * 0.3 / std::max(seconds, 1e-6))));
    measurements.emplace_back("fma_peak", false, isa + machine_json(), [threads, iterations] {
      return tools::fma_peak_work(threads, iterations);
    });
  }

  Problem problem(args, mask);
  const AttentionOutput<float> out{problem.update.data(), nullptr, nullptr, nullptr};
  // Cross-attention: Nq queries of their own against the problem's cloud as keys.
  std::vector<float> queries, query_update;
  AttentionInput<float> cross = problem.input;
  if (args.query_tokens > 0) {
    const BenchArguments query_shape = [&] {
      BenchArguments q = args;
      q.tokens = args.query_tokens;
      return q;
    }();
    const Problem query_cloud(query_shape, mask);
    queries = query_cloud.cloud;
    query_update.resize(queries.size());
    cross.queries = queries.data();
    cross.query_tokens = args.query_tokens;
  }
  const AttentionOutput<float> cross_out{query_update.data(), nullptr, nullptr, nullptr};
  // 16-bit storage: the problem's inputs rounded once (untimed), timed in the same rounds.
  std::vector<std::shared_ptr<void>> stored;
  auto add_stored = [&](auto tag, Precision p) {
    using S = decltype(tag);
    auto in = std::make_shared<StoredInput<S>>(problem.input);
    auto update = std::make_shared<std::vector<S>>(problem.update.size());
    stored.push_back(in);
    stored.push_back(update);
    ExecutionOptions o = options;
    o.precision = p;
    measurements.emplace_back("attend", true, isa, [in, update, o, flop] {
      attend(in->input, AttentionOutput<S>{update->data()}, o);
      return flop;
    });
    measurements.back().precision = p;
  };
  const bool time_fp32 =
      std::find(precisions.begin(), precisions.end(), Precision::fp32) != precisions.end();
  // --backward: the SDPA-shaped operator's forward and backward passes in place of the update,
  // each precision in the same rounds (the problems built and their forward run once, untimed).
  auto add_sdpa = [&](auto tag, Precision p) {
    using S = decltype(tag);
    auto sdpa = std::make_shared<SdpaProblem<S>>(problem, mask, options);
    stored.push_back(sdpa);
    measurements.emplace_back("sdpa_attend", true, isa, [sdpa, options, flop] {
      sdpa->forward(options);
      return flop;
    });
    measurements.back().precision = p;
    // Five products against the forward's two (docs/MATH.md §8.3).
    measurements.emplace_back("sdpa_backward", true, isa, [sdpa, options, flop] {
      sdpa->backward(options);
      return 2.5 * flop;
    });
    measurements.back().precision = p;
  };
  for (Precision p : args.backward ? precisions : std::vector<Precision>{}) {
    if (p == Precision::fp32) add_sdpa(float{}, p);
    if (p == Precision::bf16) add_sdpa(bfloat16{}, p);
    if (p == Precision::fp16) add_sdpa(float16{}, p);
  }
  for (Precision p : args.backward ? std::vector<Precision>{} : precisions) {
    if (p == Precision::bf16) add_stored(bfloat16{}, p);
    if (p == Precision::fp16) add_stored(float16{}, p);
    if (p == Precision::tf32) {
      // A permission the CPU takes as fp32 products (docs/MATH.md §7): the line says so.
      ExecutionOptions o = options;
      o.precision = p;
      measurements.emplace_back("attend", true, isa + ", \"computes\": \"fp32\"", [&, o] {
        attend(problem.input, out, o);
        return flop;
      });
      measurements.back().precision = p;
    }
  }
  if (args.device == "cpu" && time_fp32 && !args.backward) {
    const std::string shape_members =
        args.query_tokens > 0 ? isa + ", \"query_tokens\": " + std::to_string(args.query_tokens)
                              : isa;
    measurements.emplace_back(args.query_tokens > 0 ? "attend_queries" : "attend", true,
                              shape_members, [&] {
                                attend(args.query_tokens > 0 ? cross : problem.input,
                                       args.query_tokens > 0 ? cross_out : out, options);
                                return flop;
                              });
  }
  // Decoding: the problem's cloud in a DecodeCache (filled once, untimed), then NQ queries
  // against it (decode_queries), and one token appended and attended (decode_token: the cache
  // grows by one token per run).
  std::unique_ptr<DecodeCache> cache;
  std::vector<float> token_update(static_cast<std::size_t>(args.dim));
  if (args.query_tokens > 0 && args.batch == 1) {
    cache = std::make_unique<DecodeCache>(problem.input.layer, args.dim, 1.0);
    cache->append(problem.cloud.data(), args.tokens);
    const std::string members = isa + ", \"query_tokens\": " + std::to_string(args.query_tokens);
    measurements.emplace_back("decode_queries", true, members, [&] {
      cache->attend(queries.data(), args.query_tokens, mask,
                    {query_update.data(), nullptr, nullptr, nullptr}, kAlignToEnd, args.threads);
      return flop;
    });
    const double token_flop = per_pair * cross_pairs(1, args.tokens, mask);
    measurements.emplace_back("decode_token", true, isa + ", \"query_tokens\": 1", [&, token_flop] {
      cache->append(queries.data(), 1);
      cache->attend(queries.data(), 1, mask, {token_update.data(), nullptr, nullptr, nullptr},
                    kAlignToEnd, args.threads);
      return token_flop;
    });
  }
  // Self-attention at --self-tokens in the same rounds, for a ratio measured like with like.
  std::unique_ptr<Problem> self;
  if (args.self_tokens > 0) {
    BenchArguments self_shape = args;
    self_shape.tokens = args.self_tokens;
    self = std::make_unique<Problem>(self_shape, mask);
    const double self_flop = per_pair * visible_pairs(args.self_tokens, mask);
    measurements.emplace_back(
        "attend_self", true, isa + ", \"self_tokens\": " + std::to_string(args.self_tokens),
        [&, self_flop] {
          attend(self->input, {self->update.data(), nullptr, nullptr, nullptr}, options);
          return self_flop;
        });
  }
  std::unique_ptr<tools::BlasBaseline> baseline;
  std::vector<float> baseline_update;
  if (args.baseline) {
    baseline = std::make_unique<tools::BlasBaseline>(args.tokens, args.dim);
    baseline_update.resize(problem.update.size());
    measurements.emplace_back("unfused_blas", true, "", [&] {
      baseline->run(problem.input, baseline_update.data(), threads);
      return flop;
    });
  }

#if defined(EMFLOW_WITH_CUDA)
  if (args.device == "cuda") {
    print_line("attend", "cuda", args, mask, true, 0, time_cuda(problem, args.repeats), flop);
  }
#endif
  time_in_rounds(measurements, args.repeats);
  for (const Measurement& m : measurements) {
    print_line(m.op, "cpu", args, mask, m.shape, threads, m.ms, m.flop, m.extra, m.cpu_ms,
               m.precision);
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArguments>();
  CLI::App* command = add_command(
      app, "bench", "Time the contextual update and print JSON lines (with --baseline, --peak)",
      R"(Time the contextual update on a random float32 problem and print one JSON object per
line: op, device, precision, batch, heads, tokens, dim, mask, ms_median (median of
--repeats runs after one warm-up) and gflops (attention-equivalent 4 B H N^2 d / time,
halved for causal). --baseline and --peak are measured in the same run, so their ratios
to the fused update compare like with like.)");
  command->add_option("--device", args->device, "cpu (the fused CPU backend) or cuda")
      ->capture_default_str();
  command->add_option("--tokens", args->tokens, "tokens N per cloud")->capture_default_str();
  command->add_option("--dim", args->dim, "dimension d of the token space")->capture_default_str();
  command->add_option("--heads", args->heads, "heads H of the layer")->capture_default_str();
  command->add_option("--batch", args->batch, "clouds B")->capture_default_str();
  command
      ->add_option("--mask", args->mask,
                   "none, causal (keys j <= i) or window:W (keys i-W < j <= i)")
      ->capture_default_str();
  command
      ->add_option("--queries-tokens", args->query_tokens,
                   "time NQ queries of their own against the --tokens keys (decoding shapes, "
                   "aligned bottom-right; op attend_queries); 0: self-attention")
      ->capture_default_str();
  command
      ->add_option("--self-tokens", args->self_tokens,
                   "also time fused self-attention of this many tokens in the same rounds (op "
                   "attend_self; its tokens are in self_tokens)")
      ->capture_default_str();
  command->add_option("--repeats", args->repeats, "timed runs; the median is printed")
      ->capture_default_str();
  command
      ->add_option("--precision", args->precision,
                   "comma-separated precisions to time in the same rounds: fp32, tf32 (the "
                   "CPU computes it in fp32; the line says \"computes\": \"fp32\"), bf16, fp16 "
                   "(16-bit: the problem rounded once); all but fp32 need --device cpu and "
                   "self-attention")
      ->capture_default_str();
  add_threads_option(*command, args->threads);
  command->add_flag("--baseline", args->baseline,
                    "also time unfused attention as numpy does it: OpenBLAS sgemm for S = R X^T "
                    "and P C, a row softmax, and the whole N x N matrix in memory (op "
                    "unfused_blas)");
  command->add_flag("--backward", args->backward,
                    "time the SDPA-shaped operator (emflow/sdpa.hpp) instead of the update: "
                    "queries X M_h, keys X, values X F_h^T, scale 1, forward (op sdpa_attend) "
                    "and backward to dQ, dK, dV from a random dO (op sdpa_backward; its FLOP "
                    "are 2.5 times the forward's), in the same rounds; --device cpu, "
                    "self-attention, fp32, bf16, fp16");
  command->add_flag("--peak", args->peak,
                    "also measure the machine's fp32 FMA rate: independent FMA chains on every "
                    "thread, throughput-bound (op fma_peak)");
  command->callback([args] { run_bench(*args); });
}

}  // namespace emflow::cli

// The pieces of `emflow flow` that its single-process and distributed runs share
// (flow_command.hpp).
#include "flow_command.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "emflow/finite.hpp"
#include "tools/plot.hpp"

namespace emflow::cli {

bool is_generated(const std::string& text) {
  return text == "identity" || text == "minus-identity" || text == "random";
}

flow::InitialCloud check_generated_cloud(const FlowArguments& args) {
  if (args.tokens < 2) fail_option("--tokens", "must be >= 2, got ", args.tokens);
  if (args.dim < 1) fail_option("--dim", "must be >= 1, got ", args.dim);
  if (args.batch < 1) fail_option("--batch", "must be >= 1, got ", args.batch);
  const flow::InitialCloud init = flow::parse_initial_cloud(args.init, "--init");
  if (init == flow::InitialCloud::orthonormal && args.tokens > args.dim) {
    fail_option("--init", "orthonormal needs --tokens <= --dim, got ", args.tokens, " > ",
                args.dim);
  }
  expect_product_at_most({{"--batch", args.batch}, {"--tokens", args.tokens}, {"--dim", args.dim}},
                         std::int64_t{1} << 31, "values of the generated clouds");
  return init;
}

std::vector<double> parse_betas(const std::string& text, std::int64_t batch) {
  std::vector<double> betas;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const double beta = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !std::isfinite(beta) || beta <= 0.0) {
      fail_option("--beta",
                  "expects a finite number > 0, or one per cloud separated by commas, "
                  "got '",
                  text, "'");
    }
    betas.push_back(beta);
  }
  if (betas.size() != 1 && static_cast<std::int64_t>(betas.size()) != batch) {
    fail_option("--beta", "gives ", betas.size(), " values, expected 1 or one per cloud (", batch,
                ")");
  }
  return betas;
}

template <class T>
std::vector<flow::FlowLayer<T>> read_layers(const FlowArguments& args, std::int64_t dim,
                                            std::int64_t layer_count, Dtype dtype) {
  const std::string main_option = args.cloud.empty() ? "--precision" : "--x";
  flow::OperatorSource<T> sources[2];
  const char* options[2] = {"--m", "--f"};
  const std::string* texts[2] = {&args.relevance, &args.content};
  for (int which = 0; which < 2; ++which) {
    flow::OperatorSource<T>& s = sources[which];
    const std::string& text = *texts[which];
    s.name = std::string(options[which]) + " '" + text + "'";
    if (is_generated(text)) {
      s.kind = flow::parse_operator_kind(text, options[which]);
      continue;
    }
    s.array = read_float_input<T>(options[which], text, dtype, main_option, 2, 4);
    if (args.check_finite) require_finite(s.array, s.name);
  }
  return flow::layer_stack(sources[0], sources[1], dim, layer_count, args.seed);
}

std::string csv_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char text[40];
  std::snprintf(text, sizeof text, "%.9g", v);
  return text;
}

flow::FlowSettings flow_settings(const FlowArguments& args) {
  const bool continuous = !given(args.layers_option);
  if (!continuous && args.layers < 1) fail_option("--layers", "must be >= 1, got ", args.layers);
  if (continuous) {
    if (!(std::isfinite(args.time) && args.time > 0)) {
      fail_option("--time", "must be finite and > 0, got ", args.time);
    }
    if (!(std::isfinite(args.dt) && args.dt > 0)) {
      fail_option("--dt", "must be finite and > 0, got ", args.dt);
    }
    if (args.time / args.dt > static_cast<double>(flow::kMaxSteps)) {
      fail_option("--dt", "gives more than ", flow::kMaxSteps, " steps (--time ", args.time,
                  ", --dt ", args.dt, ")");
    }
  }
  const flow::Integrator integrator = flow::parse_integrator(args.integrator, "--integrator");
  const flow::Normalization norm = flow::parse_normalization(args.norm, "--norm");
  if (continuous && norm != flow::Normalization::none && norm != flow::Normalization::sphere) {
    fail_option("--norm",
                "must be none or sphere with --time (layernorm and rmsnorm need "
                "--layers), got '",
                args.norm, "'");
  }
  if (continuous && args.pre_norm) fail_option("--pre-norm", "applies to --layers only");
  if (!(std::isfinite(args.norm_eps) && args.norm_eps > 0)) {
    fail_option("--norm-eps", "must be finite and > 0, got ", args.norm_eps);
  }
  if (args.record_every < 1) {
    fail_option("--record-every", "must be >= 1, got ", args.record_every);
  }
  flow::FlowSettings settings;
  settings.layers = continuous ? 0 : args.layers;
  settings.norm = norm;
  settings.pre_norm = args.pre_norm;
  settings.time = args.time;
  settings.dt = args.dt;
  settings.integrator = integrator;
  settings.unnormalized = args.unnormalized;
  settings.norm_eps = args.norm_eps;
  settings.record_every = args.record_every;
  return settings;
}

void declare_flow_files(OutputFiles& outputs, const FlowArguments& args) {
  if (!args.out.empty()) outputs.declare("--out", args.out);
  if (!args.metrics.empty()) outputs.declare("--metrics", args.metrics);
  if (!args.plot.empty()) outputs.declare("--plot", args.plot);
  outputs.declare_input("--x", args.cloud);
  if (!is_generated(args.relevance)) outputs.declare_input("--m", args.relevance);
  if (!is_generated(args.content)) outputs.declare_input("--f", args.content);
}

// run_flow refuses a trajectory of more than 2^31 values before allocating it; this names the
// option to change.
std::int64_t trajectory_values(const FlowArguments& args, const flow::FlowSettings& settings,
                               std::int64_t B, std::int64_t N, std::int64_t d, bool from_file,
                               std::int64_t* records_out) {
  const bool continuous = settings.layers == 0;
  const std::int64_t steps = flow::step_count(settings);
  const std::int64_t records =
      steps / args.record_every + 1 + (steps % args.record_every != 0 ? 1 : 0);
  const std::string step_options = continuous ? "--time/--dt" : "--layers";
  if (records_out) *records_out = records;
  return expect_product_at_most(
      {{step_options, records,
        std::to_string(records) + " records (" + std::to_string(steps) +
            (continuous
                 ? " steps of --time " + csv_number(args.time) + " / --dt " + csv_number(args.dt)
                 : " layers of --layers") +
            ", --record-every " + std::to_string(args.record_every) + ")"},
       {"--batch", B},
       {from_file ? "--x" : "--tokens", N, from_file ? "N " + std::to_string(N) + " (--x)" : ""},
       {from_file ? "--x" : "--dim", d, from_file ? "d " + std::to_string(d) + " (--x)" : ""}},
      std::int64_t{1} << 31, "values of the trajectory (raise --record-every to record fewer)");
}

template <class T>
void stage_flow_outputs(OutputFiles& outputs, const FlowArguments& args,
                        const flow::FlowResult<T>& result, const std::vector<double>& betas,
                        const flow::FlowSettings& settings) {
  const bool continuous = settings.layers == 0;
  const flow::Normalization norm = settings.norm;
  const std::int64_t R = result.trajectory.extent(0), B = result.trajectory.extent(1),
                     N = result.trajectory.extent(2), d = result.trajectory.extent(3);
  if (!args.out.empty()) outputs.stage_npy(args.out, result.trajectory);
  if (!args.metrics.empty()) {
    std::ostringstream csv;
    csv << "step," << (continuous ? "time" : "layer")
        << ",cloud,beta,min_inner,mean_inner,clustered_fraction,clusters,energy,entropy,"
           "diameter\n";
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t b = 0; b < B; ++b) {
        const flow::Observables& o = result.observables[static_cast<std::size_t>(r * B + b)];
        csv << result.steps[static_cast<std::size_t>(r)] << ','
            << csv_number(result.times[static_cast<std::size_t>(r)]) << ',' << b << ','
            << csv_number(betas[betas.size() == 1 ? 0 : static_cast<std::size_t>(b)]) << ','
            << csv_number(o.min_inner) << ',' << csv_number(o.mean_inner) << ','
            << csv_number(o.clustered_fraction) << ',' << o.clusters << ',' << csv_number(o.energy)
            << ',' << csv_number(o.entropy) << ',' << csv_number(o.diameter) << '\n';
      }
    }
    outputs.stage_bytes(args.metrics, csv.str());
  }
  if (!args.plot.empty()) {
    tools::FlowPicture picture;
    picture.records = R;
    picture.clouds = B;
    picture.tokens = N;
    picture.dim = d;
    picture.trajectory.resize(static_cast<std::size_t>(R * N * d));
    for (std::int64_t r = 0; r < R; ++r) {
      const T* from = result.trajectory.data() + r * B * N * d;  // cloud 0
      std::copy(from, from + N * d, picture.trajectory.begin() + r * N * d);
    }
    picture.times = result.times;
    for (std::int64_t b = 0; b < B; ++b) {
      picture.betas.push_back(betas[betas.size() == 1 ? 0 : static_cast<std::size_t>(b)]);
    }
    picture.observables = result.observables;
    picture.on_sphere = norm == flow::Normalization::sphere && (continuous || !args.pre_norm);
    picture.time_label = continuous ? "time t" : "layer";
    std::ostringstream title;
    title << (continuous ? (args.unnormalized ? "USA" : "SA") : "layers") << ": N = " << N
          << ", d = " << d << ", M = " << (is_generated(args.relevance) ? args.relevance : "file")
          << ", F = " << (is_generated(args.content) ? args.content : "file")
          << ", \xCE\xB2 = " << args.beta << ", norm " << args.norm;
    if (continuous) {
      title << ", " << args.integrator << " dt = " << args.dt << ", T = " << args.time;
    } else {
      title << ", L = " << args.layers << (args.pre_norm ? " pre-norm" : " post-norm");
    }
    if (B > 1) title << "  (paths: cloud 0)";
    picture.title = title.str();
    outputs.stage_bytes(args.plot, tools::draw_flow(picture));
  }
}

#define EMFLOW_FLOW_COMMAND(T)                                                                \
  template std::vector<flow::FlowLayer<T>> read_layers<T>(const FlowArguments&, std::int64_t, \
                                                          std::int64_t, Dtype);               \
  template void stage_flow_outputs<T>(OutputFiles&, const FlowArguments&,                     \
                                      const flow::FlowResult<T>&, const std::vector<double>&, \
                                      const flow::FlowSettings&);
EMFLOW_FLOW_COMMAND(float)
EMFLOW_FLOW_COMMAND(double)
#undef EMFLOW_FLOW_COMMAND

}  // namespace emflow::cli

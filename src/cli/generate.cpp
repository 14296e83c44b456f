#include "generate.hpp"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include "flow_command.hpp"
#include "tools/plot.hpp"

namespace emflow::cli {

std::string generation_metrics(const Generation& g) {
  const std::int64_t B = g.clouds, N = g.prompt_tokens, L = g.layers, d = g.dim, K = g.steps;
  std::ostringstream csv;
  csv << (B > 1 ? "cloud," : "") << "token,position,layer,move,seconds\n";
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < K; ++t) {
      const float* path = g.paths.data() + (b * K + t) * (L + 1) * d;
      for (std::int64_t l = 0; l < L; ++l) {
        double move = 0.0;
        for (std::int64_t a = 0; a < d; ++a) {
          const double step = path[(l + 1) * d + a] - path[l * d + a];
          move += step * step;
        }
        if (B > 1) csv << b << ',';
        csv << t << ',' << N + t << ',' << l << ',' << csv_number(std::sqrt(move)) << ','
            << csv_number(g.seconds[static_cast<std::size_t>(t)]) << '\n';
      }
    }
  }
  return csv.str();
}

std::string generation_picture(const Generation& g, const std::string& title) {
  const std::int64_t L = g.layers, d = g.dim, K = g.steps;
  tools::ModelPicture picture;
  picture.records = L + 1;
  picture.tokens = K;
  picture.dim = d;
  picture.trajectory.resize(static_cast<std::size_t>((L + 1) * K * d));
  std::vector<float> record(static_cast<std::size_t>(K * d));
  for (std::int64_t r = 0; r <= L; ++r) {
    for (std::int64_t t = 0; t < K; ++t) {
      for (std::int64_t a = 0; a < d; ++a) {
        const float v = g.paths[(t * (L + 1) + r) * d + a];  // cloud 0
        picture.trajectory[static_cast<std::size_t>((r * K + t) * d + a)] = v;
        record[static_cast<std::size_t>(t * d + a)] = v;
      }
    }
    // A layer's entropy is that of the tokens it moved (the last record: none).
    double entropy = 0.0;
    if (r < L) {
      for (std::int64_t t = 0; t < K; ++t)
        entropy += g.entropy[static_cast<std::size_t>(t * L + r)];
      entropy /= static_cast<double>(K);
    }
    picture.entropy.push_back(entropy);
    picture.clusters.push_back(K >= 2 ? flow::observe(record.data(), K, d, 1.0).clusters : 1);
  }
  for (std::int64_t t = 0; t < K; ++t)
    picture.labels.push_back(std::to_string(g.prompt_tokens + t));
  picture.title = title;
  return tools::draw_model_flow(picture);
}

}  // namespace emflow::cli

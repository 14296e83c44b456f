// Shards of a sequence (which tokens each rank holds), moving rows between whole batches and
// shards, and reading one shard of a .npy cloud by offset reads.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "emflow/io.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::distributed {

Layout default_layout(const Mask& mask) noexcept {
  return mask.kind == MaskKind::none ? Layout::contiguous : Layout::zigzag;
}

namespace {

// Run k of `parts` near-equal runs of `tokens`: [k N / parts, (k + 1) N / parts).
Segment run(std::int64_t tokens, std::int64_t parts, std::int64_t k) {
  const std::int64_t first = tokens / parts * k + tokens % parts * k / parts;
  const std::int64_t last = tokens / parts * (k + 1) + tokens % parts * (k + 1) / parts;
  return {first, last - first};
}

}  // namespace

std::vector<Segment> shard(Layout layout, std::int64_t tokens, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks || tokens < 0) {
    detail::fail(ErrorCode::invalid_argument, "shard: rank ", rank, " of ", ranks, " and ", tokens,
                 " tokens");
  }
  std::vector<Segment> segments;
  if (layout == Layout::contiguous || ranks == 1) {
    segments.push_back(run(tokens, ranks, rank));
  } else {
    segments.push_back(run(tokens, 2 * std::int64_t{ranks}, rank));
    segments.push_back(run(tokens, 2 * std::int64_t{ranks}, 2 * std::int64_t{ranks} - 1 - rank));
  }
  std::vector<Segment> kept;
  for (const Segment& s : segments) {
    if (s.count > 0) kept.push_back(s);
  }
  return kept;
}

std::int64_t shard_tokens(const std::vector<Segment>& segments) noexcept {
  std::int64_t total = 0;
  for (const Segment& s : segments) total += s.count;
  return total;
}

template <class T>
std::vector<T> gather_shard(const T* whole, std::int64_t batch, std::int64_t tokens,
                            std::int64_t width, const std::vector<Segment>& segments) {
  std::vector<T> part(static_cast<std::size_t>(batch * shard_tokens(segments) * width));
  T* out = part.data();
  for (const Segment& s : segments) {
    for (std::int64_t b = 0; b < batch; ++b) {
      const T* from = whole + (b * tokens + s.position) * width;
      out = std::copy(from, from + s.count * width, out);
    }
  }
  return part;
}

template <class T>
void scatter_shard(const T* part, std::int64_t batch, std::int64_t tokens, std::int64_t width,
                   const std::vector<Segment>& segments, T* whole) {
  for (const Segment& s : segments) {
    for (std::int64_t b = 0; b < batch; ++b) {
      std::copy(part, part + s.count * width, whole + (b * tokens + s.position) * width);
      part += s.count * width;
    }
  }
}

template <class T>
std::vector<T> read_shard(const std::string& path, Layout layout, int ranks, int rank,
                          Shape* shape) {
  const NpyHeader header = read_npy_header(path);
  const Dtype expected = sizeof(T) == 4 ? Dtype::float32 : Dtype::float64;
  if (header.dtype != expected) {
    detail::fail(ErrorCode::io, "'", path, "' holds ", to_string(header.dtype), ", expected ",
                 to_string(expected));
  }
  if (header.shape.size() != 2 && header.shape.size() != 3) {
    detail::fail(ErrorCode::io, "'", path, "' has shape ", to_string(header.shape),
                 ", expected (N, d) or (B, N, d)");
  }
  if (shape) *shape = header.shape;
  const std::int64_t rank_count = static_cast<std::int64_t>(header.shape.size());
  const std::int64_t batch = rank_count == 3 ? header.shape[0] : 1;
  const std::int64_t tokens = header.shape[rank_count - 2], dim = header.shape[rank_count - 1];
  const std::vector<Segment> segments = shard(layout, tokens, ranks, rank);
  std::vector<T> part(static_cast<std::size_t>(batch * shard_tokens(segments) * dim));
  std::ifstream file(path, std::ios::binary);
  if (!file) detail::fail(ErrorCode::io, "cannot open '", path, "': ", std::strerror(errno));
  T* out = part.data();
  for (const Segment& s : segments) {
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t offset = header.data_offset + (b * tokens + s.position) * dim *
                                                           static_cast<std::int64_t>(sizeof(T));
      file.seekg(offset);
      file.read(reinterpret_cast<char*>(out),
                static_cast<std::streamsize>(s.count * dim * static_cast<std::int64_t>(sizeof(T))));
      if (!file) {
        detail::fail(ErrorCode::io, "'", path, "': cannot read ", s.count, " rows at byte ",
                     offset);
      }
      out += s.count * dim;
    }
  }
  return part;
}

#define EMFLOW_DISTRIBUTED_SHARD(T)                                                           \
  template std::vector<T> gather_shard<T>(const T*, std::int64_t, std::int64_t, std::int64_t, \
                                          const std::vector<Segment>&);                       \
  template void scatter_shard<T>(const T*, std::int64_t, std::int64_t, std::int64_t,          \
                                 const std::vector<Segment>&, T*);                            \
  template std::vector<T> read_shard<T>(const std::string&, Layout, int, int, Shape*);
EMFLOW_DISTRIBUTED_SHARD(float)
EMFLOW_DISTRIBUTED_SHARD(double)
#undef EMFLOW_DISTRIBUTED_SHARD

}  // namespace emflow::distributed

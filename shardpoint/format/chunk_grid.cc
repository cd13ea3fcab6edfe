#include "shardpoint/format/chunk_grid.h"

#include <algorithm>
#include <limits>

#include "shardpoint/base/inline_vector.h"
#include "shardpoint/exec/task_group.h"

namespace sp {

std::optional<ChunkGrid> FindChunkGrid(std::span<const StoredChunk> chunks, const Shape& shape) {
  const size_t rank = shape.size();
  const uint64_t count = chunks.size();
  // Chunk numbers are uint32_t wherever plans name them.
  if (count == 0 || count - 1 > std::numeric_limits<uint32_t>::max()) return std::nullopt;
  ChunkGrid grid;
  grid.bounds.resize(rank);
  grid.strides.resize(rank);
  // The cut points of dimension d are read off the chunks that lie on its axis: (0, .., k, .., 0)
  // is chunk k * stride, stride being the number of cells in the later dimensions.
  uint64_t stride = 1;
  for (size_t d = rank; d-- > 0;) {
    grid.strides[d] = stride;
    std::vector<int64_t>& bounds = grid.bounds[d];
    bounds.push_back(0);
    for (int64_t at = 0; at < shape[d];) {
      const uint64_t index = (bounds.size() - 1) * stride;
      if (index >= count) return std::nullopt;
      const Box& box = chunks[index].box;
      if (box.offsets.size() != rank || box.sizes.size() != rank) return std::nullopt;
      if (box.offsets[d] != at || box.sizes[d] <= 0 || box.sizes[d] > shape[d] - at) {
        return std::nullopt;
      }
      at += box.sizes[d];
      bounds.push_back(at);
    }
    const uint64_t intervals = bounds.size() - 1;
    if (intervals == 0 || stride > count / intervals) return std::nullopt;
    stride *= intervals;
  }
  if (stride != count) return std::nullopt;
  // Every chunk must be its cell: then they are within the shape, disjoint and cover it.
  if (!GridMatches(grid, chunks)) return std::nullopt;
  return grid;
}

bool GridMatches(const ChunkGrid& grid, std::span<const StoredChunk> chunks) {
  const size_t rank = grid.bounds.size();
  if (grid.strides.size() != rank) return false;
  uint64_t cells = 1;
  for (size_t d = rank; d-- > 0;) {
    const std::vector<int64_t>& bounds = grid.bounds[d];
    if (bounds.size() < 2 || bounds.front() != 0 || grid.strides[d] != cells ||
        __builtin_mul_overflow(cells, bounds.size() - 1, &cells)) {
      return false;
    }
    for (size_t k = 1; k < bounds.size(); ++k) {
      if (bounds[k] <= bounds[k - 1]) return false;
    }
  }
  if (cells != chunks.size()) return false;
  std::vector<size_t> cell(rank, 0);
  for (const StoredChunk& chunk : chunks) {
    const Box& box = chunk.box;
    if (box.offsets.size() != rank || box.sizes.size() != rank) return false;
    for (size_t d = 0; d < rank; ++d) {
      const std::vector<int64_t>& bounds = grid.bounds[d];
      if (box.offsets[d] != bounds[cell[d]] ||
          box.sizes[d] != bounds[cell[d] + 1] - bounds[cell[d]]) {
        return false;
      }
    }
    for (size_t d = rank; d-- > 0;) {  // the next cell, the last dimension fastest
      if (++cell[d] + 1 < grid.bounds[d].size()) break;
      cell[d] = 0;
    }
  }
  return true;
}

void GridChunksIntersecting(const ChunkGrid& grid, const Box& box, std::vector<uint32_t>* out) {
  if (box.empty()) return;
  const size_t rank = grid.bounds.size();
  // Per dimension, the intervals [first, last) that share a point with the box's (inline: a load's
  // coordinator asks this for every tensor of every rank).
  InlineVector<size_t, 4> first(rank), last(rank);
  for (size_t d = 0; d < rank; ++d) {
    const std::vector<int64_t>& bounds = grid.bounds[d];
    // The first interval ending after the box's start, up to the last starting before its end.
    first[d] = static_cast<size_t>(
        std::upper_bound(bounds.begin() + 1, bounds.end(), box.offsets[d]) - (bounds.begin() + 1));
    last[d] = static_cast<size_t>(
        std::lower_bound(bounds.begin(), bounds.end() - 1, box.exclusive_max(d)) - bounds.begin());
    if (first[d] >= last[d]) return;
  }
  InlineVector<size_t, 4> cell = first;
  while (true) {
    uint64_t number = 0;
    for (size_t d = 0; d < rank; ++d) number += cell[d] * grid.strides[d];
    out->push_back(static_cast<uint32_t>(number));
    size_t d = rank;
    while (d-- > 0) {  // the next cell, the last dimension fastest
      if (++cell[d] < last[d]) break;
      cell[d] = first[d];
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

int64_t GridEvenStep(const std::vector<int64_t>& bounds) {
  if (bounds.size() < 4) return 0;
  const size_t n = bounds.size() - 1;
  const int64_t step = bounds[1];
  for (size_t k = 2; k < n; ++k) {
    if (bounds[k] - bounds[k - 1] != step) return 0;
  }
  return bounds[n] - bounds[n - 1] <= step ? step : 0;
}

Box GridCellBox(const ChunkGrid& grid, uint64_t index) {
  const size_t rank = grid.bounds.size();
  Box box;
  box.offsets.resize(rank);
  box.sizes.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    const uint64_t k = index / grid.strides[d];
    index %= grid.strides[d];
    box.offsets[d] = grid.bounds[d][k];
    box.sizes[d] = grid.bounds[d][k + 1] - grid.bounds[d][k];
  }
  return box;
}

GridCellWalk::GridCellWalk(const ChunkGrid& grid) : grid_(grid), at_(grid.bounds.size(), 0) {
  const size_t rank = grid.bounds.size();
  box_.offsets.resize(rank);
  box_.sizes.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    box_.offsets[d] = grid.bounds[d][0];
    box_.sizes[d] = grid.bounds[d][1] - grid.bounds[d][0];
  }
}

void GridCellWalk::Next() {
  for (size_t d = at_.size(); d-- > 0;) {
    const std::vector<int64_t>& bounds = grid_.bounds[d];
    if (++at_[d] + 1 < bounds.size()) {
      box_.offsets[d] = bounds[at_[d]];
      box_.sizes[d] = bounds[at_[d] + 1] - bounds[at_[d]];
      return;
    }
    at_[d] = 0;
    box_.offsets[d] = bounds[0];
    box_.sizes[d] = bounds[1] - bounds[0];
  }
}

void GridCellByteLengths(const ChunkGrid& grid, uint64_t element_bytes,
                         std::vector<uint64_t>* out) {
  const size_t rank = grid.bounds.size();
  out->resize(grid.cell_count());
  if (out->empty()) return;
  // An odometer over the cells, the last dimension fastest, with the volume of every prefix of
  // the dimensions: a step recomputes the products from the dimension that moved.
  std::vector<size_t> k(rank, 0);
  std::vector<uint64_t> prefix(rank + 1, element_bytes);
  const auto length = [&](size_t d) {
    return static_cast<uint64_t>(grid.bounds[d][k[d] + 1] - grid.bounds[d][k[d]]);
  };
  for (size_t d = 0; d < rank; ++d) prefix[d + 1] = prefix[d] * length(d);
  for (uint64_t& bytes : *out) {
    bytes = prefix[rank];
    size_t d = rank;
    while (d-- > 0) {
      if (++k[d] + 1 < grid.bounds[d].size()) break;
      k[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) break;
    for (size_t e = d; e < rank; ++e) prefix[e + 1] = prefix[e] * length(e);
  }
}

namespace {

// The box of chunk `c` of a tensor held as listed cells (no grid) of rank `rank`.
Box ListedCellBox(const ChunkCells& cells, size_t rank, size_t c) {
  const int64_t* values = cells.boxes.data() + c * 2 * rank;
  Box box;
  box.offsets.assign(values, values + rank);
  box.sizes.assign(values + rank, values + 2 * rank);
  return box;
}

}  // namespace

void ChunkByteLengths(const TensorMetadata& tensor, std::vector<uint64_t>* out) {
  const uint64_t element_bytes = DTypeSize(tensor.dtype);
  if (tensor.cells && tensor.grid) {
    GridCellByteLengths(*tensor.grid, element_bytes, out);
  } else if (tensor.cells) {
    const size_t rank = tensor.shape.size();
    out->resize(tensor.cells->files.size());
    for (size_t c = 0; c < out->size(); ++c) {
      const int64_t* sizes = tensor.cells->boxes.data() + c * 2 * rank + rank;
      uint64_t bytes = element_bytes;
      for (size_t d = 0; d < rank; ++d) bytes *= static_cast<uint64_t>(sizes[d]);
      (*out)[c] = bytes;
    }
  } else {
    out->resize(tensor.chunks.size());
    for (size_t c = 0; c < tensor.chunks.size(); ++c) (*out)[c] = tensor.chunks[c].byte_length;
  }
}

Box ChunkBox(const TensorMetadata& tensor, size_t c) {
  if (!tensor.cells) return tensor.chunks[c].box;
  return tensor.grid ? GridCellBox(*tensor.grid, c)
                     : ListedCellBox(*tensor.cells, tensor.shape.size(), c);
}

namespace {

// The chunks `packed` describes, in cell order.
std::vector<StoredChunk> UnpackChunks(const PackedChunks& packed) {
  const uint64_t cells = packed.cell_count;
  std::vector<StoredChunk> chunks;
  chunks.reserve(cells);
  if (packed.listed) {
    for (uint64_t c = 0; c < cells; ++c) {
      Box box = packed.box_of(c);
      const uint64_t byte_length = static_cast<uint64_t>(box.volume()) * packed.element_bytes;
      chunks.emplace_back(std::move(box), packed.files[c], packed.data_offsets[c], byte_length,
                          InlineVector<uint32_t, 2>(packed.checksums.of(c)));
    }
    return chunks;
  }
  GridCellWalk walk(packed.grid);
  for (const CellRun& run : packed.runs) {
    uint32_t file = run.file;
    uint64_t data_offset = run.data_offset;
    for (uint64_t c = run.first; c < run.first + run.count; ++c, walk.Next()) {
      chunks.emplace_back(walk.box(), file, data_offset,
                          static_cast<uint64_t>(walk.box().volume()) * packed.element_bytes,
                          InlineVector<uint32_t, 2>(packed.checksums.of(c)));
      file = static_cast<uint32_t>(file + run.file_step);
      data_offset += run.offset_step;
    }
  }
  return chunks;
}

}  // namespace

Box PackedChunks::box_of(uint64_t c) const {
  if (!listed) return GridCellBox(grid, c);
  Box box;
  box.offsets.assign(offsets_of(c), offsets_of(c) + rank);
  box.sizes.assign(sizes_of(c), sizes_of(c) + rank);
  return box;
}

const std::vector<StoredChunk>& ChunkList::Unpacked() const {
  PackedChunks& packed = *packed_;
  std::call_once(packed.unpacked_once, [&] {
    packed.unpacked = UnpackChunks(packed);
    packed.made.store(true, std::memory_order_release);
  });
  return packed.unpacked;
}


void ChunkList::TakeUnpacked() {
  // The only holder of the packed form moves the chunks out; a holder among several copies them.
  if (packed_.use_count() == 1) {
    Unpacked();
    list_ = std::move(packed_->unpacked);
  } else {
    list_ = Unpacked();
  }
  packed_.reset();
}

void ExpandChunkCells(TensorMetadata* tensor) {
  if (!tensor->cells) return;
  const ChunkCells& cells = *tensor->cells;
  std::vector<uint64_t> lengths;
  ChunkByteLengths(*tensor, &lengths);
  std::vector<StoredChunk> chunks;
  chunks.reserve(lengths.size());
  for (size_t c = 0; c < lengths.size(); ++c) {
    chunks.emplace_back(ChunkBox(*tensor, c), cells.files[c], cells.data_offsets[c], lengths[c]);
  }
  tensor->chunks = std::move(chunks);
  tensor->cells.reset();
}

bool CompactChunkCells(TensorMetadata* tensor) {
  if (tensor->cells || tensor->kept) return false;
  // Packed chunks are raw, of the shape's rank: their placements and listed boxes are taken as
  // they are.
  if (const PackedChunks* packed = tensor->chunks.packed_chunks();
      packed != nullptr && (tensor->grid || packed->listed)) {
    ChunkCells cells;
    if (packed->listed) {
      cells.files = packed->files;
      cells.data_offsets = packed->data_offsets;
    } else {
      cells.files.resize(packed->cell_count);
      cells.data_offsets.resize(packed->cell_count);
      for (const CellRun& run : packed->runs) {
        for (uint64_t c = run.first; c < run.first + run.count; ++c) {
          cells.files[c] = run.file_of(c);
          cells.data_offsets[c] = run.data_offset_of(c);
        }
      }
    }
    if (!tensor->grid) cells.boxes = packed->boxes;
    tensor->chunks = ChunkList();
    tensor->cells = std::move(cells);
    return true;
  }
  for (const StoredChunk& chunk : tensor->chunks) {
    if (chunk.encoding != ChunkEncoding::kRaw) return false;
  }
  const size_t rank = tensor->shape.size();
  for (const StoredChunk& chunk : tensor->chunks) {
    if (chunk.box.offsets.size() != rank || chunk.box.sizes.size() != rank) return false;
  }
  ChunkCells cells;
  cells.files.resize(tensor->chunks.size());
  cells.data_offsets.resize(tensor->chunks.size());
  if (!tensor->grid) cells.boxes.reserve(tensor->chunks.size() * 2 * rank);
  for (size_t c = 0; c < tensor->chunks.size(); ++c) {
    const StoredChunk& chunk = tensor->chunks[c];
    cells.files[c] = chunk.file;
    cells.data_offsets[c] = chunk.data_offset;
    if (!tensor->grid) {
      cells.boxes.insert(cells.boxes.end(), chunk.box.offsets.begin(), chunk.box.offsets.end());
      cells.boxes.insert(cells.boxes.end(), chunk.box.sizes.begin(), chunk.box.sizes.end());
    }
  }
  tensor->chunks = ChunkList();
  tensor->cells = std::move(cells);
  return true;
}

namespace {

// A chunk's box as values in place: of a StoredChunk, or of a packed list (PackedChunks::boxes).
struct BoxValues {
  const int64_t* offsets;
  const int64_t* sizes;
  size_t offsets_rank;
  size_t sizes_rank;
};

// Calls `fn` with a function that gives chunk c's BoxValues: read from the packed boxes of a list
// that a decoder kept packed, else from the StoredChunks (unpacked on first use).
template <typename Fn>
auto WithChunkBoxes(const ChunkList& chunks, Fn&& fn) {
  if (const PackedChunks* packed = chunks.packed_chunks(); packed != nullptr && packed->listed) {
    return fn([packed](size_t c) {
      return BoxValues{packed->offsets_of(c), packed->sizes_of(c), packed->rank, packed->rank};
    });
  }
  const std::vector<StoredChunk>& list = chunks.vec();
  return fn([&list](size_t c) {
    const Box& box = list[c].box;
    return BoxValues{box.offsets.data(), box.sizes.data(), box.offsets.size(), box.sizes.size()};
  });
}

}  // namespace

std::optional<ChunkIndex> BuildChunkIndex(const ChunkList& chunks, const Shape& shape) {
  const size_t rank = shape.size();
  if (rank == 0 || chunks.size() > std::numeric_limits<uint32_t>::max()) return std::nullopt;
  return WithChunkBoxes(chunks, [&](auto box_at) -> std::optional<ChunkIndex> {
    // Offsets and sizes in [0, 2^62] (what every reader accepts), so no sum below can wrap;
    // emptiness by a zero size, not by a volume that could.
    constexpr int64_t kMax = int64_t{1} << 62;
    auto empty = [rank](const BoxValues& box) {
      return std::find(box.sizes, box.sizes + rank, 0) != box.sizes + rank;
    };
    std::vector<int64_t> longest(rank, 0);
    for (size_t c = 0; c < chunks.size(); ++c) {
      const BoxValues box = box_at(c);
      if (box.offsets_rank != rank || box.sizes_rank != rank) return std::nullopt;
      for (size_t d = 0; d < rank; ++d) {
        if (box.offsets[d] < 0 || box.offsets[d] > kMax || box.sizes[d] < 0 ||
            box.sizes[d] > kMax) {
          return std::nullopt;
        }
      }
      if (empty(box)) continue;
      for (size_t d = 0; d < rank; ++d) longest[d] = std::max(longest[d], box.sizes[d]);
    }
    // The dimension in which chunks are shortest relative to the shape: longest[d] / shape[d]
    // smallest (compared by cross-multiplying in long double: the values reach 2^62).
    size_t dim = 0;
    for (size_t d = 1; d < rank; ++d) {
      if (static_cast<long double>(longest[d]) * shape[dim] <
          static_cast<long double>(longest[dim]) * shape[d]) {
        dim = d;
      }
    }
    ChunkIndex index;
    index.dim = static_cast<uint32_t>(dim);
    index.max_extent = longest[dim];
    index.chunk_count = chunks.size();
    // (start, chunk) pairs sorted: by start, chunks of one start in their order.
    std::vector<std::pair<int64_t, uint32_t>> order;
    order.reserve(chunks.size());
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      const BoxValues box = box_at(c);
      if (!empty(box)) order.emplace_back(box.offsets[dim], c);
    }
    // A save plan lists chunks by box, so along the first dimension they are most often in
    // order already.
    if (!std::is_sorted(order.begin(), order.end())) std::sort(order.begin(), order.end());
    index.starts.reserve(order.size());
    index.chunks.reserve(order.size());
    for (const auto& [start, c] : order) {
      index.starts.push_back(start);
      index.chunks.push_back(c);
    }
    return index;
  });
}

bool IndexedChunksIntersecting(const ChunkIndex& index, const ChunkList& chunks, const Box& box,
                               std::vector<uint32_t>* out) {
  if (index.chunk_count != chunks.size() || index.starts.size() != index.chunks.size()) {
    return false;
  }
  const size_t rank = box.rank();
  if (index.dim >= rank || box.empty()) return true;
  return WithChunkBoxes(chunks, [&](auto box_at) {
    const size_t first_out = out->size();
    const int64_t begin = box.offsets[index.dim], end = box.exclusive_max(index.dim);
    // Chunks starting in (begin - max_extent, end) are the only ones that can reach the box.
    const int64_t from = begin - index.max_extent;  // offsets and extents are at most 2^62
    auto it = std::upper_bound(index.starts.begin(), index.starts.end(), from);
    for (size_t i = static_cast<size_t>(it - index.starts.begin());
         i < index.starts.size() && index.starts[i] < end; ++i) {
      const uint32_t c = index.chunks[i];
      if (c >= chunks.size()) {
        out->resize(first_out);
        return false;
      }
      const BoxValues chunk = box_at(c);
      if (chunk.offsets_rank != rank || chunk.sizes_rank != rank ||
          chunk.offsets[index.dim] != index.starts[i] ||
          chunk.sizes[index.dim] > index.max_extent) {
        out->resize(first_out);
        return false;
      }
      bool overlaps = true;
      for (size_t d = 0; d < rank && overlaps; ++d) {
        overlaps = chunk.sizes[d] > 0 && chunk.offsets[d] < box.offsets[d] + box.sizes[d] &&
                   box.offsets[d] < chunk.offsets[d] + chunk.sizes[d];
      }
      if (overlaps) out->push_back(c);
    }
    std::sort(out->begin() + static_cast<std::ptrdiff_t>(first_out), out->end());
    return true;
  });
}

void AppendChunksReached(const TensorMetadata& tensor, std::span<const Box> boxes,
                         std::vector<uint32_t>* out) {
  const size_t first = out->size();
  bool found = true;
  for (const Box& box : boxes) {
    if (!FilterBoxReaches(box, tensor.shape)) continue;
    if (tensor.grid) {
      GridChunksIntersecting(*tensor.grid, box, out);
    } else if (!tensor.index ||
               !IndexedChunksIntersecting(*tensor.index, tensor.chunks, box, out)) {
      found = false;
      break;
    }
  }
  if (!found) {  // no search: every chunk is looked at once
    out->resize(first);
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      if (FilterKeeps(boxes, tensor.shape, tensor.chunks[c].box)) {
        out->push_back(static_cast<uint32_t>(c));
      }
    }
    return;
  }
  const auto begin = out->begin() + static_cast<std::ptrdiff_t>(first);
  // One box (a rank's usual request) gives its chunks once each, ascending already.
  if (!std::is_sorted(begin, out->end())) std::sort(begin, out->end());
  out->erase(std::unique(begin, out->end()), out->end());
}

std::vector<uint32_t> ChunksReached(const TensorMetadata& tensor, std::span<const Box> boxes) {
  std::vector<uint32_t> out;
  AppendChunksReached(tensor, boxes, &out);
  return out;
}

void IndexChunkGrids(CheckpointMetadata* metadata, ThreadPool* pool) {
  std::vector<TensorMetadata>& tensors = metadata->tensors;
  (void)ParallelFor(pool, static_cast<int64_t>(tensors.size()), [&](int64_t t) {
    TensorMetadata& tensor = tensors[t];
    if (tensor.grid || tensor.index || tensor.kept) return OkStatus();  // kept: a part
    tensor.grid = FindChunkGrid(tensor.chunks, tensor.shape);
    if (!tensor.grid) tensor.index = BuildChunkIndex(tensor.chunks, tensor.shape);
    return OkStatus();
  });
}

}  // namespace sp

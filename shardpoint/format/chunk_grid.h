// Chunk grids: the stored chunks of a tensor that form a regular grid, found by arithmetic.
//
// Most tensors of a training job are cut by a rule: rows over FSDP ranks, columns over TP ranks,
// both, or not at all. After deduplication their stored chunks are the cells of a grid: per
// dimension, the shape is cut into consecutive intervals, and every combination of intervals is
// one chunk. A save plan lists the chunks sorted by box, which for a grid is row-major order:
// chunk i is the cell whose per-dimension interval numbers are the digits of i in the mixed radix
// of the interval counts (the last dimension fastest).
//
// FindChunkGrid recognizes such a list in one pass over the chunks (O(chunks x rank), no sort)
// and, when it is one, proves what the sweeps of plan/box_set.h prove at O(chunks log chunks):
// every chunk is a box within the shape, no two overlap and together they cover it. A load then
// finds the chunks that intersect a destination box by a binary search per dimension
// (GridChunksIntersecting): its cost is that of its own reads, not of the tensor's chunk count.
// Lists in another order, or not of this form (flat ranges of uneven length per row, chunks of
// other rules), are not grids. For them BuildChunkIndex sorts the chunks by their offset along
// one dimension once, and IndexedChunksIntersecting finds those under a box by a binary search;
// the load planner sweeps only those (plan/box_set.h).
//
// Both are kept with the metadata (TensorMetadata::grid and ::index): the save plan keeps the
// grid it proved, the native format stores grids (docs/FORMAT.md §3.5), and IndexChunkGrids
// indexes what is opened or received, so each is built once per process, not once per plan.
//
// Pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_CHUNK_GRID_H_
#define SHARDPOINT_FORMAT_CHUNK_GRID_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// The grid of `chunks` over `shape` when they are one in row-major order (see above), else
// nullopt (ChunkGrid is declared in format/metadata.h, where TensorMetadata keeps one). A rank-0 shape is a grid of its one chunk of rank 0. No chunk at all (a shape with
// a zero dimension) is not a grid.
std::optional<ChunkGrid> FindChunkGrid(std::span<const StoredChunk> chunks, const Shape& shape);

// Appends to `out` the number of every chunk of `grid` that shares a point with `box`, in
// increasing order. `box` must be of the grid's rank and within its shape; an empty box
// intersects nothing.
void GridChunksIntersecting(const ChunkGrid& grid, const Box& box, std::vector<uint32_t>* out);

// Whether `chunks` are exactly the cells of `grid` in its order (what FindChunkGrid proves), for
// a grid carried beside chunks that may have changed since.
bool GridMatches(const ChunkGrid& grid, std::span<const StoredChunk> chunks);

// The step of one dimension's cut points `bounds` (0 first, increasing) when there are three
// intervals or more and all are `step` long but the last, which is at most that (an even split,
// or torch.chunk's); else 0. Encoders store such cuts as the step.
int64_t GridEvenStep(const std::vector<int64_t>& bounds);

// The box of chunk number `index` of `grid` (index < the grid's cell count).
Box GridCellBox(const ChunkGrid& grid, uint64_t index);

// The boxes of `grid`'s cells in chunk order (the last dimension fastest), each the one before it
// with its last dimensions stepped, as an odometer steps, instead of divided out of the cell's
// number (GridCellBox). `grid` must outlive it.
class GridCellWalk {
 public:
  explicit GridCellWalk(const ChunkGrid& grid);
  const Box& box() const { return box_; }
  // On to the next cell (after the last, back to the first).
  void Next();

 private:
  const ChunkGrid& grid_;
  std::vector<uint32_t> at_;  // per dimension, the interval of the current cell
  Box box_;
};

// The byte length of every cell of `grid` of a tensor whose elements take `element_bytes`, in
// cell order, into `out` (its size the cell count).
void GridCellByteLengths(const ChunkGrid& grid, uint64_t element_bytes, std::vector<uint64_t>* out);

// The byte length of every stored chunk of `tensor`, in order, into `out`: its chunks', or its
// cells' (TensorMetadata::cells).
void ChunkByteLengths(const TensorMetadata& tensor, std::vector<uint64_t>* out);

// The box of stored chunk `c` of `tensor`, a chunk or a cell.
Box ChunkBox(const TensorMetadata& tensor, size_t c);

// Gives a tensor held as cells (TensorMetadata::cells) its chunks, each raw with no checksums,
// and resets `cells`; a grid stays. Does nothing to another tensor.
void ExpandChunkCells(TensorMetadata* tensor);

// Holds a tensor whose chunks are all raw as cells: their files and offsets kept, and their boxes
// listed unless the tensor has a grid (TensorMetadata::grid, which gives them); their checksums
// dropped. Returns whether it did (not for a tensor with a chunk of another encoding, a part
// (TensorMetadata::kept), or one held so already).
bool CompactChunkCells(TensorMetadata* tensor);

// An index over `chunks` (of a tensor of `shape`) along the dimension in which they are shortest
// relative to the shape, or nullopt for a rank-0 shape or a chunk whose box does not have its
// rank. O(chunks log chunks). A list the decoder kept packed is read packed (ChunkList::box).
std::optional<ChunkIndex> BuildChunkIndex(const ChunkList& chunks, const Shape& shape);

// Appends to `out` the number of every chunk of `index` that shares a point with `box` (of the
// index's rank), in increasing order. Cost: a binary search, then the chunks whose offset along
// the index's dimension lies within its longest extent before the box's end. False, with `out`
// as it was, when the index does not describe `chunks` (another chunk count, or a chunk whose
// offset is not the one indexed): the caller then looks at every chunk. A list the decoder kept
// packed is read packed.
bool IndexedChunksIntersecting(const ChunkIndex& index, const ChunkList& chunks, const Box& box,
                               std::vector<uint32_t>* out);

// The stored numbers of the chunks of `tensor` that a ChunkFilter's `boxes` keep (FilterKeeps),
// ascending: found through the tensor's grid or index when it has one (O(its own chunks) per box),
// else by looking at every chunk. `tensor` holds every chunk (no TensorMetadata::kept); with a
// grid, its chunks are not looked at (a decoder asks before it builds them). What the coordinator
// of a load sends a rank of its part of the metadata (EncodeMetadataPartForWire).
std::vector<uint32_t> ChunksReached(const TensorMetadata& tensor, std::span<const Box> boxes);
// The same, appended to `out` (what it held stays).
void AppendChunksReached(const TensorMetadata& tensor, std::span<const Box> boxes,
                         std::vector<uint32_t>* out);

// Indexes every tensor of `metadata` that has neither a grid nor an index yet and holds all its
// chunks (a part, TensorMetadata::kept, is swept: it holds a rank's few): its grid when its
// chunks form one, else a ChunkIndex. Called where metadata is opened or received (formats whose
// files store no grid, chunk lists, the load broadcast), tensor by tensor on `pool` (null: on the
// calling thread).
void IndexChunkGrids(CheckpointMetadata* metadata, ThreadPool* pool = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_CHUNK_GRID_H_

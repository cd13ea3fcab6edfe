#include "shardpoint/engine/write_reports.h"

#include <atomic>
#include <memory>

#include "shardpoint/engine/save_messages.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {

Status CollectReports(const std::vector<std::string>& reports,
                      const std::vector<TensorMetadata>& tensors, CheckpointMetadata* metadata,
                      ChunkChecksums* checksums, ThreadPool* pool) {
  const uint64_t block_bytes = metadata->checksum_block_bytes;
  if (checksums != nullptr) {
    SP_ASSIGN_OR_RETURN(*checksums, LayOutChunkChecksums(tensors, block_bytes, pool));
  }
  // Which chunks and files are reported: chunk c of tensor t at first_chunk[t] + c. A chunk is
  // claimed by the first report that names it, so that two ranks naming it never write its
  // checksums at once; a file is taken only from its writer's report, so by one thread.
  std::vector<uint64_t> first_chunk(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].cells && checksums == nullptr) {  // no chunks to fill in
      return InternalError("tensor '" + tensors[t].name +
                           "' is held as cells: its checksums must be kept apart");
    }
    first_chunk[t + 1] = first_chunk[t] + ChunkCount(tensors[t]);
  }
  const std::unique_ptr<std::atomic<uint8_t>[]> chunk_reported(
      new std::atomic<uint8_t>[first_chunk.back()]());
  std::vector<uint8_t> file_reported(metadata->files.size(), 0);

  const auto collect = [&](int64_t r) -> Status {
    const std::string rank = "rank " + std::to_string(r);
    Status scanned = ScanWriteReport(
        reports[r],
        [&](const ChunkReportView& c) -> Status {
          if (c.tensor >= tensors.size() || c.chunk >= ChunkCount(tensors[c.tensor])) {
            return InternalError(rank + " reported an unknown chunk (tensor " +
                                 std::to_string(c.tensor) + ", chunk " + std::to_string(c.chunk) +
                                 ")");
          }
          const TensorMetadata& tensor = tensors[c.tensor];
          // The count expected, from the table where there is one: the chunks themselves (128
          // bytes each, 600 MiB at 8,192 ranks x 1,000 tensors) are read here in the ranks'
          // order, not theirs, and a read of each was most of this walk's time.
          ChunkChecksums::Tensor* table =
              checksums != nullptr ? &checksums->tensors[c.tensor] : nullptr;
          const uint64_t expected =
              table != nullptr
                  ? table->start(c.chunk + 1) - table->start(c.chunk)
                  : ChecksumBlockCount(tensor.chunks[c.chunk].byte_length, block_bytes);
          if (c.crc_count != expected) {
            return InternalError(rank + " reported " + std::to_string(c.crc_count) +
                                 " block checksums of tensor '" + tensor.name + "' chunk " +
                                 ChunkBox(tensor, c.chunk).ToString() + ", expected " +
                                 std::to_string(expected));
          }
          if (chunk_reported[first_chunk[c.tensor] + c.chunk].exchange(
                  1, std::memory_order_relaxed) != 0) {
            return InternalError(rank + " reported tensor '" + tensor.name + "' chunk " +
                                 ChunkBox(tensor, c.chunk).ToString() +
                                 ", which another rank reported too");
          }
          if (table != nullptr) {
            c.CopyCrcs(table->crcs.data() + table->start(c.chunk));
          } else {
            InlineVector<uint32_t, 2>& crcs =
                metadata->tensors[c.tensor].chunks[c.chunk].block_crc32c;
            crcs.resize(c.crc_count);
            c.CopyCrcs(crcs.data());
          }
          return OkStatus();
        },
        [&](const FileReport& f) -> Status {
          if (f.index >= metadata->files.size()) {
            return InternalError(rank + " reported an unknown file (" + std::to_string(f.index) +
                                 " of " + std::to_string(metadata->files.size()) + ")");
          }
          DataFile& file = metadata->files[f.index];
          // Whether the file was reported before is asked only of its writer's task, the one
          // that marks it.
          const bool own = file.writer_rank == static_cast<int32_t>(r);
          const bool twice = own && file_reported[f.index] != 0;
          if (!own || twice || f.data_start > f.size) {
            return InternalError(rank + " reported file " + file.name + " of rank " +
                                 std::to_string(file.writer_rank) + " (data from " +
                                 std::to_string(f.data_start) + " of " + std::to_string(f.size) +
                                 " bytes)" + (twice ? " twice" : ""));
          }
          file_reported[f.index] = 1;
          file.data_start = f.data_start;
          file.size = f.size;
          file.header_crc32c = f.header_crc32c;
          return OkStatus();
        });
    if (scanned.code() == StatusCode::kDataLoss) {  // the bytes; the checks above are kInternal
      return DataLossError(rank + "'s " + scanned.message());
    }
    return scanned;
  };
  const int64_t ranks = static_cast<int64_t>(reports.size());
  if (pool != nullptr) {
    SP_RETURN_IF_ERROR(ParallelForInOrder(pool, ranks, collect));
  } else {
    for (int64_t r = 0; r < ranks; ++r) SP_RETURN_IF_ERROR(collect(r));
  }

  for (size_t f = 0; f < file_reported.size(); ++f) {
    if (file_reported[f] == 0) {
      return InternalError("no rank reported writing file " + metadata->files[f].name);
    }
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (size_t c = 0; c < ChunkCount(tensors[t]); ++c) {
      if (chunk_reported[first_chunk[t] + c].load(std::memory_order_relaxed) == 0) {
        return InternalError("no rank reported writing tensor '" + tensors[t].name + "' chunk " +
                             ChunkBox(tensors[t], c).ToString());
      }
    }
  }
  return OkStatus();
}

}  // namespace sp

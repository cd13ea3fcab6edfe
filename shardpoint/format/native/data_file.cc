// Native data files: names, chunk entry keys and the safetensors header (docs/FORMAT.md §1-2).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/safetensors/safetensors.h"

namespace sp {

std::string ChunkEntryName(std::string_view tensor, const Box& box) {
  std::string out(tensor);
  out.push_back('@');
  for (size_t i = 0; i < box.offsets.size(); ++i) {
    if (i > 0) out.push_back(',');
    out.append(std::to_string(box.offsets[i]));
  }
  return out;
}

std::string DataFileName(std::string_view save_id, int rank, int file_in_rank) {
  char suffix[64];
  std::snprintf(suffix, sizeof(suffix), "-r%05d-f%03d.safetensors", rank, file_in_rank);
  return "d-" + std::string(save_id) + suffix;
}

namespace {

// A file's chunks, in the metadata's order.
using FileChunk = std::pair<const TensorMetadata*, const StoredChunk*>;

std::string HeaderOf(const CheckpointMetadata& metadata, const std::vector<FileChunk>& chunks) {
  std::vector<DataFileChunk> entries;
  entries.reserve(chunks.size());
  for (const auto& [tensor, chunk] : chunks) {
    entries.push_back(
        DataFileChunk{tensor->name, tensor->dtype, &chunk->box, chunk->data_offset,
                      chunk->byte_length});
  }
  return BuildDataFileHeader(metadata.save_id, std::move(entries));
}

}  // namespace

std::string BuildDataFileHeader(std::string_view save_id, std::vector<DataFileChunk> chunks) {
  // Listed by data offset; ties (empty chunks) keep the metadata's order.
  auto by_offset = [](const DataFileChunk& x, const DataFileChunk& y) {
    if (x.data_offset != y.data_offset) return x.data_offset < y.data_offset;
    return x.data_offset + x.byte_length < y.data_offset + y.byte_length;
  };
  std::stable_sort(chunks.begin(), chunks.end(), by_offset);
  SafetensorsHeaderBuilder builder({
      {"format", "shardpoint"},
      {"format_version",
       std::to_string(kNativeFormatMajor) + "." + std::to_string(kNativeFormatMinor)},
      {"save_id", std::string(save_id)},
  });
  std::string name;  // reused: ChunkEntryName without an allocation per entry
  for (const DataFileChunk& chunk : chunks) {
    name.assign(chunk.tensor);
    name.push_back('@');
    for (size_t i = 0; i < chunk.box->offsets.size(); ++i) {
      if (i > 0) name.push_back(',');
      char digits[24];
      const int64_t offset = chunk.box->offsets[i];
      name.append(digits, std::to_chars(digits, digits + sizeof(digits), offset).ptr);
    }
    builder.Add(name, chunk.dtype, chunk.box->sizes, chunk.data_offset,
                chunk.data_offset + chunk.byte_length);
  }
  return std::move(builder).Finish(kDataAlignmentBytes);
}

std::string BuildDataFileHeader(const CheckpointMetadata& metadata, uint32_t file_index) {
  std::vector<FileChunk> chunks;
  for (const TensorMetadata& tensor : metadata.tensors) {
    for (const StoredChunk& chunk : tensor.chunks) {
      if (chunk.file == file_index) chunks.emplace_back(&tensor, &chunk);
    }
  }
  return HeaderOf(metadata, chunks);
}

std::vector<std::string> BuildDataFileHeaders(const CheckpointMetadata& metadata) {
  std::vector<std::vector<FileChunk>> chunks(metadata.files.size());
  for (const TensorMetadata& tensor : metadata.tensors) {
    for (const StoredChunk& chunk : tensor.chunks) {
      // A chunk naming no file of the list belongs to no header (the writer refuses such plans).
      if (chunk.file < chunks.size()) chunks[chunk.file].emplace_back(&tensor, &chunk);
    }
  }
  std::vector<std::string> headers(metadata.files.size());
  auto build = [&](int64_t f) {
    headers[f] = HeaderOf(metadata, chunks[f]);
    return OkStatus();
  };
  // Each header depends only on its own file's chunks. A save of thousands of ranks has
  // thousands of files and millions of entries (2 s on one core at 8,192 ranks x 1,000 tensors),
  // so many files are built on several threads.
  constexpr size_t kFilesPerThread = 16;
  const int threads = static_cast<int>(std::min<size_t>(
      {headers.size() / kFilesPerThread, std::max(1u, std::thread::hardware_concurrency()), 16}));
  std::optional<ThreadPool> pool;
  if (threads > 1) pool.emplace(threads);
  (void)ParallelFor(pool ? &*pool : nullptr, static_cast<int64_t>(headers.size()), build);
  return headers;
}

}  // namespace sp

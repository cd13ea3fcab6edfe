// Native data files: names, chunk entry keys and the safetensors header (docs/FORMAT.md §1-2).
#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

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

std::string HeaderOf(const CheckpointMetadata& metadata, std::vector<SafetensorsEntry> entries) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  std::map<std::string, std::string> header_metadata = {
      {"format", "shardpoint"},
      {"format_version",
       std::to_string(kNativeFormatMajor) + "." + std::to_string(kNativeFormatMinor)},
      {"save_id", metadata.save_id},
  };
  return EncodeSafetensorsHeader(entries, header_metadata);
}

SafetensorsEntry EntryOf(const TensorMetadata& tensor, const StoredChunk& chunk) {
  return {ChunkEntryName(tensor.name, chunk.box), tensor.dtype, chunk.box.sizes, chunk.data_offset,
          chunk.data_offset + chunk.byte_length};
}

}  // namespace

std::string BuildDataFileHeader(const CheckpointMetadata& metadata, uint32_t file_index) {
  std::vector<SafetensorsEntry> entries;
  for (const TensorMetadata& tensor : metadata.tensors) {
    for (const StoredChunk& chunk : tensor.chunks) {
      if (chunk.file == file_index) entries.push_back(EntryOf(tensor, chunk));
    }
  }
  return HeaderOf(metadata, std::move(entries));
}

std::vector<std::string> BuildDataFileHeaders(const CheckpointMetadata& metadata) {
  std::vector<std::vector<SafetensorsEntry>> entries(metadata.files.size());
  for (const TensorMetadata& tensor : metadata.tensors) {
    for (const StoredChunk& chunk : tensor.chunks) {
      // A chunk naming no file of the list belongs to no header (the writer refuses such plans).
      if (chunk.file < entries.size()) entries[chunk.file].push_back(EntryOf(tensor, chunk));
    }
  }
  std::vector<std::string> headers(metadata.files.size());
  for (size_t f = 0; f < headers.size(); ++f) headers[f] = HeaderOf(metadata, std::move(entries[f]));
  return headers;
}

}  // namespace sp

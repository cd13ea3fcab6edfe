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
  return BuildDataFileHeader(metadata.save_id, std::move(entries),
                             metadata.data_file_checksums ? metadata.checksum_block_bytes : 0);
}

constexpr char kChecksumsKey[] = "crc32c";
// Where the checksums' room starts in a header: its "__metadata__" is the JSON object's first
// member, and "crc32c" the first of its keys (they are sorted; a save id needs no escapes).
constexpr std::string_view kChecksumsToken = "{\"__metadata__\":{\"crc32c\":\"";

char HexDigit(uint32_t v) { return "0123456789abcdef"[v & 15]; }

}  // namespace

std::string BuildDataFileHeader(std::string_view save_id, std::vector<DataFileChunk> chunks,
                                uint64_t checksum_block_bytes) {
  // Listed by data offset; ties (empty chunks) keep the metadata's order.
  auto by_offset = [](const DataFileChunk& x, const DataFileChunk& y) {
    if (x.data_offset != y.data_offset) return x.data_offset < y.data_offset;
    return x.data_offset + x.byte_length < y.data_offset + y.byte_length;
  };
  std::stable_sort(chunks.begin(), chunks.end(), by_offset);
  // Files of version 3.1 and later keep room for their checksums: 8 hex digits a block. (The
  // headers of 3.1 and 4 are alike; a header without checksums is that of version 3.0.)
  std::map<std::string, std::string> pairs = {
      {"format", "shardpoint"},
      {"format_version", checksum_block_bytes > 0 ? std::to_string(kNativeFormatMajor) + "." +
                                                        std::to_string(kNativeFormatMinor)
                                                  : std::string("3.0")},
      {"save_id", std::string(save_id)},
  };
  if (checksum_block_bytes > 0) {
    uint64_t blocks = 0;
    for (const DataFileChunk& chunk : chunks) {
      blocks += ChecksumBlockCount(chunk.byte_length, checksum_block_bytes);
    }
    pairs.emplace(kChecksumsKey, std::string(8 * blocks, '0'));
  }
  SafetensorsHeaderBuilder builder(pairs);
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

Status FillDataFileChecksums(std::string* header, std::span<const uint32_t> crcs) {
  // After the header's 8-byte length, or nowhere.
  const bool room = header->compare(8, kChecksumsToken.size(), kChecksumsToken) == 0;
  const size_t begin = 8 + kChecksumsToken.size();
  const size_t end = room ? header->find('"', begin) : std::string::npos;
  if (end == std::string::npos || end - begin != 8 * crcs.size()) {
    return InternalError("a data file header keeps no room for its " +
                         std::to_string(crcs.size()) + " block checksums");
  }
  char* out = header->data() + begin;
  for (uint32_t crc : crcs) {
    for (int shift = 28; shift >= 0; shift -= 4) *out++ = HexDigit(crc >> shift);
  }
  return OkStatus();
}

Result<DataFileChecksums> ReadDataFileChecksums(const SafetensorsHeader& header,
                                                uint64_t checksum_block_bytes,
                                                std::string_view path) {
  const auto found = header.metadata.find(kChecksumsKey);
  if (found == header.metadata.end()) {
    return DataLossError("data file " + std::string(path) +
                         ": its header holds no block checksums (\"crc32c\" in __metadata__)");
  }
  const std::string& hex = found->second;
  DataFileChecksums out;
  out.entry_begin.reserve(header.entries.size());
  out.entry_first.reserve(header.entries.size() + 1);
  // Counted up to 2^60, whatever the entries claim: no sum or product below wraps.
  constexpr uint64_t kMost = uint64_t{1} << 60;
  uint64_t blocks = 0;
  for (const SafetensorsEntry& entry : header.entries) {
    out.entry_begin.push_back(entry.begin);
    out.entry_first.push_back(blocks);
    blocks = std::min(
        kMost, blocks + std::min(kMost, ChecksumBlockCount(entry.end - entry.begin,
                                                           checksum_block_bytes)));
  }
  out.entry_first.push_back(blocks);
  if (hex.size() != 8 * blocks) {
    return DataLossError("data file " + std::string(path) + ": its header holds " +
                         std::to_string(hex.size()) + " hex digits of block checksums, its " +
                         std::to_string(header.entries.size()) + " entries need " +
                         std::to_string(8 * blocks));
  }
  out.crcs.resize(blocks);
  for (uint64_t b = 0; b < blocks; ++b) {
    uint32_t crc = 0;
    for (size_t i = 8 * b; i < 8 * b + 8; ++i) {
      const char c = hex[i];
      const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (digit < 0) {
        return DataLossError("data file " + std::string(path) + ": its header's block checksums "
                             "hold '" + std::string(1, c) + "' at digit " + std::to_string(i) +
                             ", not a lowercase hex digit");
      }
      crc = crc << 4 | static_cast<uint32_t>(digit);
    }
    out.crcs[b] = crc;
  }
  return out;
}

std::span<const uint32_t> DataFileChecksums::Of(uint64_t data_offset,
                                                uint64_t byte_length) const {
  if (byte_length == 0) return {};
  const auto after = std::upper_bound(entry_begin.begin(), entry_begin.end(), data_offset);
  if (after == entry_begin.begin() || *std::prev(after) != data_offset) return {};
  const size_t e = static_cast<size_t>(after - entry_begin.begin()) - 1;
  const uint64_t first = entry_first[e];
  return std::span<const uint32_t>(crcs).subspan(first, entry_first[e + 1] - first);
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

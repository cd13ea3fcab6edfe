#include "shardpoint/format/native/metadata_codec.h"

#include <algorithm>
#include <cstring>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/native/metadata_sections.h"

namespace sp {
namespace {

using native_metadata::Corrupt;
using native_metadata::kObjectIndex;
using native_metadata::kObjectRecords;
using native_metadata::kSummary;
using native_metadata::kTensorIndex;
using native_metadata::kTensorRecords;

// Encodes `items` (sorted by name here) into an index section, appending their records
// (`append_record(item, records)`) to `records`, whose records section starts at byte
// `records_at`.
template <typename T, typename AppendRecord>
void EncodeNamed(const std::vector<T>& items, AppendRecord append_record, std::string* index,
                 std::string* records, uint64_t records_at = 0) {
  std::vector<const T*> sorted;
  sorted.reserve(items.size());
  for (const T& item : items) sorted.push_back(&item);
  std::sort(sorted.begin(), sorted.end(), [](const T* a, const T* b) { return a->name < b->name; });
  for (const T* item : sorted) {
    const uint64_t at = records->size();
    append_record(*item, records);
    const std::string_view record = std::string_view(*records).substr(at);
    native_metadata::EncodeIndexEntry(
        index, item->name,
        MetadataReader::RecordSlot{at - records_at, record.size(), Crc32c(record)});
  }
}

// A ReadableFile over bytes owned by the caller (DecodeMetadata's input).
class BytesFile : public ReadableFile {
 public:
  BytesFile(std::string_view bytes, std::string_view path) : bytes_(bytes), path_(path) {}
  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    if (offset > bytes_.size() || out.size() > bytes_.size() - offset) {
      return DataLossError("read " + path_ + " at offset " + std::to_string(offset) + ": wanted " +
                           std::to_string(out.size()) + " bytes of a " +
                           std::to_string(bytes_.size()) + "-byte file");
    }
    if (!out.empty()) std::memcpy(out.data(), bytes_.data() + offset, out.size());
    return OkStatus();
  }
  uint64_t size() const override { return bytes_.size(); }
  const std::string& path() const override { return path_; }

 private:
  std::string_view bytes_;
  std::string path_;
};

Result<std::string> ReadBytes(const ReadableFile& file, uint64_t offset, uint64_t length) {
  std::string out(length, '\0');
  SP_RETURN_IF_ERROR(file.ReadAt(offset, AsMutableBytes(out.data(), out.size())));
  return out;
}

// EncodeMetadata of `metadata` with `tensors` as its tensors, and their chunks' block checksums
// from `apart` when given.
std::string EncodeMetadataOf(const CheckpointMetadata& metadata,
                             const std::vector<TensorMetadata>& tensors,
                             const ChunkChecksums* apart, uint32_t major) {
  // The tensor records are the bulk of a large checkpoint's metadata (110 MiB at 8,192 ranks x
  // 1,000 tensors): they are encoded straight into the output, behind room left for the header,
  // the summary and the tensor index, in a buffer reserved to a bound of their size, so that they
  // are never copied and never moved by a growing buffer. Reserved bytes that are not written
  // are never touched, and cost the process no memory.
  // Version 4 keeps the chunks' checksums in the data files' headers alone: written where they
  // are there (data_file_checksums), and the only version for metadata that holds none itself
  // (checksums_in_headers); otherwise 3.0, whose records hold them. Version 3.1 has them in both
  // places (the summary of 3.1 and 4 ends with the headers' CRCs).
  if (major >= 4 && !metadata.data_file_checksums) major = 3;
  if (metadata.checksums_in_headers) major = 4;
  const uint32_t minor = major == 3 && metadata.data_file_checksums ? 1 : 0;
  std::string sections[native_metadata::kSectionCount];
  sections[kSummary] =
      native_metadata::EncodeSummary(metadata, major >= 4 || minor >= 1);
  EncodeNamed(
      metadata.objects,
      [](const ObjectEntry& object, std::string* out) {
        out->append(native_metadata::EncodeObjectRecord(object));
      },
      &sections[kObjectIndex], &sections[kObjectRecords]);
  uint64_t index_bytes = 0, records_bound = 0;
  const auto checksums_of = [&](const TensorMetadata& tensor) {
    return apart == nullptr ? nullptr : &apart->tensors[&tensor - tensors.data()];
  };
  for (const TensorMetadata& tensor : tensors) {
    index_bytes += 4 + tensor.name.size() + 8 + 8 + 4;  // as EncodeIndexEntry writes it
    records_bound += native_metadata::TensorRecordBound(tensor, checksums_of(tensor));
  }
  const uint32_t header_length =
      native_metadata::kPrefixBytes +
      native_metadata::kSectionEntryBytes * native_metadata::kSectionCount + 4;
  std::string out;
  out.reserve(header_length + sections[kSummary].size() + index_bytes + records_bound +
              sections[kObjectIndex].size() + sections[kObjectRecords].size());
  out.resize(header_length);  // written last
  out.append(sections[kSummary]);
  const uint64_t index_at = out.size();
  out.resize(index_at + index_bytes);  // written once the records' places are known
  const uint64_t records_at = out.size();
  std::string& index = sections[kTensorIndex];
  index.reserve(index_bytes);
  EncodeNamed(
      tensors,
      [&](const TensorMetadata& tensor, std::string* records) {
        native_metadata::AppendTensorRecord(tensor, metadata.checksum_block_bytes, major, records,
                                            checksums_of(tensor));
      },
      &index, &out, records_at);
  std::memcpy(out.data() + index_at, index.data(), index.size());
  const uint64_t records_length = out.size() - records_at;
  out.append(sections[kObjectIndex]);
  out.append(sections[kObjectRecords]);

  const uint64_t lengths[] = {sections[kSummary].size(), index.size(), records_length,
                              sections[kObjectIndex].size(), sections[kObjectRecords].size()};
  const uint32_t counts[] = {0, static_cast<uint32_t>(tensors.size()),
                             static_cast<uint32_t>(tensors.size()),
                             static_cast<uint32_t>(metadata.objects.size()),
                             static_cast<uint32_t>(metadata.objects.size())};
  std::string header;
  header.reserve(header_length);
  ByteWriter w(&header);
  w.PutRaw(std::string_view(native_metadata::kMagic, sizeof(native_metadata::kMagic)));
  w.PutU32(major);
  w.PutU32(minor);
  w.PutU32(header_length);
  w.PutU32(native_metadata::kSectionCount);
  w.PutU64(out.size());
  uint64_t offset = header_length;
  for (size_t i = 0; i < native_metadata::kSectionCount; ++i) {
    w.PutU64(offset);
    w.PutU64(lengths[i]);
    w.PutU32(Crc32c(std::string_view(out).substr(offset, lengths[i])));
    w.PutU32(counts[i]);
    offset += lengths[i];
  }
  w.PutU32(Crc32c(header));
  std::memcpy(out.data(), header.data(), header.size());
  return out;
}

}  // namespace

std::string EncodeMetadata(const CheckpointMetadata& metadata, uint32_t major) {
  return EncodeMetadataOf(metadata, metadata.tensors, nullptr, major);
}

std::string EncodeMetadata(const CheckpointMetadata& metadata,
                           const std::vector<TensorMetadata>& tensors,
                           const ChunkChecksums& checksums, uint32_t major) {
  return EncodeMetadataOf(metadata, tensors, &checksums, major);
}

Result<CheckpointMetadata> DecodeMetadata(std::string_view bytes, std::string_view path,
                                          ThreadPool* pool, const ChunkFilter* filter,
                                          bool chunk_cells) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<MetadataReader> reader,
                      MetadataReader::Open(std::make_unique<BytesFile>(bytes, path)));
  return reader->ReadAll(pool, filter, chunk_cells);
}

Result<std::unique_ptr<MetadataReader>> MetadataReader::Open(std::unique_ptr<ReadableFile> file) {
  auto reader = std::make_unique<MetadataReader>(PrivateTag{});
  reader->file_ = std::move(file);
  SP_RETURN_IF_ERROR(reader->LoadHeader());
  SP_RETURN_IF_ERROR(reader->LoadSummaryAndIndexes());
  return reader;
}

Status MetadataReader::LoadHeader() {
  const uint64_t file_size = file_->size();
  SP_ASSIGN_OR_RETURN(
      std::string prefix,
      ReadBytes(*file_, 0, std::min<uint64_t>(file_size, native_metadata::kPrefixBytes)));
  SP_ASSIGN_OR_RETURN(uint32_t header_length,
                      native_metadata::DecodePrefix(prefix, file_size, path(), &summary_));
  SP_ASSIGN_OR_RETURN(std::string header, ReadBytes(*file_, 0, header_length));
  SP_ASSIGN_OR_RETURN(sections_,
                      native_metadata::DecodeSectionTable(header, file_size, path()));
  return OkStatus();
}

Status MetadataReader::LoadSummaryAndIndexes() {
  SP_ASSIGN_OR_RETURN(std::string summary, ReadSection(kSummary, "summary"));
  SP_RETURN_IF_ERROR(native_metadata::DecodeSummary(summary, newer_minor(), path(), &summary_));
  SP_ASSIGN_OR_RETURN(std::string tensor_index, ReadSection(kTensorIndex, "tensor index"));
  SP_RETURN_IF_ERROR(native_metadata::DecodeIndex(
      tensor_index, sections_[kTensorIndex].count, sections_[kTensorRecords].length,
      "tensor index", path(), &tensor_names_, &tensor_slots_));
  SP_ASSIGN_OR_RETURN(std::string object_index, ReadSection(kObjectIndex, "object index"));
  SP_RETURN_IF_ERROR(native_metadata::DecodeIndex(
      object_index, sections_[kObjectIndex].count, sections_[kObjectRecords].length,
      "object index", path(), &object_names_, &object_slots_));
  return OkStatus();
}

Result<std::string> MetadataReader::ReadSection(size_t index, std::string_view what) const {
  const Section& section = sections_[index];
  SP_ASSIGN_OR_RETURN(std::string bytes, ReadBytes(*file_, section.offset, section.length));
  SP_RETURN_IF_ERROR(native_metadata::CheckCrc(bytes, section.crc32c, what, path()));
  return bytes;
}

Result<std::string> MetadataReader::ReadRecord(const Section& section, const RecordSlot& slot,
                                               std::string_view kind,
                                               std::string_view name) const {
  SP_ASSIGN_OR_RETURN(std::string bytes,
                      ReadBytes(*file_, section.offset + slot.offset, slot.length));
  SP_RETURN_IF_ERROR(native_metadata::CheckCrc(
      bytes, slot.crc32c, std::string(kind) + " \"" + std::string(name) + "\" record", path()));
  return bytes;
}

Result<TensorMetadata> MetadataReader::ReadTensor(std::string_view name) const {
  auto it = std::lower_bound(tensor_names_.begin(), tensor_names_.end(), name);
  if (it == tensor_names_.end() || *it != name) {
    return NotFoundError("tensor \"" + std::string(name) + "\" not found in metadata file " +
                         path());
  }
  const RecordSlot& slot = tensor_slots_[it - tensor_names_.begin()];
  SP_ASSIGN_OR_RETURN(std::string bytes,
                      ReadRecord(sections_[kTensorRecords], slot, "tensor", name));
  return native_metadata::DecodeTensorRecord(bytes, std::string(name), summary_, newer_minor(),
                                             path());
}

Result<ObjectEntry> MetadataReader::ReadObject(std::string_view name) const {
  auto it = std::lower_bound(object_names_.begin(), object_names_.end(), name);
  if (it == object_names_.end() || *it != name) {
    return NotFoundError("object \"" + std::string(name) + "\" not found in metadata file " +
                         path());
  }
  const RecordSlot& slot = object_slots_[it - object_names_.begin()];
  SP_ASSIGN_OR_RETURN(std::string bytes,
                      ReadRecord(sections_[kObjectRecords], slot, "object", name));
  return native_metadata::DecodeObjectRecord(bytes, std::string(name), newer_minor(), path());
}

Result<CheckpointMetadata> MetadataReader::ReadAll(ThreadPool* pool, const ChunkFilter* filter,
                                                   bool chunk_cells) const {
  CheckpointMetadata out = summary_;
  SP_ASSIGN_OR_RETURN(std::string tensors, ReadSection(kTensorRecords, "tensor records"));
  out.tensors.resize(tensor_names_.size());
  const int64_t count = static_cast<int64_t>(tensor_names_.size());
  // From version 4, the first record whose grid cells take the records' total past the budget
  // (GridCellBudget), found before any is decoded; it fails as the one bad record a decoding in
  // name order meets, and the records after it are not decoded.
  int64_t over_budget = count;
  if (summary_.version_major >= 4) {
    const uint64_t budget = native_metadata::GridCellBudget(summary_);
    uint64_t cells = 0;
    for (int64_t i = 0; i < count && over_budget == count; ++i) {
      const RecordSlot& slot = tensor_slots_[i];
      cells += native_metadata::GridRecordCells(
          std::string_view(tensors).substr(slot.offset, slot.length), summary_.version_major);
      if (cells > budget) over_budget = i;  // each term is at most 2^62: no wrap before this
    }
  }
  const std::vector<Box> none;
  SP_RETURN_IF_ERROR(ParallelForInOrder(pool, count, [&](int64_t i) -> Status {
    const RecordSlot& slot = tensor_slots_[i];
    if (i >= over_budget) {
      return native_metadata::Corrupt(
          path(), "tensor \"" + tensor_names_[over_budget] + "\": its grid cells take the " +
                      "records' total past " +
                      std::to_string(native_metadata::GridCellBudget(summary_)) +
                      ", the budget of 2^24 cells and 4096 for each of the " +
                      std::to_string(summary_.files.size()) + " data files");
    }
    const std::vector<Box>* keep = nullptr;
    if (filter != nullptr) {
      auto it = filter->find(tensor_names_[i]);
      keep = it != filter->end() ? &it->second : &none;
    }
    SP_ASSIGN_OR_RETURN(out.tensors[i],
                        native_metadata::DecodeTensorRecord(
                            std::string_view(tensors).substr(slot.offset, slot.length),
                            tensor_names_[i], summary_, newer_minor(), path(), keep,
                            /*index_lists=*/!chunk_cells));
    if (chunk_cells && filter == nullptr) CompactChunkCells(&out.tensors[i]);
    return OkStatus();
  }));
  SP_ASSIGN_OR_RETURN(std::string objects, ReadSection(kObjectRecords, "object records"));
  out.objects.reserve(object_names_.size());
  for (size_t i = 0; i < object_names_.size(); ++i) {
    const RecordSlot& slot = object_slots_[i];
    SP_ASSIGN_OR_RETURN(ObjectEntry object,
                        native_metadata::DecodeObjectRecord(
                            std::string_view(objects).substr(slot.offset, slot.length),
                            object_names_[i], newer_minor(), path()));
    out.objects.push_back(std::move(object));
  }
  return out;
}

}  // namespace sp

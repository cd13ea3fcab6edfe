#include "shardpoint/format/safetensors/safetensors.h"

#include <algorithm>
#include <charconv>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/json.h"

namespace sp {
namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

Status Corrupt(std::string_view path, std::string_view problem) {
  return DataLossError("safetensors file " + std::string(path) + ": " + std::string(problem));
}

Status CorruptEntry(std::string_view path, std::string_view entry, std::string_view problem) {
  return Corrupt(path, "entry \"" + std::string(entry) + "\": " + std::string(problem));
}

// Validates the 8-byte header length N against the caps and the file size.
Result<uint64_t> CheckHeaderLength(uint64_t header_length, uint64_t file_size,
                                   std::string_view path) {
  if (header_length > kMaxSafetensorsHeaderBytes) {
    return Corrupt(path, "header length " + std::to_string(header_length) +
                             " exceeds the limit of " +
                             std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (header_length > file_size - 8) {
    return Corrupt(path, "header length " + std::to_string(header_length) +
                             " runs past the end of the file (" + std::to_string(file_size) +
                             " bytes)");
  }
  return header_length;
}

Result<DType> ParseEntryDType(const JsonValue& v, std::string_view path, std::string_view name) {
  if (!v.is_string()) return CorruptEntry(path, name, "\"dtype\" is not a string");
  Result<DType> dtype = DTypeFromSafetensorsName(v.string);
  if (dtype.ok()) return dtype;
  if (v.string == "F4" || v.string == "F6_E2M3" || v.string == "F6_E3M2") {
    return UnimplementedError("safetensors file " + std::string(path) + ": entry \"" +
                              std::string(name) + "\": dtype " + v.string +
                              " is not supported by shardpoint");
  }
  return CorruptEntry(path, name, "unknown dtype \"" + v.string + "\"");
}

// Parses "shape" and returns the element count (checked against overflow).
Result<uint64_t> ParseEntryShape(const JsonValue& v, std::string_view path, std::string_view name,
                                 Shape* shape) {
  if (!v.is_array()) return CorruptEntry(path, name, "\"shape\" is not an array");
  if (v.items.size() > kMaxSafetensorsRank) {
    return CorruptEntry(path, name, "shape has " + std::to_string(v.items.size()) +
                                        " dimensions, more than 64");
  }
  uint64_t numel = 1;
  for (const JsonValue& dim : v.items) {
    if (!dim.is_number() || dim.number > static_cast<uint64_t>(INT64_MAX)) {
      return CorruptEntry(path, name, "shape dimension is not an integer in [0, 2^63)");
    }
    if (__builtin_mul_overflow(numel, dim.number, &numel)) {
      return CorruptEntry(path, name, "element count overflows 64 bits");
    }
    shape->push_back(static_cast<int64_t>(dim.number));
  }
  return numel;
}

Status ParseEntryOffsets(const JsonValue& v, std::string_view path, SafetensorsEntry* entry) {
  if (!v.is_array() || v.items.size() != 2 || !v.items[0].is_number() ||
      !v.items[1].is_number()) {
    return CorruptEntry(path, entry->name, "\"data_offsets\" is not an array of two integers");
  }
  entry->begin = v.items[0].number;
  entry->end = v.items[1].number;
  if (entry->begin > entry->end) {
    return CorruptEntry(path, entry->name,
                        "data_offsets [" + std::to_string(entry->begin) + ", " +
                            std::to_string(entry->end) + ") end before they begin");
  }
  return OkStatus();
}

Result<SafetensorsEntry> ParseEntry(std::string name, const JsonValue& v, std::string_view path) {
  SafetensorsEntry entry;
  entry.name = std::move(name);
  if (!v.is_object()) return CorruptEntry(path, entry.name, "value is not an object");
  const JsonValue* fields[3] = {nullptr, nullptr, nullptr};
  static constexpr std::string_view kFields[3] = {"dtype", "shape", "data_offsets"};
  for (size_t i = 0; i < v.keys.size(); ++i) {
    auto it = std::find(std::begin(kFields), std::end(kFields), v.keys[i]);
    if (it == std::end(kFields)) {
      return CorruptEntry(path, entry.name, "unexpected field \"" + v.keys[i] + "\"");
    }
    fields[it - std::begin(kFields)] = &v.values[i];
  }
  for (size_t i = 0; i < 3; ++i) {
    if (fields[i] == nullptr) {
      return CorruptEntry(path, entry.name, "missing field \"" + std::string(kFields[i]) + "\"");
    }
  }
  SP_ASSIGN_OR_RETURN(entry.dtype, ParseEntryDType(*fields[0], path, entry.name));
  SP_ASSIGN_OR_RETURN(uint64_t numel, ParseEntryShape(*fields[1], path, entry.name, &entry.shape));
  SP_RETURN_IF_ERROR(ParseEntryOffsets(*fields[2], path, &entry));
  uint64_t nbytes;
  if (__builtin_mul_overflow(numel, DTypeSize(entry.dtype), &nbytes)) {
    return CorruptEntry(path, entry.name, "byte size overflows 64 bits");
  }
  if (entry.end - entry.begin != nbytes) {
    return CorruptEntry(path, entry.name,
                        "data_offsets [" + std::to_string(entry.begin) + ", " +
                            std::to_string(entry.end) + ") hold " +
                            std::to_string(entry.end - entry.begin) + " bytes, expected " +
                            std::to_string(nbytes) + " for shape " + ShapeToString(entry.shape) +
                            " of " + std::string(DTypeSafetensorsName(entry.dtype)));
  }
  return entry;
}

Status ParseMetadata(const JsonValue& v, std::string_view path,
                     std::map<std::string, std::string>* out) {
  if (!v.is_object()) return Corrupt(path, "\"__metadata__\" is not an object");
  for (size_t i = 0; i < v.keys.size(); ++i) {
    if (!v.values[i].is_string()) {
      return Corrupt(path, "\"__metadata__\" value of \"" + v.keys[i] + "\" is not a string");
    }
    out->emplace(v.keys[i], v.values[i].string);
  }
  return OkStatus();
}

// Entries sorted by data offsets must tile [0, file_size - data_start) exactly.
Status CheckLayout(std::vector<SafetensorsEntry>& entries, uint64_t data_start,
                   uint64_t file_size, std::string_view path) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t expected = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin != expected) {
      return CorruptEntry(path, e.name,
                          "data_offsets begin at " + std::to_string(e.begin) + ", expected " +
                              std::to_string(expected) +
                              (e.begin < expected ? " (overlap)" : " (hole)"));
    }
    expected = e.end;
  }
  uint64_t data_bytes = file_size - data_start;
  if (expected != data_bytes) {
    return Corrupt(path, "the entries cover " + std::to_string(expected) +
                             " data bytes but the file holds " + std::to_string(data_bytes) +
                             " (file size " + std::to_string(file_size) + ")");
  }
  return OkStatus();
}

template <typename Int>
void AppendNumber(std::string* json, Int value) {
  char digits[24];
  const std::to_chars_result r = std::to_chars(digits, digits + sizeof(digits), value);
  json->append(digits, r.ptr);
}

}  // namespace

SafetensorsHeaderBuilder::SafetensorsHeaderBuilder(
    const std::map<std::string, std::string>& metadata)
    : json_("{") {
  if (metadata.empty()) return;
  AppendJsonString(&json_, kMetadataKey);
  json_.append(":{");
  bool first = true;
  for (const auto& [key, value] : metadata) {
    if (!first) json_.push_back(',');
    first = false;
    AppendJsonString(&json_, key);
    json_.push_back(':');
    AppendJsonString(&json_, value);
  }
  json_.push_back('}');
}

void SafetensorsHeaderBuilder::Add(std::string_view name, DType dtype,
                                   std::span<const int64_t> shape, uint64_t begin, uint64_t end) {
  if (json_.size() > 1) json_.push_back(',');
  AppendJsonString(&json_, name);
  json_.append(":{\"dtype\":");
  AppendJsonString(&json_, DTypeSafetensorsName(dtype));
  json_.append(",\"shape\":[");
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) json_.push_back(',');
    AppendNumber(&json_, shape[i]);
  }
  json_.append("],\"data_offsets\":[");
  AppendNumber(&json_, begin);
  json_.push_back(',');
  AppendNumber(&json_, end);
  json_.append("]}");
}

std::string SafetensorsHeaderBuilder::Finish(uint64_t data_alignment) && {
  json_.push_back('}');
  const uint64_t a = std::max<uint64_t>(8, data_alignment / 8 * 8);
  json_.append((a - (8 + json_.size()) % a) % a, ' ');
  std::string out(8, '\0');
  EncodeFixed64(out.data(), json_.size());
  out.append(json_);
  return out;
}

std::string EncodeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                    const std::map<std::string, std::string>& metadata,
                                    uint64_t data_alignment) {
  SafetensorsHeaderBuilder builder(metadata);
  for (const SafetensorsEntry& e : entries) builder.Add(e.name, e.dtype, e.shape, e.begin, e.end);
  return std::move(builder).Finish(data_alignment);
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view bytes_from_file_start,
                                                 uint64_t file_size, std::string_view path) {
  if (file_size < 8) {
    return Corrupt(path, "file of " + std::to_string(file_size) +
                             " bytes is too short for the 8-byte header length");
  }
  if (bytes_from_file_start.size() < 8) {
    return Corrupt(path, "header truncated: 8 bytes expected, " +
                             std::to_string(bytes_from_file_start.size()) + " available");
  }
  SP_ASSIGN_OR_RETURN(
      uint64_t header_length,
      CheckHeaderLength(DecodeFixed64(bytes_from_file_start.data()), file_size, path));
  if (bytes_from_file_start.size() - 8 < header_length) {
    return Corrupt(path, "header truncated: " + std::to_string(header_length) +
                             " bytes expected, " +
                             std::to_string(bytes_from_file_start.size() - 8) + " available");
  }
  std::string_view json = bytes_from_file_start.substr(8, header_length);
  if (json.empty() || json.front() != '{') return Corrupt(path, "header does not start with '{'");
  SP_ASSIGN_OR_RETURN(JsonValue root,
                      ParseJson(json, "safetensors file " + std::string(path) + ": header JSON"));
  SafetensorsHeader header;
  header.data_start = 8 + header_length;
  for (size_t i = 0; i < root.keys.size(); ++i) {
    if (root.keys[i] == kMetadataKey) {
      SP_RETURN_IF_ERROR(ParseMetadata(root.values[i], path, &header.metadata));
      continue;
    }
    SP_ASSIGN_OR_RETURN(SafetensorsEntry entry,
                        ParseEntry(std::move(root.keys[i]), root.values[i], path));
    header.entries.push_back(std::move(entry));
  }
  SP_RETURN_IF_ERROR(CheckLayout(header.entries, header.data_start, file_size, path));
  return header;
}

Result<SafetensorsHeader> ReadSafetensorsHeader(ReadableFile& file) {
  const uint64_t file_size = file.size();
  if (file_size < 8) {
    return Corrupt(file.path(), "file of " + std::to_string(file_size) +
                                    " bytes is too short for the 8-byte header length");
  }
  char length_bytes[8];
  SP_RETURN_IF_ERROR(file.ReadAt(0, AsMutableBytes(length_bytes, 8)));
  SP_ASSIGN_OR_RETURN(uint64_t header_length,
                      CheckHeaderLength(DecodeFixed64(length_bytes), file_size, file.path()));
  std::string bytes(8 + header_length, '\0');
  SP_RETURN_IF_ERROR(file.ReadAt(0, AsMutableBytes(bytes.data(), bytes.size())));
  return ParseSafetensorsHeader(bytes, file_size, file.path());
}

}  // namespace sp

// shardpoint inspect PATH [--json] [--chunks]
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>

#include "shardpoint/checkpoint.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kInspectUsage[] =
    "usage: shardpoint inspect PATH [--json] [--chunks] [--allow-external-links]\n"
    "\n"
    "Lists the tensors (dtype, shape, chunk count, bytes, files), the objects and the data files\n"
    "of the committed checkpoint at PATH. The objects of a PyTorch DCP checkpoint are listed as\n"
    "stored (torch-save, with the item's stored size): they are read, and plain data told apart,\n"
    "only when loaded.\n"
    "  --json     print the same as one JSON document\n"
    "  --chunks   also list every chunk: its box, file and byte range\n"
    "  --allow-external-links  read files that symbolic links lead outside the checkpoint\n";

std::string EncodingName(ObjectEncoding e) {
  switch (e) {
    case ObjectEncoding::kJson: return "json";
    case ObjectEncoding::kPickle: return "pickle";
    case ObjectEncoding::kBytes: return "bytes";
    case ObjectEncoding::kTorchSave: return "torch-save";
    case ObjectEncoding::kPlain: return "plain";
  }
  return "unknown";
}

std::string JsonIntList(std::span<const int64_t> v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

// An attribute value as one short line: long or multi-line values (the saved structure's paths,
// a planner's data) are cut, with their size, and --json prints them whole.
std::string AttributeSummary(const std::string& value) {
  constexpr size_t kShown = 100;
  const size_t newline = value.find('\n');
  if (value.size() <= kShown && newline == std::string::npos) return value;
  size_t cut = std::min(kShown, newline);
  while (cut > 0 && (static_cast<unsigned char>(value[cut]) & 0xC0) == 0x80) --cut;  // UTF-8
  return value.substr(0, cut) + "... (" + std::to_string(value.size()) +
         " bytes; --json prints it whole)";
}

size_t FileCount(const TensorMetadata& t) {
  std::set<uint32_t> files;
  for (const StoredChunk& c : t.chunks) files.insert(c.file);
  return files.size();
}

uint64_t TotalBytes(const CheckpointMetadata& md) {
  uint64_t total = 0;
  for (const TensorMetadata& t : md.tensors) total += t.total_bytes();
  return total;
}

// "shardpoint" and "1.0" for native checkpoints; the driver's name and version otherwise.
std::pair<std::string, std::string> FormatAndVersion(const CheckpointMetadata& md) {
  if (md.format == CheckpointFormat::kNative) {
    return {"shardpoint", std::to_string(md.version_major) + "." + std::to_string(md.version_minor)};
  }
  auto version = md.attributes.find("torch_dcp.version");
  return {std::string(CheckpointFormatName(md.format)),
          version != md.attributes.end() ? version->second : ""};
}

void PrintJson(const CheckpointMetadata& md, std::string_view path, bool chunks) {
  std::ostream& o = std::cout;
  const auto [format, version] = FormatAndVersion(md);
  o << "{\"path\":" << JsonQuote(path) << ",\"format\":" << JsonQuote(format)
    << ",\"version\":" << JsonQuote(version) << ",\"checksums\":"
    << (md.checksum_block_bytes > 0 ? "true" : "false") << ",\"save_id\":" << JsonQuote(md.save_id)
    << ",\"world_size\":" << md.world_size << ",\"checksum\":\""
    << (md.checksum_block_bytes > 0 ? "crc32c" : "none") << "\",\"checksum_block_bytes\":"
    << md.checksum_block_bytes << ",\"total_bytes\":" << TotalBytes(md) << ",\"tensors\":[";
  for (size_t i = 0; i < md.tensors.size(); ++i) {
    const TensorMetadata& t = md.tensors[i];
    o << (i ? "," : "") << "{\"name\":" << JsonQuote(t.name) << ",\"dtype\":\""
      << DTypeName(t.dtype) << "\",\"shape\":" << JsonIntList(t.shape)
      << ",\"chunks\":" << t.chunks.size() << ",\"bytes\":" << t.total_bytes()
      << ",\"files\":" << FileCount(t);
    if (chunks) {
      o << ",\"chunk_list\":[";
      for (size_t c = 0; c < t.chunks.size(); ++c) {
        const StoredChunk& ch = t.chunks[c];
        o << (c ? "," : "") << "{\"offsets\":" << JsonIntList(ch.box.offsets)
          << ",\"sizes\":" << JsonIntList(ch.box.sizes) << ",\"file\":"
          << JsonQuote(md.files[ch.file].name) << ",\"data_offset\":" << ch.data_offset
          << ",\"bytes\":" << ch.byte_length << "}";
      }
      o << "]";
    }
    o << "}";
  }
  o << "],\"objects\":[";
  for (size_t i = 0; i < md.objects.size(); ++i) {
    const ObjectEntry& obj = md.objects[i];
    o << (i ? "," : "") << "{\"name\":" << JsonQuote(obj.name) << ",\"encoding\":\""
      << EncodingName(obj.encoding) << "\",\"bytes\":" << obj.size_bytes() << "}";
  }
  o << "],\"files\":[";
  for (size_t i = 0; i < md.files.size(); ++i) {
    const DataFile& f = md.files[i];
    o << (i ? "," : "") << "{\"name\":" << JsonQuote(f.name) << ",\"bytes\":" << f.size
      << ",\"writer_rank\":" << f.writer_rank << "}";
  }
  o << "],\"attributes\":{";
  size_t i = 0;
  for (const auto& [k, v] : md.attributes) o << (i++ ? "," : "") << JsonQuote(k) << ":" << JsonQuote(v);
  o << "}}\n";
}

void PrintTable(const CheckpointMetadata& md, std::string_view path, bool chunks) {
  std::ostream& o = std::cout;
  const auto [format, version] = FormatAndVersion(md);
  o << "checkpoint " << path << "\n  format " << format << (version.empty() ? "" : " ")
    << version << (md.checksum_block_bytes > 0 ? "" : " (no checksums)")
    << (md.save_id.empty() ? "" : ", save " + md.save_id) << ", written by " << md.world_size
    << " rank(s)\n  " << md.tensors.size() << " tensors, " << md.objects.size() << " objects, "
    << md.files.size() << " files, " << HumanBytes(TotalBytes(md)) << "\n\n";
  size_t width = 6;
  for (const TensorMetadata& t : md.tensors) width = std::max(width, t.name.size());
  o << std::left << std::setw(static_cast<int>(width) + 2) << "TENSOR" << std::setw(16) << "DTYPE"
    << std::setw(22) << "SHAPE" << std::setw(8) << "CHUNKS" << std::setw(13) << "BYTES"
    << "FILES\n";
  for (const TensorMetadata& t : md.tensors) {
    o << std::setw(static_cast<int>(width) + 2) << t.name << std::setw(16) << DTypeName(t.dtype)
      << std::setw(22) << ShapeToString(t.shape) << std::setw(8) << t.chunks.size()
      << std::setw(13) << HumanBytes(t.total_bytes()) << FileCount(t) << "\n";
    if (!chunks) continue;
    for (const StoredChunk& c : t.chunks) {
      o << "    " << c.box.ToString() << "  " << md.files[c.file].name << " +" << c.data_offset
        << " (" << c.byte_length << " bytes)\n";
    }
  }
  if (!md.objects.empty()) {
    o << "\nOBJECT  ENCODING  BYTES\n";
    for (const ObjectEntry& obj : md.objects) {
      o << obj.name << "  " << EncodingName(obj.encoding) << "  " << obj.size_bytes() << "\n";
    }
  }
  o << "\nFILE  BYTES  RANK\n";
  for (const DataFile& f : md.files) {
    o << f.name << "  " << HumanBytes(f.size) << "  " << f.writer_rank << "\n";
  }
  for (const auto& [k, v] : md.attributes) o << "attribute " << k << " = " << AttributeSummary(v) << "\n";
}

}  // namespace

int InspectCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "chunks", "help", kLinksFlag}, {});
  if (!args.ok()) return UsageError("inspect", args.status().message(), kInspectUsage);
  if (args->Has("help")) {
    std::cout << kInspectUsage;
    return kExitOk;
  }
  if (args->positional.size() != 1) {
    return UsageError("inspect", "expected exactly one PATH", kInspectUsage);
  }
  const std::string& path = args->positional[0];
  Result<std::unique_ptr<Store>> store = StoreFor(*args, path);
  if (!store.ok()) return Fail("inspect", store.status());
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(path, store->get());
  if (!md.ok()) return Fail("inspect", md.status());
  if (args->Has("json")) {
    PrintJson(*md, path, args->Has("chunks"));
  } else {
    PrintTable(*md, path, args->Has("chunks"));
  }
  return kExitOk;
}

}  // namespace sp::cli

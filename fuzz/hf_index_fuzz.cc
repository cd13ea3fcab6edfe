// libFuzzer target for model.safetensors.index.json (shardpoint/format/safetensors/hf_directory.h)
// parsed directly: the input is the index of a directory whose two data files are fixed and
// valid (a.safetensors holds x and y, b.safetensors holds z), so every mutation reaches the index
// parser and the checks of the index against the headers. hf_directory_fuzz mutates the headers
// too.
//
// Invariants when the directory is accepted: the data files are exactly those the weight_map
// names, every tensor of those files is present once, in the file that holds it, as one chunk
// covering the whole tensor with the bytes the header gives.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardpoint/format/safetensors/hf_directory.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/store/memory_store.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

struct FixedFile {
  std::string name;
  std::vector<sp::SafetensorsEntry> entries;
};

const std::vector<FixedFile>& Files() {
  static const std::vector<FixedFile> files = {
      {"a.safetensors",
       {{"x", sp::DType::kFloat32, {2, 3}, 0, 24}, {"y", sp::DType::kInt64, {4}, 24, 56}}},
      {"b.safetensors", {{"z", sp::DType::kBFloat16, {5}, 0, 10}}},
  };
  return files;
}

void Write(sp::MemoryStore& store, const std::string& path, std::string_view bytes) {
  auto file = store.NewWritableFile(path);
  Check(file.ok() && (*file)->WriteAt(0, sp::AsBytes(bytes)).ok());
}

void CheckAccepted(const sp::CheckpointMetadata& md) {
  std::set<std::string> tensors;
  for (const sp::DataFile& f : md.files) {
    const FixedFile* fixed = nullptr;
    for (const FixedFile& candidate : Files()) {
      if (candidate.name == f.name) fixed = &candidate;
    }
    Check(fixed != nullptr);
    for (const sp::SafetensorsEntry& e : fixed->entries) tensors.insert(e.name);
  }
  Check(md.tensors.size() == tensors.size());
  for (const sp::TensorMetadata& t : md.tensors) {
    Check(tensors.count(t.name) == 1 && t.chunks.size() == 1);
    const sp::StoredChunk& c = t.chunks[0];
    Check(c.file < md.files.size() && c.box == sp::Box(std::vector<int64_t>(t.shape.size(), 0), t.shape));
    for (const FixedFile& fixed : Files()) {
      for (const sp::SafetensorsEntry& e : fixed.entries) {
        if (e.name != t.name) continue;
        Check(md.files[c.file].name == fixed.name && t.shape == e.shape && t.dtype == e.dtype);
        Check(c.data_offset == e.begin && c.byte_length == e.end - e.begin);
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sp::MemoryStore store;
  Check(store.CreateDirs("/hf").ok());
  for (const FixedFile& f : Files()) {
    std::string bytes = sp::EncodeSafetensorsHeader(f.entries, {});
    bytes.append(f.entries.back().end, '\x01');
    Write(store, "/hf/" + f.name, bytes);
  }
  Write(store, std::string("/hf/") + sp::kSafetensorsIndexFileName,
        std::string_view(reinterpret_cast<const char*>(data), size));
  sp::Result<sp::CheckpointMetadata> md = sp::ReadSafetensorsDirectory(store, "/hf");
  if (md.ok()) CheckAccepted(*md);
  return 0;
}

// libFuzzer target for the hf-safetensors driver (shardpoint/format/safetensors/hf_directory.h):
// the index file, DCP_SHARDING_INFO and the checks across files.
//
// The input is up to three parts separated by "\n--8<--\n": model.safetensors.index.json (no index
// when the part is empty), then the bytes of a.safetensors and b.safetensors. The driver reads the
// directory from an in-memory store; whatever it returns, the metadata it accepts must be sane:
// files sorted and sized as written, every chunk inside its tensor and its file.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "shardpoint/format/safetensors/hf_directory.h"
#include "shardpoint/store/memory_store.h"

namespace {

std::vector<std::string_view> Split(std::string_view bytes) {
  constexpr std::string_view kSeparator = "\n--8<--\n";
  std::vector<std::string_view> parts;
  while (parts.size() < 2) {
    const size_t at = bytes.find(kSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(bytes.substr(0, at));
    bytes.remove_prefix(at + kSeparator.size());
  }
  parts.push_back(bytes);
  return parts;
}

void Write(sp::MemoryStore& store, const std::string& path, std::string_view bytes) {
  auto file = store.NewWritableFile(path);
  if (!file.ok() || !(*file)->WriteAt(0, sp::AsBytes(bytes)).ok()) std::abort();
}

void CheckSane(const sp::CheckpointMetadata& md) {
  for (const sp::TensorMetadata& t : md.tensors) {
    for (const sp::StoredChunk& c : t.chunks) {
      if (c.file >= md.files.size() || !sp::WithinShape(c.box, t.shape)) std::abort();
      const sp::DataFile& f = md.files[c.file];
      if (c.byte_length != static_cast<uint64_t>(c.box.volume()) * sp::DTypeSize(t.dtype) ||
          c.data_offset > f.size || c.byte_length > f.size - f.data_start - c.data_offset) {
        std::abort();
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string_view> parts =
      Split(std::string_view(reinterpret_cast<const char*>(data), size));
  sp::MemoryStore store;
  if (!store.CreateDirs("/hf").ok()) std::abort();
  if (parts.size() > 1 && !parts[0].empty()) {
    Write(store, std::string("/hf/") + sp::kSafetensorsIndexFileName, parts[0]);
  }
  Write(store, "/hf/a.safetensors", parts.size() > 1 ? parts[1] : parts[0]);
  if (parts.size() > 2) Write(store, "/hf/b.safetensors", parts[2]);
  sp::Result<sp::CheckpointMetadata> md = sp::ReadSafetensorsDirectory(store, "/hf");
  if (md.ok()) CheckSane(*md);
  sp::Result<sp::CheckpointMetadata> one = sp::ReadSafetensorsDirectory(store, "/hf/a.safetensors");
  if (one.ok()) CheckSane(*one);
  return 0;
}

// Writes a seed corpus for the fuzz targets: a few valid metadata files and data file headers.
// Usage: make_fuzz_seeds METADATA_DIR SAFETENSORS_DIR
#include <fstream>
#include <iostream>
#include <string>

#include "shardpoint/format/native/metadata_codec.h"

namespace {

sp::CheckpointMetadata Seed(int variant) {
  sp::CheckpointMetadata m;
  m.save_id = "seed" + std::to_string(variant);
  m.world_size = 2;
  m.checksum_block_bytes = 16;
  m.files = {{sp::DataFileName(m.save_id, 0, 0), 0, 0, 0}, {sp::DataFileName(m.save_id, 1, 0), 0, 0, 1}};
  uint64_t cursor[2] = {0, 0};
  const sp::DType dtypes[] = {sp::DType::kFloat32, sp::DType::kBFloat16, sp::DType::kInt64,
                              sp::DType::kBool};
  for (int t = 0; t < 2 + variant; ++t) {
    sp::TensorMetadata tensor{"model.layer" + std::to_string(t) + ".w", dtypes[(t + variant) % 4],
                              {4, 2 + t}, {}};
    for (int half = 0; half < 2; ++half) {
      sp::StoredChunk c{sp::Box({2 * half, 0}, {2, 2 + t}), static_cast<uint32_t>(half), cursor[half], 0, {}};
      c.byte_length = static_cast<uint64_t>(c.box.volume()) * sp::DTypeSize(tensor.dtype);
      cursor[half] += c.byte_length;
      for (uint64_t b = 0; b < (c.byte_length + 15) / 16; ++b) c.block_crc32c.push_back(0x1234567u * (b + 1));
      tensor.chunks.push_back(c);
    }
    m.tensors.push_back(tensor);
  }
  m.tensors.push_back({"step", sp::DType::kInt64, {}, {{sp::Box(), 0, cursor[0], 8, {7}}}});
  cursor[0] += 8;
  m.objects = {{"cfg", sp::ObjectEncoding::kJson, "{\"lr\": 0.1}"}, {"blob", sp::ObjectEncoding::kBytes, "xyz"}};
  m.attributes = {{"step", "100"}};
  for (uint32_t f = 0; f < 2; ++f) {
    m.files[f].data_start = sp::BuildDataFileHeader(m, f).size();
    m.files[f].size = m.files[f].data_start + cursor[f];
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: make_fuzz_seeds METADATA_DIR SAFETENSORS_DIR\n";
    return 2;
  }
  for (int variant = 0; variant < 3; ++variant) {
    sp::CheckpointMetadata m = Seed(variant);
    std::ofstream(std::string(argv[1]) + "/seed" + std::to_string(variant), std::ios::binary)
        << sp::EncodeMetadata(m);
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      std::string file = sp::BuildDataFileHeader(m, f);
      file.resize(m.files[f].size, '\0');
      std::ofstream(std::string(argv[2]) + "/seed" + std::to_string(variant) + "-" + std::to_string(f),
                    std::ios::binary)
          << file;
    }
  }
  return 0;
}

// Writes a seed corpus for the fuzz targets: a few valid metadata files and data file headers.
// Usage: make_fuzz_seeds METADATA_DIR SAFETENSORS_DIR [UNPICKLE_DIR ZIP_DIR]
#include <fstream>
#include <iostream>
#include <string>

#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/torch_save.h"

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

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// DCP metadata and plain-data pickles (unpickle_fuzz), torch.save archives (zip_fuzz).
void TorchSeeds(const std::string& unpickle_dir, const std::string& zip_dir) {
  namespace td = sp::torch_dcp;
  using P = td::PlainValue;
  td::DcpMetadata md;
  md.state_dict_metadata = {{"w", td::DcpEntry::Kind::kTensor, {sp::DType::kBFloat16}, {4, 2},
                             {sp::Box({0, 0}, {2, 2}), sp::Box({2, 0}, {2, 2})}},
                            {"step", td::DcpEntry::Kind::kBytes, {}, {}, {}}};
  md.storage_data = {{"w", std::vector<int64_t>{0, 0}, 0, "__0_0.distcp", 0, 1577, {}},
                     {"w", std::vector<int64_t>{2, 0}, 1, "__1_0.distcp", 0, 1577, {"stream.zstd/1"}},
                     {"step", std::nullopt, std::nullopt, "__0_0.distcp", 1577, 1261, {}}};
  md.planner_data = td::MakeDcpPlannerData({{"w", {std::string("w")}}, {"step", {std::string("step")}}});
  md.storage_meta = td::DcpStorageMeta{"/ckpt", "seed", std::nullopt, {}};
  md.version = td::kDcpVersion;
  Write(unpickle_dir + "/dcp-metadata", td::EncodeDcpMetadata(md).value());
  P plain = P::Dict({{P::String("lr"), P::Float(0.5)},
                     {P::String("ids"), P::List({P::Int(-1), P::Int(int64_t{1} << 40), P::None()})},
                     {P::String("t"), P::Tuple({P::Bool(true), P::Bytes("\x01\xff")})}});
  Write(unpickle_dir + "/plain", td::EncodePlainPickle(plain).value());
  td::TorchSaveLayout tensor = td::LayoutTensorItem(sp::DType::kFloat32, {2, 3}).value();
  Write(unpickle_dir + "/tensor-data.pkl", tensor.data_pkl());
  Write(zip_dir + "/tensor", td::TensorItemPrefix(tensor) + std::string(24, '\1') +
                                td::TensorItemSuffix(tensor, 0));
  td::TorchSaveLayout sd = td::TorchSaveLayout::ForStateDict(
      {{"a", sp::DType::kUInt16, {2}}, {"b", sp::DType::kInt8, {}}}).value();
  Write(zip_dir + "/state-dict", sd.Head() + std::string(4, '\2') + sd.Between(0, 0) + "x" +
                                    sd.Tail(std::vector<uint32_t>{0, 0}));
  Write(zip_dir + "/object", td::EncodePlainObjectItem(plain).value());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 5) {
    std::cerr << "usage: make_fuzz_seeds METADATA_DIR SAFETENSORS_DIR [UNPICKLE_DIR ZIP_DIR]\n";
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
  if (argc == 5) TorchSeeds(argv[3], argv[4]);
  return 0;
}

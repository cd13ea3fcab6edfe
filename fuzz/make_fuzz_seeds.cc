// Writes seeds for the fuzz targets into CORPUS_DIR/<target>/ (each folder must exist): valid
// native metadata and data-file headers encoded by shardpoint, torch pickles and archives, and,
// from the checkpoints under SOURCE_ROOT/shardpoint/format/*/testdata (written by torch and by
// safetensors), their metadata in the wire encoding, their stored objects and attributes and the
// zstd items torch wrote.
// Usage: make_fuzz_seeds CORPUS_DIR SOURCE_ROOT
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <utility>

#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/safetensors/hf_directory.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/store/posix_store.h"

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
  // Tensors of 2 row chunks (a grid with listed cuts), of 4 (an even step), and in variant 2 one
  // whose chunks are listed out of grid order (a chunk list).
  for (int t = 0; t < 2 + variant; ++t) {
    const int pieces = t % 2 == 0 ? 2 : 4;
    sp::TensorMetadata tensor{"model.layer" + std::to_string(t) + ".w", dtypes[(t + variant) % 4],
                              {8, 2 + t}, {}};
    for (int piece = 0; piece < pieces; ++piece) {
      const int half = piece % 2;
      const int64_t rows = 8 / pieces;
      sp::StoredChunk c{sp::Box({rows * piece, 0}, {rows, 2 + t}), static_cast<uint32_t>(half), cursor[half], 0, {}};
      c.byte_length = static_cast<uint64_t>(c.box.volume()) * sp::DTypeSize(tensor.dtype);
      cursor[half] += c.byte_length;
      for (uint64_t b = 0; b < (c.byte_length + 15) / 16; ++b) c.block_crc32c.push_back(0x1234567u * (b + 1));
      tensor.chunks.push_back(c);
    }
    if (variant == 2 && t == 3) std::swap(tensor.chunks[0], tensor.chunks[1]);
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
  namespace ts = sp::torch_save;
  using P = ts::PlainValue;
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
  Write(unpickle_dir + "/plain", ts::EncodePlainPickle(plain).value());
  ts::TorchSaveLayout tensor = ts::LayoutTensorItem(sp::DType::kFloat32, {2, 3}).value();
  Write(unpickle_dir + "/tensor-data.pkl", tensor.data_pkl());
  Write(zip_dir + "/tensor", ts::TensorItemPrefix(tensor) + std::string(24, '\1') +
                                ts::TensorItemSuffix(tensor, 0));
  ts::TorchSaveLayout sd = ts::TorchSaveLayout::ForStateDict(
      {{"a", sp::DType::kUInt16, {2}}, {"b", sp::DType::kInt8, {}}}).value();
  Write(zip_dir + "/state-dict", sd.Head() + std::string(4, '\2') + sd.Between(0, 0) + "x" +
                                    sd.Tail(std::vector<uint32_t>{0, 0}));
  Write(zip_dir + "/object", ts::EncodePlainObjectItem(plain).value());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Exits on failure: a seed that cannot be made means the fixtures or the codecs changed.
template <typename T>
T Must(sp::Result<T> r, const std::string& what) {
  if (!r.ok()) {
    std::cerr << "make_fuzz_seeds: " << what << ": " << r.status().ToString() << "\n";
    std::exit(1);
  }
  return *std::move(r);
}

// A checkpoint read by its driver: its wire encoding, its objects' payloads and its attributes.
void MetadataSeeds(const sp::CheckpointMetadata& md, const std::string& name,
                   const std::string& corpus) {
  Write(corpus + "/metadata_wire/" + name, sp::EncodeMetadataForWire(md));
  // A load rank's part of it: the first chunk of every other tensor.
  sp::ChunkFilter first_chunks;
  for (size_t t = 0; t < md.tensors.size(); t += 2) {
    const sp::TensorMetadata& tensor = md.tensors[t];
    if (!tensor.chunks.empty()) first_chunks[tensor.name] = {tensor.chunks[0].box};
  }
  Write(corpus + "/metadata_wire/" + name + "-part",
        sp::EncodeMetadataPartForWire(md, first_chunks));
  // And that rank's request for it, as the coordinator receives it.
  Write(corpus + "/metadata_wire/" + name + "-request", sp::EncodeChunkFilter(first_chunks));
  for (size_t i = 0; i < md.objects.size(); ++i) {
    Write(corpus + "/objects/" + name + "-object" + std::to_string(i), md.objects[i].payload);
  }
  for (const auto& [key, value] : md.attributes) {
    Write(corpus + "/objects/" + name + "-" + key, value);
  }
}

// The real checkpoints in the source tree's testdata.
void TestdataSeeds(const std::string& corpus, const std::string& root) {
  sp::PosixStore store;
  const std::string dcp = root + "/shardpoint/format/torch_dcp/testdata/";
  for (const char* name : {"plain", "sharded", "zstd", "megatron"}) {
    MetadataSeeds(Must(sp::torch_dcp::ReadDcpCheckpoint(store, dcp + name, nullptr), dcp + name),
                  std::string("dcp-") + name, corpus);
  }
  const std::string st = root + "/shardpoint/format/safetensors/testdata/python_written.safetensors";
  MetadataSeeds(Must(sp::ReadSafetensorsDirectory(store, st), st), "safetensors", corpus);
  for (int v = 0; v < 3; ++v) MetadataSeeds(Seed(v), "native" + std::to_string(v), corpus);
  // The zstd items torch's ZStandard extension wrote, as stored.
  const std::string zstd = dcp + "zstd/";
  const std::string metadata = ReadFile(zstd + ".metadata");
  sp::torch_dcp::DcpMetadata md =
      Must(sp::torch_dcp::DecodeDcpMetadata(sp::AsBytes(metadata), zstd), zstd + ".metadata");
  int n = 0;
  for (const sp::torch_dcp::DcpStorageEntry& e : md.storage_data) {
    if (e.transform_descriptors.empty()) continue;
    const std::string data = ReadFile(zstd + e.relative_path);
    if (e.offset > data.size() || e.length > data.size() - e.offset) continue;
    Write(corpus + "/zstd_item/torch" + std::to_string(n++), data.substr(e.offset, e.length));
  }
  const std::string tensor = ReadFile(dcp + "tensor_f32.pt");
  Write(corpus + "/zstd_item/tensor_f32.pt",
        Must(sp::torch_dcp::EncodeZstdItem(sp::AsBytes(tensor)), "zstd of tensor_f32.pt"));
}

// JSON objects and attribute values beyond those the fixtures hold, and an index for
// hf_index_fuzz's fixed files.
void TextSeeds(const std::string& corpus) {
  Write(corpus + "/objects/json-kinds",
        "{\"a\": [1, -2, 0.5, 1e300, true, false, null, NaN, -Infinity], \"b\": {\"c\": \"\\u00e9\\ud83d\\ude00\"}, "
        "\"d\": [], \"e\": {}}");
  Write(corpus + "/objects/paths",
        "[[\"o\", [\"model\", 0, {\"int\": 3}, \"w\"]], [\"step\", [\"step\"]]]");
  Write(corpus + "/hf_index/index",
        "{\"metadata\": {\"total_size\": 66, \"format\": \"pt\"}, \"weight_map\": "
        "{\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", \"z\": \"b.safetensors\"}}");
  Write(corpus + "/hf_index/index-a",
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\"}}");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: make_fuzz_seeds CORPUS_DIR SOURCE_ROOT\n";
    return 2;
  }
  const std::string corpus = argv[1];
  for (int variant = 0; variant < 3; ++variant) {
    sp::CheckpointMetadata m = Seed(variant);
    Write(corpus + "/metadata/seed" + std::to_string(variant), sp::EncodeMetadata(m));
    Write(corpus + "/metadata/seed" + std::to_string(variant) + "-v1", sp::EncodeMetadata(m, 1));
    Write(corpus + "/metadata/seed" + std::to_string(variant) + "-v2", sp::EncodeMetadata(m, 2));
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      std::string file = sp::BuildDataFileHeader(m, f);
      file.resize(m.files[f].size, '\0');
      Write(corpus + "/safetensors/seed" + std::to_string(variant) + "-" + std::to_string(f), file);
    }
  }
  TorchSeeds(corpus + "/unpickle", corpus + "/zip");
  TestdataSeeds(corpus, argv[2]);
  TextSeeds(corpus);
  return 0;
}

// Writes archives and DCP checkpoints with the torch_dcp writers, for torch_reads_check.py to
// load with real torch (the ctest torch_dcp_torch_reads). Not installed.
// Usage: torch_dcp_write_fixture OUT_DIR
//
// Tensor bytes follow a pattern the check script recomputes: byte k of the tensor with seed s is
// (k * 31 + s * 7 + 1) mod 256, or k mod 2 for bool tensors.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::EncodePlainObjectItem;
using torch_save::LayoutTensorItem;
using torch_save::PlainValue;
using torch_save::TensorItemLayout;
using torch_save::TensorItemPrefix;
using torch_save::TensorItemSuffix;
using torch_save::TorchSaveLayout;
using torch_save::TorchSaveTensorSpec;

namespace {

std::string Pattern(DType dtype, uint64_t bytes, int seed) {
  std::string out(bytes, '\0');
  for (uint64_t k = 0; k < bytes; ++k) {
    out[k] = static_cast<char>(dtype == DType::kBool ? k % 2 : (k * 31 + seed * 7 + 1) % 256);
  }
  return out;
}

// The archive of `layout` with tensor i's bytes `data[i]`, assembled from the framing pieces.
std::string Assemble(const TorchSaveLayout& layout, const std::vector<std::string>& data) {
  std::string out = layout.Head();
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < data.size(); ++i) {
    crcs.push_back(Crc32(0, data[i].data(), data[i].size()));
    out += data[i];
    if (i + 1 < data.size()) out += layout.Between(i, crcs[i]);
  }
  return out + layout.Tail(crcs);
}

Status WriteFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  return out.good() ? OkStatus() : InternalError("cannot write " + path.string());
}

Status WriteTensors(const std::filesystem::path& dir) {
  int seed = 0;
  for (DType dtype : AllDTypes()) {
    SP_ASSIGN_OR_RETURN(TensorItemLayout layout, LayoutTensorItem(dtype, {2, 3}));
    std::string data = Pattern(dtype, layout.data_bytes(0), seed++);
    uint32_t crc = Crc32(0, data.data(), data.size());
    std::string bytes = TensorItemPrefix(layout) + data + TensorItemSuffix(layout, crc);
    SP_RETURN_IF_ERROR(WriteFile(dir / ("tensor_" + std::string(DTypeName(dtype)) + ".pt"), bytes));
  }
  std::vector<TorchSaveTensorSpec> specs = {{"model.weight", DType::kBFloat16, {3, 4}},
                                            {"model.bias", DType::kFloat32, {3}},
                                            {"scale", DType::kFloat8E4M3FN, {}},
                                            {"count", DType::kInt64, {2}}};
  SP_ASSIGN_OR_RETURN(TorchSaveLayout sd, TorchSaveLayout::ForStateDict(specs));
  std::vector<std::string> data;
  for (size_t i = 0; i < specs.size(); ++i) data.push_back(Pattern(specs[i].dtype, sd.data_bytes(i), 100 + i));
  SP_RETURN_IF_ERROR(WriteFile(dir / "state_dict.bin", Assemble(sd, data)));
  using P = PlainValue;
  P obj = P::Dict({{P::String("lr"), P::Float(0.25)},
                   {P::String("steps"), P::List({P::Int(1), P::Int(-2), P::Int(int64_t{1} << 40)})},
                   {P::String("betas"), P::Tuple({P::Float(0.9), P::Float(0.95)})},
                   {P::String("name"), P::String("caf\xc3\xa9")},
                   {P::String("flags"), P::Dict({{P::String("on"), P::Bool(true)}, {P::String("none"), P::None()}})},
                   {P::String("raw"), P::Bytes(std::string("\x00\x01\xff", 3))}});
  SP_ASSIGN_OR_RETURN(std::string object, EncodePlainObjectItem(obj));
  return WriteFile(dir / "object.pt", object);
}

// A float32 [4, 3] tensor "w" saved as two row chunks in two files (value at (i, j) is
// i * 3 + j + 0.5), a bfloat16 [5] tensor "b" with the byte pattern of seed 7, and BYTE_IO
// items "step" = 42 and "name" = "shardpoint". With `zstd`, every item is zstd-compressed.
Status WriteCheckpoint(const std::filesystem::path& dir, bool zstd) {
  std::filesystem::create_directories(dir);
  DcpMetadata md;
  md.state_dict_metadata = {{"w", DcpEntry::Kind::kTensor, {DType::kFloat32}, {4, 3}, {Box({0, 0}, {2, 3}), Box({2, 0}, {2, 3})}},
                            {"b", DcpEntry::Kind::kTensor, {DType::kBFloat16}, {5}, {Box({0}, {5})}},
                            {"step", DcpEntry::Kind::kBytes, {}, {}, {}},
                            {"name", DcpEntry::Kind::kBytes, {}, {}, {}}};
  std::string files[2];
  std::vector<std::string> descriptors;
  if (zstd) descriptors.push_back(kZstdTransformDescriptor);
  auto add = [&](const std::string& fqn, std::optional<std::vector<int64_t>> offsets, std::optional<int64_t> index,
                 int file, std::string item) -> Status {
    if (zstd) {
      SP_ASSIGN_OR_RETURN(item, EncodeZstdItem(AsBytes(item)));
    }
    md.storage_data.push_back({fqn, offsets, index, "__" + std::to_string(file) + "_0.distcp", files[file].size(),
                               item.size(), descriptors});
    files[file] += item;
    return OkStatus();
  };
  for (int chunk = 0; chunk < 2; ++chunk) {
    SP_ASSIGN_OR_RETURN(TensorItemLayout layout, LayoutTensorItem(DType::kFloat32, {2, 3}));
    std::string data(24, '\0');
    for (int k = 0; k < 6; ++k) {
      float v = static_cast<float>(chunk * 6 + k) + 0.5f;
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    SP_RETURN_IF_ERROR(add("w", std::vector<int64_t>{2 * chunk, 0}, chunk, chunk,
                           Assemble(layout, {data})));
  }
  SP_ASSIGN_OR_RETURN(TensorItemLayout b, LayoutTensorItem(DType::kBFloat16, {5}));
  SP_RETURN_IF_ERROR(add("b", std::vector<int64_t>{0}, 0, 0, Assemble(b, {Pattern(DType::kBFloat16, 10, 7)})));
  SP_ASSIGN_OR_RETURN(std::string step, EncodePlainObjectItem(PlainValue::Int(42)));
  SP_RETURN_IF_ERROR(add("step", std::nullopt, std::nullopt, 1, step));
  SP_ASSIGN_OR_RETURN(std::string name, EncodePlainObjectItem(PlainValue::String("shardpoint")));
  SP_RETURN_IF_ERROR(add("name", std::nullopt, std::nullopt, 0, name));
  md.planner_data = MakeDcpPlannerData({{"w", {std::string("w")}}, {"b", {std::string("b")}},
                                        {"step", {std::string("step")}}, {"name", {std::string("name")}}});
  md.storage_meta = DcpStorageMeta{dir.string(), "fixture", std::nullopt, {}};
  md.version = kDcpVersion;
  SP_ASSIGN_OR_RETURN(std::string metadata, EncodeDcpMetadata(md));
  SP_RETURN_IF_ERROR(WriteFile(dir / "__0_0.distcp", files[0]));
  SP_RETURN_IF_ERROR(WriteFile(dir / "__1_0.distcp", files[1]));
  return WriteFile(dir / kDcpMetadataFileName, metadata);
}

}  // namespace
}  // namespace sp::torch_dcp

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: torch_dcp_write_fixture OUT_DIR\n";
    return 2;
  }
  std::filesystem::path dir(argv[1]);
  std::filesystem::create_directories(dir);
  sp::Status status = sp::torch_dcp::WriteTensors(dir);
  if (status.ok()) status = sp::torch_dcp::WriteCheckpoint(dir / "dcp", false);
  if (status.ok()) status = sp::torch_dcp::WriteCheckpoint(dir / "dcp_zstd", true);
  if (!status.ok()) {
    std::cerr << status << "\n";
    return 1;
  }
  return 0;
}

#include "shardpoint/format/torch_dcp/dcp_metadata.h"

#include <gtest/gtest.h>

#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::MemoryRangeReader;
using torch_save::ParseTorchSaveObject;
using torch_save::ParseTorchSaveTensor;
using torch_save::PickleWriter;
using torch_save::PlainValue;
using torch_save::PlainValueToString;
using torch_save::TorchSaveTensorInfo;

namespace {

Result<DcpMetadata> Decode(const std::string& bytes, std::string_view path = "/ckpt/.metadata") {
  return DecodeDcpMetadata(AsBytes(bytes), path);
}

TEST(DecodeDcpMetadata, PlainStateDictFromTorch) {
  Result<DcpMetadata> md = Decode(TestData("plain/.metadata"), "plain/.metadata");
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->state_dict_metadata.size(), 10u);
  const DcpEntry* w = md->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->kind, DcpEntry::Kind::kTensor);
  EXPECT_EQ(w->properties.dtype, DType::kFloat32);
  EXPECT_EQ(w->size, (Shape{3, 4}));
  ASSERT_EQ(w->chunks.size(), 1u);
  EXPECT_EQ(w->chunks[0], Box({0, 0}, {3, 4}));
  EXPECT_EQ(md->Find("b")->properties.dtype, DType::kBFloat16);
  EXPECT_EQ(md->Find("scalar")->size, Shape{});
  EXPECT_EQ(md->Find("step")->kind, DcpEntry::Kind::kBytes);
  ASSERT_EQ(md->storage_data.size(), 10u);
  std::vector<int64_t> origin = {0, 0};
  const DcpStorageEntry* ws = md->FindStorage("w", &origin);
  ASSERT_NE(ws, nullptr);
  EXPECT_EQ(ws->relative_path, "__0_0.distcp");
  EXPECT_EQ(ws->index, 0);
  const DcpStorageEntry* step = md->FindStorage("step", nullptr);
  ASSERT_NE(step, nullptr);
  EXPECT_FALSE(step->index.has_value());
  ASSERT_TRUE(md->storage_meta.has_value());
  EXPECT_EQ(md->storage_meta->checkpoint_id, "plain");
  EXPECT_EQ(md->version, "1.0.0");
  Result<std::vector<DcpPlannerPath>> paths = ParseDcpPlannerData(*md->planner_data);
  ASSERT_TRUE(paths.ok()) << paths.status();
  EXPECT_EQ((*paths)[0].fqn, "w");

  // Every item lies in the data file and parses: tensors as tensors, BYTE_IO items as data.
  std::string data = TestData("plain/__0_0.distcp");
  for (const DcpStorageEntry& s : md->storage_data) {
    ASSERT_LE(s.offset + s.length, data.size());
    ByteView item = AsBytes(data).subspan(s.offset, s.length);
    if (s.chunk_offsets.has_value()) {
      Result<TorchSaveTensorInfo> t = ParseTorchSaveTensor(MemoryRangeReader(item), s.length, s.fqn);
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(t->shape, md->Find(s.fqn)->chunks[0].sizes);
    } else {
      Result<PlainValue> v = ParseTorchSaveObject(MemoryRangeReader(item), s.length, s.fqn);
      ASSERT_TRUE(v.ok()) << v.status();
      if (s.fqn == "betas") {
        EXPECT_EQ(PlainValueToString(*v), "(0.90000000000000002, 0.999)");
      }
      if (s.fqn == "name") {
        EXPECT_EQ(*v, PlainValue::String("run-1"));
      }
    }
  }
}

TEST(DecodeDcpMetadata, ShardedNestedStateDictFromTwoRanks) {
  Result<DcpMetadata> md = Decode(TestData("sharded/.metadata"));
  ASSERT_TRUE(md.ok()) << md.status();
  const DcpEntry* rows = md->Find("model.layers.0.w");
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(rows->chunks, (std::vector<Box>{Box({0, 0}, {2, 6}), Box({2, 0}, {2, 6})}));
  const DcpEntry* cols = md->Find("model.layers.1.w");
  EXPECT_EQ(cols->properties.dtype, DType::kBFloat16);
  EXPECT_EQ(cols->chunks, (std::vector<Box>{Box({0, 0}, {2, 3}), Box({0, 3}, {2, 3})}));
  std::vector<int64_t> second = {0, 3};
  const DcpStorageEntry* s = md->FindStorage("model.layers.1.w", &second);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->relative_path, "__1_0.distcp");
  EXPECT_EQ(s->index, 1);
  Result<std::vector<DcpPlannerPath>> paths = ParseDcpPlannerData(*md->planner_data);
  ASSERT_TRUE(paths.ok());
  bool found = false;
  for (const DcpPlannerPath& p : *paths) {
    if (p.fqn != "optim.param_groups.0.lr") continue;
    found = true;
    EXPECT_EQ(p.path, (std::vector<std::variant<std::string, int64_t>>{
                          std::string("optim"), std::string("param_groups"), int64_t{0}, std::string("lr")}));
  }
  EXPECT_TRUE(found);
}

TEST(DecodeDcpMetadata, ProtocolVariantsDecodeAlike) {
  Result<DcpMetadata> p4 = Decode(TestData("plain/.metadata"));
  Result<DcpMetadata> p2 = Decode(TestData("metadata_p2.metadata"));
  Result<DcpMetadata> p5 = Decode(TestData("metadata_p5.metadata"));
  ASSERT_TRUE(p4.ok() && p2.ok() && p5.ok()) << p2.status() << p5.status();
  EXPECT_EQ(*p2, *p4);
  EXPECT_EQ(*p5, *p4);
}

TEST(EncodeDcpMetadata, RoundTripsTorchFixtures) {
  for (const char* file : {"plain/.metadata", "sharded/.metadata", "zstd/.metadata"}) {
    Result<DcpMetadata> md = Decode(TestData(file), file);
    ASSERT_TRUE(md.ok()) << md.status();
    Result<std::string> bytes = EncodeDcpMetadata(*md);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    Result<DcpMetadata> again = Decode(*bytes, file);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *md) << file;
    EXPECT_EQ(bytes->substr(0, 2), "\x80\x02");  // protocol 2
  }
}

DcpMetadata SmallModel() {
  DcpMetadata md;
  DcpEntry w{"w", DcpEntry::Kind::kTensor, {DType::kFloat32}, {4, 2}, {Box({0, 0}, {2, 2}), Box({2, 0}, {2, 2})}};
  DcpEntry step{"step", DcpEntry::Kind::kBytes, {}, {}, {}};
  md.state_dict_metadata = {w, step};
  md.storage_data = {{"w", std::vector<int64_t>{0, 0}, 0, "__0_0.distcp", 0, 100, {}},
                     {"w", std::vector<int64_t>{2, 0}, 1, "__1_0.distcp", 0, 100, {"stream.zstd/1"}},
                     {"step", std::nullopt, std::nullopt, "__0_0.distcp", 100, 50, {}}};
  md.planner_data = MakeDcpPlannerData({{"w", {std::string("w")}}, {"step", {std::string("step")}}});
  md.storage_meta = DcpStorageMeta{"/ckpt", "id", std::nullopt, {}};
  md.version = kDcpVersion;
  return md;
}

TEST(EncodeDcpMetadata, ModelRoundTrips) {
  DcpMetadata md = SmallModel();
  Result<std::string> bytes = EncodeDcpMetadata(md);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  Result<DcpMetadata> back = Decode(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);
}

// planner_data is any plain data. bytes in it are written as protocol 2 writes them
// (_codecs.encode, and bytes() when empty), and what EncodeDcpMetadata writes must decode again.
TEST(EncodeDcpMetadata, PlannerDataWithBytesRoundTrips) {
  DcpMetadata md = SmallModel();
  md.planner_data = PlainValue::Dict(
      {{PlainValue::String("w"), PlainValue::Tuple({PlainValue::String("w"), PlainValue::Bytes("")})},
       {PlainValue::String("step"),
        PlainValue::Tuple({PlainValue::Bytes(std::string("\x00\x7f\x80\xff", 4)), PlainValue::Int(1)})}});
  Result<std::string> bytes = EncodeDcpMetadata(md);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_NE(bytes->find("c__builtin__\nbytes"), std::string::npos);
  EXPECT_NE(bytes->find("_codecs\nencode"), std::string::npos);
  Result<DcpMetadata> back = Decode(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);
  Result<std::string> again = EncodeDcpMetadata(*back);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *bytes);
}

TEST(ValidateDcpMetadata, RefusesInconsistentModels) {
  auto expect = [](DcpMetadata md, std::string_view fragment) {
    SP_EXPECT_ERROR(EncodeDcpMetadata(md).status(), StatusCode::kInvalidArgument, fragment);
    SP_EXPECT_ERROR(ValidateDcpMetadata(md, "/x/.metadata", StatusCode::kDataLoss), StatusCode::kDataLoss,
                    "/x/.metadata");
  };
  DcpMetadata md = SmallModel();
  md.state_dict_metadata[0].chunks[1] = Box({3, 0}, {2, 2});
  expect(md, "key 'w': chunk [3:5, 0:2] is not inside size [4, 2]");
  md = SmallModel();
  md.storage_data[1].chunk_offsets = std::vector<int64_t>{1, 0};
  expect(md, "key 'w': storage entry for chunk offsets [1, 0] that no chunk has");
  md = SmallModel();
  md.storage_data.pop_back();
  expect(md, "key 'step': no storage entry");
  md = SmallModel();
  md.storage_data[0].relative_path = "../../etc/passwd";
  expect(md, "unsafe relative_path '../../etc/passwd'");
  md = SmallModel();
  md.storage_data[2].fqn = "ghost";
  expect(md, "key 'ghost': storage entry for a key that is not in state_dict_metadata");
  md = SmallModel();
  md.state_dict_metadata.push_back(md.state_dict_metadata[1]);
  expect(md, "key 'step': key appears twice");
  md = SmallModel();
  md.storage_data[0].length = uint64_t{1} << 63;
  expect(md, "out of range");
}

TEST(DecodeDcpMetadata, RefusesHostilePickles) {
  std::string good = TestData("plain/.metadata");
  for (size_t n = 0; n < good.size(); n += 7) {
    Result<DcpMetadata> md = Decode(good.substr(0, n));
    EXPECT_FALSE(md.ok()) << n;
    EXPECT_EQ(md.status().code(), StatusCode::kDataLoss) << md.status();
  }
  PickleWriter system;
  system.Global("os", "system");
  system.String("rm -rf /");
  system.Tuple(1);
  system.Reduce();
  SP_EXPECT_ERROR(Decode(system.Finish()).status(), StatusCode::kDataLoss,
                  "global 'os.system' is not in the DCP metadata allowlist");
  PickleWriter eval;
  eval.Global("builtins", "eval");
  SP_EXPECT_ERROR(Decode(eval.Finish()).status(), StatusCode::kDataLoss, "'builtins.eval'");
  PickleWriter list;
  list.EmptyList();
  SP_EXPECT_ERROR(Decode(list.Finish()).status(), StatusCode::kDataLoss,
                  "root: expected torch.distributed.checkpoint.metadata.Metadata, got list of 0");
  // A dtype shardpoint has no type for.
  std::string bytes = EncodeDcpMetadata(SmallModel()).value();
  size_t at = bytes.find("float32");
  ASSERT_NE(at, std::string::npos);
  std::string complex32 = bytes.substr(0, at) + "complex32" + bytes.substr(at + 7);
  SP_EXPECT_ERROR(Decode(complex32).status(), StatusCode::kUnimplemented, "dtype torch.complex32");
}

}  // namespace
}  // namespace sp::torch_dcp

// Plain objects: the kPlain pickle codec and how DCP BYTE_IO items become stored objects.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_save/test_util.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp::torch_save {
namespace {

using P = PlainValue;

uint64_t Bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  return u;
}

TEST(DecodePlainPickle, ReadsWhatPythonWrites) {
  // pickle.dumps({(1, 2): [b'\x00', None], 1.5: (True,), None: -2**63}, protocol=2)
  const std::string pickle(
      "\x80\x02}q\x00(K\x01K\x02\x86q\x01]q\x02(c_codecs\nencode\nq\x03X\x01\x00\x00\x00\x00q\x04"
      "X\x06\x00\x00\x00latin1q\x05\x86q\x06Rq\x07NeG?\xf8\x00\x00\x00\x00\x00\x00\x88\x85q\x08"
      "N\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80u.",
      90);
  Result<PlainValue> v = DecodePlainPickle(pickle, "object 'x'");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(PlainValueToString(*v),
            "{(1, 2): [b'\\x00', None], 1.5: (True,), None: -9223372036854775808}");
}

TEST(DecodePlainPickle, RefusesCodeNamingTheGlobal) {
  // pickle.dumps of an object whose __reduce__ is (os.system, ('true',)).
  const std::string pickle("\x80\x02\x63posix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.",
                           36);
  SP_EXPECT_ERROR(DecodePlainPickle(pickle, "object 'evil'").status(), StatusCode::kDataLoss,
                  "posix.system");
  SP_EXPECT_ERROR(DecodePlainPickle(pickle, "object 'evil'").status(), StatusCode::kDataLoss,
                  "object 'evil'");
}

PlainValue EveryKind() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  return P::Dict({
      {P::String("betas"), P::Tuple({P::Float(0.9), P::Float(0.999)})},
      {P::Int(3), P::Tuple({P::Tuple({}), P::Tuple({P::Int(1)}), P::List({P::Bool(true), P::Int(1)})})},
      {P::Tuple({P::Int(1), P::String("a")}), P::List({P::Float(nan), P::Float(-inf), P::Float(-0.0)})},
      {P::None(), P::Bytes(std::string("\x00\xff\x80", 3))},
      {P::Bool(false), P::Int(std::numeric_limits<int64_t>::min())},
      {P::Float(1.5), P::Int(std::numeric_limits<int64_t>::max())},
  });
}

// The float bit patterns of `v`, depth first: NaN compares unequal to itself, bits do not.
void FloatBits(const PlainValue& v, std::vector<uint64_t>* out) {
  if (v.is(P::Kind::kFloat)) out->push_back(Bits(v.float_value));
  for (const PlainValue& item : v.items) FloatBits(item, out);
}

TEST(ObjectFromTorchSaveItem, PlainDataBecomesAnExactPlainPickle) {
  const PlainValue v = EveryKind();
  Result<std::string> item = EncodePlainObjectItem(v);
  ASSERT_TRUE(item.ok()) << item.status();
  ObjectEntry o = ObjectFromTorchSaveItem("optim.param_groups", *item);
  EXPECT_EQ(o.name, "optim.param_groups");
  ASSERT_EQ(o.encoding, ObjectEncoding::kPlain);
  Result<PlainValue> back = DecodePlainPickle(o.payload, "back");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(PlainValueToString(*back), PlainValueToString(v));
  std::vector<uint64_t> want, got;
  FloatBits(v, &want);
  FloatBits(*back, &got);
  EXPECT_EQ(got, want);
  EXPECT_EQ(Bits(back->value(2).items[2].float_value), Bits(-0.0));
}

TEST(ObjectFromTorchSaveItem, OtherArchivesStayTorchSave) {
  // A tensor inside: torch._utils globals are not plain data.
  Result<TorchSaveLayout> layout = TorchSaveLayout::ForTensor(DType::kFloat32, {2});
  ASSERT_TRUE(layout.ok());
  std::string data(8, '\0');
  uint32_t crc = Crc32(0, data.data(), data.size());
  std::string tensor = layout->Head() + data + layout->Tail(std::span<const uint32_t>(&crc, 1));
  ObjectEntry o = ObjectFromTorchSaveItem("t", tensor);
  EXPECT_EQ(o.encoding, ObjectEncoding::kTorchSave);
  EXPECT_EQ(o.payload, tensor);
  // Code: refused by the restricted reader, kept as it is for Python to judge.
  const std::string evil_pkl("\x80\x02\x63posix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.",
                             36);
  std::string evil = BuildZip({{"archive/data.pkl", evil_pkl}, {"archive/version", "3\n"}}).value();
  EXPECT_EQ(ObjectFromTorchSaveItem("evil", evil).encoding, ObjectEncoding::kTorchSave);
  // Not an archive at all.
  EXPECT_EQ(ObjectFromTorchSaveItem("junk", "PK junk").encoding, ObjectEncoding::kTorchSave);
}

TEST(ObjectFromTorchSaveItem, LargeItemsAreNotExaminedEagerly) {
  const std::string big(kMaxPlainObjectItemBytes, 'x');
  Result<std::string> item = EncodePlainObjectItem(P::String(big));
  ASSERT_TRUE(item.ok()) << item.status();
  ASSERT_GT(item->size(), kMaxPlainObjectItemBytes);
  EXPECT_EQ(ObjectFromTorchSaveItem("big", *item).encoding, ObjectEncoding::kTorchSave);
  Result<std::string> small = EncodePlainObjectItem(P::String(std::string(1000, 'x')));
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(ObjectFromTorchSaveItem("small", *small).encoding, ObjectEncoding::kPlain);
}

}  // namespace
}  // namespace sp::torch_save

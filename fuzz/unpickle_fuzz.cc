// libFuzzer target for the restricted unpickler and the DCP metadata decoder
// (shardpoint/format/torch_save, docs/TORCH_DCP.md).
//
// Each input is unpickled under the three allowlists. Whatever decodes must re-encode to bytes
// that decode again and encode to the same bytes: DCP metadata through EncodeDcpMetadata, plain
// data through EncodePlainPickle. Walking a decoded tree must never crash, even when the pickle
// builds a cycle.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_save/pickle.h"
#include "shardpoint/format/torch_save/plain_value.h"

namespace {

using namespace sp::torch_dcp;   // NOLINT
using namespace sp::torch_save;  // NOLINT

// Names the failed check on stderr before aborting, so a campaign's log says which property broke.
void CheckAt(bool condition, const char* what, int line) {
  if (condition) return;
  std::fprintf(stderr, "unpickle_fuzz.cc:%d: check failed: %s\n", line, what);
  std::abort();
}
#define Check(condition) CheckAt((condition), #condition, __LINE__)

void MetadataRoundTrip(sp::ByteView bytes) {
  sp::Result<DcpMetadata> md = DecodeDcpMetadata(bytes, "fuzz");
  if (!md.ok()) return;
  sp::Result<std::string> encoded = EncodeDcpMetadata(*md);
  Check(encoded.ok());
  sp::Result<DcpMetadata> again = DecodeDcpMetadata(sp::AsBytes(*encoded), "fuzz");
  if (!again.ok()) std::fprintf(stderr, "%s\n", again.status().ToString().c_str());
  Check(again.ok());
  sp::Result<std::string> twice = EncodeDcpMetadata(*again);
  Check(twice.ok() && *twice == *encoded);
}

void PlainRoundTrip(sp::ByteView bytes, std::span<const PickleGlobalName> globals, bool persistent) {
  UnpickleOptions options;
  options.what = "fuzz";
  options.allowed_globals = globals;
  options.allow_persistent_id = persistent;
  options.max_nodes = 1 << 16;
  sp::Result<PickleTree> tree = Unpickle(bytes, options);
  if (!tree.ok()) return;
  DescribePickleValue(tree->root());
  FindAttribute(tree->root(), "fqn");
  // The product's budget lets a 200-byte input name 2^16 + 3,200 values (PlainValueBudget);
  // converting them takes milliseconds, but re-encoding and decoding them again below, under
  // ASan, takes seconds per input. The round trip is checked on values of a smaller budget; the
  // product's budget has unit tests of its own (pickle_test).
  constexpr uint64_t kRoundTripValues = uint64_t{1} << 16;
  sp::Result<PlainValue> plain =
      ToPlainValue(tree->root(), "fuzz", std::min(PlainValueBudget(bytes.size()), kRoundTripValues));
  if (!plain.ok()) return;
  PlainValueToString(*plain);
  sp::Result<std::string> encoded = EncodePlainPickle(*plain);
  Check(encoded.ok());
  options.allowed_globals = PlainDataGlobals();
  options.max_nodes = 1 << 26;
  sp::Result<PickleTree> back = Unpickle(sp::AsBytes(*encoded), options);
  Check(back.ok());
  sp::Result<PlainValue> plain_back =
      ToPlainValue(back->root(), "fuzz", PlainValueBudget(encoded->size()));
  Check(plain_back.ok());
  sp::Result<std::string> twice = EncodePlainPickle(*plain_back);
  Check(twice.ok() && *twice == *encoded);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sp::ByteView bytes(reinterpret_cast<const std::byte*>(data), size);
  MetadataRoundTrip(bytes);
  PlainRoundTrip(bytes, PlainDataGlobals(), false);
  PlainRoundTrip(bytes, TorchSaveTensorGlobals(), true);
  return 0;
}

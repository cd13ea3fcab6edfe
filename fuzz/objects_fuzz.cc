// libFuzzer target for the decoders of native object payloads and parsed attributes
// (docs/FORMAT.md, docs/TORCH_DCP.md): JSON objects (ParseJson with the full syntax, then the
// conversion to Python values that torch-dcp and Megatron saves perform), plain-data pickles
// (DecodePlainPickle), torch.save archives stored as objects (ObjectFromTorchSaveItem), and the
// "python.state_dict_paths" attribute.
//
// Every input is tried as each of them. Invariants checked besides the absence of crashes:
//  - a JSON or plain-pickle object that converts to a DCP BYTE_IO item yields an archive that the
//    restricted torch.save reader parses back to plain data re-encoding to the same bytes;
//  - ObjectFromTorchSaveItem keeps a refused archive byte for byte, and a plain one becomes a
//    pickle that decodes and re-encodes to itself;
//  - a `.metadata` or common.pt built with the attribute decodes again, and a common.pt built
//    with an object either decodes again or is refused as an argument error (an object past
//    the readers' limits at its path).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "shardpoint/base/json.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace {

using namespace sp::torch_dcp;   // NOLINT
using namespace sp::torch_save;  // NOLINT

void Check(bool condition) {
  if (!condition) std::abort();
}

sp::CheckpointMetadata WithObject(sp::ObjectEncoding encoding, std::string payload) {
  sp::CheckpointMetadata md;
  md.save_id = "fuzz";
  md.objects = {{"o", encoding, std::move(payload)}};
  return md;
}

// The archive `item` holds plain data whose archive is `item` again.
void CheckPlainItem(const std::string& item) {
  RangeReader read = MemoryRangeReader(sp::AsBytes(item));
  sp::Result<PlainValue> value = ParseTorchSaveObject(read, item.size(), "fuzz");
  Check(value.ok());
  sp::Result<std::string> again = EncodePlainObjectItem(*value);
  Check(again.ok() && *again == item);
}

// A native object of `encoding` as a torch-dcp BYTE_IO item and inside a Megatron common.pt.
void ObjectAsItems(sp::ObjectEncoding encoding, std::string_view payload) {
  sp::CheckpointMetadata md = WithObject(encoding, std::string(payload));
  sp::Result<DcpObjectFile> file = BuildDcpObjectFile(md, 0);
  if (!file.ok()) return;
  for (const DcpObjectItem& item : file->items) {
    Check(item.offset <= file->bytes.size() && item.length <= file->bytes.size() - item.offset);
    CheckPlainItem(file->bytes.substr(item.offset, item.length));
  }
  // Refused only as an argument error (an object past the readers' depth or value limits at its
  // path in common.pt); what is written reads back.
  sp::Result<std::string> common = BuildMegatronCommonFile(md);
  if (!common.ok()) {
    Check(common.status().code() == sp::StatusCode::kInvalidArgument);
    return;
  }
  Check(DecodeMegatronCommon(sp::AsBytes(*common), "fuzz").ok());
}

// True when `text` is JSON (the object and the attribute are tried only then).
bool JsonObject(std::string_view text) {
  sp::Result<sp::JsonValue> json = sp::ParseJson(text, "fuzz", sp::JsonSyntax::kFull);
  sp::Result<sp::JsonValue> subset = sp::ParseJson(text, "fuzz");
  if (subset.ok()) Check(json.ok());  // the subset is a subset
  if (json.ok()) ObjectAsItems(sp::ObjectEncoding::kJson, text);
  return json.ok();
}

void PlainObject(std::string_view pickle) {
  sp::Result<PlainValue> value = DecodePlainPickle(pickle, "fuzz");
  if (!value.ok()) return;
  sp::Result<std::string> encoded = EncodePlainPickle(*value);
  Check(encoded.ok());
  sp::Result<PlainValue> again = DecodePlainPickle(*encoded, "fuzz");
  Check(again.ok());
  sp::Result<std::string> twice = EncodePlainPickle(*again);
  Check(twice.ok() && *twice == *encoded);
  ObjectAsItems(sp::ObjectEncoding::kPlain, pickle);
}

void TorchSaveObject(std::string_view archive) {
  sp::ObjectEntry o = ObjectFromTorchSaveItem("o", std::string(archive));
  Check(o.name == "o");
  if (o.encoding == sp::ObjectEncoding::kTorchSave) {
    Check(o.payload == archive);
    return;
  }
  Check(o.encoding == sp::ObjectEncoding::kPlain);
  sp::Result<PlainValue> value = DecodePlainPickle(o.payload, "fuzz");
  Check(value.ok());
  sp::Result<std::string> encoded = EncodePlainPickle(*value);
  Check(encoded.ok() && *encoded == o.payload);
}

// The attribute as a torch-dcp save and a Megatron save would read it.
void PathsAttribute(std::string_view text) {
  sp::CheckpointMetadata md = WithObject(sp::ObjectEncoding::kJson, "1");
  md.attributes[kStateDictPathsAttribute] = std::string(text);
  sp::Result<DcpObjectFile> objects = BuildDcpObjectFile(md, 0);
  Check(objects.ok());
  sp::Result<std::string> metadata = BuildDcpMetadataFile(md, *objects, "fuzz");
  if (metadata.ok()) {
    sp::Result<DcpMetadata> decoded = DecodeDcpMetadata(sp::AsBytes(*metadata), "fuzz");
    Check(decoded.ok() && decoded->planner_data.has_value());
    Check(ParseDcpPlannerData(*decoded->planner_data).ok());
  }
  sp::Result<std::string> common = BuildMegatronCommonFile(md);
  if (common.ok()) Check(DecodeMegatronCommon(sp::AsBytes(*common), "fuzz").ok());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // An attribute that is not JSON stops at the parser, as a JSON object does.
  if (JsonObject(bytes)) PathsAttribute(bytes);
  PlainObject(bytes);
  TorchSaveObject(bytes);
  return 0;
}

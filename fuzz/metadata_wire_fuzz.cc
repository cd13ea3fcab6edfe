// libFuzzer target for the metadata wire codec (shardpoint/format/metadata_wire.h), which ranks
// decode from the coordinator of a load: the whole metadata, or a rank's part of it.
//
// A decoded model must re-encode to bytes that decode to the same model and encode to the same
// bytes again. The encoding is never longer than the input: decoding drops repeated attribute
// keys, varints may come padded, names may share less with the name before than they could, and
// grids may come as lists. (It may differ from an input as long: "aaa" after "aa" shares two
// bytes either at the start or at the end.) A re-encoding cut by one byte is refused.
//
// A decoded part (a load rank's: a tensor with kept chunks, or a data file without a name, which
// a part does not hold) re-encodes only from the whole it came from, which the input does not
// carry: its kept numbers are checked instead. For a whole model whose sizes are sound (what a
// coordinator encodes parts of), the part that a filter taken from the input keeps decodes to
// what the whole encoding decodes to with that filter, files not held aside, and the part the
// coordinator appends for that filter's request decoded as a list is the same bytes.
//
// The input is also read as a rank's request (a chunk filter): as a map and as a list it decodes
// to the same names and boxes or fails with the same error, and a filter decoded re-encodes to
// bytes that decode to it again.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/geometry/box.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

// The input as a rank's request for its part of the metadata.
void CheckAsChunkFilter(std::string_view bytes) {
  const sp::Result<sp::ChunkFilter> filter = sp::DecodeChunkFilter(bytes, "fuzz");
  const sp::Result<sp::ChunkFilterList> list = sp::DecodeChunkFilterList(bytes, "fuzz");
  Check(filter.ok() == list.ok());
  if (!filter.ok()) {
    Check(filter.status() == list.status());
    return;
  }
  Check(filter->size() == list->size());
  size_t i = 0;
  for (const auto& [name, boxes] : *filter) {
    Check(list->name(i) == name && list->boxes(i).size() == boxes.size());
    for (size_t b = 0; b < boxes.size(); ++b) Check(list->boxes(i)[b] == boxes[b]);
    ++i;
  }
  const sp::Result<sp::ChunkFilter> again =
      sp::DecodeChunkFilter(sp::EncodeChunkFilter(*filter), "fuzz");
  Check(again.ok() && *again == *filter);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  CheckAsChunkFilter(bytes);
  sp::Result<sp::CheckpointMetadata> decoded = sp::DecodeMetadataFromWire(bytes);
  if (!decoded.ok()) return 0;
  bool part = false;
  for (const sp::DataFile& f : decoded->files) part = part || f.name.empty();
  for (const sp::TensorMetadata& t : decoded->tensors) {
    if (!t.kept) continue;
    part = true;
    Check(t.kept->size() == t.chunks.size() && !t.grid && !t.index);
    for (size_t k = 1; k < t.kept->size(); ++k) Check((*t.kept)[k - 1] < (*t.kept)[k]);
  }
  if (part) return 0;
  std::string encoded = sp::EncodeMetadataForWire(*decoded);
  Check(encoded.size() <= size);
  sp::Result<sp::CheckpointMetadata> again = sp::DecodeMetadataFromWire(encoded);
  Check(again.ok() && *again == *decoded);
  Check(sp::EncodeMetadataForWire(*again) == encoded);
  sp::Result<sp::CheckpointMetadata> cut =
      sp::DecodeMetadataFromWire(std::string_view(encoded).substr(0, encoded.size() - 1));
  Check(!cut.ok());
  if (!sp::ValidateCheckpointSizes(*decoded, "fuzz").ok()) return 0;
  sp::ChunkFilter filter;
  for (size_t i = 0; i < decoded->tensors.size(); ++i) {
    const sp::TensorMetadata& t = decoded->tensors[i];
    if (i % 3 == 2) continue;  // not named: keeps none
    filter[t.name] = {t.chunks.empty() || i % 3 == 1 ? sp::Box::Whole(t.shape)
                                                     : t.chunks[size % t.chunks.size()].box};
  }
  const std::string part_bytes = sp::EncodeMetadataPartForWire(*decoded, filter);
  std::string answered = "n";  // as the coordinator answers: behind a prefix, from the request
  sp::MetadataPartEncoder(*decoded).EncodeTo(
      sp::DecodeChunkFilterList(sp::EncodeChunkFilter(filter), "fuzz").value(), &answered);
  Check(answered == "n" + part_bytes);
  sp::Result<sp::CheckpointMetadata> mine = sp::DecodeMetadataFromWire(part_bytes);
  sp::Result<sp::CheckpointMetadata> expected =
      sp::DecodeMetadataFromWire(encoded, nullptr, &filter);
  Check(mine.ok() && expected.ok());
  Check(mine->tensors == expected->tensors && mine->objects == expected->objects &&
        mine->attributes == expected->attributes && mine->save_id == expected->save_id);
  Check(mine->files.size() == expected->files.size());
  for (size_t f = 0; f < mine->files.size(); ++f) {
    Check(mine->files[f] == expected->files[f] || mine->files[f] == sp::DataFile());
  }
  return 0;
}

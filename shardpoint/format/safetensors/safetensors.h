// The safetensors header: encode, parse and validate.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (padded with
// spaces), then the data section. The header maps tensor names to {dtype, shape, data_offsets}
// and may hold a "__metadata__" object of string pairs. Native shardpoint data files are
// safetensors files (one entry per chunk; docs/FORMAT.md §2), and the hf-safetensors driver reads
// Hugging Face checkpoints with the same parser.
//
// Parsing treats the bytes as hostile and applies the validation rules of the reference
// implementation (docs/FORMAT.md §2.1). Every violation is kDataLoss naming the file and, where
// there is one, the entry. All functions are thread-safe; ReadSafetensorsHeader only reads `file`.
#ifndef SHARDPOINT_FORMAT_SAFETENSORS_SAFETENSORS_H_
#define SHARDPOINT_FORMAT_SAFETENSORS_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

// Largest header JSON a reader accepts (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
// Most dimensions an entry may have.
inline constexpr size_t kMaxSafetensorsRank = 64;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t begin = 0;  // data offsets relative to the data section; end exclusive
  uint64_t end = 0;

  friend bool operator==(const SafetensorsEntry&, const SafetensorsEntry&) = default;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted by (begin, end); ties keep header order
  std::map<std::string, std::string> metadata;  // the "__metadata__" pairs
  uint64_t data_start = 0;  // 8 + N: file offset of the data section
};

// The first 8 + N bytes of a safetensors file: the length, then compact JSON with "__metadata__"
// first (omitted when `metadata` is empty) and the entries in the order given, padded with spaces
// so that N is a multiple of 8 (the data section starts 8-byte aligned). The caller provides
// consistent entries (offsets, sizes, names other than "__metadata__"); the function does not
// validate them.
// `data_alignment`: as SafetensorsHeaderBuilder::Finish.
std::string EncodeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                    const std::map<std::string, std::string>& metadata,
                                    uint64_t data_alignment = 8);

// The same bytes built entry by entry, for callers with many entries whose names and shapes they
// hold elsewhere (no SafetensorsEntry per entry).
class SafetensorsHeaderBuilder {
 public:
  explicit SafetensorsHeaderBuilder(const std::map<std::string, std::string>& metadata);
  void Add(std::string_view name, DType dtype, std::span<const int64_t> shape, uint64_t begin,
           uint64_t end);
  // The header, padded with spaces so that the data section starts at a multiple of
  // `data_alignment` bytes of the file (a multiple of 8: trailing spaces are valid JSON
  // whitespace, and safetensors readers accept them).
  std::string Finish(uint64_t data_alignment = 8) &&;

 private:
  std::string json_;
};

// Parses and validates the header of a file of `file_size` bytes whose first bytes are
// `bytes_from_file_start` (at least 8 + N of them; more are ignored). `path` names the file in
// messages. kDataLoss for any violation; kUnimplemented for a valid safetensors dtype shardpoint
// has no type for (F4, F6_E2M3, F6_E3M2).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view bytes_from_file_start,
                                                 uint64_t file_size, std::string_view path);

// Reads the 8-byte length, then the header, from `file`, and parses it as above.
Result<SafetensorsHeader> ReadSafetensorsHeader(ReadableFile& file);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_SAFETENSORS_SAFETENSORS_H_

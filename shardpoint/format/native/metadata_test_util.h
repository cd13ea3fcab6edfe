// Test helpers for the native format: random, valid CheckpointMetadata and a field-by-field
// comparison. Header-only; used by the format tests only.
#ifndef SHARDPOINT_FORMAT_NATIVE_METADATA_TEST_UTIL_H_
#define SHARDPOINT_FORMAT_NATIVE_METADATA_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>

#include "shardpoint/base/dtype.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/native/metadata_codec.h"

namespace sp::testing {

inline std::string RandomBytes(std::mt19937_64& rng, size_t max_len) {
  std::string out(rng() % (max_len + 1), '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

// The boxes of a grid that splits each dimension of `shape` into 1..3 contiguous pieces.
inline std::vector<Box> RandomGrid(std::mt19937_64& rng, const Shape& shape) {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> cuts(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) {
      cuts[d].push_back({0, 0});
      continue;
    }
    int64_t pieces = 1 + static_cast<int64_t>(rng() % std::min<int64_t>(3, shape[d]));
    std::set<int64_t> bounds = {0, shape[d]};
    while (static_cast<int64_t>(bounds.size()) < pieces + 1) bounds.insert(1 + rng() % (shape[d] - 1));
    for (auto it = bounds.begin(); std::next(it) != bounds.end(); ++it) {
      cuts[d].push_back({*it, *std::next(it) - *it});
    }
  }
  std::vector<Box> boxes = {Box()};
  for (size_t d = 0; d < shape.size(); ++d) {
    std::vector<Box> next;
    for (const Box& b : boxes) {
      for (auto [offset, size] : cuts[d]) {
        Box c = b;
        c.offsets.push_back(offset);
        c.sizes.push_back(size);
        next.push_back(c);
      }
    }
    boxes = std::move(next);
  }
  return boxes;
}

// Adds a random tensor whose chunks go to random files; advances the files' data cursors.
inline void AddRandomTensor(std::mt19937_64& rng, std::string name, CheckpointMetadata* m,
                            std::vector<uint64_t>* cursors) {
  TensorMetadata t;
  t.name = std::move(name);
  t.dtype = AllDTypes()[rng() % AllDTypes().size()];
  size_t rank = rng() % 6;
  for (size_t d = 0; d < rank; ++d) t.shape.push_back(rng() % 10 == 0 ? 0 : 1 + rng() % 9);
  for (Box& box : RandomGrid(rng, t.shape)) {
    StoredChunk c;
    c.file = static_cast<uint32_t>(rng() % m->files.size());
    c.byte_length = static_cast<uint64_t>(box.volume()) * DTypeSize(t.dtype);
    c.data_offset = (*cursors)[c.file];
    (*cursors)[c.file] += c.byte_length;
    c.box = std::move(box);
    uint64_t blocks = (c.byte_length + m->checksum_block_bytes - 1) / m->checksum_block_bytes;
    for (uint64_t i = 0; i < blocks; ++i) c.block_crc32c.push_back(static_cast<uint32_t>(rng()));
    t.chunks.push_back(std::move(c));
  }
  // One tensor in four lists its chunks out of grid order (stored as a chunk list).
  if (rng() % 4 == 0) std::shuffle(t.chunks.begin(), t.chunks.end(), rng);
  m->tensors.push_back(std::move(t));
}

// A valid random checkpoint: up to 6 ranks with 1-2 files each, `tensor_count` tensors of every
// dtype and rank 0..5, objects of each encoding, and attributes. Data files' data_start and size
// are those BuildDataFileHeader implies.
inline CheckpointMetadata RandomMetadata(uint64_t seed, size_t tensor_count = 20) {
  std::mt19937_64 rng(seed);
  CheckpointMetadata m;
  m.save_id = "s" + std::to_string(seed) + "-x_y.z";
  m.world_size = 1 + static_cast<int32_t>(rng() % 6);
  m.checksum_block_bytes = 1 + rng() % 64;
  for (int r = 0; r < m.world_size; ++r) {
    for (int k = 0, n = 1 + static_cast<int>(rng() % 2); k < n; ++k) {
      m.files.push_back({DataFileName(m.save_id, r, k), 0, 0, r});
    }
  }
  std::vector<uint64_t> cursors(m.files.size(), 0);
  std::set<std::string> names;
  while (names.size() < tensor_count) {
    names.insert("model.layers." + std::to_string(rng() % 1000) + ".w" + std::to_string(rng() % 7));
  }
  for (const std::string& name : names) AddRandomTensor(rng, name, &m, &cursors);
  for (uint32_t f = 0; f < m.files.size(); ++f) {
    m.files[f].data_start = BuildDataFileHeader(m, f).size();
    m.files[f].size = m.files[f].data_start + cursors[f];
  }
  const ObjectEncoding encodings[] = {ObjectEncoding::kJson, ObjectEncoding::kPickle,
                                      ObjectEncoding::kBytes, ObjectEncoding::kPlain};
  for (int i = 0; i < 4; ++i) {
    m.objects.push_back({"obj." + std::to_string(i), encodings[i % 4], RandomBytes(rng, 40)});
  }
  m.objects[0].payload = "{\"lr\": [0.001, 0.0001], \"name\": \"adam\"}";
  m.attributes["step"] = std::to_string(rng() % 100000);
  m.attributes[RandomBytes(rng, 12)] = RandomBytes(rng, 30);
  return m;
}

// `m` as a version-4 decoder gives it back: its chunks without their checksums, which are in the
// data files' headers.
inline CheckpointMetadata AsVersionFour(CheckpointMetadata m) {
  m.version_major = 4;
  m.version_minor = 0;
  m.checksums_in_headers = true;
  for (TensorMetadata& t : m.tensors) {
    for (StoredChunk& c : t.chunks) c.block_crc32c.clear();
  }
  return m;
}

inline void ExpectChunkEq(const StoredChunk& a, const StoredChunk& b, const std::string& where) {
  EXPECT_EQ(a.box, b.box) << where;
  EXPECT_EQ(a.file, b.file) << where;
  EXPECT_EQ(a.data_offset, b.data_offset) << where;
  EXPECT_EQ(a.byte_length, b.byte_length) << where;
  EXPECT_EQ(a.block_crc32c, b.block_crc32c) << where;
}

inline void ExpectTensorEq(const TensorMetadata& a, const TensorMetadata& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.dtype, b.dtype) << a.name;
  EXPECT_EQ(a.shape, b.shape) << a.name;
  ASSERT_EQ(a.chunks.size(), b.chunks.size()) << a.name;
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    ExpectChunkEq(a.chunks[i], b.chunks[i], a.name + " chunk " + std::to_string(i));
  }
}

inline void ExpectMetadataEq(const CheckpointMetadata& a, const CheckpointMetadata& b) {
  EXPECT_EQ(a.version_major, b.version_major);
  EXPECT_EQ(a.version_minor, b.version_minor);
  EXPECT_EQ(a.save_id, b.save_id);
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.checksum_block_bytes, b.checksum_block_bytes);
  EXPECT_EQ(a.data_file_checksums, b.data_file_checksums);
  EXPECT_EQ(a.checksums_in_headers, b.checksums_in_headers);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    EXPECT_EQ(a.files[i].name, b.files[i].name);
    EXPECT_EQ(a.files[i].data_start, b.files[i].data_start);
    EXPECT_EQ(a.files[i].size, b.files[i].size);
    EXPECT_EQ(a.files[i].writer_rank, b.files[i].writer_rank);
    EXPECT_EQ(a.files[i].header_crc32c, b.files[i].header_crc32c);
  }
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) ExpectTensorEq(a.tensors[i], b.tensors[i]);
  ASSERT_EQ(a.objects.size(), b.objects.size());
  for (size_t i = 0; i < a.objects.size(); ++i) {
    EXPECT_EQ(a.objects[i].name, b.objects[i].name);
    EXPECT_EQ(a.objects[i].encoding, b.objects[i].encoding);
    EXPECT_EQ(a.objects[i].payload, b.objects[i].payload);
  }
  EXPECT_EQ(a.attributes, b.attributes);
}

}  // namespace sp::testing

#endif  // SHARDPOINT_FORMAT_NATIVE_METADATA_TEST_UTIL_H_

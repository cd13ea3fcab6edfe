#include "shardpoint/engine/read_exchange.h"

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "shardpoint/base/coding.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/geometry/strided_copy.h"

namespace sp {
namespace {

constexpr uint64_t kBalanceSlackBytes = uint64_t{32} << 20;
constexpr uint64_t kExchangeCostFactor = 4;  // reading a byte costs about this many copies
// Row bands whose edges cannot lie on checksum blocks are cut only when each spans at least this
// many blocks: the two readers of the block at an edge both read it.
constexpr uint64_t kBandBlocks = 8;

// Total length of the union of `intervals` (sorted in place).
uint64_t UnionLength(std::vector<Interval>& intervals) {
  std::sort(intervals.begin(), intervals.end());
  uint64_t total = 0, end = 0;
  bool open = false;
  uint64_t begin = 0;
  for (const Interval& i : intervals) {
    if (open && i.first <= end) {
      end = std::max(end, i.second);
      continue;
    }
    if (open) total += end - begin;
    begin = i.first;
    end = i.second;
    open = true;
  }
  if (open) total += end - begin;
  return total;
}

// The needs of every rank on one stored chunk.
struct ChunkUsers {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t first_byte = 0;  // of the chunk's bytes these users cover: 0, or where its band begins
  std::vector<std::pair<int, size_t>> users;  // (rank, need index), sorted
  std::vector<int> ranks;                     // distinct ranks, ascending
  uint64_t union_bytes = 0;                   // read once
  std::vector<uint64_t> packed;               // per entry of `ranks`: bytes that rank receives
  std::vector<uint64_t> alone;                // per entry of `ranks`: bytes it reads by itself
  bool shared = false;
  bool whole = false;  // shared as whole rows (read_exchange.h)
  Box rows;            // with `whole`: the rows its users cover
  uint64_t rows_bytes = 0;
};

// Every rank's needs, and the parts of them that fall in the row bands of a chunk cut into bands
// (read_exchange.h): need index i of rank r is all[r].needs[i] below all[r].needs.size(), else
// parts[r][i - all[r].needs.size()].
struct Needs {
  const std::vector<RankNeeds>& all;
  std::vector<std::vector<ChunkNeed>> parts;
  std::vector<std::vector<size_t>> part_of;  // of each rank's parts: the need each is a part of

  const ChunkNeed& operator()(int r, size_t i) const {
    const size_t whole = all[r].needs.size();
    return i < whole ? all[r].needs[i] : parts[r][i - whole];
  }
};

// Fills the users' measures of `u` (ranks, packed, alone, union_bytes) and decides whether it is
// worth sharing (read_exchange.h) and whether it fits a round; returns whether it is worth it.
bool Measure(ChunkUsers& u, const Needs& need, const TensorMetadata& tensor,
             const StoredChunk& chunk, uint64_t block_bytes, uint64_t round_bytes) {
  std::vector<Interval> every;
  uint64_t separate = 0;  // bytes read when each rank reads for itself
  for (size_t k = 0; k < u.users.size();) {
    const int r = u.users[k].first;
    std::vector<Interval> mine;
    uint64_t packed = 0;
    for (; k < u.users.size() && u.users[k].first == r; ++k) {
      const ChunkNeed& n = need(r, u.users[k].second);
      mine.push_back(ReadSpan(tensor, chunk, n.region, need.all[r].verify, block_bytes));
      packed += PackedBytes(n.region, tensor.dtype);
    }
    every.insert(every.end(), mine.begin(), mine.end());
    u.ranks.push_back(r);
    u.packed.push_back(packed);
    u.alone.push_back(UnionLength(mine));
    separate += u.alone.back();
  }
  u.union_bytes = UnionLength(every);
  if (u.ranks.size() < 2) return false;
  uint64_t total = 0, largest = 0;
  for (uint64_t p : u.packed) {
    total += p;
    largest = std::max(largest, p);
  }
  const bool worth = kExchangeCostFactor * (separate - u.union_bytes) >= total - largest;
  u.shared = worth && total <= round_bytes;
  return worth;
}

// The users of each row band of chunk `u` (read_exchange.h), whose exchange exceeds a round:
// bands of about half a round's exchange, their edges on checksum block boundaries where the rows
// allow (else at least kBandBlocks blocks each) when some user verifies checksums, on any rows
// when none does. Each band's users are the needs that lie inside it and the parts of those it
// cuts (added to `need`). Empty when the chunk cannot be cut.
std::vector<ChunkUsers> CutIntoBands(const ChunkUsers& u, Needs& need,
                                     const TensorMetadata& tensor, const StoredChunk& chunk,
                                     uint64_t block_bytes, uint64_t round_bytes) {
  std::vector<ChunkUsers> bands;
  if (chunk.encoding == ChunkEncoding::kDriverDecoded || chunk.box.rank() == 0 ||
      chunk.box.sizes[0] < 2) {
    return bands;
  }
  const int64_t rows = chunk.box.sizes[0];
  const uint64_t row_bytes = chunk.byte_length / static_cast<uint64_t>(rows);
  // Only readers that verify read whole checksum blocks.
  bool verified = false;
  for (const auto& [r, i] : u.users) verified = verified || need.all[r].verify;
  if (!verified) block_bytes = 0;
  uint64_t total = 0;
  for (uint64_t p : u.packed) total += p;
  const uint64_t count = std::max<uint64_t>(2, (2 * total + round_bytes - 1) / round_bytes);
  int64_t band_rows = (rows + static_cast<int64_t>(count) - 1) / static_cast<int64_t>(count);
  if (block_bytes > 0 && row_bytes > 0) {
    // Rows per step whose bytes are a whole number of blocks.
    const uint64_t unit = block_bytes / std::gcd(block_bytes, row_bytes);
    if (unit <= static_cast<uint64_t>(band_rows)) {
      band_rows = band_rows / static_cast<int64_t>(unit) * static_cast<int64_t>(unit);
    } else if (static_cast<uint64_t>(band_rows) * row_bytes < kBandBlocks * block_bytes) {
      return bands;  // each band would read most of its blocks again for its neighbours
    }
  }
  band_rows = std::max<int64_t>(1, band_rows);
  if (band_rows >= rows) return bands;
  const int64_t begin = chunk.box.offsets[0];
  for (int64_t first = begin; first < begin + rows; first += band_rows) {
    const int64_t end = std::min(begin + rows, first + band_rows);
    ChunkUsers band;
    band.tensor = u.tensor;
    band.chunk = u.chunk;
    band.first_byte = static_cast<uint64_t>(first - begin) * row_bytes;
    for (const auto& [r, i] : u.users) {
      const Box& region = need(r, i).region;
      const int64_t lo = std::max(first, region.offsets[0]);
      const int64_t hi = std::min(end, region.exclusive_max(0));
      if (lo >= hi) continue;
      if (lo == region.offsets[0] && hi == region.exclusive_max(0)) {
        band.users.emplace_back(r, i);
        continue;
      }
      ChunkNeed part = need(r, i);
      part.region.offsets[0] = lo;
      part.region.sizes[0] = hi - lo;
      need.part_of[r].push_back(i);
      need.parts[r].push_back(std::move(part));
      band.users.emplace_back(r, need.all[r].needs.size() + need.parts[r].size() - 1);
    }
    if (!band.users.empty()) bands.push_back(std::move(band));
  }
  return bands;
}

// Whether the users of shared chunk `u` get whole rows (read_exchange.h), and which: sets u.whole,
// u.rows and u.rows_bytes.
void ChooseWholeRows(ChunkUsers& u, const Needs& need, const TensorMetadata& tensor,
                     const StoredChunk& chunk, uint64_t round_bytes, uint64_t whole_rows_below) {
  if (whole_rows_below == 0 || chunk.encoding == ChunkEncoding::kDriverDecoded ||
      chunk.box.rank() < 2) {
    return;
  }
  const size_t es = DTypeSize(tensor.dtype);
  int64_t first = chunk.box.exclusive_max(0), end = chunk.box.offsets[0];
  bool cut_short = false;
  for (const auto& [r, i] : u.users) {
    const Box& region = need(r, i).region;
    first = std::min(first, region.offsets[0]);
    end = std::max(end, region.exclusive_max(0));
    const RunSummary runs = SummarizeByteRuns(chunk.box, region, es);
    cut_short = cut_short || (runs.runs > 1 && runs.bytes / runs.runs < whole_rows_below);
  }
  if (!cut_short) return;
  Box rows = chunk.box;
  rows.offsets[0] = first;
  rows.sizes[0] = end - first;
  const uint64_t bytes = static_cast<uint64_t>(rows.volume()) * es;
  uint64_t needed = 0;
  for (uint64_t p : u.packed) needed += p;
  if (bytes > 2 * needed || bytes > round_bytes) return;
  u.whole = true;
  u.rows = std::move(rows);
  u.rows_bytes = bytes;
}

// The list of `rank` in `lists`, added (empty, in its place) when it has none.
template <typename T>
std::vector<T>& ListOf(ByRank<T>& lists, int rank) {
  auto at = std::lower_bound(lists.begin(), lists.end(), rank,
                             [](const auto& entry, int r) { return entry.first < r; });
  if (at == lists.end() || at->first != rank) at = lists.emplace(at, rank, std::vector<T>());
  return at->second;
}

}  // namespace

Interval ReadSpan(const TensorMetadata& tensor, const StoredChunk& chunk, const Box& region,
                  bool verify, uint64_t block_bytes) {
  if (chunk.encoding == ChunkEncoding::kDriverDecoded) return {0, chunk.stored_length};
  const uint64_t es = DTypeSize(tensor.dtype);
  if (chunk.box.rank() == 0) return {0, es};
  uint64_t row = es;
  for (size_t d = 1; d < chunk.box.rank(); ++d) row *= static_cast<uint64_t>(chunk.box.sizes[d]);
  uint64_t begin = static_cast<uint64_t>(region.offsets[0] - chunk.box.offsets[0]) * row;
  uint64_t end = begin + static_cast<uint64_t>(region.sizes[0]) * row;
  if (verify && block_bytes > 0) {
    begin = begin / block_bytes * block_bytes;
    end = std::min(chunk.byte_length, (end + block_bytes - 1) / block_bytes * block_bytes);
  }
  return {begin, end};
}

uint64_t WholeRowsBytes(const WholeRows& rows, const CheckpointMetadata& metadata) {
  return static_cast<uint64_t>(rows.rows.volume()) * DTypeSize(metadata.tensors[rows.tensor].dtype);
}

uint64_t PackedBytes(const Box& region, DType dtype) {
  const uint64_t bytes = static_cast<uint64_t>(region.volume()) * DTypeSize(dtype);
  return (bytes + 15) / 16 * 16;
}

namespace {

void PutBox(ByteWriter& writer, const Box& box) {
  writer.PutU8(static_cast<uint8_t>(box.rank()));
  for (size_t d = 0; d < box.rank(); ++d) {
    writer.PutI64(box.offsets[d]);
    writer.PutI64(box.sizes[d]);
  }
}

Status ReadBox(ByteReader& reader, Box* box) {
  SP_ASSIGN_OR_RETURN(uint8_t rank, reader.ReadU8());
  box->offsets.resize(rank);
  box->sizes.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    SP_ASSIGN_OR_RETURN(box->offsets[d], reader.ReadI64());
    SP_ASSIGN_OR_RETURN(box->sizes[d], reader.ReadI64());
  }
  return OkStatus();
}

void PutChunkNeed(ByteWriter& writer, const ChunkNeed& n) {
  writer.PutU32(n.tensor);
  writer.PutU32(n.chunk);
  PutBox(writer, n.region);
}

// The index in `metadata` of the stored chunk numbered `number` of tensor `tensor`, or an error
// naming `label` ("need 3").
Result<uint32_t> ChunkNamed(const CheckpointMetadata& metadata, uint32_t tensor, uint32_t number,
                            const ByteReader& reader, const std::string& label) {
  std::optional<uint32_t> index;
  if (tensor < metadata.tensors.size()) {
    index = ChunkIndexOfNumber(metadata.tensors[tensor], number);
  }
  if (!index) {
    const bool part = tensor < metadata.tensors.size() && metadata.tensors[tensor].kept;
    return DataLossError(reader.what() + ": " + label + " names tensor " + std::to_string(tensor) +
                         " chunk " + std::to_string(number) +
                         (part ? ", which this rank's part of the metadata does not hold (its "
                                 "boxes do not reach it)"
                               : ", which the checkpoint does not have"));
  }
  return *index;
}

// A region of a stored chunk, checked to be a non-empty part of it; errors name `label`. The
// chunk travels as its stored number and comes back as its index in `metadata`.
Result<ChunkNeed> ReadChunkNeed(ByteReader& reader, const CheckpointMetadata& metadata,
                                const std::string& label) {
  ChunkNeed n;
  SP_ASSIGN_OR_RETURN(n.tensor, reader.ReadU32());
  SP_ASSIGN_OR_RETURN(uint32_t number, reader.ReadU32());
  SP_ASSIGN_OR_RETURN(n.chunk, ChunkNamed(metadata, n.tensor, number, reader, label));
  const StoredChunk* chunk = &metadata.tensors[n.tensor].chunks[n.chunk];
  SP_RETURN_IF_ERROR(ReadBox(reader, &n.region));
  if (n.region.rank() != chunk->box.rank() || n.region.empty() ||
      !Contains(chunk->box, n.region)) {
    return DataLossError(reader.what() + ": " + label + " region " + n.region.ToString() +
                         " is not a non-empty part of chunk " + chunk->box.ToString() +
                         " of tensor '" + metadata.tensors[n.tensor].name + "'");
  }
  return n;
}

Status Trailing(const ByteReader& reader, const std::string& after) {
  if (reader.done()) return OkStatus();
  return DataLossError(reader.what() + ": " + std::to_string(reader.remaining()) +
                       " unexpected bytes after " + after);
}

// Per-rank lists: a count, then each rank, its list's length and the list.
template <typename T, typename Put>
void PutByRank(ByteWriter& writer, const ByRank<T>& lists, Put put) {
  writer.PutU32(static_cast<uint32_t>(lists.size()));
  for (const auto& [rank, list] : lists) {
    writer.PutU32(static_cast<uint32_t>(rank));
    writer.PutU32(static_cast<uint32_t>(list.size()));
    for (const T& each : list) put(each);
  }
}

// Reads lists written by PutByRank, checking that the ranks ascend within [0, ranks) and that no
// list is empty; `read` reads one element of the list of `rank`.
template <typename T, typename Read>
Status ReadByRank(ByteReader& reader, int ranks, const std::string& label, ByRank<T>* lists,
                  Read read) {
  SP_ASSIGN_OR_RETURN(uint32_t count, reader.ReadCount(8));
  lists->reserve(count);
  for (uint32_t k = 0; k < count; ++k) {
    SP_ASSIGN_OR_RETURN(uint32_t rank, reader.ReadU32());
    SP_ASSIGN_OR_RETURN(uint32_t length, reader.ReadCount(4));
    if (rank >= static_cast<uint32_t>(ranks) ||
        (!lists->empty() && static_cast<int>(rank) <= lists->back().first) || length == 0) {
      return DataLossError(reader.what() + ": " + label + " lists rank " + std::to_string(rank) +
                           " with " + std::to_string(length) + " entries" +
                           (lists->empty() ? std::string()
                                           : " after rank " + std::to_string(lists->back().first)) +
                           " in a group of " + std::to_string(ranks) +
                           "; expected ranks in ascending order, each with a non-empty list");
    }
    std::vector<T> list;
    list.reserve(length);
    for (uint32_t i = 0; i < length; ++i) {
      SP_ASSIGN_OR_RETURN(T each, read());
      list.push_back(std::move(each));
    }
    lists->emplace_back(static_cast<int>(rank), std::move(list));
  }
  return OkStatus();
}

}  // namespace

std::string EncodeNeeds(const RankNeeds& needs) {
  std::string out;
  ByteWriter writer(&out);
  writer.PutU8(needs.verify ? 1 : 0);
  writer.PutU32(static_cast<uint32_t>(needs.needs.size()));
  for (const ChunkNeed& n : needs.needs) PutChunkNeed(writer, n);
  return out;
}

Result<RankNeeds> DecodeNeeds(std::string_view bytes, const CheckpointMetadata& metadata,
                              int from_rank) {
  ByteReader reader(bytes, "read needs of rank " + std::to_string(from_rank));
  RankNeeds out;
  SP_ASSIGN_OR_RETURN(uint8_t verify, reader.ReadU8());
  out.verify = verify != 0;
  SP_ASSIGN_OR_RETURN(uint32_t count, reader.ReadCount(9));
  out.needs.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    SP_ASSIGN_OR_RETURN(ChunkNeed n, ReadChunkNeed(reader, metadata, "need " + std::to_string(i)));
    out.needs.push_back(std::move(n));
  }
  SP_RETURN_IF_ERROR(Trailing(reader, "the last need"));
  return out;
}

std::string EncodeExchangePlan(const ExchangePlan& plan) {
  std::string out;
  ByteWriter writer(&out);
  auto put_index = [&](size_t i) { writer.PutU32(static_cast<uint32_t>(i)); };
  auto put_need = [&](const ChunkNeed& n) { PutChunkNeed(writer, n); };
  writer.PutU64(plan.shared_chunks);
  writer.PutU32(static_cast<uint32_t>(plan.parts.size()));
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    PutChunkNeed(writer, plan.parts[j]);
    put_index(plan.part_of[j]);
  }
  writer.PutU32(static_cast<uint32_t>(plan.rounds.size()));
  for (const ExchangeRound& round : plan.rounds) {
    writer.PutU32(static_cast<uint32_t>(round.own.size()));
    for (size_t i : round.own) put_index(i);
    PutByRank(writer, round.send, put_need);
    PutByRank(writer, round.receive, put_index);
    writer.PutU32(static_cast<uint32_t>(round.rows.size()));
    for (const WholeRows& w : round.rows) {
      PutChunkNeed(writer, ChunkNeed{w.tensor, w.chunk, w.rows});  // a region of its chunk
    }
    PutByRank(writer, round.from_rows, put_index);
  }
  return out;
}

Result<ExchangePlan> DecodeExchangePlan(std::string_view bytes, const CheckpointMetadata& metadata,
                                        size_t needs, int ranks, int from_rank) {
  ByteReader reader(bytes, "exchange plan from rank " + std::to_string(from_rank));
  ExchangePlan plan;
  SP_ASSIGN_OR_RETURN(plan.shared_chunks, reader.ReadU64());
  SP_ASSIGN_OR_RETURN(uint32_t parts, reader.ReadCount(13));
  for (uint32_t j = 0; j < parts; ++j) {
    const std::string label = "part " + std::to_string(j);
    SP_ASSIGN_OR_RETURN(ChunkNeed part, ReadChunkNeed(reader, metadata, label));
    SP_ASSIGN_OR_RETURN(uint32_t of, reader.ReadU32());
    if (of >= needs) {
      return DataLossError(reader.what() + ": " + label + " is a part of need " +
                           std::to_string(of) + ", but this rank has " + std::to_string(needs) +
                           " needs");
    }
    plan.parts.push_back(std::move(part));
    plan.part_of.push_back(of);
  }
  // Indices into this rank's needs, then its parts.
  const size_t indices = needs + plan.parts.size();
  std::string label;
  auto read_index = [&]() -> Result<size_t> {
    SP_ASSIGN_OR_RETURN(uint32_t i, reader.ReadU32());
    if (i >= indices) {
      return DataLossError(reader.what() + ": " + label + " names need " + std::to_string(i) +
                           ", but this rank has " + std::to_string(needs) + " needs and " +
                           std::to_string(plan.parts.size()) + " parts");
    }
    return static_cast<size_t>(i);
  };
  auto read_need = [&]() { return ReadChunkNeed(reader, metadata, label); };
  SP_ASSIGN_OR_RETURN(uint32_t rounds, reader.ReadCount(20));
  if (rounds == 0) return DataLossError(reader.what() + ": no rounds; expected at least one");
  plan.rounds.resize(rounds);
  for (uint32_t k = 0; k < rounds; ++k) {
    ExchangeRound& round = plan.rounds[k];
    const std::string in_round = " of round " + std::to_string(k);
    label = "own reads" + in_round;
    SP_ASSIGN_OR_RETURN(uint32_t own, reader.ReadCount(4));
    round.own.reserve(own);
    for (uint32_t i = 0; i < own; ++i) {
      SP_ASSIGN_OR_RETURN(size_t index, read_index());
      round.own.push_back(index);
    }
    label = "sends" + in_round;
    SP_RETURN_IF_ERROR(ReadByRank(reader, ranks, label, &round.send, read_need));
    label = "receives" + in_round;
    SP_RETURN_IF_ERROR(ReadByRank(reader, ranks, label, &round.receive, read_index));
    label = "whole rows" + in_round;
    SP_ASSIGN_OR_RETURN(uint32_t rows, reader.ReadCount(9));
    for (uint32_t j = 0; j < rows; ++j) {
      SP_ASSIGN_OR_RETURN(ChunkNeed w, read_need());  // written as a region of its chunk
      round.rows.push_back(WholeRows{w.tensor, w.chunk, std::move(w.region)});
    }
    label = "copies out of whole rows" + in_round;
    SP_RETURN_IF_ERROR(ReadByRank(reader, ranks, label, &round.from_rows, read_index));
  }
  SP_RETURN_IF_ERROR(Trailing(reader, "the last round"));
  return plan;
}

Result<ExchangePlan> PlanExchangeOnRoot(Communicator& comm, Result<RankNeeds> mine,
                                        const CheckpointMetadata& metadata, uint64_t round_bytes,
                                        uint64_t whole_rows_below) {
  constexpr int kRoot = 0;
  const size_t my_needs = mine.ok() ? mine->needs.size() : 0;
  Result<std::string> sent =
      mine.ok() ? Result<std::string>(EncodeNeeds(*mine)) : Result<std::string>(mine.status());
  mine = RankNeeds();
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                      GatherOrFail(comm, std::move(sent), kRoot));
  Result<std::vector<std::string>> plans = std::vector<std::string>();
  if (comm.rank() == kRoot) {
    plans = [&]() -> Result<std::vector<std::string>> {
      std::vector<RankNeeds> all;
      all.reserve(gathered.size());
      for (size_t r = 0; r < gathered.size(); ++r) {
        SP_ASSIGN_OR_RETURN(RankNeeds needs,
                            DecodeNeeds(gathered[r], metadata, static_cast<int>(r)));
        all.push_back(std::move(needs));
        std::string().swap(gathered[r]);
      }
      std::vector<ExchangePlan> planned =
          PlanExchange(all, metadata, round_bytes, whole_rows_below);
      all.clear();
      std::vector<std::string> encoded(planned.size());
      for (size_t r = 0; r < planned.size(); ++r) {
        encoded[r] = EncodeExchangePlan(planned[r]);
        planned[r] = ExchangePlan();
      }
      return encoded;
    }();
  }
  SP_ASSIGN_OR_RETURN(std::string bytes, ScatterOrFail(comm, std::move(plans), kRoot));
  Result<ExchangePlan> plan = DecodeExchangePlan(bytes, metadata, my_needs, comm.size(), kRoot);
  // A rank without a plan cannot take part in the rounds: all stop together.
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, plan.status()));
  return plan;
}

std::vector<ExchangePlan> PlanExchange(const std::vector<RankNeeds>& all,
                                       const CheckpointMetadata& metadata, uint64_t round_bytes,
                                       uint64_t whole_rows_below) {
  const int n = static_cast<int>(all.size());
  const uint64_t bs = metadata.checksum_block_bytes;

  // Group the needs by stored chunk; a chunk worth sharing whose exchange exceeds a round is cut
  // into row bands, each a unit of its own.
  Needs need{all, std::vector<std::vector<ChunkNeed>>(n), std::vector<std::vector<size_t>>(n)};
  // The chunks found by a hash of (tensor, chunk), then taken in that order (which orders the
  // parts of needs cut at row bands).
  std::vector<ChunkUsers> by_chunk;
  {
    size_t total = 0;
    for (const RankNeeds& needs : all) total += needs.needs.size();
    std::unordered_map<uint64_t, uint32_t> index;
    index.reserve(total);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < all[r].needs.size(); ++i) {
        const ChunkNeed& each = all[r].needs[i];
        const auto [at, fresh] = index.try_emplace(
            uint64_t{each.tensor} << 32 | each.chunk, static_cast<uint32_t>(by_chunk.size()));
        if (fresh) {
          ChunkUsers& u = by_chunk.emplace_back();
          u.tensor = each.tensor;
          u.chunk = each.chunk;
        }
        by_chunk[at->second].users.emplace_back(r, i);
      }
    }
  }
  std::sort(by_chunk.begin(), by_chunk.end(), [](const ChunkUsers& a, const ChunkUsers& b) {
    return std::tie(a.tensor, a.chunk) < std::tie(b.tensor, b.chunk);
  });
  auto stored = [&](const ChunkUsers& u) -> const StoredChunk& {
    return metadata.tensors[u.tensor].chunks[u.chunk];
  };
  std::deque<ChunkUsers> units;  // stable addresses
  std::vector<uint64_t> load(n, 0);
  auto add_unit = [&](ChunkUsers u, bool may_cut) {
    const TensorMetadata& tensor = metadata.tensors[u.tensor];
    const StoredChunk& chunk = stored(u);
    const bool worth = Measure(u, need, tensor, chunk, bs, round_bytes);
    if (worth && !u.shared && may_cut) {
      std::vector<ChunkUsers> bands = CutIntoBands(u, need, tensor, chunk, bs, round_bytes);
      if (!bands.empty()) return bands;
    }
    if (u.shared) ChooseWholeRows(u, need, tensor, chunk, round_bytes, whole_rows_below);
    if (!u.shared) {
      for (size_t k = 0; k < u.ranks.size(); ++k) load[u.ranks[k]] += u.alone[k];
    }
    units.push_back(std::move(u));
    return std::vector<ChunkUsers>();
  };
  for (ChunkUsers& u : by_chunk) {
    for (ChunkUsers& band : add_unit(std::move(u), true)) add_unit(std::move(band), false);
  }
  std::vector<ChunkUsers>().swap(by_chunk);
  std::vector<ChunkUsers*> chunks;
  for (ChunkUsers& u : units) chunks.push_back(&u);
  // Units in order of their relative position in their file, so that each round reads about the
  // same share of every file (and so of every rank's work), and each file front to back.
  auto position = [&](const ChunkUsers& u) -> uint64_t {
    const StoredChunk& c = stored(u);
    const uint64_t size = std::max<uint64_t>(1, metadata.files[c.file].size);
    return static_cast<uint64_t>(static_cast<unsigned __int128>(c.data_offset + u.first_byte) *
                                 (1u << 20) / size);
  };
  auto order = [&](const ChunkUsers* u) {
    const StoredChunk& c = stored(*u);
    return std::make_tuple(position(*u), c.file, c.data_offset + u->first_byte, u->tensor,
                           u->chunk);
  };
  std::sort(chunks.begin(), chunks.end(),
            [&](const ChunkUsers* a, const ChunkUsers* b) { return order(a) < order(b); });

  // Readers, then rounds, in file order. A rank's rounds are added as it takes part in them (and
  // all brought to the same count at the end), so that a round costs nothing for the ranks that
  // take no part in it.
  std::vector<ExchangePlan> plans(n);
  size_t rounds = 1;
  auto round_of = [&](int r) -> ExchangeRound& {
    std::vector<ExchangeRound>& of = plans[r].rounds;
    if (of.size() < rounds) of.resize(rounds);
    return of.back();
  };
  std::vector<uint64_t> used(n, 0);
  std::vector<char> in_round(n, 0);
  std::vector<int> users_of_round;  // the ranks with traffic in the round (in_round)
  bool round_has_shared = false;
  uint64_t shared_chunks = 0;
  std::vector<int> previous_reader(metadata.files.size(), -1);  // per file; -1: none yet
  for (ChunkUsers* u : chunks) {
    if (!u->shared) {
      for (const auto& [r, i] : u->users) round_of(r).own.push_back(i);
      continue;
    }
    ++shared_chunks;
    const uint32_t file = stored(*u).file;
    int least = u->ranks.front();
    for (int r : u->ranks) {
      if (load[r] < load[least]) least = r;
    }
    int reader = least;
    const int previous = previous_reader[file];
    if (previous >= 0 &&
        std::binary_search(u->ranks.begin(), u->ranks.end(), previous) &&
        load[previous] <= load[least] + kBalanceSlackBytes) {
      reader = previous;
    }
    load[reader] += u->union_bytes;
    previous_reader[file] = reader;

    // This chunk's traffic: each other rank receives its regions, the reader sends them all (or
    // the whole rows).
    std::vector<uint64_t> traffic(u->ranks.size());
    uint64_t sent = 0;
    size_t reader_k = 0;
    for (size_t k = 0; k < u->ranks.size(); ++k) {
      if (u->ranks[k] == reader) {
        reader_k = k;
      } else {
        traffic[k] = u->packed[k];
        sent += u->packed[k];
      }
    }
    traffic[reader_k] = u->whole ? u->rows_bytes : sent;
    bool fits = true;
    for (size_t k = 0; k < u->ranks.size(); ++k) {
      fits = fits && used[u->ranks[k]] + traffic[k] <= round_bytes;
    }
    if (!fits && round_has_shared) {
      ++rounds;
      for (int r : users_of_round) {
        used[r] = 0;
        in_round[r] = 0;
      }
      users_of_round.clear();
      round_has_shared = false;
    }
    for (size_t k = 0; k < u->ranks.size(); ++k) {
      const int r = u->ranks[k];
      if (!in_round[r]) {
        in_round[r] = 1;
        users_of_round.push_back(r);
      }
      used[r] += traffic[k];
    }
    round_has_shared = true;
    if (u->whole) {
      round_of(reader).rows.push_back(WholeRows{u->tensor, u->chunk, u->rows});
      for (const auto& [r, i] : u->users) ListOf(round_of(r).from_rows, reader).push_back(i);
      continue;
    }
    for (const auto& [r, i] : u->users) {
      if (r == reader) {
        round_of(r).own.push_back(i);
      } else {
        ListOf(round_of(reader).send, r).push_back(need(r, i));
        ListOf(round_of(r).receive, reader).push_back(i);
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    ExchangePlan& plan = plans[r];
    plan.rounds.resize(rounds);
    plan.shared_chunks = shared_chunks;
    plan.parts = std::move(need.parts[r]);
    plan.part_of = std::move(need.part_of[r]);
  }
  return plans;
}

std::vector<std::vector<NeedRef>> AssignInMemoryReads(const std::vector<RankNeeds>& all,
                                                      const CheckpointMetadata& metadata) {
  // A unit is a run of a stored chunk's bytes that overlapping reads of its users cover; the
  // users of one unit share its read, users whose rows are apart are separate units.
  struct Unit {
    uint32_t file = 0;
    uint64_t offset = 0;  // in the file
    uint64_t bytes = 0;
    std::vector<NeedRef> users;
  };
  std::map<std::pair<uint32_t, uint32_t>, std::vector<NeedRef>> by_chunk;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    for (size_t i = 0; i < all[r].needs.size(); ++i) {
      by_chunk[{all[r].needs[i].tensor, all[r].needs[i].chunk}].emplace_back(r, i);
    }
  }
  std::vector<Unit> units;
  uint64_t total = 0;
  for (auto& [key, users] : by_chunk) {
    const TensorMetadata& tensor = metadata.tensors[key.first];
    const StoredChunk& stored = tensor.chunks[key.second];
    std::vector<std::pair<Interval, NeedRef>> spans;
    for (const auto& [r, i] : users) {
      spans.push_back({ReadSpan(tensor, stored, all[r].needs[i].region, all[r].verify,
                                metadata.checksum_block_bytes),
                       NeedRef(r, i)});
    }
    std::sort(spans.begin(), spans.end());
    for (size_t k = 0; k < spans.size();) {
      Unit unit{stored.file, stored.data_offset + spans[k].first.first, 0, {}};
      uint64_t end = spans[k].first.second;
      for (; k < spans.size() && (unit.users.empty() || spans[k].first.first < end); ++k) {
        end = std::max(end, spans[k].first.second);
        unit.users.push_back(spans[k].second);
      }
      unit.bytes = std::max<uint64_t>(1, end - (unit.offset - stored.data_offset));
      total += unit.bytes;
      units.push_back(std::move(unit));
    }
  }
  std::sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
    return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
  });
  // Rank k reads the units that begin in bytes [k * total / n, (k + 1) * total / n) of the
  // concatenated run.
  const uint64_t n = all.size();
  std::vector<std::vector<NeedRef>> reads(n);
  uint64_t before = 0;
  for (const Unit& u : units) {
    const uint64_t reader =
        std::min<uint64_t>(n - 1, static_cast<uint64_t>(static_cast<unsigned __int128>(before) * n /
                                                        std::max<uint64_t>(1, total)));
    reads[reader].insert(reads[reader].end(), u.users.begin(), u.users.end());
    before += u.bytes;
  }
  return reads;
}

}  // namespace sp

#include "shardpoint/engine/read_exchange.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <mutex>
#include <set>

#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/thread_comm.h"

namespace sp {
namespace {

// One tensor per entry of `rows`: f32 [rows, 64], stored as chunks of `chunk_rows` rows spread
// over `files` files in order.
CheckpointMetadata RowChunks(const std::vector<int64_t>& rows, int64_t chunk_rows, int files,
                             uint64_t block_bytes) {
  CheckpointMetadata md;
  md.checksum_block_bytes = block_bytes;
  md.files.resize(files);
  std::vector<uint64_t> offset(files, 0);
  int next = 0;
  for (size_t t = 0; t < rows.size(); ++t) {
    TensorMetadata tensor;
    tensor.name = "t" + std::to_string(t);
    tensor.dtype = DType::kFloat32;
    tensor.shape = {rows[t], 64};
    for (int64_t r = 0; r < rows[t]; r += chunk_rows) {
      StoredChunk c;
      c.box = Box({r, 0}, {std::min(chunk_rows, rows[t] - r), 64});
      c.file = static_cast<uint32_t>(next++ % files);
      c.byte_length = static_cast<uint64_t>(c.box.volume()) * 4;
      c.data_offset = offset[c.file];
      offset[c.file] += c.byte_length;
      tensor.chunks.push_back(std::move(c));
    }
    md.tensors.push_back(std::move(tensor));
  }
  return md;
}

// The list of `rank` in `lists` (read_exchange.h), empty when it has none.
template <typename T>
const std::vector<T>& ListFor(const ByRank<T>& lists, int rank) {
  static const std::vector<T> kNone;
  for (const auto& [r, list] : lists) {
    if (r == rank) return list;
  }
  return kNone;
}

// Need index i of a rank whose needs are `needs` and plan `plan`: a need, or a part of one cut at a
// row band.
const ChunkNeed& NeedOf(const RankNeeds& needs, const ExchangePlan& plan, size_t i) {
  return i < needs.needs.size() ? needs.needs[i] : plan.parts.at(i - needs.needs.size());
}

TEST(ReadExchangeTest, NeedsRoundTripAndHostileBytesAreRefusedByName) {
  const CheckpointMetadata md = RowChunks({8}, 4, 1, 1 << 20);
  RankNeeds needs;
  needs.verify = false;
  needs.needs = {ChunkNeed{0, 1, Box({5, 3}, {2, 10})}, ChunkNeed{0, 0, Box({0, 0}, {4, 64})}};
  const std::string bytes = EncodeNeeds(needs);
  EXPECT_EQ(DecodeNeeds(bytes, md, 2).value(), needs);
  for (size_t len = 0; len < bytes.size(); ++len) {
    EXPECT_EQ(DecodeNeeds(bytes.substr(0, len), md, 2).status().code(), StatusCode::kDataLoss);
  }
  EXPECT_EQ(DecodeNeeds(bytes + "x", md, 2).status(),
            DataLossError("read needs of rank 2: 1 unexpected bytes after the last need"));
  RankNeeds outside = needs;
  outside.needs[0].region = Box({5, 60}, {2, 10});
  EXPECT_EQ(DecodeNeeds(EncodeNeeds(outside), md, 1).status(),
            DataLossError("read needs of rank 1: need 0 region [5:7, 60:70] is not a non-empty "
                          "part of chunk [4:8, 0:64] of tensor 't0'"));
  RankNeeds absent = needs;
  absent.needs[1].chunk = 2;
  EXPECT_EQ(DecodeNeeds(EncodeNeeds(absent), md, 0).status(),
            DataLossError("read needs of rank 0: need 1 names tensor 0 chunk 2, which the "
                          "checkpoint does not have"));
}

TEST(ReadExchangeTest, ColumnSplitIsSharedAndRowSplitOfLargeChunksIsNot) {
  // t0: one 8 KiB chunk inside a 1 MiB block; t1: one 4 MiB chunk (16384 rows of 256 bytes).
  CheckpointMetadata md = RowChunks({32, 16384}, 16384, 1, 1 << 20);
  std::vector<RankNeeds> all(2);
  all[0].needs = {ChunkNeed{0, 0, Box({0, 0}, {32, 32})}, ChunkNeed{1, 0, Box({0, 0}, {8192, 64})}};
  all[1].needs = {ChunkNeed{0, 0, Box({0, 32}, {32, 32})},
                  ChunkNeed{1, 0, Box({8192, 0}, {8192, 64})}};
  const std::vector<ExchangePlan> plans = PlanExchange(all, md, 64 << 20);
  ASSERT_EQ(plans.size(), 2u);
  const ExchangePlan& p0 = plans[0];
  const ExchangePlan& p1 = plans[1];
  ASSERT_EQ(p0.rounds.size(), 1u);
  ASSERT_EQ(p1.rounds.size(), 1u);
  EXPECT_EQ(p0.shared_chunks, 1u);
  // Rank 0 (the less loaded on a tie: the lowest) reads t0 and sends rank 1 its columns.
  EXPECT_EQ(p0.rounds[0].own, (std::vector<size_t>{0, 1}));  // in file order
  EXPECT_EQ(ListFor(p0.rounds[0].send, 1), (std::vector<ChunkNeed>{all[1].needs[0]}));
  EXPECT_TRUE(ListFor(p0.rounds[0].receive, 1).empty());
  EXPECT_EQ(p1.rounds[0].own, (std::vector<size_t>{1}));
  EXPECT_EQ(ListFor(p1.rounds[0].receive, 0), (std::vector<size_t>{0}));
  EXPECT_TRUE(ListFor(p1.rounds[0].send, 0).empty());
  // A round too small for t0's exchange: every rank reads it itself.
  const ExchangePlan tight = PlanExchange(all, md, 1024)[1];
  EXPECT_EQ(tight.shared_chunks, 0u);
  EXPECT_EQ(tight.rounds[0].own, (std::vector<size_t>{0, 1}));
}

TEST(ReadExchangeTest, ColumnsCutShortAreReadAsWholeRowsThatEveryUserCopiesFrom) {
  // t0: 32 rows of 256 bytes whose columns two ranks split (runs of 128 bytes); t1: one 4 MiB
  // chunk that three ranks need, rows 0-8191 by ranks 0 and 1 (one run each) and one column
  // (runs of 4 bytes) by rank 2; t2: 512 rows of which ranks 0 and 1 need one column each
  // (8 bytes of every 256: the rows would take far more than twice what they need).
  CheckpointMetadata md = RowChunks({32, 16384, 512}, 16384, 1, 1 << 20);
  std::vector<RankNeeds> all(3);
  all[0].needs = {ChunkNeed{0, 0, Box({0, 0}, {32, 32})}, ChunkNeed{1, 0, Box({0, 0}, {8192, 64})},
                  ChunkNeed{2, 0, Box({0, 0}, {512, 1})}};
  all[1].needs = {ChunkNeed{0, 0, Box({0, 32}, {32, 32})},
                  ChunkNeed{1, 0, Box({0, 0}, {8192, 64})}, ChunkNeed{2, 0, Box({0, 1}, {512, 1})}};
  all[2].needs = {ChunkNeed{1, 0, Box({0, 5}, {16384, 1})}};
  const std::vector<ExchangePlan> plans = PlanExchange(all, md, 64 << 20, 64 << 10);
  for (const ExchangePlan& plan : plans) ASSERT_EQ(plan.rounds.size(), 1u);
  const ExchangeRound& r0 = plans[0].rounds[0];
  const ExchangeRound& r1 = plans[1].rounds[0];
  const ExchangeRound& r2 = plans[2].rounds[0];
  // Rank 0 reads t0 and t1 whole (rows 0-16383 of t1, the rows its three users cover), and every
  // user, rank 0 included, copies its region out of them.
  EXPECT_EQ(r0.rows, (std::vector<WholeRows>{WholeRows{0, 0, Box({0, 0}, {32, 64})},
                                              WholeRows{1, 0, Box({0, 0}, {16384, 64})}}));
  EXPECT_EQ(WholeRowsBytes(r0.rows[1], md), uint64_t{4} << 20);
  EXPECT_EQ(ListFor(r0.from_rows, 0), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(ListFor(r1.from_rows, 0), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(ListFor(r2.from_rows, 0), (std::vector<size_t>{0}));
  EXPECT_TRUE(r1.rows.empty());
  EXPECT_TRUE(r2.rows.empty());
  // t2's columns are packed: rank 0 reads them, keeps its own and sends rank 1 its column.
  EXPECT_EQ(r0.own, (std::vector<size_t>{2}));
  EXPECT_EQ(ListFor(r0.send, 1), (std::vector<ChunkNeed>{all[1].needs[2]}));
  EXPECT_EQ(ListFor(r1.receive, 0), (std::vector<size_t>{2}));
  EXPECT_TRUE(r1.own.empty());
  // Without whole rows (a store whose reads scatter runs this short, or the communicator's
  // exchange), the same needs are packed.
  const ExchangePlan packed = PlanExchange(all, md, 64 << 20, 0)[0];
  EXPECT_TRUE(packed.rounds[0].rows.empty());
  EXPECT_EQ(packed.rounds[0].own, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(ListFor(packed.rounds[0].send, 1).size(), 3u);
  // Runs of 128 bytes are long enough when reads scatter runs of 128 bytes: t0 is packed, and
  // t1 is still read whole for rank 2's column.
  const ExchangePlan scattered = PlanExchange(all, md, 64 << 20, 128)[0];
  EXPECT_EQ(scattered.rounds[0].rows,
            (std::vector<WholeRows>{WholeRows{1, 0, Box({0, 0}, {16384, 64})}}));
  // Rows larger than a round are packed too.
  const ExchangePlan small = PlanExchange(all, md, 1 << 20, 64 << 10)[0];
  ASSERT_FALSE(small.rounds.empty());
  for (const ExchangeRound& round : small.rounds) {
    for (const WholeRows& w : round.rows) EXPECT_LE(WholeRowsBytes(w, md), uint64_t{1} << 20);
  }
}

TEST(ReadExchangeTest, AChunkLargerThanARoundIsSharedInRowBands) {
  // One 64 MiB chunk (262144 rows of 256 bytes, 1 MiB checksum blocks) of which four ranks each
  // need 16 columns: 64 MiB of exchange, twice a 32 MiB round. Without bands every rank would
  // read all of it.
  constexpr int64_t kRows = 262144;
  const CheckpointMetadata md = RowChunks({kRows}, kRows, 1, 1 << 20);
  std::vector<RankNeeds> all(4);
  for (int r = 0; r < 4; ++r) all[r].needs = {ChunkNeed{0, 0, Box({0, 16 * r}, {kRows, 16})}};
  constexpr uint64_t kRound = uint64_t{32} << 20;
  for (const uint64_t whole_below : {uint64_t{64} << 10, uint64_t{0}}) {
    SCOPED_TRACE("whole rows below " + std::to_string(whole_below));
    const std::vector<ExchangePlan> plans = PlanExchange(all, md, kRound, whole_below);
    // Four bands of 65536 rows (16 MiB, on block edges), each read once, by one rank.
    EXPECT_EQ(plans[0].shared_chunks, 4u);
    std::vector<int64_t> band_starts;
    uint64_t read_for_all = 0;
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(plans[r].parts.size(), 4u);
      for (size_t j = 0; j < 4; ++j) {
        EXPECT_EQ(plans[r].part_of[j], 0u);
        EXPECT_EQ(plans[r].parts[j].region.sizes[0], kRows / 4);
        EXPECT_EQ(plans[r].parts[j].region.offsets[1], 16 * r);
      }
      for (const ExchangeRound& round : plans[r].rounds) {
        for (const WholeRows& w : round.rows) {
          band_starts.push_back(w.rows.offsets[0]);
          EXPECT_EQ(w.rows.sizes[0], kRows / 4);
          read_for_all += WholeRowsBytes(w, md);
        }
        for (size_t i : round.own) read_for_all += plans[r].parts[i - 1].region.volume() * 4;
        for (const auto& [q, send] : round.send) {
          for (const ChunkNeed& n : send) read_for_all += n.region.volume() * 4;
        }
        // No rank copies its whole need out of anything: only its parts.
        for (const auto& [s, from] : round.from_rows) {
          for (size_t i : from) EXPECT_GE(i, 1u);
        }
      }
    }
    EXPECT_EQ(read_for_all, uint64_t{64} << 20);  // every byte once
    if (whole_below > 0) {
      std::sort(band_starts.begin(), band_starts.end());
      EXPECT_EQ(band_starts, (std::vector<int64_t>{0, kRows / 4, kRows / 2, 3 * kRows / 4}));
    } else {
      EXPECT_TRUE(band_starts.empty());
    }
  }
  // Blocks that no band edge can begin on: bands of 16 MiB span over 8 blocks of 1 MiB + 1 and
  // are cut anyway; with blocks of 3 MiB + 1 they would span fewer, and the chunk is not shared.
  const CheckpointMetadata odd = RowChunks({kRows}, kRows, 1, (1 << 20) + 1);
  EXPECT_EQ(PlanExchange(all, odd, kRound, 64 << 10)[0].shared_chunks, 4u);
  const CheckpointMetadata large_odd = RowChunks({kRows}, kRows, 1, (3 << 20) + 1);
  EXPECT_EQ(PlanExchange(all, large_odd, kRound, 64 << 10)[0].shared_chunks, 0u);
}

TEST(ReadExchangeTest, RanksThatDoNotVerifyCutBandsOnAnyRows) {
  // A 6 KiB chunk (96 rows of 256 bytes) inside one 1 MiB checksum block, whose columns three
  // ranks need; rounds of 4 KiB. Ranks that verify each read the whole block, so bands would
  // read it again for every band and the chunk is not shared. Ranks that do not verify read
  // rows alone: the chunk is shared in bands of rows, each byte read once.
  const CheckpointMetadata md = RowChunks({96}, 96, 1, 1 << 20);
  constexpr uint64_t kRound = 4096;
  for (const bool verify : {true, false}) {
    SCOPED_TRACE(verify ? "verified" : "unverified");
    std::vector<RankNeeds> all(3);
    for (int r = 0; r < 3; ++r) {
      all[r].verify = verify;
      all[r].needs = {ChunkNeed{0, 0, Box({0, 20 * r}, {96, r < 2 ? 20 : 24})}};
    }
    const std::vector<ExchangePlan> plans = PlanExchange(all, md, kRound);
    if (verify) {
      EXPECT_EQ(plans[0].shared_chunks, 0u);
      continue;
    }
    EXPECT_GE(plans[0].shared_chunks, 2u);
    EXPECT_GE(plans[0].rounds.size(), 2u);
    uint64_t read_for_all = 0;
    for (int r = 0; r < 3; ++r) {
      for (const ExchangeRound& round : plans[r].rounds) {
        for (size_t i : round.own) {
          read_for_all += NeedOf(all[r], plans[r], i).region.sizes[0] * 256;
        }
        uint64_t sent = 0;
        for (const auto& [q, send] : round.send) {
          for (const ChunkNeed& n : send) sent += PackedBytes(n.region, DType::kFloat32);
        }
        EXPECT_LE(sent, kRound);
      }
    }
    // Each band's rows are read once, by its reader (as its own need's part): 96 rows in all.
    EXPECT_EQ(read_for_all, 96u * 256);
  }
}

// Every rank's plan, from random needs: what s sends q is what q expects from s, in order; every
// need is served exactly once; readers need the chunk; rounds respect the byte limit.
TEST(ReadExchangeTest, RandomPlansAreConsistentAcrossRanks) {
  std::mt19937_64 rng(5);
  int whole_rows_read = 0;
  int cut_needs = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int ranks = 2 + static_cast<int>(rng() % 5);
    std::vector<int64_t> rows;
    for (int t = 0, n = 1 + static_cast<int>(rng() % 6); t < n; ++t) {
      rows.push_back(1 + rng() % 300);
    }
    const uint64_t block = uint64_t{1} << (8 + rng() % 10);
    const CheckpointMetadata md = RowChunks(rows, 1 + static_cast<int64_t>(rng() % 64),
                                            1 + static_cast<int>(rng() % 4), block);
    std::vector<RankNeeds> all(ranks);
    for (int r = 0; r < ranks; ++r) {
      all[r].verify = rng() % 4 != 0;
      for (uint32_t t = 0; t < md.tensors.size(); ++t) {
        for (uint32_t c = 0; c < md.tensors[t].chunks.size(); ++c) {
          if (rng() % 3 == 0) continue;
          const Box& box = md.tensors[t].chunks[c].box;
          const int64_t r0 = box.offsets[0] + static_cast<int64_t>(rng() % box.sizes[0]);
          const int64_t c0 = static_cast<int64_t>(rng() % 64);
          all[r].needs.push_back(ChunkNeed{
              t, c,
              Box({r0, c0}, {1 + static_cast<int64_t>(rng() % (box.exclusive_max(0) - r0)),
                             1 + static_cast<int64_t>(rng() % (64 - c0))})});
        }
      }
    }
    const uint64_t round_bytes = uint64_t{1} << (10 + rng() % 12);
    const uint64_t whole_below = rng() % 2 == 0 ? 0 : uint64_t{1} << (rng() % 12);
    const std::vector<ExchangePlan> plans = PlanExchange(all, md, round_bytes, whole_below);
    ASSERT_EQ(plans.size(), static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(plans[r].rounds.size(), plans[0].rounds.size());
      EXPECT_EQ(plans[r].shared_chunks, plans[0].shared_chunks);
      // Each rank's lists name other ranks (or, for whole rows, any rank), in ascending order,
      // none empty; and the plan travels unchanged.
      for (const ExchangeRound& round : plans[r].rounds) {
        for (const ByRank<size_t>* lists : {&round.receive, &round.from_rows}) {
          for (size_t j = 0; j < lists->size(); ++j) {
            EXPECT_FALSE((*lists)[j].second.empty());
            if (j > 0) {
              EXPECT_LT((*lists)[j - 1].first, (*lists)[j].first);
            }
            if (lists == &round.receive) {
              EXPECT_NE((*lists)[j].first, r);
            }
          }
        }
        for (size_t j = 0; j < round.send.size(); ++j) {
          EXPECT_FALSE(round.send[j].second.empty());
          EXPECT_NE(round.send[j].first, r);
          if (j > 0) {
            EXPECT_LT(round.send[j - 1].first, round.send[j].first);
          }
        }
      }
      EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(plans[r]), md, all[r].needs.size(), ranks,
                                   0)
                    .value(),
                plans[r]);
    }
    // Per rank, per need index (needs, then parts): how often it is served.
    std::vector<std::vector<int>> served(ranks);
    for (int r = 0; r < ranks; ++r) {
      served[r].assign(all[r].needs.size() + plans[r].parts.size(), 0);
      ASSERT_EQ(plans[r].part_of.size(), plans[r].parts.size());
    }
    for (size_t k = 0; k < plans[0].rounds.size(); ++k) {
      std::vector<uint64_t> traffic(ranks, 0);
      for (int s = 0; s < ranks; ++s) {
        for (size_t i : plans[s].rounds[k].own) ++served[s][i];
        // Whole rows: s reads them (counted as its traffic) and every user copies its region
        // out of them.
        for (const WholeRows& w : plans[s].rounds[k].rows) {
          EXPECT_NE(whole_below, 0u);
          ++whole_rows_read;
          traffic[s] += WholeRowsBytes(w, md);
          const Box& chunk = md.tensors[w.tensor].chunks[w.chunk].box;
          EXPECT_TRUE(Contains(chunk, w.rows));
          EXPECT_EQ(w.rows.offsets[1], 0);
          EXPECT_EQ(w.rows.sizes[1], 64);
        }
        for (int q = 0; q < ranks; ++q) {
          for (size_t i : ListFor(plans[q].rounds[k].from_rows, s)) {
            ++served[q][i];
            const ChunkNeed& need = NeedOf(all[q], plans[q], i);
            bool held = false;
            for (const WholeRows& w : plans[s].rounds[k].rows) {
              held = held || (w.tensor == need.tensor && w.chunk == need.chunk &&
                              Contains(w.rows, need.region));
            }
            EXPECT_TRUE(held) << "rank " << q << " need " << i << " from rank " << s;
          }
        }
        for (int q = 0; q < ranks; ++q) {
          const std::vector<size_t>& expected = ListFor(plans[q].rounds[k].receive, s);
          const std::vector<ChunkNeed>& sent = ListFor(plans[s].rounds[k].send, q);
          ASSERT_EQ(sent.size(), expected.size()) << s << " -> " << q;
          for (size_t j = 0; j < sent.size(); ++j) {
            EXPECT_EQ(sent[j], NeedOf(all[q], plans[q], expected[j]));
            ++served[q][expected[j]];
            const uint64_t bytes = PackedBytes(sent[j].region, DType::kFloat32);
            traffic[s] += bytes;
            traffic[q] += bytes;
            // The reader needs the same chunk itself.
            bool reader_needs = false;
            for (size_t i : plans[s].rounds[k].own) {
              const ChunkNeed& own = NeedOf(all[s], plans[s], i);
              reader_needs = reader_needs || (own.tensor == sent[j].tensor &&
                                              own.chunk == sent[j].chunk);
            }
            EXPECT_TRUE(reader_needs);
          }
        }
      }
      for (int r = 0; r < ranks; ++r) EXPECT_LE(traffic[r], round_bytes) << "round " << k;
    }
    // Each need is served once, whole or as its parts: parts of one need lie in it, apart, and
    // together cover it.
    for (int r = 0; r < ranks; ++r) {
      const size_t whole = all[r].needs.size();
      std::vector<int64_t> covered(whole, 0);
      for (size_t j = 0; j < plans[r].parts.size(); ++j) {
        ++cut_needs;
        const size_t i = plans[r].part_of[j];
        ASSERT_LT(i, whole);
        const ChunkNeed& part = plans[r].parts[j];
        EXPECT_EQ(part.tensor, all[r].needs[i].tensor);
        EXPECT_EQ(part.chunk, all[r].needs[i].chunk);
        EXPECT_TRUE(Contains(all[r].needs[i].region, part.region));
        for (size_t j2 = 0; j2 < j; ++j2) {
          if (plans[r].part_of[j2] == i) {
            EXPECT_FALSE(Intersect(plans[r].parts[j2].region, part.region).has_value());
          }
        }
        EXPECT_EQ(served[r][whole + j], 1) << "rank " << r << " part " << j;
        covered[i] += part.region.volume();
      }
      for (size_t i = 0; i < whole; ++i) {
        if (covered[i] > 0) {
          EXPECT_EQ(served[r][i], 0) << "rank " << r << " need " << i << " also served whole";
          EXPECT_EQ(covered[i], all[r].needs[i].region.volume());
        } else {
          EXPECT_EQ(served[r][i], 1) << "rank " << r << " need " << i;
        }
      }
    }
  }
  EXPECT_GT(whole_rows_read, 100);
  EXPECT_GT(cut_needs, 100);
}

TEST(ReadExchangeTest, PlansRoundTripAndHostileBytesAreRefusedByName) {
  const CheckpointMetadata md = RowChunks({8, 8}, 4, 2, 1 << 20);
  ExchangePlan plan;
  plan.shared_chunks = 3;
  plan.parts = {ChunkNeed{1, 0, Box({0, 0}, {2, 64})}};
  plan.part_of = {1};
  plan.rounds.resize(2);
  plan.rounds[0].own = {0, 2};
  plan.rounds[0].send = {{1, {ChunkNeed{0, 1, Box({5, 3}, {2, 10})}}},
                         {4, {ChunkNeed{0, 0, Box({0, 0}, {1, 1})}}}};
  plan.rounds[0].receive = {{3, {1}}};
  plan.rounds[1].rows = {WholeRows{1, 1, Box({4, 0}, {3, 64})}};
  plan.rounds[1].from_rows = {{0, {2}}, {2, {1}}};
  const std::string bytes = EncodeExchangePlan(plan);
  // This rank sent 2 needs (so indices 0-2 with the part), in a group of 5.
  EXPECT_EQ(DecodeExchangePlan(bytes, md, 2, 5, 0).value(), plan);
  for (size_t len = 0; len < bytes.size(); ++len) {
    EXPECT_EQ(DecodeExchangePlan(bytes.substr(0, len), md, 2, 5, 0).status().code(),
              StatusCode::kDataLoss)
        << len;
  }
  EXPECT_EQ(DecodeExchangePlan(bytes + "x", md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: 1 unexpected bytes after the last round"));
  EXPECT_EQ(DecodeExchangePlan(bytes, md, 1, 5, 0).status(),
            DataLossError("exchange plan from rank 0: part 0 is a part of need 1, but this rank "
                          "has 1 needs"));
  EXPECT_EQ(DecodeExchangePlan(bytes, md, 2, 4, 0).status(),
            DataLossError("exchange plan from rank 0: sends of round 0 lists rank 4 with 1 "
                          "entries after rank 1 in a group of 4; expected ranks in ascending "
                          "order, each with a non-empty list"));
  ExchangePlan unordered = plan;
  std::swap(unordered.rounds[1].from_rows[0], unordered.rounds[1].from_rows[1]);
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(unordered), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: copies out of whole rows of round 1 lists "
                          "rank 0 with 1 entries after rank 2 in a group of 5; expected ranks in "
                          "ascending order, each with a non-empty list"));
  ExchangePlan empty_list = plan;
  empty_list.rounds[0].receive[0].second.clear();
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(empty_list), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: receives of round 0 lists rank 3 with 0 "
                          "entries in a group of 5; expected ranks in ascending order, each with "
                          "a non-empty list"));
  ExchangePlan far = plan;
  far.rounds[0].own[1] = 3;
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(far), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: own reads of round 0 names need 3, but "
                          "this rank has 2 needs and 1 parts"));
  ExchangePlan outside = plan;
  outside.rounds[0].send[1].second[0].region = Box({0, 60}, {1, 5});
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(outside), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: sends of round 0 region [0:1, 60:65] is not "
                          "a non-empty part of chunk [0:4, 0:64] of tensor 't0'"));
  ExchangePlan rows = plan;
  rows.rounds[1].rows[0].rows = Box({4, 0}, {5, 64});
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(rows), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: whole rows of round 1 region [4:9, 0:64] "
                          "is not a non-empty part of chunk [4:8, 0:64] of tensor 't1'"));
  ExchangePlan absent = plan;
  absent.rounds[1].rows[0].chunk = 2;
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(absent), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: whole rows of round 1 names tensor 1 chunk "
                          "2, which the checkpoint does not have"));
  ExchangePlan none = plan;
  none.rounds.clear();
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(none), md, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: no rounds; expected at least one"));

  // A rank that holds part of the chunks (TensorMetadata::kept) gets the chunks by their stored
  // numbers and turns them into its own indices: here it holds chunk 1 of t0 and chunks 0 and 1
  // of t1 (chunk 0 of t0 is not its), as if its boxes reached only those.
  CheckpointMetadata part = md;
  part.tensors[0].chunks = {md.tensors[0].chunks[1]};
  part.tensors[0].kept = std::vector<uint32_t>{1};
  part.tensors[0].grid.reset();
  part.tensors[0].index.reset();
  ExchangePlan mine = plan;
  mine.rounds[0].send = {{1, {ChunkNeed{0, 1, Box({5, 3}, {2, 10})}}}};
  ExchangePlan expected = mine;
  expected.rounds[0].send[0].second[0].chunk = 0;  // its index in this rank's part
  EXPECT_EQ(DecodeExchangePlan(EncodeExchangePlan(mine), part, 2, 5, 0).value(), expected);
  EXPECT_EQ(DecodeExchangePlan(bytes, part, 2, 5, 0).status(),
            DataLossError("exchange plan from rank 0: sends of round 0 names tensor 0 chunk 0, "
                          "which this rank's part of the metadata does not hold (its boxes do "
                          "not reach it)"));
}

// Counts what each rank receives from the collectives, and which it calls.
class CountingComm : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  Result<std::vector<std::string>> Gather(std::string p, int root) override {
    ++gathers;
    Result<std::vector<std::string>> out = ForwardingComm::Gather(std::move(p), root);
    if (out.ok()) {
      for (const std::string& each : *out) received += each.size();
    }
    return out;
  }
  Result<std::string> Scatter(std::vector<std::string> p, int root) override {
    Result<std::string> out = ForwardingComm::Scatter(std::move(p), root);
    if (out.ok()) received += out->size();
    return out;
  }
  Result<std::string> Broadcast(std::string p, int root) override {
    Result<std::string> out = ForwardingComm::Broadcast(std::move(p), root);
    if (out.ok()) received += out->size();
    return out;
  }
  Result<std::vector<std::string>> AllGather(std::string p) override {
    ++all_gathers;
    return ForwardingComm::AllGather(std::move(p));
  }
  uint64_t received = 0;
  int gathers = 0;
  int all_gathers = 0;
};

TEST(ReadExchangeTest, OneRankPlansAndEachRankReceivesOnlyItsOwnPlan) {
  // 6 ranks load t0 (4 chunks of 4 rows) as two column halves each over 3 row bands: every chunk
  // is shared by the two ranks of its band.
  constexpr int kRanks = 6;
  const CheckpointMetadata md = RowChunks({16, 16, 16}, 4, 3, 1 << 20);
  std::vector<RankNeeds> all(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (uint32_t t = 0; t < 3; ++t) {
      for (uint32_t c = 0; c < 4; ++c) {
        if (static_cast<int>(c + t) % 3 != r / 2) continue;
        all[r].needs.push_back(ChunkNeed{t, c, Box({4 * c, 32 * (r % 2)}, {4, 32})});
      }
    }
  }
  const std::vector<ExchangePlan> expected = PlanExchange(all, md, 1 << 20);
  ASSERT_GT(expected[0].shared_chunks, 0u);
  std::vector<ExchangePlan> got(kRanks);
  std::vector<uint64_t> received(kRanks);
  std::vector<Status> statuses = RunRanks(kRanks, [&](Communicator& inner) -> Status {
    CountingComm comm(inner);
    SP_ASSIGN_OR_RETURN(got[comm.rank()],
                        PlanExchangeOnRoot(comm, all[comm.rank()], md, 1 << 20));
    received[comm.rank()] = comm.received;
    EXPECT_EQ(comm.all_gathers, 0);
    EXPECT_EQ(comm.gathers, 1);
    return OkStatus();
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    EXPECT_EQ(got[r], expected[r]) << "rank " << r;
    if (r == 0) continue;
    // Its own plan, and the verdict of the gather (with their envelopes: a few bytes).
    const uint64_t plan_bytes = EncodeExchangePlan(expected[r]).size();
    EXPECT_GE(received[r], plan_bytes) << "rank " << r;
    EXPECT_LE(received[r], plan_bytes + 16) << "rank " << r;
  }
  // Rank 0 receives every rank's needs.
  uint64_t needs_bytes = 0;
  for (const RankNeeds& needs : all) needs_bytes += EncodeNeeds(needs).size();
  EXPECT_GE(received[0], needs_bytes + EncodeExchangePlan(expected[0]).size());

  // One rank's error reaches every rank, named by rank; so does needs the metadata lacks, by the
  // rank that sent them.
  statuses = RunRanks(kRanks, [&](Communicator& comm) -> Status {
    Result<RankNeeds> mine = all[comm.rank()];
    if (comm.rank() == 4) mine = InvalidArgumentError("no such tensor");
    return PlanExchangeOnRoot(comm, std::move(mine), md, 1 << 20).status();
  });
  for (const Status& status : statuses) {
    EXPECT_EQ(status, InvalidArgumentError("rank 4: no such tensor"));
  }
  statuses = RunRanks(kRanks, [&](Communicator& comm) -> Status {
    RankNeeds mine = all[comm.rank()];
    if (comm.rank() == 3) mine.needs[0].chunk = 9;
    return PlanExchangeOnRoot(comm, std::move(mine), md, 1 << 20).status();
  });
  for (const Status& status : statuses) {
    EXPECT_EQ(status, DataLossError("rank 0: read needs of rank 3: need 0 names tensor 0 chunk 9, "
                                    "which the checkpoint does not have"));
  }
}

TEST(ReadExchangeTest, InMemoryReadsGiveEachRankOneStretchOfTheFiles) {
  // 40 tensors of 8 row chunks over 3 files; 4 ranks each need random regions of random chunks
  // (some chunks by several ranks, some by none).
  std::vector<int64_t> rows(40, 64);
  const CheckpointMetadata md = RowChunks(rows, 8, 3, 1 << 10);
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    std::vector<RankNeeds> all(n);
    for (RankNeeds& r : all) {
      r.verify = rng() % 2 == 0;
      for (uint32_t t = 0; t < md.tensors.size(); ++t) {
        for (uint32_t c = 0; c < md.tensors[t].chunks.size(); ++c) {
          if (rng() % 3 != 0) continue;
          const Box& box = md.tensors[t].chunks[c].box;
          const int64_t row = box.offsets[0] + static_cast<int64_t>(rng() % 8);
          const int64_t col = static_cast<int64_t>(rng() % 60);
          r.needs.push_back(ChunkNeed{t, c, Box({row, col}, {1, 4})});
        }
      }
    }
    // Every need is read by exactly one rank; needs whose reads overlap by the same rank.
    std::map<NeedRef, int> reader_of;
    std::vector<uint64_t> first(n, UINT64_MAX), last(n, 0);
    const std::vector<std::vector<NeedRef>> reads = AssignInMemoryReads(all, md);
    ASSERT_EQ(reads.size(), static_cast<size_t>(n));
    for (int me = 0; me < n; ++me) {
      for (const NeedRef& ref : reads[me]) {
        EXPECT_TRUE(reader_of.emplace(ref, me).second) << "read twice";
        const ChunkNeed& need = all[ref.first].needs[ref.second];
        // The position of the read in the files taken in order: file, then offset.
        const TensorMetadata& tensor = md.tensors[need.tensor];
        const StoredChunk& chunk = tensor.chunks[need.chunk];
        const Interval span = ReadSpan(tensor, chunk, need.region, all[ref.first].verify,
                                       md.checksum_block_bytes);
        const uint64_t at = (uint64_t{chunk.file} << 40) + chunk.data_offset;
        first[me] = std::min(first[me], at + span.first);
        last[me] = std::max(last[me], at + span.second - 1);
      }
    }
    for (const auto& [a, ra] : reader_of) {
      for (const auto& [b, rb] : reader_of) {
        const ChunkNeed& na = all[a.first].needs[a.second];
        const ChunkNeed& nb = all[b.first].needs[b.second];
        if (na.tensor != nb.tensor || na.chunk != nb.chunk) continue;
        const TensorMetadata& tensor = md.tensors[na.tensor];
        const Interval sa = ReadSpan(tensor, tensor.chunks[na.chunk], na.region,
                                     all[a.first].verify, md.checksum_block_bytes);
        const Interval sb = ReadSpan(tensor, tensor.chunks[nb.chunk], nb.region,
                                     all[b.first].verify, md.checksum_block_bytes);
        if (sa.first < sb.second && sb.first < sa.second) {
          EXPECT_EQ(ra, rb) << "overlapping reads of one chunk by two ranks";
        }
      }
    }
    size_t needs = 0;
    for (const RankNeeds& r : all) needs += r.needs.size();
    EXPECT_EQ(reader_of.size(), needs);
    // Each rank's stretch lies wholly before the next rank's.
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        if (first[a] == UINT64_MAX || first[b] == UINT64_MAX) continue;
        EXPECT_LT(last[a], first[b]) << "ranks " << a << " and " << b;
      }
    }
  }
}

TEST(ReadExchangeTest, InMemoryReadsSplitAChunkWhoseRowsGoToDifferentRanks) {
  // One chunk of 64 rows: each of two ranks needs its half, and a third needs rows 0-7 again.
  // Without checksums the half with the repeated rows is one read, the other half another (by
  // the rank whose stretch it begins in); with checksum blocks of the whole chunk every read
  // overlaps and one rank reads it all.
  for (uint64_t block : {uint64_t{0}, uint64_t{1} << 20}) {
    const CheckpointMetadata md = RowChunks({64}, 64, 1, block);
    std::vector<RankNeeds> all(3);
    for (int r = 0; r < 3; ++r) all[r].verify = block > 0;
    all[0].needs = {ChunkNeed{0, 0, Box({0, 0}, {32, 64})}};
    all[1].needs = {ChunkNeed{0, 0, Box({32, 0}, {32, 64})}};
    all[2].needs = {ChunkNeed{0, 0, Box({0, 0}, {8, 64})}};
    const std::vector<std::vector<NeedRef>> mine = AssignInMemoryReads(all, md);
    if (block == 0) {
      EXPECT_EQ(mine[0], (std::vector<NeedRef>{{2, 0}, {0, 0}}));
      EXPECT_EQ(mine[1], (std::vector<NeedRef>{{1, 0}}));
      EXPECT_EQ(mine[2], std::vector<NeedRef>{});
    } else {
      EXPECT_EQ(mine[0], (std::vector<NeedRef>{{0, 0}, {1, 0}, {2, 0}}));
      EXPECT_EQ(mine[1], std::vector<NeedRef>{});
      EXPECT_EQ(mine[2], std::vector<NeedRef>{});
    }
  }
}

}  // namespace
}  // namespace sp

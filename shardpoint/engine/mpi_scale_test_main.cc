// A save by many MPI ranks and loads by other numbers of ranks in other layouts (ctest: 256 ranks
// save, then 192 and 320 load, all oversubscribed on this machine). One run does one side:
//   mpi_scale_test save DIR   every rank saves its row block of "w" [3840, 8] and the replicated
//                             "b" [1000] (stored once, by one of its holders), twice through a
//                             SavePlanCache: the second save (which the loads read) must take the
//                             cached plan on every rank. The even ranks give their tensors' mesh
//                             rules (SaveTensor::layout), the odd ones boxes: two shared parts,
//                             the odd ranks' asked for in a second exchange
//   mpi_scale_test load DIR   every rank loads a block of "w" on a (world / 8) x 8 grid and the
//                             whole of "b", bit-exact; again with the ranks saying they run on
//                             separate machines (each stored block of "w" read by one of the 8
//                             ranks that need it and sent to the others, "b" read by one rank
//                             and sent to all, point to point), every stored byte read once;
//                             then a load in which the last rank asks for a tensor the
//                             checkpoint lacks must fail on every rank, naming it
// Rank 0 prints one line per failed check and then "N passed, M failed"; the exit status is
// non-zero when any check failed on any rank.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/mpi_comm.h"
#include "shardpoint/engine/mpi_test_checks.h"

namespace sp {
namespace {

// 3840 rows = 15 x 256 = 20 x 192 = 12 x 320.
constexpr int64_t kRows = 3840, kCols = 8, kReplicated = 1000;

float W(int64_t row, int64_t col) { return static_cast<float>(row * 16 + col) + 0.5f; }
int64_t B(int64_t i) { return i * i - 7; }

std::vector<float> Block(int64_t row, int64_t rows, int64_t col, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = row; r < row + rows; ++r) {
    for (int64_t c = col; c < col + cols; ++c) out.push_back(W(r, c));
  }
  return out;
}

std::vector<int64_t> Replicated() {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < kReplicated; ++i) out.push_back(B(i));
  return out;
}

void SaveSide(Communicator& comm, const std::string& path, MpiChecks& checks) {
  const int n = comm.size(), rank = comm.rank();
  if (kRows % n != 0) {
    checks.Expect("the world divides the rows", false, std::to_string(n));
    return;
  }
  const int64_t rows = kRows / n;
  const std::vector<float> mine = Block(rank * rows, rows, 0, kCols);
  const std::vector<int64_t> b = Replicated();
  SaveState state;
  state.tensors.push_back(SaveTensor{
      "w", DType::kFloat32, {kRows, kCols},
      {ConstPieceView{Box{{rank * rows, 0}, {rows, kCols}},
                      reinterpret_cast<const std::byte*>(mine.data())}}});
  state.tensors.push_back(SaveTensor{
      "b", DType::kInt64, {kReplicated},
      {ConstPieceView{Box{{0}, {kReplicated}}, reinterpret_cast<const std::byte*>(b.data())}}});
  if (rank % 2 == 0) {
    state.tensors[0].layout = MeshLayout{{n}, {Placement::Shard(0)}, {}};
    state.tensors[1].layout = MeshLayout{{n}, {Placement::Replicate()}, {}};
  }
  SavePlanCache cache;
  SaveStats stats;
  SaveOptions options;
  options.comm = &comm;
  options.overwrite = true;
  options.plan_cache = &cache;
  options.stats = &stats;
  const Status saved = sp::Save(state, path, options);
  checks.Expect("save", saved.ok(), saved.ToString());
  checks.Expect("the first save plans", !stats.plan_cached);
  checks.Expect("the first save asks for the odd ranks' shared part in a second exchange",
                stats.plan_exchanges == 2, std::to_string(stats.plan_exchanges) + " exchanges");
  const Status again = sp::Save(state, path, options);
  checks.Expect("a second save over it", again.ok(), again.ToString());
  checks.Expect("the second save takes the cached plan", stats.plan_cached && cache.hits() == 1,
                std::to_string(cache.hits()) + " hits");
}

void LoadSide(Communicator& comm, const std::string& path, MpiChecks& checks) {
  const int n = comm.size(), rank = comm.rank();
  if (n % kCols != 0 || kRows % (n / kCols) != 0) {
    checks.Expect("the world makes a grid of the tensor", false, std::to_string(n));
    return;
  }
  const int64_t rows = kRows / (n / kCols);
  const Box box{{rank / kCols * rows, rank % kCols}, {rows, 1}};
  std::vector<float> w(static_cast<size_t>(rows), -1.0f);
  std::vector<int64_t> b(kReplicated, -1);
  LoadState state;
  state.tensors.push_back(LoadTensor{"w", DType::kFloat32, {kRows, kCols},
                                     {PieceView{box, reinterpret_cast<std::byte*>(w.data())}}});
  state.tensors.push_back(LoadTensor{"b", DType::kInt64, {kReplicated},
                                     {PieceView{Box{{0}, {kReplicated}},
                                                reinterpret_cast<std::byte*>(b.data())}}});
  LoadOptions options;
  options.comm = &comm;
  Result<LoadResult> loaded = sp::Load(state, path, options);
  checks.Expect("load", loaded.ok(), loaded.ok() ? "" : loaded.status().ToString());
  checks.Expect("the block of w is bit-exact", w == Block(box.offsets[0], rows, box.offsets[1], 1));
  checks.Expect("b is bit-exact", b == Replicated());
  // Rank 0 holds every stored chunk of the metadata; every other process only those its boxes
  // reach (LoadOptions::own_chunks_only), counted here by a plain scan of the whole metadata.
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(path);
  checks.Expect("the metadata, read again", md.ok(), md.ok() ? "" : md.status().ToString());
  if (md.ok() && loaded.ok()) {
    uint64_t all = 0, reached = 0;
    for (const TensorMetadata& t : md->tensors) {
      all += t.chunks.size();
      const Box& mine = t.name == "w" ? box : state.tensors[1].pieces[0].box;
      for (const StoredChunk& c : t.chunks) reached += Intersect(mine, c.box).has_value();
    }
    const uint64_t expected = rank == 0 ? all : reached;
    checks.Expect("the chunks this process's copy of the metadata holds",
                  loaded->metadata_chunks == expected,
                  std::to_string(loaded->metadata_chunks) + " of " + std::to_string(all) +
                      " chunks, expected " + std::to_string(expected));
  }

  // Between machines: the shared regions go point to point, each stored byte read once.
  testing::AcrossMachinesComm apart(comm);
  std::fill(w.begin(), w.end(), -1.0f);
  std::fill(b.begin(), b.end(), -1);
  options.comm = &apart;
  loaded = sp::Load(state, path, options);
  options.comm = &comm;
  checks.Expect("load across machines", loaded.ok(),
                loaded.ok() ? "" : loaded.status().ToString());
  checks.Expect("across machines, the block of w is bit-exact",
                w == Block(box.offsets[0], rows, box.offsets[1], 1));
  checks.Expect("across machines, b is bit-exact", b == Replicated());
  unsigned long long read = loaded.ok() ? loaded->bytes_read : 0, all_read = 0;
  MPI_Allreduce(&read, &all_read, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  const unsigned long long stored = kRows * kCols * sizeof(float) + kReplicated * sizeof(int64_t);
  checks.Expect("across machines, every stored byte is read once", all_read == stored,
                std::to_string(all_read) + " of " + std::to_string(stored) + " bytes");

  // One rank's error reaches every rank.
  float missing = 0;
  if (rank == n - 1) {
    state.tensors.push_back(LoadTensor{"absent", DType::kFloat32, {1},
                                       {PieceView{Box{{0}, {1}},
                                                  reinterpret_cast<std::byte*>(&missing)}}});
  }
  Result<LoadResult> failed = sp::Load(state, path, options);
  const std::string message = failed.ok() ? "" : failed.status().ToString();
  checks.Expect("a load missing a tensor on the last rank fails on every rank", !failed.ok());
  checks.Expect("every rank's error names the tensor",
                message.find("absent") != std::string::npos, message);
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "save" && mode != "load") {
    std::fprintf(stderr, "usage: mpi_scale_test save|load DIR\n");
    return 2;
  }
  const std::string path = std::string(argv[2]) + "/ckpt";
  return sp::RunMpiChecks(&argc, &argv, 600, [&](sp::Communicator& comm, sp::MpiChecks& checks) {
    if (mode == "save") {
      sp::SaveSide(comm, path, checks);
    } else {
      sp::LoadSide(comm, path, checks);
    }
  });
}

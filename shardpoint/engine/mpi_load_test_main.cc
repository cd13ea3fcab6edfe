// Saves and loads a checkpoint over MpiComm under mpirun (ctest runs it with 4 ranks, all on this
// machine): the same layout and a resharded one load bit-exact, and the ranks, separate
// processes of one machine, read through one shared gate (LoadResult::read_gate_ranks) when each
// reads its own, or each through its own with machine_read_gate off or when they share their
// reads through shared memory (each stored byte has one reader then); chunks larger than a round
// of the exchange are shared in bands of rows, each process reading its share. Rank 0 prints one
// line per failed check and then "N passed, M failed"; the exit status is non-zero when any
// check failed on any rank. Then the same ranks say they run on separate machines: shared reads go
// through the communicator, round by round, point to point between the ranks that exchange
// (MpiComm::ExchangeWithPeers), bit-exact, each stored byte read once, and a corrupt chunk read
// for others fails every rank with its reader's error.
//
// Usage: mpirun -np 4 mpi_load_test
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/base/random_id.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/mpi_comm.h"
#include "shardpoint/engine/mpi_test_checks.h"

namespace sp {
namespace {

constexpr int64_t kRows = 64, kCols = 48;
// "big": chunks of 256 rows of 2 KiB (512 KiB) per rank, larger than a round of a load whose
// budget is kSmallBudget, in checksum blocks of kSmallBlock.
constexpr int64_t kBigRows = 256, kBigCols = 512;
constexpr uint64_t kSmallBudget = 3 * (uint64_t{128} << 10), kSmallBlock = uint64_t{16} << 10;

float Value(int64_t row, int64_t col) { return static_cast<float>(row * 1000 + col) + 0.25f; }

// The block [row, row + rows) x [col, col + cols) of the tensor, row-major.
std::vector<float> Block(int64_t row, int64_t rows, int64_t col, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = row; r < row + rows; ++r) {
    for (int64_t c = col; c < col + cols; ++c) out.push_back(Value(r, c));
  }
  return out;
}

void Run(Communicator& comm, MpiChecks& checks) {
  const int rank = comm.rank();
  const int n = comm.size();
  checks.Expect("the ranks share one machine", static_cast<int>(comm.machine_ranks().size()) == n);

  // Rank 0 picks the directory; every rank gets its name.
  char dir[128] = {};
  if (rank == 0) {
    std::snprintf(dir, sizeof(dir), "%s/sp-mpi-load-%s",
                  std::filesystem::temp_directory_path().c_str(), RandomHexId(12).c_str());
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string path = std::string(dir) + "/ckpt";

  // Saved as row blocks, one per rank.
  const int64_t rows = kRows / n;
  const std::vector<float> mine = Block(rank * rows, rows, 0, kCols);
  const std::vector<float> big = Block(rank * kBigRows, kBigRows, 0, kBigCols);
  SaveState save_state;
  save_state.tensors.push_back(SaveTensor{
      "w", DType::kFloat32, {kRows, kCols},
      {ConstPieceView{Box{{rank * rows, 0}, {rows, kCols}},
                      reinterpret_cast<const std::byte*>(mine.data())}}});
  save_state.tensors.push_back(SaveTensor{
      "big", DType::kFloat32, {n * kBigRows, kBigCols},
      {ConstPieceView{Box{{rank * kBigRows, 0}, {kBigRows, kBigCols}},
                      reinterpret_cast<const std::byte*>(big.data())}}});
  SaveOptions save_options;
  save_options.comm = &comm;
  save_options.checksum_block_bytes = kSmallBlock;
  const Status saved = Save(save_state, path, save_options);
  checks.Expect("save", saved.ok(), saved.ToString());

  // Loads `box` of the tensor with `gate` on and `share` reads; returns what read_gate_ranks
  // said, -1 on error.
  auto load = [&](const Box& box, bool gate, std::optional<bool> share, const std::string& name,
                  Communicator* via = nullptr, uint64_t* bytes_read = nullptr,
                  uint64_t* metadata_chunks = nullptr) {
    std::vector<float> out(static_cast<size_t>(box.sizes[0] * box.sizes[1]), -1.0f);
    LoadState state;
    state.tensors.push_back(LoadTensor{
        "w", DType::kFloat32, {kRows, kCols},
        {PieceView{box, reinterpret_cast<std::byte*>(out.data())}}});
    LoadOptions options;
    options.comm = via != nullptr ? via : &comm;
    options.machine_read_gate = gate;
    options.share_reads = share;
    Result<LoadResult> loaded = Load(state, path, options);
    checks.Expect(name, loaded.ok(), loaded.ok() ? "" : loaded.status().ToString());
    checks.Expect(name + " is bit-exact",
                  out == Block(box.offsets[0], box.sizes[0], box.offsets[1], box.sizes[1]));
    if (bytes_read != nullptr) *bytes_read = loaded.ok() ? loaded->bytes_read : 0;
    if (metadata_chunks != nullptr) *metadata_chunks = loaded.ok() ? loaded->metadata_chunks : 0;
    return loaded.ok() ? loaded->read_gate_ranks : -1;
  };
  // The metadata holds n row blocks of each tensor. Rank 0 (the coordinator) keeps them all; every
  // other process keeps only the chunks its boxes reach (LoadOptions::own_chunks_only): its own
  // row block of "w", nothing of "big", which it does not load.
  {
    uint64_t held = 0;
    load(Box{{rank * rows, 0}, {rows, kCols}}, true, false, "own rows", nullptr, nullptr, &held);
    checks.Expect("own rows: the chunks this process's copy of the metadata holds",
                  held == (rank == 0 ? 2 * static_cast<uint64_t>(n) : 1),
                  std::to_string(held) + " chunks");
  }
  const Box same{{rank * rows, 0}, {rows, kCols}};
  const Box columns{{0, rank * (kCols / n)}, {kRows, kCols / n}};
  checks.Expect("same layout: one gate for the machine",
                load(same, true, std::nullopt, "same layout") == n);
  checks.Expect("resharded, each reading its own: one gate for the machine",
                load(columns, true, false, "resharded alone") == n);
  checks.Expect("resharded through shared memory: a gate each",
                load(columns, true, std::nullopt, "resharded") == 1);
  checks.Expect("machine_read_gate off: a gate each",
                load(columns, false, false, "gates off") == 1);

  // Columns of chunks whose exchange exceeds a round: shared in bands of rows
  // (engine/read_exchange.h), each process reading about a quarter of the bytes.
  auto big_columns = [&](Communicator& via, const std::string& name) -> Result<LoadResult> {
    const int64_t cols = kBigCols / n;
    std::vector<float> out(static_cast<size_t>(n * kBigRows * cols), -1.0f);
    LoadState state;
    state.tensors.push_back(LoadTensor{
        "big", DType::kFloat32, {n * kBigRows, kBigCols},
        {PieceView{Box{{0, rank * cols}, {n * kBigRows, cols}},
                   reinterpret_cast<std::byte*>(out.data())}}});
    LoadOptions options;
    options.comm = &via;
    options.memory_budget_bytes = kSmallBudget;
    Result<LoadResult> loaded = Load(state, path, options);
    if (!loaded.ok()) return loaded;
    checks.Expect(name + " are bit-exact", out == Block(0, n * kBigRows, rank * cols, cols));
    // Every row block of "big" and none of "w" (rank 0: all of both), numbered as stored when
    // they cross processes.
    checks.Expect(name + ": the chunks this process's copy of the metadata holds",
                  loaded->metadata_chunks == static_cast<uint64_t>(rank == 0 ? 2 * n : n),
                  std::to_string(loaded->metadata_chunks) + " chunks");
    const uint64_t stored = static_cast<uint64_t>(n * kBigRows * kBigCols) * 4;
    checks.Expect(name + ": each process reads its share",
                  loaded->bytes_read > 0 && loaded->bytes_read <= stored / n + stored / 8,
                  std::to_string(loaded->bytes_read) + " of " + std::to_string(stored) + " bytes");
    return loaded;
  };
  {
    Result<LoadResult> loaded = big_columns(comm, "columns in bands");
    checks.Expect("columns in bands", loaded.ok(), loaded.ok() ? "" : loaded.status().ToString());
  }

  // Across machines: the regions go point to point, round by round.
  testing::AcrossMachinesComm across(comm);
  {
    uint64_t read = 0;
    load(columns, true, std::nullopt, "resharded across machines", &across, &read);
    unsigned long long mine_read = read, all_read = 0;
    MPI_Allreduce(&mine_read, &all_read, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    checks.Expect("resharded across machines: each stored byte read once",
                  all_read == static_cast<unsigned long long>(kRows * kCols) * 4,
                  std::to_string(all_read) + " bytes read in all");
    Result<LoadResult> loaded = big_columns(across, "columns in bands across machines");
    checks.Expect("columns in bands across machines", loaded.ok(),
                  loaded.ok() ? "" : loaded.status().ToString());
  }
  // A flipped byte in the last stored chunk of "big": the rank that reads it for the others
  // finds it, and every rank returns its error.
  {
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(path);
    checks.Expect("metadata", md.ok(), md.ok() ? "" : md.status().ToString());
    std::string flipped;
    if (md.ok() && rank == 0) {
      for (const TensorMetadata& t : md->tensors) {
        if (t.name != "big") continue;
        const StoredChunk& chunk = t.chunks.back();
        const DataFile& file = md->files[chunk.file];
        flipped = path + "/" + file.name;
        std::FILE* f = std::fopen(flipped.c_str(), "r+b");
        const long at = static_cast<long>(file.data_start + chunk.data_offset + 1000);
        int byte = f != nullptr && std::fseek(f, at, SEEK_SET) == 0 ? std::fgetc(f) : EOF;
        if (byte != EOF && std::fseek(f, at, SEEK_SET) == 0) std::fputc(byte ^ 0x10, f);
        if (f != nullptr) std::fclose(f);
      }
    }
    Result<LoadResult> loaded = big_columns(across, "a corrupt chunk");
    const std::string message = loaded.ok() ? "" : loaded.status().ToString();
    // Every rank returns the same error, the reader's: the chunk, its file and which rank read it.
    char first[1024] = {};
    if (rank == 0) std::snprintf(first, sizeof(first), "%s", message.c_str());
    MPI_Bcast(first, sizeof(first), MPI_CHAR, 0, MPI_COMM_WORLD);
    checks.Expect("a corrupt chunk fails every rank with one error",
                  !loaded.ok() && loaded.status().code() == StatusCode::kDataLoss &&
                      message.rfind("DATA_LOSS: rank ", 0) == 0 &&
                      message.find("checksum mismatch in tensor 'big'") != std::string::npos &&
                      message.substr(0, sizeof(first) - 1) == first,
                  message);
  }

  MPI_Barrier(MPI_COMM_WORLD);
  bool clean = true;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().rfind("shardpoint-io-", 0) == 0) clean = false;
  }
  checks.Expect("nothing stays in /dev/shm", clean);
  if (rank == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) { return sp::RunMpiChecks(&argc, &argv, 300, sp::Run); }

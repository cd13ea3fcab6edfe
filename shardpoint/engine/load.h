// Load: reads a checkpoint of any format into the pieces every rank asks for, and the reads of
// its metadata and objects alone (implemented in load.cc).
//
// A checkpoint is a directory of data files plus one metadata file; it exists only once the
// metadata is committed. Every rank calls the same function with its own state; ranks exchange
// plans through a Communicator (null: one rank in this process). Errors: a Status or Result;
// inside a collective call, if any rank fails every rank returns the same error (docs/DESIGN.md
// decision 5). Thread-safety: one call per rank at a time.
//
// Loads write straight into the caller's buffers, which must stay valid until the call returns.
#ifndef SHARDPOINT_ENGINE_LOAD_H_
#define SHARDPOINT_ENGINE_LOAD_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"
#include "shardpoint/engine/budget.h"

namespace sp {

struct PieceView {
  Box box;
  std::byte* data = nullptr;
};

// What one rank wants of one tensor (load).
struct LoadTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // global; must equal the stored shape
  std::vector<PieceView> pieces;
};

struct LoadState {
  std::vector<LoadTensor> tensors;
  std::vector<std::string> objects;  // names of the objects wanted
};

struct LoadOptions {
  Communicator* comm = nullptr;
  Store* store = nullptr;
  ThreadPool* pool = nullptr;
  int threads = 0;                  // 0: DefaultIoThreads(), max(4, cores)
  int coordinator = 0;              // the rank that reads the metadata and broadcasts it
  bool strict = true;               // missing keys are an error
  bool allow_cast = false;          // convert stored dtypes to the destination's dtype
  bool verify_checksums = true;
  uint64_t memory_budget_bytes = kDefaultMemoryBudgetBytes;  // staging beyond the caller's buffers
  // A stored chunk that several ranks need is read by one of them, which sends the others their
  // regions through the communicator (each stored byte read once); between ranks that share an
  // address space (comm->shares_memory(): threads of one process) every needed chunk is read by
  // one rank, each rank reading one stretch of the files, and its regions are copied straight into
  // the destinations of the ranks that need them; between the processes of one machine (every
  // rank in comm->machine_ranks()) the regions go through one POSIX shared-memory object instead
  // of the communicator (engine/load_internal.h, LoadSharedOnMachine). false: every rank reads for
  // itself. Unset: shared when the store's reads cross the network (object storage, where every
  // read is a request and there is no page cache: Store::reads_cross_the_network), when the
  // ranks share memory (it costs nothing), when comm->spans_machines(), and between the processes
  // of one machine (a region costs a copy in memory instead of a read; when the shared-memory
  // object cannot be made, they read alone).
  std::optional<bool> share_reads;
  // Direct I/O: reads of at least direct_io_min_bytes consecutive bytes of a file bypass the page
  // cache (O_DIRECT), where the store and the file system allow it; the others, and files that
  // cannot be read directly, go through the page cache. Checksums are verified on the bytes read,
  // in the same pass. For cold loads of large checkpoints whose files will not be read again.
  // Unset (the default): decided per file by what the page cache holds: a file whose bytes to
  // read are mostly not cached (ReadableFile::CachedFraction) is read directly, a warm one (just
  // written or read) through the cache; so is a file of which the rank keeps less than 7/8 of the
  // bytes it reads (rows read whole for columns that other ranks need: they read the same rows,
  // and the cache serves them). false: always through the page cache.
  std::optional<bool> direct_io;
  uint64_t direct_io_min_bytes = uint64_t{1} << 20;
  // A stored chunk whose wanted regions are runs of at least this many bytes in both the chunk
  // and their destinations (columns of rows, as a resharded load reads them) is read with each
  // run landing in place, without a copy through staging (engine/read_executor.h, scattered
  // reads); shorter runs are read as whole rows into staging and copied out. Unset: 512 bytes
  // from object storage (Store::reads_cross_the_network), 64 KiB from local files (engine/
  // budget.h). std::numeric_limits<uint64_t>::max() turns it off.
  std::optional<uint64_t> scatter_min_run_bytes;
  // Reads in flight at once. 0 (the default): tuned as the load runs, from the throughput the
  // storage delivers, between 1 and the pool's threads (ThreadPool::io_tuner, shared by the ranks
  // of the pool and carried from one load to the next). N > 0: at most N per rank, fixed.
  int io_depth = 0;
  // With io_depth 0: ranks that run as separate processes on one machine
  // (comm->machine_ranks(): torchrun, mpirun) and read their own (share_reads false, or nothing
  // shared) put their reads through one gate in shared memory, tuned from the throughput of all of
  // them (exec/shared_io_tuner.h), so that the device sees one depth instead of the sum of
  // competing ones. When they share their reads through shared memory each byte has one reader
  // already, and each process tunes its own. false: each process tunes its own.
  bool machine_read_gate = true;
  // Which stored chunks each rank's copy of the metadata holds, and what it is sent. Ranks in
  // separate address spaces other than rank 0 (which plans shared reads for every rank) and the
  // coordinator (which opens the checkpoint) send the coordinator the boxes they load, and are
  // sent their part: every tensor's header and only the stored chunks their boxes reach
  // (TensorMetadata::kept), with the data files those name. At 8,192 ranks x 1,000 tensors the
  // whole metadata is 4.9 million chunks, a 110 MiB file and 600 MiB decoded, in each process
  // (docs/PERFORMANCE.md). Ranks that share an address space share one whole copy.
  // false: the coordinator broadcasts the whole metadata and every rank keeps every chunk.
  bool own_chunks_only = true;
};

struct LoadResult {
  std::vector<std::string> missing_keys;     // wanted but not in the checkpoint (non-strict)
  std::vector<std::string> unexpected_keys;  // in the checkpoint but not wanted
  std::vector<ObjectEntry> objects;          // the wanted objects that were found
  uint64_t bytes_read = 0;                   // bytes this rank read from storage
  // Ranks whose reads went through one gate with this rank's (LoadOptions::machine_read_gate):
  // those of its machine in other processes and itself; 1 when it used its pool's own.
  int read_gate_ranks = 1;
  // Stored chunks this rank's copy of the metadata held (LoadOptions::own_chunks_only).
  uint64_t metadata_chunks = 0;
  // Seconds from the call to this rank's first read: reading the metadata, planning, the ranks'
  // agreement on who reads what, opening the data files and reading their headers. The whole call
  // when the rank read nothing.
  double before_reads_seconds = 0;
  double seconds = 0;  // the whole call
};

// Loads the checkpoint at `path` into the pieces of `state`. Collective over options.comm.
Result<LoadResult> Load(const LoadState& state, std::string_view path,
                        const LoadOptions& options = {});

// Reads and checks the committed metadata of the checkpoint at `path` (store null: POSIX).
// kNotFound when no committed checkpoint is there.
Result<CheckpointMetadata> ReadCheckpointMetadata(std::string_view path, Store* store = nullptr);

// The objects named `names` of the checkpoint at `path`, with their payloads (ReadObjectPayloads
// in format/open_checkpoint.h, default limits); names the checkpoint does not hold are skipped.
// Errors as ReadCheckpointMetadata's and ReadObjectPayloads'.
Result<std::vector<ObjectEntry>> ReadCheckpointObjects(std::string_view path,
                                                       std::span<const std::string> names,
                                                       Store* store = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_LOAD_H_

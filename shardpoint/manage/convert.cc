#include "shardpoint/manage/convert.h"

#include <atomic>
#include <memory>

#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/opened_checkpoint.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/store/open_store.h"

namespace sp {
namespace {

// The source side: its metadata and open data files, read chunk by chunk.
struct Source {
  CheckpointMetadata metadata;
  DataFiles files;
  // The files' checksums, where the metadata holds none: each header read once.
  std::unique_ptr<HeaderChecksums> headers;

  Status Open(Store& store, std::string_view path, ThreadPool& pool) {
    SP_ASSIGN_OR_RETURN(metadata, OpenCheckpointMetadata(store, path, &pool));
    SP_ASSIGN_OR_RETURN(files, OpenDataFiles(store, path, metadata, AllDataFiles(metadata)));
    headers = std::make_unique<HeaderChecksums>(metadata.files.size());
    return OkStatus();
  }

  // Reads stored chunk `c` of tensor `t` whole into `out`, verified when it has checksums.
  Status ReadChunk(size_t t, size_t c, MutableByteView out, ThreadPool& pool, uint64_t window) const {
    const TensorMetadata& tensor = metadata.tensors.at(t);
    const StoredChunk& chunk = tensor.chunks.at(c);
    const ReadRequest request =
        MakeReadRequest(tensor, c, ReadDestination{out.data(), chunk.box, tensor.dtype}, chunk.box);
    ReadExecutorOptions read_options;
    read_options.window = window;
    read_options.header_checksums = headers.get();
    SP_ASSIGN_OR_RETURN(uint64_t bytes, ExecuteReads(std::span<const ReadRequest>(&request, 1),
                                                     metadata, files, pool, read_options));
    (void)bytes;
    return OkStatus();
  }
};

SaveState StreamingState(const CheckpointMetadata& md) {
  SaveState state;
  for (const TensorMetadata& t : md.tensors) {
    SaveTensor tensor{t.name, t.dtype, t.shape, {}};
    for (const StoredChunk& c : t.chunks) tensor.pieces.push_back(ConstPieceView{c.box, nullptr});
    state.tensors.push_back(std::move(tensor));
  }
  state.objects = md.objects;
  return state;
}

}  // namespace

Result<ConvertReport> Convert(std::string_view source, std::string_view destination,
                              const ConvertOptions& options) {
  if (NormalizePath(source) == NormalizePath(destination)) {
    return InvalidArgumentError("convert: the source and the destination are both " +
                                std::string(source));
  }
  std::unique_ptr<Store> owned_source, owned_destination;
  Store* source_store = options.source_store;
  Store* destination_store = options.destination_store;
  if (source_store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned_source, OpenStore(source));
    source_store = owned_source.get();
  }
  if (destination_store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned_destination, OpenStore(destination));
    destination_store = owned_destination.get();
  }
  if (source_store == destination_store ||
      (source_store->name() == "posix" && destination_store->name() == "posix")) {
    // The same directory however spelled (absolute, "..", a link alias): device and inode.
    SP_ASSIGN_OR_RETURN(bool same, source_store->SameFile(source, destination));
    if (same) {
      return InvalidArgumentError("convert: the destination " + std::string(destination) +
                                  " is the source checkpoint " + std::string(source));
    }
  }
  ThreadPool pool(options.threads > 0 ? options.threads : DefaultIoThreads());
  Source src;
  SP_RETURN_IF_ERROR(src.Open(*source_store, source, pool));
  SP_RETURN_IF_ERROR(ReadObjectPayloads(*source_store, source, src.metadata, src.metadata.objects));

  ConvertReport report;
  report.source_format = src.metadata.format;
  report.tensors = src.metadata.tensors.size();
  report.objects = src.metadata.objects.size();
  for (const TensorMetadata& t : src.metadata.tensors) {
    report.chunks += t.chunks.size();
    for (const StoredChunk& c : t.chunks) report.bytes += c.byte_length;
  }
  std::atomic<uint64_t> written{0};
  SaveOptions save;
  save.store = destination_store;
  save.pool = &pool;
  save.overwrite = options.overwrite;
  save.format = options.format;
  save.megatron = options.megatron;
  save.files_per_rank = std::max(1, options.files);
  save.attributes = src.metadata.attributes;
  save.attributes.erase("torch_dcp.version");
  std::erase_if(save.attributes, [](const auto& kv) { return kv.first.starts_with("megatron."); });
  save.fill_budget_bytes = options.memory_budget_bytes;
  const uint64_t window = std::max<uint64_t>(uint64_t{1} << 20, options.memory_budget_bytes / 4);
  save.fill_piece = [&](size_t t, size_t c, MutableByteView out) {
    return src.ReadChunk(t, c, out, pool, window);
  };
  if (options.progress) {
    save.on_chunk_written = [&](uint64_t bytes) {
      options.progress(written.fetch_add(bytes) + bytes, report.bytes);
    };
  }
  SP_RETURN_IF_ERROR(Save(StreamingState(src.metadata), destination, save));
  return report;
}

}  // namespace sp

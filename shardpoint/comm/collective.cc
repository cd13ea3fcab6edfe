#include "shardpoint/comm/collective.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "shardpoint/base/coding.h"

namespace sp {
namespace {

constexpr char kValueTag = 0x00;
constexpr char kErrorTag = 0x01;
constexpr uint32_t kMaxStatusCode = static_cast<uint32_t>(StatusCode::kDataLoss);

// Appends the tag in place: a payload moves through without being copied (unless the string
// has no spare capacity for one more byte).
std::string WrapValue(std::string value) {
  value.push_back(kValueTag);
  return value;
}

std::string WrapError(const Status& error) {
  std::string out = EncodeStatus(error);
  out.push_back(kErrorTag);
  return out;
}

std::string Wrap(Result<std::string> local) {
  if (!local.ok()) return WrapError(local.status());
  return WrapValue(std::move(local).value());
}

// Strips the envelope from `bytes` (sent by `from_rank`) in place. Returns OK when it held a
// value (now in `bytes`), the carried error prefixed "rank R: ", or kDataLoss when malformed.
Status Unwrap(std::string& bytes, int from_rank, const char* collective) {
  auto malformed = [&](const std::string& detail) {
    return DataLossError(std::string(collective) + ": the envelope sent by rank " +
                         std::to_string(from_rank) + " is malformed: " + detail);
  };
  if (bytes.empty()) return malformed("it is empty, expected at least the 1-byte tag");
  const char tag = bytes.back();
  bytes.pop_back();
  if (tag == kValueTag) return OkStatus();
  if (tag != kErrorTag) {
    return malformed("unknown tag " + std::to_string(static_cast<uint8_t>(tag)) +
                     ", expected 0 (value) or 1 (error)");
  }
  Status carried;
  if (Status status = DecodeStatus(bytes, &carried); !status.ok()) {
    return malformed(status.message());
  }
  if (carried.ok()) return malformed("its error tag carries an OK status");
  return carried.WithContext("rank " + std::to_string(from_rank));
}

// Unwraps every payload in place; returns the lowest-ranked failure, or OK.
Status UnwrapAll(std::vector<std::string>& payloads, const char* collective) {
  for (size_t r = 0; r < payloads.size(); ++r) {
    SP_RETURN_IF_ERROR(Unwrap(payloads[r], static_cast<int>(r), collective));
  }
  return OkStatus();
}

// A sender's wrapped payloads, one per rank, or its error copied to every rank.
std::vector<std::string> WrapPerRank(Result<std::vector<std::string>> root_payloads, int size,
                                     const std::string& who) {
  Status error = root_payloads.status();
  if (error.ok() && root_payloads->size() != static_cast<size_t>(size)) {
    error = InvalidArgumentError(who + " computed " +
                                 std::to_string(root_payloads->size()) +
                                 " payloads, expected one per rank (" + std::to_string(size) + ")");
  }
  if (!error.ok()) return std::vector<std::string>(size, WrapError(error));
  std::vector<std::string> wrapped = std::move(root_payloads).value();
  for (std::string& payload : wrapped) payload.push_back(kValueTag);
  return wrapped;
}

}  // namespace

std::string EncodeStatus(const Status& status) {
  std::string out;
  ByteWriter writer(&out);
  writer.PutU32(static_cast<uint32_t>(status.code()));
  writer.PutString(status.message());
  return out;
}

Status DecodeStatus(std::string_view encoded, Status* decoded) {
  ByteReader reader(encoded, "encoded status");
  SP_ASSIGN_OR_RETURN(uint32_t code, reader.ReadU32());
  if (code > kMaxStatusCode) {
    return DataLossError("encoded status: unknown status code " + std::to_string(code) +
                         ", expected at most " + std::to_string(kMaxStatusCode));
  }
  SP_ASSIGN_OR_RETURN(std::string_view message,
                      reader.ReadString(std::numeric_limits<uint32_t>::max()));
  if (!reader.done()) {
    return DataLossError("encoded status: " + std::to_string(reader.remaining()) +
                         " unexpected bytes after the message");
  }
  if (code == 0 && !message.empty()) {
    return DataLossError("encoded status: an OK code carries a message of " +
                         std::to_string(message.size()) + " bytes, expected none");
  }
  *decoded = Status(static_cast<StatusCode>(code), std::string(message));
  return OkStatus();
}

Result<std::vector<std::string>> GatherOrFail(Communicator& comm, Result<std::string> local,
                                              int root) {
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered, comm.Gather(Wrap(std::move(local)), root));
  const bool is_root = comm.rank() == root;
  std::string verdict;
  if (is_root) verdict = EncodeStatus(UnwrapAll(gathered, "GatherOrFail"));
  SP_ASSIGN_OR_RETURN(verdict, comm.Broadcast(std::move(verdict), root));
  Status agreed;
  if (Status status = DecodeStatus(verdict, &agreed); !status.ok()) {
    return status.WithContext("GatherOrFail: verdict broadcast by rank " + std::to_string(root));
  }
  if (!agreed.ok()) return agreed;
  if (!is_root) gathered.clear();
  return gathered;
}

Result<std::string> ScatterOrFail(Communicator& comm,
                                  Result<std::vector<std::string>> root_payloads, int root) {
  std::vector<std::string> wrapped;
  if (comm.rank() == root) {
    wrapped = WrapPerRank(std::move(root_payloads), comm.size(), "ScatterOrFail: root");
  }
  SP_ASSIGN_OR_RETURN(std::string mine, comm.Scatter(std::move(wrapped), root));
  SP_RETURN_IF_ERROR(Unwrap(mine, root, "ScatterOrFail"));
  return mine;
}

Result<std::string> BroadcastOrFail(Communicator& comm, Result<std::string> root_value, int root) {
  std::string wrapped;
  if (comm.rank() == root) wrapped = Wrap(std::move(root_value));
  SP_ASSIGN_OR_RETURN(std::string value, comm.Broadcast(std::move(wrapped), root));
  SP_RETURN_IF_ERROR(Unwrap(value, root, "BroadcastOrFail"));
  return value;
}

Result<std::vector<std::string>> AllGatherOrFail(Communicator& comm, Result<std::string> local) {
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered, comm.AllGather(Wrap(std::move(local))));
  SP_RETURN_IF_ERROR(UnwrapAll(gathered, "AllGatherOrFail"));
  return gathered;
}

Result<std::vector<std::string>> AllToAllOrFail(Communicator& comm,
                                                Result<std::vector<std::string>> local) {
  SP_ASSIGN_OR_RETURN(
      std::vector<std::string> received,
      comm.AllToAll(WrapPerRank(std::move(local), comm.size(),
                                "AllToAllOrFail: rank " + std::to_string(comm.rank()))));
  SP_RETURN_IF_ERROR(UnwrapAll(received, "AllToAllOrFail"));
  return received;
}

Status AgreeOnStatus(Communicator& comm, Status local) {
  // Nearly always nothing failed: one flag per rank says so, and the messages travel only when
  // some rank has one.
  SP_ASSIGN_OR_RETURN(bool any_failed, comm.AnyRank(!local.ok()));
  if (!any_failed) return OkStatus();
  Result<std::string> as_payload =
      local.ok() ? Result<std::string>(std::string()) : Result<std::string>(std::move(local));
  return AllGatherOrFail(comm, std::move(as_payload)).status();
}

}  // namespace sp

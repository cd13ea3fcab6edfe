#include "shardpoint/store/store.h"

namespace sp {

Result<std::string> Store::ReadFile(std::string_view path) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenReadable(path));
  std::string out(file->size(), '\0');
  SP_RETURN_IF_ERROR(file->ReadAt(0, AsMutableBytes(out.data(), out.size())));
  return out;
}

Result<std::unique_ptr<ReadableFile>> Store::OpenInDirectory(std::string_view dir,
                                                             std::string_view name) {
  return OpenReadable(JoinPath(dir, name));
}

Result<LinkInfo> Store::FindLink(std::string_view dir, std::string_view name) {
  return LinkInfo{};
}

Result<bool> Store::SameFile(std::string_view a, std::string_view b) {
  return NormalizePath(a) == NormalizePath(b);
}

Result<std::string> Store::FileVersion(std::string_view path) {
  return UnimplementedError(OpOn("version of", path) + ": the " + name() +
                            " store does not version files");
}

Status Store::WriteFileIf(std::string_view path, std::string_view bytes,
                          const FileCondition& condition) {
  return UnimplementedError(OpOn("conditional write", path) + ": the " + name() +
                            " store cannot write files conditionally");
}

Status WritableFile::WriteDirectAt(uint64_t offset, ByteView data) {
  return FailedPreconditionError(OpAt("write", path(), offset) +
                                 ": this store does not write files directly (no O_DIRECT)");
}

Result<uint64_t> ReadableFile::ReadDirectVAt(uint64_t offset,
                                             std::span<const MutableByteView> pieces) const {
  return FailedPreconditionError(OpAt("read", path(), offset) +
                                 ": this store does not read files directly (no O_DIRECT)");
}

Status ReadableFile::ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const {
  for (const MutableByteView& piece : pieces) {
    SP_RETURN_IF_ERROR(ReadAt(offset, piece));
    offset += piece.size();
  }
  return OkStatus();
}

std::string OpOn(std::string_view op, std::string_view path) {
  std::string what(op);
  what += ' ';
  what += path;
  return what;
}

std::string OpAt(std::string_view op, std::string_view path, uint64_t offset) {
  return OpOn(op, path) + " at offset " + std::to_string(offset);
}

Result<std::string> ReadSmallFile(Store& store, const std::string& path, uint64_t limit) {
  const size_t slash = path.rfind('/');
  const std::string_view name =
      slash == std::string::npos ? std::string_view(path) : std::string_view(path).substr(slash + 1);
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                      store.OpenInDirectory(ParentPath(path), name));
  if (file->size() > limit) {
    return DataLossError(path + " has " + std::to_string(file->size()) +
                         " bytes, more than the limit of " + std::to_string(limit));
  }
  std::string bytes(file->size(), '\0');
  SP_RETURN_IF_ERROR(
      file->ReadAt(0, MutableByteView(reinterpret_cast<std::byte*>(bytes.data()), bytes.size())));
  return bytes;
}

Status WriteSyncedFile(Store& store, const std::string& path, std::string_view bytes) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, store.NewWritableFile(path));
  Status written = file->WriteAt(0, AsBytes(bytes));
  if (written.ok()) written = file->Sync();
  // Closed whatever happened, so that the handle is released before the file is removed.
  Status closed = file->Close();
  if (written.ok()) written = closed;
  if (!written.ok()) store.RemoveFile(path).IgnoreError();
  return written;
}

Status WriteFileDurably(Store& store, std::string_view dir, std::string_view name,
                        std::string_view temp_name, std::string_view bytes,
                        const FileCondition* condition) {
  const std::string final_path = JoinPath(dir, name);
  if (condition != nullptr) {
    Status written = store.WriteFileIf(final_path, bytes, *condition);
    if (written.code() != StatusCode::kUnimplemented) return written;
  }
  if (store.files_appear_when_closed()) {
    // Closing is the commit point: the file appears whole, or not at all (and a failed write
    // leaves what was there; nothing is removed).
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, store.NewWritableFile(final_path));
    Status written = file->WriteAt(0, AsBytes(bytes));
    Status closed = file->Close();
    return written.ok() ? closed : written;
  }
  const std::string temp_path = JoinPath(dir, temp_name);
  SP_RETURN_IF_ERROR(WriteSyncedFile(store, temp_path, bytes));
  return store.Rename(temp_path, final_path);
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  if (name.empty()) return std::string(dir);
  std::string out(dir);
  if (out.back() != '/') out += '/';
  while (!name.empty() && name.front() == '/') name.remove_prefix(1);
  out += name;
  return out;
}

std::string ParentPath(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return "";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string NormalizePath(std::string_view path) {
  std::string out;
  if (!path.empty() && path.front() == '/') out.push_back('/');
  size_t pos = 0;
  while (pos < path.size()) {
    size_t end = path.find('/', pos);
    if (end == std::string_view::npos) end = path.size();
    std::string_view part = path.substr(pos, end - pos);
    pos = end + 1;
    if (part.empty() || part == ".") continue;
    if (!out.empty() && out.back() != '/') out += '/';
    out += part;
  }
  return out;
}

}  // namespace sp

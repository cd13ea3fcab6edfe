"""shardpoint as the storage layer of ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    import shardpoint.dcp

    dcp.save(state_dict, storage_writer=shardpoint.dcp.StorageWriter("ckpt/step_100"))
    future = dcp.async_save(state_dict, storage_writer=shardpoint.dcp.StorageWriter("ckpt/step_200"))
    dcp.load(state_dict, storage_reader=shardpoint.dcp.StorageReader("ckpt/step_200"))

DCP keeps its own planners (the caller's, or its defaults: flattening, deduplication of replicated
tensors, resharding on load); these classes only store what the planners hand them. What they write
is a native shardpoint checkpoint: CRC32C-checksummed data, metadata without pickle, committed
atomically; ``shardpoint.load``, ``shardpoint.verify`` and ``shardpoint inspect`` read it like any
other.

Design. DCP reaches ``write_data`` on every rank in the same phase (between its plan exchange and
its result gather; with ``async_save``, on each rank's background thread), while ``finish`` runs on
the coordinator alone. ``write_data`` therefore runs the core's collective save over the writer's
process group: each rank resolves its write items through the planner (a tensor item becomes a
chunk at its offsets in the global tensor, a bytes item a stored object), the ranks agree that all
of them could (one all-gather; a rank's error is raised on every rank), and the core writes every
rank's data files and commits the metadata once all ranks have written. A failure on any rank
therefore leaves no committed checkpoint, and an existing checkpoint is replaced only with
``overwrite=True`` and only by a complete new one. ``finish`` has nothing left to commit.

Bytes items (DCP's non-tensor values, ``torch.save`` archives made by the planner) are stored as
plain objects when that loses nothing: when the archive holds plain data (None, bool, int, float,
str, bytes, and lists, tuples and dicts of them) and ``torch.save`` of that value gives back the
very same archive, it is stored as JSON when JSON holds it exactly, else in the exact "plain"
encoding (a tuple stays a tuple), or as bytes, all of which ``shardpoint.load`` reads without
pickle; otherwise the archive is stored as it is (encoding "torch-save"). On read, the planner gets the same archive in both cases.

Reads go through the core's load on each rank alone: every read item becomes the region of the
stored tensor it asks for (its chunk's offsets plus the item's storage offsets, and its lengths),
and the core reads exactly those bytes from the chunks that cover them, checking their checksums.
A stored archive is handed to the planner (which unpickles it, as DCP does) only when it loads
with ``torch.load(weights_only=True)`` or the reader was made with ``allow_pickle=True``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from . import _api, _core, _dist, _torch
from ._errors import CheckpointArgumentError, translated
from ._flatten import encode_paths
from ._pieces import Box, TensorPlan
from ._values import decode_object, decode_paths_attribute, encode_object

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["StorageWriter", "StorageReader"]


def _is_local_path(checkpoint_id: Any) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in os.fspath(checkpoint_id)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _archive(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def encode_bytes_item(fqn: str, archive: bytes) -> tuple[str, str, bytes]:
    """The core's object entry for a DCP bytes item (see the module docstring)."""
    try:
        value = torch.load(io.BytesIO(archive), weights_only=True)
    except Exception:  # not a plain archive: kept as it is
        return (fqn, "torch-save", archive)
    if isinstance(value, bytes) and _archive(value) == archive:
        return (fqn, "bytes", value)
    if not isinstance(value, bytes):
        try:
            _, encoding, payload = encode_object(fqn, value, allow_pickle=False)
        except CheckpointArgumentError:  # not plain data (or an int outside 64 bits): kept as it is
            return (fqn, "torch-save", archive)
        if encoding in ("json", "plain") and _archive(decode_object(fqn, encoding, payload, False)) == archive:
            return (fqn, encoding, payload)
    return (fqn, "torch-save", archive)


class StorageWriter(_storage.StorageWriter):
    """Writes a DCP save as a native shardpoint checkpoint at ``path`` (``dcp.save``'s
    ``checkpoint_id``, when given, replaces it).

    ``overwrite``: replace a committed checkpoint at the path (else CheckpointExistsError on every
    rank). ``threads``: write parallelism per rank (default: the machine's cores shared among the
    group's ranks on it). ``process_group``: the group the core's save runs over; it must be the
    group given to ``dcp.save`` (default: the default group). Its gloo communicator is resolved at
    construction when torch.distributed is initialized, so that a non-gloo group gets its gloo
    companion on the caller's thread, not on ``async_save``'s background thread.
    """

    def __init__(self, path: PathLike, *, overwrite: bool = False, threads: Optional[int] = None,
                 process_group: Any = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.threads = threads
        self.process_group = process_group
        self._comm = _dist.resolve(process_group) if _dist._initialized() else None
        self._resolved = _dist._initialized()

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        """Starts a new save; ``checkpoint_id`` (a directory path) replaces the path when given."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Raises CheckpointArgumentError for ``use_collectives=False`` on several ranks: the
        core's save is collective."""
        if not self._resolved:
            self._comm = _dist.resolve(self.process_group)
            self._resolved = True
        if kwargs.get("use_collectives", True) is False and self._comm is not None:
            raise CheckpointArgumentError(
                "shardpoint.dcp.StorageWriter needs use_collectives=True (its save is collective over "
                f"{self._comm.size} ranks)", "INVALID_ARGUMENT")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Writes every rank's items and commits the checkpoint (collective: see the module
        docstring). Raises the same CheckpointError on every rank when any rank fails."""
        comm = self._comm
        prepared, error = None, None
        try:
            prepared = self._prepare(plan, planner)
        except Exception as e:  # forwarded to every rank by _agree
            error = e
        _api._agree(comm, error)
        plans, objects, results = prepared
        attributes = self._attributes(planner)
        entries, device_options = _api._save_entries(plans, None)
        with translated():
            options = _core.SaveOptions(comm=comm, overwrite=self.overwrite, attributes=attributes,
                                        threads=self.threads or _dist.default_threads(comm), **device_options)
            _core.save(self.path, entries, objects, options)
        return _done(results)

    def _prepare(self, plan: SavePlan, planner: SavePlanner
                 ) -> tuple[list[TensorPlan], list[tuple[str, str, bytes]], list[_storage.WriteResult]]:
        plans: dict[str, TensorPlan] = {}
        objects, results = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                archive = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                objects.append(encode_bytes_item(item.index.fqn, archive))
                results.append(_storage.WriteResult(item.index, len(archive), "object"))
                continue
            piece = self._tensor_piece(item, data)
            if item.index.fqn in plans:
                plans[item.index.fqn].pieces.extend(piece.pieces)
            else:
                plans[item.index.fqn] = piece
            results.append(_storage.WriteResult(item.index, piece.nbytes, "tensor"))
        return list(plans.values()), objects, results

    @staticmethod
    def _tensor_piece(item: WriteItem, data: Any) -> TensorPlan:
        fqn, chunk = item.index.fqn, item.tensor_data.chunk
        if not isinstance(data, torch.Tensor):
            raise CheckpointArgumentError(
                f"tensor {fqn!r}: the planner resolved a {type(data).__name__}, expected a torch.Tensor",
                "INVALID_ARGUMENT")
        tensor = data.detach()
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise CheckpointArgumentError(
                f"tensor {fqn!r}: the planner resolved shape {tuple(tensor.shape)} for the chunk at offsets "
                f"{tuple(chunk.offsets)}, expected {tuple(chunk.sizes)}", "INVALID_ARGUMENT")
        box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        return _torch.local_plan(fqn, tensor, tuple(int(s) for s in item.tensor_data.size), [(box, 0)], False)

    @staticmethod
    def _attributes(planner: SavePlanner) -> dict[str, str]:
        """The flattening of the state dict (DCP's default planners' ``mappings``), stored where
        ``shardpoint.load_full`` rebuilds the nested structure from it."""
        mappings = getattr(planner, "mappings", None)
        if not isinstance(mappings, dict) or not mappings:
            return {}
        paths = {k: tuple(p) for k, p in mappings.items()
                 if isinstance(k, str) and isinstance(p, tuple) and all(isinstance(s, (str, int)) for s in p)}
        return {_api._PATHS_ATTRIBUTE: json.dumps(encode_paths(paths))}

    def finish(self, metadata: Metadata, results: list[list[_storage.WriteResult]]) -> None:
        """Nothing left to do: ``write_data`` committed the checkpoint on every rank's behalf."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        """True for a local directory path (no URL scheme)."""
        return _is_local_path(checkpoint_id)


class StorageReader(_storage.StorageReader):
    """Reads a shardpoint checkpoint at ``path`` for ``dcp.load`` (its ``checkpoint_id``, when given,
    replaces the path): a native one, or any format shardpoint opens.

    ``threads``: read parallelism of this rank (default: the core's). ``allow_pickle``: hand the
    planner stored archives that do not load with ``torch.load(weights_only=True)`` (the planner
    unpickles them, which runs code from the checkpoint), and pickled objects re-archived.
    ``staging_budget``: pinned host bytes of loads into CUDA tensors, as in ``shardpoint.load``
    (default 2 GiB; docs/GPU.md).
    """

    def __init__(self, path: PathLike, *, threads: Optional[int] = None, allow_pickle: bool = False,
                 staging_budget: Optional[int] = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.threads = threads
        self.allow_pickle = allow_pickle
        self.staging_budget = int(staging_budget) if staging_budget else 0
        self._tensors: dict[str, tuple[str, tuple[int, ...]]] = {}  # name: (dtype, shape)

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        """Starts a new load; ``checkpoint_id`` (a directory path) replaces the path when given."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the checkpoint. Raises CheckpointNotFoundError when no committed
        checkpoint is at the path."""
        with translated():
            md = _core.read_metadata(self.path)
        state: dict[str, Any] = {}
        for t in md.tensors:
            dtype = _torch.empty_like_stored(t.dtype, (0,)).dtype
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks]
            state[t.name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(t.shape), chunks)
        for o in md.objects:
            state[o.name] = BytesStorageMetadata()
        encoded = md.attributes.get(_api._PATHS_ATTRIBUTE)
        planner_data = decode_paths_attribute(self.path, _api._PATHS_ATTRIBUTE, encoded) if encoded else None
        return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data={},
                        storage_meta=StorageMeta(checkpoint_id=self.path, save_id=md.save_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Takes the stored dtype and shape of every tensor from ``metadata``."""
        self._tensors = {name: (_torch.dtype_name(m.properties.dtype), tuple(int(s) for s in m.size))
                         for name, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Reads every item of ``plan`` on this rank alone (see the module docstring). Items whose
        planner tensor lies on a CUDA device are read in batches into the pinned halves of the
        process's device loads (shardpoint._cuda.LoadBatches, ``staging_budget`` bytes in all), each
        batch going to the device on the copy streams while the next one is read: no pageable copy
        of the whole state is made."""
        object_items = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
        tensor_items = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        resolved = [planner.resolve_tensor(item) for item in tensor_items]
        on_device = [r.device.type == "cuda" for r in resolved]
        cuda = _api._device_module() if any(on_device) else None
        wanted = sorted({i.storage_index.fqn for i in object_items})
        batches = self._batches(tensor_items, resolved, on_device, cuda)
        objects: list = []
        staging = cuda.load_batches(self.staging_budget or cuda.DEFAULT_LOAD_STAGING) if cuda else None
        with staging.lock if staging is not None else contextlib.nullcontext():
            try:
                if staging is not None:
                    needs = [sum(self._region_bytes(tensor_items[i], resolved[i], cuda) for i in batch
                                 if on_device[i]) for batch in batches]
                    staging.start({r.device.index for r, d in zip(resolved, on_device) if d}, needs)
                for b, batch in enumerate(batches):
                    pool = staging.begin(b) if staging is not None else None
                    reads = [self._tensor_read(tensor_items[i], resolved[i], pool) for i in batch]
                    entries: dict[str, list] = {}
                    for i, (_, _, piece) in zip(batch, reads):
                        entries.setdefault(tensor_items[i].storage_index.fqn, []).append(piece)
                    tensors = [(name, *self._tensors[name], pieces) for name, pieces in entries.items()]
                    with translated():
                        options = _core.LoadOptions()
                        if self.threads:
                            options.threads = self.threads
                        _, _, found, *_ = _core.load(self.path, tensors, wanted if b == 0 else [], options)
                    objects += found
                    copies = [copy for _, copy, _ in reads if copy is not None]
                    if staging is not None:
                        staging.to_device(b, copies)
                    else:
                        for copy in copies:
                            copy()
            finally:
                if staging is not None:
                    staging.finish()
        for item, tensor in zip(tensor_items, resolved):
            planner.commit_tensor(item, tensor)
        found_objects = {name: (encoding, payload) for name, encoding, payload in objects}
        for item in object_items:
            encoding, payload = found_objects[item.storage_index.fqn]
            planner.load_bytes(item, io.BytesIO(self._archive_of(item.storage_index.fqn, encoding, payload)))
        return _done(None)

    def _batches(self, items: list[ReadItem], resolved: list[torch.Tensor], on_device: list[bool],
                 cuda: Any) -> list[list[int]]:
        """The items (indices) of each core load: all in one without device tensors; else the host
        ones first, then the device ones in batches of at most half the staging budget (a larger
        item alone)."""
        if cuda is None:
            return [list(range(len(items)))] if items else [[]]
        half = max(1, (self.staging_budget or cuda.DEFAULT_LOAD_STAGING) // 2)
        units = [([i], self._region_bytes(items[i], resolved[i], cuda)) for i, d in enumerate(on_device) if d]
        return _api.device_batches([i for i, d in enumerate(on_device) if not d], units, half)

    def _region_bytes(self, item: ReadItem, resolved: torch.Tensor, cuda: Any) -> int:
        """The pinned bytes of a device item's region (what _tensor_read takes from the pool)."""
        return cuda.region_bytes(resolved.numel() * self._stored_itemsize(item.storage_index.fqn))

    def _stored_itemsize(self, name: str) -> int:
        return _torch.empty_like_stored(self._tensors[name][0], (0,)).element_size()

    def _tensor_read(self, item: ReadItem, resolved: torch.Tensor,
                     pool: Any) -> tuple[torch.Tensor, Optional[Callable[[], None]], tuple]:
        """(a contiguous host buffer, the copy of it into the planner's tensor or None, the core's
        piece) of one read item; a device tensor's buffer is a region of ``pool`` (pinned), copied
        on its device's copy stream."""
        fqn = item.storage_index.fqn
        dest = resolved.detach()
        if tuple(dest.shape) != tuple(item.lengths):
            raise CheckpointArgumentError(
                f"tensor {fqn!r}: the planner resolved shape {tuple(dest.shape)} for a read of lengths "
                f"{tuple(item.lengths)}", "INVALID_ARGUMENT")
        stored = _torch.empty_like_stored(self._tensors[fqn][0], (0,)).dtype
        host, copy = dest, None
        if dest.device.type == "cuda" and pool is not None and dest.numel():
            region = pool.take(dest.numel() * stored.itemsize)
            host = region.view(stored).view(tuple(item.lengths))

            def copy() -> None:
                from . import _cuda

                with torch.cuda.stream(_cuda.STREAMS.get(dest.device)):
                    dest.copy_(host, non_blocking=True)
        elif dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype != stored:
            host = torch.empty(tuple(item.lengths), dtype=stored)

            def copy() -> None:
                dest.copy_(host)
        offsets = tuple(int(c) + int(o) for c, o in zip(item.storage_index.offset, item.storage_offsets))
        flat = host.reshape(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8)
        return host, copy, (offsets, tuple(int(s) for s in item.lengths), flat)

    def _archive_of(self, name: str, encoding: str, payload: bytes) -> bytes:
        """The ``torch.save`` archive DCP's planner expects for a stored object."""
        if encoding in ("json", "plain"):  # plain data: decoded without running code
            return _archive(decode_object(name, encoding, payload, False))
        if encoding == "bytes":
            return _archive(bytes(payload))
        if encoding == "pickle":
            if not self.allow_pickle:
                raise CheckpointArgumentError(
                    f"object {name!r} of {self.path} is stored with pickle; loading it runs code from the "
                    f"checkpoint, so it needs StorageReader(..., allow_pickle=True)", "INVALID_ARGUMENT")
            import pickle

            return _archive(pickle.loads(payload))
        if encoding == "torch-save":
            if not self.allow_pickle:
                try:
                    torch.load(io.BytesIO(payload), weights_only=True)
                except Exception as e:
                    raise CheckpointArgumentError(
                        f"object {name!r} of {self.path} is a torch.save archive that does not load with "
                        f"weights_only=True ({type(e).__name__}); the planner would run code from the "
                        f"checkpoint, so it needs StorageReader(..., allow_pickle=True)", "INVALID_ARGUMENT") from None
            return bytes(payload)
        raise CheckpointArgumentError(f"object {name!r} of {self.path} has unknown encoding {encoding!r}",
                                      "INVALID_ARGUMENT")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        """True for a local directory path (no URL scheme)."""
        return _is_local_path(checkpoint_id)

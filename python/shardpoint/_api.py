"""save, async_save, load, inspect, load_full and verify over the core."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core, _dist, _mapped_load
from ._errors import CheckpointArgumentError, CheckpointError, CheckpointNotFoundError, code_of, error_for, translated
from ._mapping import KeyMapping
from ._flatten import encode_paths, flatten, set_by_path, unflatten
from ._pieces import TensorPlan, numpy_dtype
from ._pipeline import pipelined
from ._progress import Progress
from ._values import decode_object, decode_paths_attribute, encode_object, is_tensor_leaf, tensor_plan

PathLike = Union[str, "os.PathLike[str]"]
_PATHS_ATTRIBUTE = "python.state_dict_paths"
_LOAD_FULL_BATCH_BYTES = 1 << 30


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor: dtype (torch's name), global shape, and its chunks as (offsets, sizes)."""

    dtype: str
    shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
    nbytes: int = 0


@dataclass(frozen=True)
class ObjectInfo:
    """A stored object: its encoding ("json", "plain", "bytes", "torch-save" or "pickle") and payload size."""

    encoding: str
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`inspect` reports about a committed checkpoint."""

    path: str
    version: str
    save_id: str
    world_size: int
    total_bytes: int
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    files: list[dict[str, Any]] = field(default_factory=list)
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadResult:
    """Keys wanted but not stored (non-strict loads), keys stored but not wanted, bytes read here,
    how many ranks read through one gate with this one (``read_gate_ranks``: the ranks of this
    machine in other processes and this one, 1 when its reads had a gate of their own), and the
    stored chunks this rank's copies of the checkpoint's metadata held, summed over the load's
    batches (``metadata_chunks``: a process other than rank 0 keeps only those its own boxes
    reach)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    bytes_read: int = 0
    read_gate_ranks: int = 1
    metadata_chunks: int = 0


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: ``ok`` when ``defects`` is empty."""

    ok: bool
    defects: list[str]
    files_checked: int
    chunks_checked: int
    bytes_checked: int
    notes: list[str] = field(default_factory=list)   # symbolic links that are not defects


def _device_module() -> Any:
    """shardpoint._cuda when torch is loaded and CUDA is available (a state may then hold device
    tensors), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    from . import _cuda

    return _cuda


def _save_entries(plans: list[TensorPlan], staging_budget: Optional[int]) -> tuple[list[tuple], dict[str, Any]]:
    """The core's tensor entries of a synchronous save and the SaveOptions fields for their device
    pieces (shardpoint._cuda): copied into the process's pinned pool for synchronous saves, up to
    ``staging_budget`` bytes of it (default 4 GiB), and past it copied by the core's I/O threads
    range by range as they are written."""
    entries = [p.entry() for p in plans]
    cuda = _device_module()
    if cuda is None or not any(cuda.state_on_device(e[3]) for e in entries):
        return entries, {}
    budget = int(staging_budget if staging_budget is not None else cuda.DEFAULT_SAVE_STAGING)
    staging = cuda.stage_async(entries, cuda.save_pool(budget), budget, "block")
    if staging.fill is None:
        return staging.entries, {}
    return staging.entries, {"fill": staging.fill, "fill_budget_bytes": max(1, staging.fill_budget)}


def _agree(comm: Optional[_dist.TorchComm], error: Optional[BaseException]) -> None:
    """Raises on every rank the first error any rank met while preparing (one all-reduce of a flag;
    the ranks' messages are gathered only when some rank failed)."""
    if comm is None:
        if error is not None:
            raise error
        return
    if not comm.any_rank(error is not None):
        return
    message = b""
    if error is not None:
        text = error.message if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
        message = json.dumps({"code": code_of(error), "message": text}).encode()
    for rank, reply in enumerate(comm.all_gather(message)):
        if reply:
            failure = json.loads(reply)
            raise error_for(failure["code"], f"rank {rank}: {failure['message']}") from error


def _is_stateful(value: Any) -> bool:
    """Whether ``value`` is ``torch.distributed.checkpoint.stateful.Stateful`` (it has both
    ``state_dict`` and ``load_state_dict``): torch's runtime-checkable protocol when torch is loaded,
    the same duck typing without it. Tensors and layout wrappers never are."""
    if is_tensor_leaf(value):
        return False
    if sys.modules.get("torch") is not None:
        from torch.distributed.checkpoint.stateful import Stateful

        return isinstance(value, Stateful)
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _stateful_state_dicts(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """As ``torch.distributed.checkpoint.save``: a shallow copy with each top-level Stateful value
    replaced by its ``state_dict()`` (``state_dict`` itself when it holds none)."""
    if not any(_is_stateful(v) for v in state_dict.values()):
        return state_dict
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state_dict.items()}


def _stateful_view(state_dict: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    """As ``torch.distributed.checkpoint.load``: the template to load into (each top-level Stateful
    value's current ``state_dict()``) and a function that, once it is loaded, hands each Stateful
    its loaded state (``load_state_dict``) and puts the other values back into ``state_dict``."""
    view = _stateful_state_dicts(state_dict)
    if view is state_dict:
        return state_dict, lambda: None

    def apply() -> None:
        for key, value in view.items():
            if _is_stateful(state_dict[key]):
                state_dict[key].load_state_dict(value)
            elif state_dict[key] is not value:
                state_dict[key] = value
    return view, apply


def _prepare_save(state_dict: Mapping[str, Any], rank: int, allow_pickle: bool,
                  on_entry: Optional[Callable[[tuple], None]] = None
                  ) -> tuple[list[TensorPlan], list[tuple[str, str, bytes]], dict[str, str]]:
    """The tensor plans, encoded objects and attributes of a save; ``on_entry`` gets each plan's core
    entry as soon as it is made (an async save stages it while the next ones are planned)."""
    flat, paths = flatten(state_dict, is_tensor_leaf)
    plans, objects = [], []
    for key, value in flat.items():
        if is_tensor_leaf(value):
            plan = tensor_plan(key, value, rank, for_load=False)
            plans.append(plan)
            if on_entry is not None:
                on_entry(plan.entry())
        else:
            objects.append(encode_object(key, value, allow_pickle))
    return plans, objects, {_PATHS_ATTRIBUTE: json.dumps(encode_paths(paths))}


def _prepared_save(state_dict: Mapping[str, Any], comm: Optional[_dist.TorchComm], allow_pickle: bool
                   ) -> tuple[list[TensorPlan], list[tuple[str, str, bytes]], dict[str, str]]:
    prepared, error = None, None
    try:
        prepared = _prepare_save(state_dict, comm.rank if comm else 0, allow_pickle)
    except Exception as e:  # forwarded to every rank by _agree
        error = e
    _agree(comm, error)
    return prepared


def save(state_dict: Mapping[str, Any], path: PathLike, *, process_group: Any = None, overwrite: bool = False,
         threads: Optional[int] = None, allow_pickle: bool = False,
         separation_hint: Union[str, Sequence[str], None] = None, format: str = "native",
         direct_io: bool = False, staging_budget: Optional[int] = None, plan_cache: Any = True) -> None:
    """Saves ``state_dict`` (nested dicts/lists of tensors, DTensors, numpy arrays and plain objects)
    as a checkpoint at ``path``. Collective over ``process_group`` (default: the default group when
    torch.distributed is initialized, else this process alone). ``threads``: write parallelism per
    rank (default: the machine's cores shared among the group's ranks on it).

    As ``torch.distributed.checkpoint.save``, a top-level value that is ``Stateful`` (has
    ``state_dict()`` and ``load_state_dict()``: a module, an optimizer, a scheduler, a dataloader) is
    saved as its ``state_dict()``.

    Raises CheckpointExistsError when a committed checkpoint is at ``path`` and not ``overwrite``;
    CheckpointArgumentError for an unsupported value (non-plain objects need ``allow_pickle``) or an
    inconsistent layout; the same error on every rank whenever any rank fails.

    ``separation_hint`` (Megatron's): a key prefix or a list of them; the chunks of tensors whose
    keys start with one are written into data files of their own on each rank (so that, for
    example, the optimizer state can later be pruned by dropping whole files).

    ``format``: ``"native"`` (shardpoint's format, checksummed), ``"torch-dcp"`` (a PyTorch
    distributed checkpoint that ``torch.distributed.checkpoint.load`` reads, at any number of ranks;
    it has no checksums and ``separation_hint`` does not apply to it) or ``"megatron"`` (a
    Megatron-Core ``torch_dist`` checkpoint that ``megatron.core.dist_checkpointing.load`` reads:
    the torch-dcp checkpoint of the tensors plus ``metadata.json`` and ``common.pt``, which holds the
    non-tensor objects in their nested structure, as Megatron's own save puts its common state
    there; see docs/TORCH_DCP.md).

    ``direct_io``: the large writes (1 MiB and more) bypass the page cache (``O_DIRECT``) for their
    whole aligned blocks, staged through aligned buffers, where the file system allows it (others
    fall back to ordinary writes): the page cache is neither filled with bytes nobody reads back
    nor flushed at the end. Durability is the same either way.

    Tensors on CUDA devices are copied into pinned host memory kept from one save to the next, on
    copy streams that first wait for the work the caller queued before the call, and written from
    there (docs/GPU.md); ``staging_budget`` bounds that memory (default 4 GiB; 0: the whole state),
    and what does not fit is copied range by range (16 MiB) by the writing threads as they write it.

    ``plan_cache``: ``True`` (the default) keeps the save's plan in this process for the group; a
    later save whose layout (keys, dtypes, shapes, shards, options) is unchanged on every rank skips
    the gather of every rank's tensor list and the global planning, and sends each rank only its
    files. Any change plans afresh. ``False``: every save plans. A :class:`SavePlanCache` object: that
    cache (its ``hits`` and ``misses`` count this rank's saves).
    """
    comm = _dist.resolve(process_group)
    path = os.fspath(path)
    state_dict = _stateful_state_dicts(state_dict)
    separate = [separation_hint] if isinstance(separation_hint, str) else list(separation_hint or [])
    plans, objects, attributes = _prepared_save(state_dict, comm, allow_pickle)
    progress = Progress(f"shardpoint save {path}", sum(p.nbytes for p in plans), rank=comm.rank if comm else 0)
    entries, device_options = _save_entries(plans, staging_budget)
    with translated():
        options = _core.SaveOptions(comm=comm, overwrite=overwrite, threads=threads or _dist.default_threads(comm),
                                    attributes=attributes, format=format, separate_key_prefixes=separate,
                                    direct_io=bool(direct_io), **device_options,
                                    plan_cache=_dist.plan_cache(comm, plan_cache, "sync"))
        _core.save(path, entries, objects, options)
    progress.finish()


def load(state_dict: Mapping[str, Any], path: PathLike, *, process_group: Any = None, strict: bool = True,
         cast: bool = False, allow_pickle: bool = False, threads: Optional[int] = None,
         share_reads: Optional[bool] = None, mapping: Optional[KeyMapping] = None,
         allow_external_links: bool = False, direct_io: Optional[bool] = None,
         io_depth: Optional[int] = None, machine_read_gate: bool = True,
         staging_budget: Optional[int] = None) -> LoadResult:
    """Loads the checkpoint at ``path`` into ``state_dict``: tensors in place (any layout: resharding
    is done by the reads), objects replaced in the structure. Collective over ``process_group``.
    As ``torch.distributed.checkpoint.load``, a top-level ``Stateful`` value is loaded into its
    current ``state_dict()``, which is then handed to its ``load_state_dict()``.

    ``strict``: keys of ``state_dict`` missing from the checkpoint are an error (else reported in
    ``missing_keys``). ``cast``: convert stored dtypes to the destination's (else a mismatch is an
    error). Pickled objects need ``allow_pickle``. Raises CheckpointNotFoundError when no committed
    checkpoint is at ``path``, CheckpointArgumentError for shape/dtype mismatches,
    CheckpointCorruptError for bad data; the same error on every rank.

    ``share_reads``: a stored chunk that several ranks need is read by one of them and handed to
    the others, so each stored byte is read once: through one shared-memory object in /dev/shm when
    every rank of the group runs on one machine, over the process group otherwise. ``None`` (the
    default) shares on object storage (``s3://``: every read is a request), when the group spans
    several machines, and between the processes of one machine (through shared memory; where it
    cannot be made, each process reads what it needs). ``False``: every rank reads for itself.

    ``mapping`` (a :class:`KeyMapping`, e.g. ``shardpoint.mappings.for_model(model)``): stored names
    renamed to keys of ``state_dict``, and keys made of several stored tensors (stacked or
    concatenated); each rank reads only the parts of those it holds. A key missing from the
    checkpoint whose tensor is the same tensor as another key's that is loaded (tied weights) is
    filled by that load and is not missing.

    ``allow_external_links``: read files of the checkpoint that symbolic links lead outside its
    directory (refused by default; docs/FORMAT.md §1.1).

    ``direct_io``: large reads (1 MiB and more of consecutive bytes) bypass the page cache
    (``O_DIRECT``) where the file system allows it, for cold loads of checkpoints that will not be
    read again soon; checksums are verified on the bytes read. Other file systems fall back to
    ordinary reads. ``None`` (the default): chosen per file by what the page cache holds: a file
    whose bytes to read are mostly not cached is read directly, one just written or read goes
    through the cache. ``False``: always through the page cache.

    ``io_depth``: how many reads run at once. ``None`` (the default) tunes it as the load runs from
    the throughput the storage delivers (between 1 and ``threads``); a number fixes it, per rank.

    ``machine_read_gate``: with ``io_depth`` None, the ranks that run as separate processes on one
    machine (torchrun, mpirun) and read their own files put their reads through one gate in shared
    memory, whose depth is tuned from the throughput of all of them, so that the disk sees one
    well-chosen number of reads in flight rather than the sum of competing ones (a resharded load
    that shares its reads through shared memory gives each byte one reader already, and each
    process tunes its own). ``False``: each process tunes its own.

    Tensors on CUDA devices are loaded through pinned host memory, in batches of at most half of
    ``staging_budget`` bytes (default 2 GiB; a larger tensor is a batch of its own): two batches
    are read at once, each into one pinned half, each batch's host-to-device copies run on a copy
    stream as soon as its reads are done, and the caller's current streams wait for the copies
    (docs/GPU.md).
    """
    comm = _dist.resolve(process_group)
    path = os.fspath(path)
    state_dict, load_stateful = _stateful_view(state_dict)
    flat, paths = flatten(state_dict, is_tensor_leaf)
    # An empty dict has nothing to load: DCP stores nothing for it (so it is not asked for), and
    # a shardpoint checkpoint stores it as {} (so not reading it changes nothing).
    empty_dicts = {k for k, v in flat.items() if isinstance(v, Mapping) and not v}
    object_names = [k for k, v in flat.items() if not is_tensor_leaf(v) and k not in empty_dicts]

    def options_for(lane_comm: Optional[_dist.TorchComm]) -> Any:
        with translated():
            return _core.LoadOptions(comm=lane_comm, strict=strict, allow_cast=cast,
                                     allow_external_links=allow_external_links,
                                     threads=threads or _dist.default_threads(comm),
                                     share_reads=None if share_reads is None else bool(share_reads),
                                     direct_io=None if direct_io is None else bool(direct_io),
                                     io_depth=int(io_depth or 0),
                                     machine_read_gate=bool(machine_read_gate))

    loader = _BatchLoad(path, flat, comm, options_for, staging_budget)
    missing, unexpected, objects, bytes_read, gate_ranks, chunks = loader.run(
        object_names, lambda values, plans: _mapped_load.map_load(path, values, plans, mapping, strict, cast,
                                                                  allow_external_links))
    for name, encoding, payload in objects:
        set_by_path(state_dict, paths[name], decode_object(name, encoding, payload, allow_pickle, flat[name], path))
    load_stateful()
    return LoadResult(list(missing), [k for k in unexpected if k not in empty_dicts], int(bytes_read),
                      int(gate_ranks), int(chunks))


def _local_tensor(value: Any) -> Any:
    """The local torch tensor of a load destination: the tensor, a DTensor's local tensor, or the
    ``local`` / ``data`` tensor of a layout wrapper; None for anything else (numpy arrays)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    local = value
    for attr in ("local", "data"):
        if isinstance(local, torch.Tensor):
            break
        local = getattr(value, attr, None)
    if not isinstance(local, torch.Tensor):
        return None
    return getattr(local, "_local_tensor", local)


def _device_of(value: Any) -> Optional[int]:
    """The CUDA device index of a destination's local data (None for host data)."""
    local = _local_tensor(value)
    return local.device.index if local is not None and local.device.type == "cuda" else None


def device_batches(host: list, units: list[tuple[list, int]], half: int) -> list[list]:
    """The batches of a load to the device: ``host`` items first, then ``units`` (lists of device
    items loaded together, with their bytes) in order, at most ``half`` bytes per batch (a larger
    unit makes a batch of its own); the first batch holds the host items and the first units."""
    batches: list[list] = [list(host)]
    used, started = 0, False
    for members, nbytes in units:
        if started and used + nbytes > half:
            batches.append([])
            used = 0
        started = True
        batches[-1].extend(members)
        used += nbytes
    return batches


class _BatchLoad:
    """One load as one core load per batch of tensor keys. Without destinations on CUDA devices
    (on every rank) that is one batch of every key, as it always was. With them, host destinations
    come first and the device ones follow in batches of at most half of ``staging_budget`` bytes (a
    larger tensor alone; tensors sharing storage, tied weights, together), each read into one
    pinned half of shardpoint._cuda.LoadBatches; two batches are read at once (one per half, on
    lane threads of shardpoint._pipeline, the second with a communicator of its own), and a batch
    goes to the device as soon as its reads are done. Every rank runs as many batches as the rank
    with the most (the others' trailing ones are empty), as each is one collective load. Missing
    keys are those of any batch; unexpected keys those that no batch wanted."""

    def __init__(self, path: str, flat: Mapping[str, Any], comm: Optional[_dist.TorchComm],
                 options_for: Callable[[Optional[_dist.TorchComm]], Any], staging_budget: Optional[int]) -> None:
        self.path, self.flat, self.comm = path, flat, comm
        self.options = options_for(comm)
        self.rank = comm.rank if comm else 0
        self.keys = [k for k, v in flat.items() if is_tensor_leaf(v)]
        self.staging = None
        self.region_bytes: dict[str, int] = {}  # device keys: the pinned bytes of their regions
        cuda = _device_module()
        devices = {k: _device_of(flat[k]) for k in self.keys} if cuda is not None else {}
        batches = self._batches(devices, int(staging_budget or (cuda.DEFAULT_LOAD_STAGING if cuda else 0)))
        count = len(batches) if batches else 0
        if comm is not None and cuda is not None:
            # Ranks without CUDA (a CPU-only group) have no count to agree on: all_gather is only
            # made when this process could hold device tensors, as on its peers.
            count = max(int(c) for c in comm.all_gather(str(count).encode()))
        self.lanes = [(comm, self.options)]
        if count == 0:
            self.batches = [self.keys]
            return
        self.batches = (batches or [[]]) + [[] for _ in range(count - len(batches or [[]]))]
        self.needs = [sum(self.region_bytes.get(k, 0) for k in keys) for keys in self.batches]
        self.staging = cuda.load_batches(int(staging_budget or cuda.DEFAULT_LOAD_STAGING))
        # Batches in flight at once, each lane with its own communicator (the collectives of two
        # core loads must not interleave): the first lane is the load's own, the second a gloo
        # group of the same ranks, made once (every rank gets here with the same count).
        if cuda.LOAD_LANES > 1 and count > 1:
            lane_comm = _dist.lane_comm(comm, "load-lane") if comm is not None else None
            self.lanes.append((lane_comm, options_for(lane_comm)))

    def _batches(self, devices: dict[str, Optional[int]], budget: int) -> Optional[list[list[str]]]:
        if not any(d is not None for d in devices.values()):
            return None
        from ._mapped_load import tied_groups

        from ._cuda import region_bytes

        half = max(1, budget // 2)
        size = {k: (lambda t: t.numel() * t.element_size())(_local_tensor(self.flat[k])) if devices[k] is not None
                else 0 for k in self.keys}
        self.region_bytes = {k: region_bytes(n) for k, n in size.items() if n}
        group_of: dict[str, list[str]] = {}
        for group in tied_groups({k: self.flat[k] for k in self.keys}):
            for key in group:
                group_of[key] = list(group)
        host: list[str] = []
        units: list[tuple[list[str], int]] = []
        placed: set[str] = set()
        for key in self.keys:
            if key in placed:
                continue
            members = [m for m in group_of.get(key, [key]) if m not in placed]
            placed.update(members)
            nbytes = sum(self.region_bytes.get(m, 0) for m in members)
            if nbytes == 0:
                host.extend(members)
            else:
                units.append((members, nbytes))
        return device_batches(host, units, half)

    def run(self, object_names: list[str], map_load: Any) -> tuple[list[str], list[str], list, int, int, int]:
        total = 0
        for key in self.keys:
            local = _local_tensor(self.flat[key])
            total += local.numel() * local.element_size() if local is not None else int(getattr(self.flat[key], "nbytes", 0))
        progress = Progress(f"shardpoint load {self.path}", total, rank=self.rank)
        missing: dict[str, None] = {}
        unexpected: Optional[list[str]] = None
        objects: list = []
        bytes_read, gate_ranks, chunks = 0, 1, 0
        with self.staging.lock if self.staging is not None else contextlib.nullcontext():
            try:
                if self.staging is not None:
                    self.staging.start({d for d in (_device_of(self.flat[k]) for k in self.keys) if d is not None},
                                       self.needs)

                def complete(i: int, prepared: tuple, loaded: tuple) -> None:
                    nonlocal unexpected, objects, bytes_read, gate_ranks, chunks
                    batch = self._complete(i, prepared, loaded)
                    missing.update(dict.fromkeys(batch[0]))
                    unexpected = list(batch[1]) if unexpected is None else [k for k in unexpected if k in set(batch[1])]
                    objects += batch[2]
                    bytes_read += batch[3]
                    gate_ranks = max(gate_ranks, batch[4])
                    chunks += batch[5]
                    progress.advance(batch[6])

                pipelined(len(self.batches), len(self.lanes),
                          lambda i, lane: self._prepare(i, self.batches[i], object_names if i == 0 else [], map_load,
                                                        self.lanes[lane][0]),
                          lambda lane, prepared: self._core_load(prepared, self.lanes[lane][1]), complete)
            finally:
                if self.staging is not None:
                    from . import _torch

                    _torch.set_load_pool(None)
                    self.staging.finish()
        progress.finish()
        return list(missing), list(unexpected or []), objects, bytes_read, gate_ranks, chunks

    def _prepare(self, batch: int, keys: list[str], object_names: list[str], map_load: Any,
                 comm: Optional[_dist.TorchComm]) -> tuple:
        """A batch's plans (their host regions taken from the batch's pinned half), agreed on
        every rank of ``comm`` (the batch's lane): (plans, mapped, core entries, object names)."""
        plans, mapped, error = [], None, None
        if self.staging is not None:
            from . import _torch

            _torch.set_load_pool(self.staging.begin(batch))
        try:
            values = {k: self.flat[k] for k in keys}
            plans = [tensor_plan(k, v, self.rank, for_load=True) for k, v in values.items()]
            mapped = map_load(values, plans)
        except Exception as e:  # forwarded to every rank by _agree
            error = e
        _agree(comm, error)
        return plans, mapped, [p.entry() for p in (mapped.plans if mapped else plans)], object_names

    def _core_load(self, prepared: tuple, options: Any) -> tuple:
        """The core load of a prepared batch (on its lane's thread when batches overlap)."""
        with translated():
            return _core.load(self.path, prepared[2], prepared[3], options)

    def _complete(self, batch: int, prepared: tuple, loaded: tuple) -> tuple:
        """After a batch's core load: its copies to the destinations (to the device on the copy
        streams, the half's events recorded for its reuse)."""
        plans, mapped = prepared[0], prepared[1]
        missing, unexpected, objects, bytes_read, gate_ranks, chunks = loaded
        copies = mapped.after_load if mapped else [c for p in plans for c in p.after_load]
        if self.staging is not None:
            self.staging.to_device(batch, copies)
        else:
            for copy_back in copies:
                copy_back()
        if mapped:
            missing = mapped.missing_keys(missing)
        return missing, unexpected, objects, bytes_read, gate_ranks, chunks, sum(p.nbytes for p in plans)


class SaveHandle:
    """An asynchronous save in flight: ``wait()`` returns when it is committed (or raises its error,
    the same on every rank); ``done()`` says whether it has finished."""

    def __init__(self, saver: Any, path: str, comm: Any) -> None:
        self.path = path
        self._saver = saver
        self._comm = comm  # the core uses it from its background thread until the save ends
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        self.staging: Optional[StagingReport] = None  # set for a state with device tensors

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                with translated():
                    self._saver.wait()
            except CheckpointError as e:
                self._error = e
            self._finished = True
            self._comm = None

    def wait(self) -> None:
        """Blocks until the save has committed; raises its CheckpointError if it failed."""
        self._finish()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        """True once the save has finished (committed or failed); never blocks."""
        return self._finished or self._saver.done()


@dataclass(frozen=True)
class StagingReport:
    """Where an async save of device tensors put their bytes: ``staged_bytes`` copied into pinned
    host staging before the call returned, ``snapshot_bytes`` snapshotted on their devices and
    drained in the background, ``blocked_bytes`` copied from the caller's tensors while the call
    blocked (docs/GPU.md)."""

    staged_bytes: int
    snapshot_bytes: int
    blocked_bytes: int


class _AsyncState:
    """The process's async saver (staging reused across saves), its staging budget, the pinned
    pool of device states, and its latest handle."""

    def __init__(self) -> None:
        self.saver: Any = None
        self.budget = 0
        self.last: Optional[SaveHandle] = None
        self._pool: Any = None

    def use_budget(self, budget: int) -> None:
        """Staging for a save under ``budget`` bytes (0: none), once the previous save is over: the
        saver and pinned pool of the previous saves when it is their budget, new ones otherwise."""
        if self.saver is None or budget != self.budget:
            self.saver = _core.AsyncSaver(budget)
            self.budget = budget
            self._pool = None

    def pool(self, cuda: Any) -> Any:
        """The pinned pool that device states are staged in (made by the first such save)."""
        if self._pool is None:
            self._pool = cuda.PinnedPool()
        return self._pool

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes held for device states."""
        return self._pool.capacity if self._pool is not None else 0

    def wait_last(self) -> None:
        if self.last is not None:
            self.last._finish()


_ASYNC = _AsyncState()
atexit.register(_ASYNC.wait_last)


def async_save(state_dict: Mapping[str, Any], path: PathLike, *, process_group: Any = None,
               overwrite: bool = False, allow_pickle: bool = False, staging_budget: Optional[int] = None,
               threads: Optional[int] = None, direct_io: bool = False, over_budget: str = "auto",
               staging_budget_bytes: Optional[int] = None, plan_cache: Any = True) -> SaveHandle:
    """Starts saving ``state_dict`` at ``path`` and returns once its values are copied into host
    staging memory; the caller may change its tensors right away. Writing and commit run on
    background threads over a dedicated gloo group. A previous async save is waited for first (its
    handle keeps its outcome). Errors known before the copy are raised here, the rest by
    ``SaveHandle.wait()``; an unfinished save never leaves a committed checkpoint.
    Top-level ``Stateful`` values are saved as their ``state_dict()``, as by :func:`save`.
    ``staging_budget`` (bytes; ``staging_budget_bytes`` is its former name) bounds the host staging
    memory of this save (0 or None: no bound); the staging is kept for the next save with the same
    budget. ``threads`` is the copy and write parallelism (default: the number of cores);
    ``direct_io`` and ``plan_cache`` as for :func:`save` (async saves keep a cache of their own).

    A state with tensors on CUDA devices is staged in pinned host memory that is allocated by the
    first save and reused by every later one: each device's copies run on a copy stream that first
    waits for the work the caller queued before the call, and the background save writes from that
    memory with no second copy (docs/GPU.md). What does not fit in ``staging_budget`` is, by
    ``over_budget``: ``"device"``, snapshotted on its device (one device-to-device copy, which needs
    the free device memory) and drained through the host budget in the background; ``"block"``,
    copied from the caller's tensors by the background save while this call blocks until the last
    of them is copied; ``"auto"`` (the default), ``"device"`` where the device has the memory and
    ``"block"`` elsewhere. ``SaveHandle.staging`` says what went where.
    """
    budget = int(staging_budget if staging_budget is not None else staging_budget_bytes or 0)
    if budget < 0:
        raise CheckpointArgumentError(f"staging_budget={budget}: expected a number of bytes >= 0", "INVALID_ARGUMENT")
    comm = _dist.resolve(process_group, for_async=True)
    path = os.fspath(path)
    state_dict = _stateful_state_dicts(state_dict)
    _ASYNC.wait_last()
    _ASYNC.use_budget(budget)
    threads = threads or _dist.default_threads(comm)
    # No collective call here (the caller is blocked only for the copy): a rank that fails to
    # prepare joins its peers' save with the error, so that their wait() raises it too.
    staging = None
    stager = None
    try:
        cuda = _device_module()
        # Device pieces are copied to pinned memory tensor by tensor as the plans are made.
        stager = cuda.Stager(_ASYNC.pool(cuda), budget, over_budget) if cuda is not None else None
        plans, objects, attributes = _prepare_save(state_dict, comm.rank if comm else 0, allow_pickle,
                                                   stager.add if stager is not None else None)
        entries = [p.entry() for p in plans]
        if stager is not None:
            staging = stager.finish()
    except Exception as e:
        if stager is not None:
            stager.abort()
        if comm is not None:
            text = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            try:
                _ASYNC.saver.start_failed(path, code_of(e), text, _core.SaveOptions(comm=comm, threads=threads))
            except _core.StatusError:
                pass  # that same failure: raised below as it was met
        raise
    with translated():
        options = _core.SaveOptions(comm=comm, overwrite=overwrite, threads=threads, attributes=attributes,
                                    direct_io=bool(direct_io),
                                    plan_cache=_dist.plan_cache(comm, plan_cache, "async"))
        if staging is None:
            _ASYNC.saver.start(path, entries, objects, options)
        else:
            if staging.fill is not None:
                options.fill = staging.fill
                options.fill_budget_bytes = max(1, staging.fill_budget)
            _ASYNC.saver.start(path, staging.entries, objects, options, borrow=True)
    _ASYNC.last = SaveHandle(_ASYNC.saver, path, comm)
    if staging is not None:
        _ASYNC.last.staging = StagingReport(staging.staged_bytes, staging.snapshot_bytes, staging.blocked_bytes)
        if staging.blocking:
            # The caller's own tensors are read by the background save: return once the last of
            # them is copied (or the save has ended without needing them).
            while not staging.fill.done.wait(0.005):
                if _ASYNC.saver.done():
                    break
    return _ASYNC.last


def inspect(path: PathLike, *, allow_external_links: bool = False) -> CheckpointInfo:
    """The committed metadata at ``path``: tensors (dtype, shape, chunks), objects, sizes.

    Raises CheckpointNotFoundError when no committed checkpoint is there. ``allow_external_links``
    as in :func:`load`.
    """
    path = os.fspath(path)
    with translated():
        md = _core.read_metadata(path, allow_external_links=allow_external_links)
    tensors = {t.name: TensorInfo(t.dtype, t.shape, [(c.offsets, c.sizes) for c in t.chunks], t.nbytes)
               for t in md.tensors}
    objects = {o.name: ObjectInfo(o.encoding, o.nbytes) for o in md.objects}
    files = [{"name": f.name, "bytes": f.size, "writer_rank": f.writer_rank} for f in md.files]
    attributes = {k: v for k, v in md.attributes.items() if k != _PATHS_ATTRIBUTE}
    return CheckpointInfo(path, md.version, md.save_id, md.world_size, md.total_bytes, tensors, objects, files,
                          attributes)


def _selected(names: Sequence[str], keys: Optional[Sequence[str]]) -> list[str]:
    if keys is None:
        return list(names)
    if isinstance(keys, str):
        keys = [keys]
    chosen = [n for n in names if any(n == k or n.startswith(k + ".") for k in keys)]
    unmatched = [k for k in keys if not any(n == k or n.startswith(k + ".") for n in names)]
    if unmatched:
        raise CheckpointNotFoundError(f"keys {unmatched} match nothing in the checkpoint", "NOT_FOUND")
    return chosen


def _empty_tensor(dtype: str, shape: tuple[int, ...], use_torch: bool) -> Any:
    if use_torch:
        from . import _torch

        return _torch.empty_like_stored(dtype, shape)
    return np.empty(shape, dtype=numpy_dtype(dtype))


def load_full(path: PathLike, *, keys: Optional[Sequence[str]] = None, allow_pickle: bool = False,
              threads: Optional[int] = None, mapping: Optional[KeyMapping] = None,
              allow_external_links: bool = False) -> dict[str, Any]:
    """Every tensor whole (torch tensors when torch can be imported, else numpy arrays) and every
    object of the checkpoint, rebuilt into the saved nested structure. No template is needed.

    ``keys``: dotted names or prefixes of them to load (default: all); a key that matches nothing
    raises CheckpointNotFoundError. Runs on this process alone.

    ``mapping`` (a :class:`KeyMapping`): tensors come back under their target names, fused ones
    built from their stored parts; ``keys`` then select target names. ``allow_external_links`` as
    in :func:`load`.
    """
    path = os.fspath(path)
    try:
        import torch  # noqa: F401
        use_torch = True
    except ImportError:
        use_torch = False
    with translated():
        md = _core.read_metadata(path, allow_external_links=allow_external_links)
    targets = {t.name: (t.dtype, t.shape) for t in md.tensors}
    stored_objects = [o.name for o in md.objects]
    resolved = None
    if mapping is not None:
        targets, resolved = _mapped_load.full_targets(mapping, targets)
    chosen = set(_selected(list(targets) + stored_objects, keys))
    tensor_names = [n for n in targets if n in chosen]
    object_names = [n for n in stored_objects if n in chosen]
    flat: dict[str, Any] = {}
    batches: list[list[TensorPlan]] = [[]]
    batch_bytes = 0
    for name in tensor_names:
        flat[name] = _empty_tensor(*targets[name], use_torch)
        plan = tensor_plan(name, flat[name], 0, for_load=True)
        if batch_bytes and batch_bytes + plan.nbytes > _LOAD_FULL_BATCH_BYTES:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(plan)
        batch_bytes += plan.nbytes
    progress = Progress(f"shardpoint load_full {path}", sum(p.nbytes for b in batches for p in b))
    objects: list = []
    options = _core.LoadOptions(allow_external_links=allow_external_links)
    if threads:
        options.threads = threads
    for i, batch in enumerate(batches):  # batches keep the bar moving; each reads its tensors once
        mapped = _mapped_load.to_stored(batch, resolved) if resolved is not None else None
        with translated():
            _, _, found, *_ = _core.load(path, [p.entry() for p in (mapped.plans if mapped else batch)],
                                        object_names if i == 0 else [], options)
        for copy_back in mapped.after_load if mapped else []:
            copy_back()
        objects += found
        progress.advance(sum(p.nbytes for p in batch))
    progress.finish()
    for name, encoding, payload in objects:
        flat[name] = decode_object(name, encoding, payload, allow_pickle, where=path)
    encoded = md.attributes.get(_PATHS_ATTRIBUTE)
    paths = decode_paths_attribute(path, _PATHS_ATTRIBUTE, encoded) if encoded else {}
    return unflatten({n: flat[n] for n in sorted(flat, key=_order(paths))}, paths)


def _order(paths: Mapping[str, Any]) -> Any:
    position = {key: i for i, key in enumerate(paths)}
    return lambda name: (position.get(name, len(position)), name)


def verify(path: PathLike, *, allow_external_links: bool = False) -> VerifyReport:
    """Checks every file, checksum and tensor coverage of the checkpoint at ``path``.

    Defects are reported in the result; raises CheckpointNotFoundError / CheckpointCorruptError only
    when the metadata itself cannot be read.
    """
    with translated():
        report = _core.verify(os.fspath(path), allow_external_links=allow_external_links)
    return VerifyReport(report.ok, report.defects, report.files_checked, report.chunks_checked, report.bytes_checked,
                        report.notes)

"""Communicator adapter: the core's comm protocol over torch.distributed object collectives.

``resolve(process_group)`` picks what the core talks through: ``None`` (one rank) when
torch.distributed is not initialized or the group has one rank, else a :class:`TorchComm` on a gloo
group: the group itself when it is gloo, otherwise a gloo group over the same ranks, created once
(collectively, by the group's ranks only) and cached. Async saves always get their own cached gloo
group so the background thread never interleaves with the training's collectives.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Optional

from ._errors import CheckpointArgumentError

_GROUPS: dict[tuple, Any] = {}
_HOSTS: dict[tuple, list[bytes]] = {}
_GROUPS_LOCK = threading.Lock()
_PLAN_CACHES: dict[tuple, Any] = {}


class TorchComm:
    """The core's communicator over one torch.distributed (gloo) process group.

    ``rank`` and ``size`` are within the group; roots are group ranks. Calls block until every rank
    of the group has made the matching call; one call at a time per instance.
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)

    def _global(self, group_rank: int) -> int:
        return self._dist.get_global_rank(self.group, group_rank)

    def gather(self, data: bytes, root: int) -> Optional[list[bytes]]:
        """Every rank's ``data`` at ``root`` (None elsewhere)."""
        out = [None] * self.size if self.rank == root else None
        self._dist.gather_object(data, out, dst=self._global(root), group=self.group)
        return out

    def scatter(self, chunks: Optional[list[bytes]], root: int) -> bytes:
        """Rank i receives ``chunks[i]`` from ``root``."""
        out: list[Any] = [None]
        self._dist.scatter_object_list(out, chunks if self.rank == root else None,
                                       src=self._global(root), group=self.group)
        return out[0]

    def broadcast(self, data: Optional[bytes], root: int) -> bytes:
        """``root``'s ``data`` on every rank."""
        box = [data]
        self._dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on every rank."""
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, data, group=self.group)
        return out

    def all_to_all_buffers(self, send: bytearray, sizes: list[int]) -> tuple[Any, list[int]]:
        """``send`` holds a payload per rank back to back, ``sizes[i]`` bytes for rank i; returns a
        uint8 array holding what every rank sent to this one back to back, and how many bytes
        came from each.

        The bytes travel as uint8 tensors viewing the buffers (one size exchange, one
        ``all_to_all_single``): no copy on either side beyond the transport's own.
        """
        import torch

        counts = torch.tensor(sizes, dtype=torch.int64)
        incoming = torch.empty(self.size, dtype=torch.int64)
        self._dist.all_to_all_single(incoming, counts, group=self.group)
        outgoing = torch.frombuffer(send, dtype=torch.uint8) if send else torch.empty(0, dtype=torch.uint8)
        splits = incoming.tolist()
        recv = torch.empty(sum(splits), dtype=torch.uint8)
        self._dist.all_to_all_single(recv, outgoing, output_split_sizes=splits,
                                     input_split_sizes=list(sizes), group=self.group)
        return recv.numpy(), splits

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self._dist.barrier(group=self.group)

    def spans_machines(self) -> bool:
        """Whether the group's ranks run on more than one machine (one all-gather of host names per
        group, the first time any comm of the group is asked). The core asks it, on every rank at
        the same point, to decide whether a load shares its reads."""
        return len(set(_hosts(self))) > 1

    def machine_ranks(self) -> list[int]:
        """The group ranks on this rank's machine (the same host name), ascending: separate
        processes, whose loads put their reads through one shared gate (the same all-gather of
        host names as spans_machines)."""
        hosts = _hosts(self)
        return [r for r, host in enumerate(hosts) if host == hosts[self.rank]]


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _gloo_group(group: Any, purpose: str) -> Any:
    """A gloo group over ``group``'s ranks, created once per (ranks, purpose) by those ranks."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    key = (ranks, purpose)
    with _GROUPS_LOCK:
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
        return _GROUPS[key]


def lane_comm(comm: TorchComm, purpose: str) -> TorchComm:
    """A communicator over ``comm``'s ranks through a gloo group of their own, made once per
    (ranks, ``purpose``) by those ranks together: for collectives that run while ``comm``'s own
    run on another thread (the second batch in flight of a load to the device)."""
    return TorchComm(_gloo_group(comm.group, purpose))


def plan_cache(comm: Optional[TorchComm], cache: Any, purpose: str) -> Any:
    """The SavePlanCache a save hands to the core: ``cache`` itself when it is one, None for False
    or None, and for True this process's cache for the group's ranks and ``purpose`` (``"sync"``,
    ``"async"``: the two may run at once, and a cache serves one save at a time), made on first
    use. No choice of cache can make a save wrong: a cached plan is taken only when every rank's
    layout is exactly the one it was made from (shardpoint/engine/save_plan_cache.h)."""
    from ._core import SavePlanCache

    if cache is None or cache is False:
        return None
    if isinstance(cache, SavePlanCache):
        return cache
    if cache is not True:
        raise CheckpointArgumentError(f"plan_cache={cache!r}: expected True, False or a SavePlanCache",
                                      "INVALID_ARGUMENT")
    if comm is None:
        key: tuple = ((), purpose)
    else:
        key = (tuple(comm._dist.get_process_group_ranks(comm.group)), comm.rank, purpose)
    with _GROUPS_LOCK:
        if key not in _PLAN_CACHES:
            _PLAN_CACHES[key] = SavePlanCache()
        return _PLAN_CACHES[key]


def resolve(process_group: Any = None, *, for_async: bool = False) -> Optional[TorchComm]:
    """The comm for ``process_group`` (see the module docstring); None means one rank.

    Raises CheckpointArgumentError when a group is given but torch.distributed is not initialized,
    or when this process is not a member of the group.
    """
    if not _initialized():
        if process_group is not None:
            raise CheckpointArgumentError("process_group given but torch.distributed is not initialized",
                                          "INVALID_ARGUMENT")
        return None
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise CheckpointArgumentError(f"this process (global rank {dist.get_rank()}) is not in the process group",
                                      "INVALID_ARGUMENT")
    if dist.get_world_size(group) == 1:
        return None
    if for_async:
        return TorchComm(_gloo_group(group, "async"))
    if dist.get_backend(group) != "gloo":
        return TorchComm(_gloo_group(group, "sync"))
    return TorchComm(group)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads(comm: Optional[TorchComm]) -> int:
    """Threads per rank when the caller gives none: the core's default for one process
    (max(4, cores): I/O threads mostly wait on storage) shared among the group's ranks on this
    machine (learned once per group with one all-gather of host names), so that ranks sharing a
    machine do not oversubscribe it, and at least 2, so that a rank's reads overlap (with one
    thread a rank reading its own file keeps one read in flight, and a cold DCP load of 4 ranks on
    2 cores took 1.2-1.7x the raw read of the files, against 0.8-1.0x with 2-4 threads); 0 (the
    core's default) for one rank."""
    if comm is None:
        return 0
    hosts = _hosts(comm)
    return max(2, max(4, _cores()) // hosts.count(hosts[comm.rank]))


def _hosts(comm: TorchComm) -> list[bytes]:
    """The host name of every rank of the group, by group rank: one all-gather per group."""
    import torch.distributed as dist

    key = tuple(dist.get_process_group_ranks(comm.group))
    if key not in _HOSTS:
        _HOSTS[key] = comm.all_gather(socket.gethostname().encode())
    return _HOSTS[key]

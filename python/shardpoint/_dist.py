"""Communicator adapter: the core's comm protocol over torch.distributed collectives of uint8 tensors.

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
        """Every rank's ``data`` at ``root`` (None elsewhere): one gather of slots (each rank's
        length and first bytes); a rank whose payload overflows its slot sends the rest to
        ``root`` alone, which knows from the slots whom to receive it from."""
        import torch

        slot = rank_slot_bytes(self.size)
        inline = slot - _LENGTH_BYTES
        send = torch.from_numpy(_slot(data, slot))
        source = self._global(root)
        if self.rank != root:
            self._dist.gather(send, None, dst=source, group=self.group)
            if len(data) > inline:
                self._dist.send(torch.from_numpy(_tail(data, slot, len(data) - inline)), dst=source,
                                group=self.group, tag=_OVERFLOW_TAG)
            return None
        received = torch.empty(self.size * slot, dtype=torch.uint8)
        self._dist.gather(send, list(received.split(slot)), dst=source, group=self.group)
        slots = received.numpy().reshape(self.size, slot)
        out: list[bytes] = []
        for r in range(self.size):
            length = _slot_length(slots[r])
            if r == root or length <= inline:
                out.append(data if r == root else _unslot(slots[r], length, None))
                continue
            tail = torch.empty(length - inline, dtype=torch.uint8)
            self._dist.recv(tail, src=self._global(r), group=self.group, tag=_OVERFLOW_TAG)
            out.append(_unslot(slots[r], length, tail.numpy()))
        return out

    def scatter(self, chunks: Optional[list[bytes]], root: int) -> bytes:
        """Rank i receives ``chunks[i]`` from ``root``: one scatter of slots (each chunk's length
        and first bytes); ``root`` sends what overflows a slot to its rank alone."""
        import torch

        slot = rank_slot_bytes(self.size)
        inline = slot - _LENGTH_BYTES
        source = self._global(root)
        mine = torch.empty(slot, dtype=torch.uint8)
        if self.rank == root:
            if chunks is None or len(chunks) != self.size:
                raise CheckpointArgumentError(f"scatter from rank {root}: expected {self.size} payloads, found "
                                              f"{None if chunks is None else len(chunks)}", "INTERNAL")
            slots = [torch.from_numpy(_slot(chunk, slot)) for chunk in chunks]
            self._dist.scatter(mine, slots, src=source, group=self.group)
            for r, chunk in enumerate(chunks):
                if r != root and len(chunk) > inline:
                    self._dist.send(torch.from_numpy(_tail(chunk, slot, len(chunk) - inline)), dst=self._global(r),
                                    group=self.group, tag=_OVERFLOW_TAG)
            return chunks[root]
        self._dist.scatter(mine, None, src=source, group=self.group)
        row = mine.numpy()
        length = _slot_length(row)
        if length <= inline:
            return _unslot(row, length, None)
        tail = torch.empty(length - inline, dtype=torch.uint8)
        self._dist.recv(tail, src=source, group=self.group, tag=_OVERFLOW_TAG)
        return _unslot(row, length, tail.numpy())

    def broadcast(self, data: Optional[bytes], root: int) -> bytes:
        """``root``'s ``data`` on every rank: one broadcast of a slot (the length and the first
        bytes), and a second of the rest only when the data overflows it."""
        import torch

        source = self._global(root)
        head = torch.from_numpy(_slot(data if self.rank == root else b"", _BROADCAST_SLOT_BYTES))
        self._dist.broadcast(head, src=source, group=self.group)
        length = _slot_length(head.numpy())
        inline = _BROADCAST_SLOT_BYTES - _LENGTH_BYTES
        if length <= inline:
            return data if self.rank == root else _unslot(head.numpy(), length, None)
        if self.rank == root:
            rest = torch.from_numpy(_tail(data, _BROADCAST_SLOT_BYTES, length - inline))
        else:
            rest = torch.empty(length - inline, dtype=torch.uint8)
        self._dist.broadcast(rest, src=source, group=self.group)
        if self.rank == root:
            return data
        return _unslot(head.numpy(), length, rest.numpy())

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on every rank: one all-gather of slots (each rank's length and its
        first bytes), and a second of the rest only when some rank's payload overflows its slot."""
        import torch

        slot = rank_slot_bytes(self.size)
        send = _slot(data, slot)
        received = torch.empty(self.size * slot, dtype=torch.uint8)
        self._dist.all_gather(list(received.split(slot)), torch.from_numpy(send), group=self.group)
        slots = received.numpy().reshape(self.size, slot)
        lengths = [_slot_length(row) for row in slots]
        rest = max(lengths) - (slot - _LENGTH_BYTES)
        tails = None
        if rest > 0:
            gathered = torch.empty(self.size * rest, dtype=torch.uint8)
            self._dist.all_gather(list(gathered.split(rest)), torch.from_numpy(_tail(data, slot, rest)),
                                  group=self.group)
            tails = gathered.numpy().reshape(self.size, rest)
        return [_unslot(slots[r], lengths[r], None if tails is None else tails[r]) for r in range(self.size)]

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

    def exchange_with_peers(self, sends: list[tuple[int, bytearray]], sources: list[int]) -> list[Any]:
        """Sends each ``(rank, data)`` of ``sends`` to its rank and returns what each rank of
        ``sources`` sent to this one, in that order; nothing moves between other ranks.

        Two steps of point-to-point messages between the peers alone: each payload's length,
        then the payloads that are not empty, into buffers of those lengths. What a rank moves
        grows with its peers, where an all-to-all (``all_to_all_buffers``) grows with the group.
        The core checks the lists (each rank at most once, within the group) before the call.
        """
        import torch

        mine = self.rank
        works = []
        lengths = []
        for q, data in sends:
            if q == mine:
                continue
            length = torch.tensor([len(data)], dtype=torch.int64)
            lengths.append(length)
            works.append(self._dist.isend(length, dst=self._global(q), group=self.group, tag=_PEER_LENGTH_TAG))
        incoming = {}
        for s in sources:
            if s != mine:
                incoming[s] = torch.empty(1, dtype=torch.int64)
                works.append(self._dist.irecv(incoming[s], src=self._global(s), group=self.group,
                                              tag=_PEER_LENGTH_TAG))
        for work in works:
            work.wait()
        works = []
        own: Any = b""
        for q, data in sends:
            if q == mine:
                own = data
            elif data:
                works.append(self._dist.isend(torch.frombuffer(data, dtype=torch.uint8), dst=self._global(q),
                                              group=self.group, tag=_PEER_DATA_TAG))
        received: list[Any] = []
        for s in sources:
            if s == mine:
                received.append(own)
                continue
            buffer = torch.empty(int(incoming[s].item()), dtype=torch.uint8)
            if buffer.numel():
                works.append(self._dist.irecv(buffer, src=self._global(s), group=self.group, tag=_PEER_DATA_TAG))
            received.append(buffer)
        for work in works:
            work.wait()
        return [data.numpy() if isinstance(data, torch.Tensor) else data for data in received]

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank: one all-reduce of one integer, the cheapest
        collective gloo has (a third of an all-gather's time on 4 processes of 2 cores)."""
        import torch

        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

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


# The collectives above carry bytes in fixed-size slots of uint8 tensors rather than through
# torch's *_object collectives, which pickle and take two collectives each (one for the sizes, one
# for the padded data): with several processes on few cores each collective costs milliseconds of
# scheduling, and a load or save makes several. A slot starts with the payload's length (8 bytes,
# little endian) and holds as much of the payload as fits; what overflows goes in a second
# collective, sized by the longest payload, which every rank learns from the first.
_LENGTH_BYTES = 8
# The tag of the point-to-point messages that carry what overflows a gather's or a scatter's slot.
_OVERFLOW_TAG = 0x5350
# The tags of exchange_with_peers' messages: each payload's length, then the payload.
_PEER_LENGTH_TAG = 0x5351
_PEER_DATA_TAG = 0x5352
# A broadcast's slot: what every rank receives however many ranks there are.
_BROADCAST_SLOT_BYTES = 64 << 10
# The slots of an all-gather, a gather and a scatter: every rank (the root) receives one per rank,
# so they shrink as the group grows (about 1 MiB in all, from 64 KiB each at 16 ranks or fewer down
# to 256 bytes).
_SLOTS_TOTAL_BYTES = 1 << 20
_MIN_SLOT_BYTES = 256
_MAX_SLOT_BYTES = 64 << 10


def rank_slot_bytes(size: int) -> int:
    """The bytes of each rank's slot in an all-gather, a gather or a scatter of ``size`` ranks
    (length included)."""
    return max(_MIN_SLOT_BYTES, min(_MAX_SLOT_BYTES, _SLOTS_TOTAL_BYTES // max(1, size)))


def _slot(data: Any, slot: int) -> Any:
    """A uint8 numpy array of ``slot`` bytes: ``data``'s length, then as much of ``data`` as fits
    (the rest of the slot is not cleared: the length says where the payload ends)."""
    import numpy as np

    out = np.empty(slot, dtype=np.uint8)
    view = memoryview(data).cast("B")
    out[:_LENGTH_BYTES] = np.frombuffer(len(view).to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8)
    inline = min(len(view), slot - _LENGTH_BYTES)
    out[_LENGTH_BYTES:_LENGTH_BYTES + inline] = np.frombuffer(view[:inline], dtype=np.uint8)
    return out


def _tail(data: Any, slot: int, rest: int) -> Any:
    """A uint8 numpy array of ``rest`` bytes: what of ``data`` did not fit in its slot, then zeros."""
    import numpy as np

    out = np.zeros(rest, dtype=np.uint8)
    overflow = memoryview(data).cast("B")[slot - _LENGTH_BYTES:]
    out[:len(overflow)] = np.frombuffer(overflow, dtype=np.uint8)
    return out


def _slot_length(row: Any) -> int:
    """The payload length at the start of a slot."""
    return int.from_bytes(row[:_LENGTH_BYTES].tobytes(), "little")


def _unslot(row: Any, length: int, tail: Any) -> bytes:
    """The payload of ``length`` bytes held by a slot and, past the slot, by ``tail``."""
    inline = len(row) - _LENGTH_BYTES
    head = row[_LENGTH_BYTES:_LENGTH_BYTES + min(length, inline)].tobytes()
    if length <= inline:
        return head
    return head + tail[:length - inline].tobytes()


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

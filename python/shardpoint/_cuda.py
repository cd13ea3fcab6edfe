"""Device (CUDA) state: copies on side streams, pinned host memory reused across operations, and
the three ways device bytes reach the core (docs/GPU.md).

* Save and async save: the pieces are copied into pinned host blocks that are allocated once and
  reused by every later save (bounded by ``staging_budget``), and the core writes from those blocks
  without a second copy. What the budget cannot hold goes to the core as ``None`` pieces whose
  bytes the core's I/O threads copy device-to-host just before writing them (``SaveOptions.fill``,
  each thread on a copy stream of its own); an async save first snapshots them on the device (a
  device-to-device copy, while free device memory allows) or blocks until they are copied (see
  :class:`Stager`, which copies each tensor while the next ones are planned).
* Load: the destination tensors are loaded in batches through two pinned halves, two batches read
  at once (one per half), and the host-to-device copies of a batch run on a copy stream as soon as
  its reads are done, while the next batch is read (:class:`LoadBatches`).

Ordering with the caller's work: before any copy reads a tensor, its copy stream waits on an event
recorded on the caller's current stream of that device; after a load, the caller's current streams
wait on the copy streams. There is no device-wide synchronize.

This module imports torch; it is used only when a state holds tensors on a CUDA device.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ._errors import CheckpointArgumentError, error_for

_ALIGN = 64
_MIN_BLOCK = 64 << 20
# cudaHostRegisterPortable: the block counts as pinned for every device's context, not only for the
# device current on the thread that registers it (a state may span devices; a load's second half
# is registered on a thread of its own).
_HOST_REGISTER_PORTABLE = 1
# Device memory kept free beside a device snapshot: the caller's next steps need room too.
_DEVICE_MARGIN_FRACTION = 0.1
_DEVICE_MARGIN_MIN = 1 << 30
# Default pinned host memory of a load (two halves, one being read into while the other is copied
# to the device); a tensor larger than a half makes a batch of its own, and its half grows to it.
DEFAULT_LOAD_STAGING = 2 << 30
# Core loads in flight at once for the batches of a load to the device, one per pinned half: the
# reads of batch i + 1 run while batch i finishes, so the storage does not idle between batches
# (1: one batch after the other).
LOAD_LANES = 2
# Default pinned staging of a synchronous save (what does not fit is copied as it is written).
DEFAULT_SAVE_STAGING = 4 << 30


def is_device_bytes(value: Any) -> bool:
    """True for a uint8 piece view of device memory (what the torch adapter makes of a CUDA tensor)."""
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def state_on_device(pieces: list) -> bool:
    """Whether any piece of ``pieces`` (core entry pieces) lies in device memory."""
    return any(is_device_bytes(p[2]) for p in pieces)


class CopyStreams:
    """One copy stream per (device, thread): copies issued by different I/O threads never wait on
    each other, and a thread's stream sync waits only for its own copies."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[torch.cuda.Stream] = []

    def get(self, device: torch.device) -> torch.cuda.Stream:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(device=index)
            with self._lock:
                self._all.append(stream)
        return stream


STREAMS = CopyStreams()


def caller_events(sources: list[torch.Tensor]) -> dict[int, torch.cuda.Event]:
    """An event on the caller's current stream of each device that ``sources`` live on: what the
    copies of those tensors must wait for (the work the caller queued before the call)."""
    events: dict[int, torch.cuda.Event] = {}
    for src in sources:
        index = src.device.index
        if index not in events:
            events[index] = torch.cuda.current_stream(index).record_event()
    return events


def copy_to_host(src: torch.Tensor, out: torch.Tensor, events: dict[int, torch.cuda.Event]) -> None:
    """Copies device bytes ``src`` into host ``out`` on this thread's copy stream of its device,
    after the caller's event, and waits for the copy."""
    stream = STREAMS.get(src.device)
    stream.wait_event(events[src.device.index])
    with torch.cuda.stream(stream):
        out.copy_(src, non_blocking=True)
    stream.synchronize()


def _unregister(blocks: list[torch.Tensor]) -> None:
    for block in blocks:
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
    blocks.clear()


class PinnedPool:
    """Grow-only pinned host blocks handed out as aligned regions, reset for each operation and kept
    for the next one, so that an operation of the same size as an earlier one allocates nothing.
    ``limit`` bounds the bytes held (0: none); ``take`` returns None when a region would pass it.
    Blocks are host memory page-locked with cudaHostRegister at their exact size (torch's pinned
    allocator rounds each allocation up to a power of two and caches it after it is freed), and
    unregistered when the pool goes. Not thread-safe: one operation at a time."""

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor] = []
        self._block = 0
        self._used = 0
        self._taken = 0  # bytes of the blocks passed over or handed out in this operation
        weakref.finalize(self, _unregister, self._blocks)

    def _new_block(self, size: int) -> torch.Tensor:
        block = torch.empty(size, dtype=torch.uint8)
        rc = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), size, _HOST_REGISTER_PORTABLE))
        if rc != 0:
            raise error_for(
                "RESOURCE_EXHAUSTED",
                f"cannot page-lock {size} bytes of host memory for device copies (cudaHostRegister returned "
                f"error {rc}; {self.capacity} bytes held already): lower staging_budget or the memory locked "
                f"elsewhere")
        self._blocks.append(block)
        return block

    @property
    def capacity(self) -> int:
        """Pinned bytes held."""
        return sum(b.numel() for b in self._blocks)

    def reset(self) -> None:
        self._block = 0
        self._used = 0
        self._taken = 0

    def holds(self, size: int) -> bool:
        """Whether the first block has room for ``size`` bytes of regions."""
        return bool(self._blocks) and self._blocks[0].numel() >= size

    def reserve(self, size: int) -> None:
        """Makes the first block at least ``size`` bytes, for an operation whose regions are known
        to fit in ``size`` (a load batch: its bytes, each region rounded up to the alignment). A
        pool whose first block is smaller is replaced by one block of ``size``: the old blocks are
        unregistered, so the caller must know that no copy still uses them. Regions taken after a
        reserve lie in that one block, so a sequence of batches of other sizes neither passes over
        blocks nor registers new ones."""
        if size <= 0 or self.holds(size):
            return
        self._drop_blocks()
        self.reset()
        self._new_block(size)

    def _drop_blocks(self) -> None:
        _unregister(self._blocks)

    def take(self, nbytes: int, limit: int = 0) -> Optional[torch.Tensor]:
        """A region of ``nbytes`` bytes, or None when the bytes of this operation's regions (with
        their alignment and the ends of the blocks passed over) would pass ``limit`` (0: none). A
        block held from an earlier operation counts only once used: the pool never holds more than
        the largest ``limit`` it was given, and an operation never uses more than its own. A take
        that fails leaves the pool as it was: a smaller region may still fit."""
        cursor = (self._block, self._used, self._taken)
        region = self._take(nbytes, limit)
        if region is None:
            self._block, self._used, self._taken = cursor
        return region

    def _take(self, nbytes: int, limit: int) -> Optional[torch.Tensor]:
        while self._block < len(self._blocks):
            size = self._blocks[self._block].numel()
            start = -(-self._used // _ALIGN) * _ALIGN
            if start + nbytes <= size:
                if limit and self._taken + start + nbytes > limit:
                    return None
                self._used = start + nbytes
                return self._blocks[self._block][start:start + nbytes]
            self._taken += size
            self._block += 1
            self._used = 0
        if limit and self._taken + nbytes > limit:
            return None
        size = max(nbytes, _MIN_BLOCK)
        if limit:
            room = min(limit - self.capacity, limit - self._taken)
            if room < nbytes:
                return None
            size = min(size, room)
        self._new_block(size)
        self._block = len(self._blocks) - 1
        self._used = nbytes
        return self._blocks[-1][:nbytes]


# --- save -------------------------------------------------------------------------------------

_SAVE_POOL: Optional[PinnedPool] = None
_SAVE_POOL_BUDGET = -1


def save_pool(budget: int) -> PinnedPool:
    """The pinned pool of synchronous saves under ``budget`` bytes: kept from one save to the next,
    made again when the budget changes. One synchronous save at a time per process uses it (saves
    are collective calls of the process's one training loop)."""
    global _SAVE_POOL, _SAVE_POOL_BUDGET
    if _SAVE_POOL is None or _SAVE_POOL_BUDGET != budget:
        _SAVE_POOL, _SAVE_POOL_BUDGET = PinnedPool(), budget
    return _SAVE_POOL


@dataclass
class Fill:
    """The ``fill`` of a save: piece (tensor index, piece index) -> device (or host) bytes to copy
    from. The core's I/O threads call it for byte ranges of the pieces as they write them (several
    at once, each on its thread's copy stream). ``done`` is set once ``pending`` bytes have been
    filled (after a failed range, the end of the save says the caller's tensors are no longer read)."""

    sources: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)
    pending: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, tensor: int, piece: int, offset: int, out: memoryview) -> None:
        filled = 0
        try:
            src = self.sources[(tensor, piece)]
            dst = torch.frombuffer(out, dtype=torch.uint8) if len(out) else torch.empty(0, dtype=torch.uint8)
            if offset < 0 or offset + dst.numel() > src.numel():
                raise CheckpointArgumentError(
                    f"piece {piece} of tensor entry {tensor} holds {src.numel()} bytes, the engine asked for "
                    f"bytes [{offset}, {offset + dst.numel()})", "INTERNAL")
            part = src[offset:offset + dst.numel()]
            if part.device.type == "cuda":
                copy_to_host(part, dst, self.events)
            else:
                dst.copy_(part)
            del dst
            filled = len(out)
        finally:
            with self.lock:
                self.pending -= filled
                if self.pending <= 0:
                    self.done.set()


OVER_BUDGET_MODES = ("auto", "device", "block")


@dataclass
class AsyncStaging:
    """What :class:`Stager` made: the entries for the core (host pieces in the pinned pool,
    the rest None), the fill of the None pieces, the fill budget, and whether the caller must wait
    for the fill (``blocking``) before it may change its tensors."""

    entries: list[tuple]
    fill: Optional[Fill]
    fill_budget: int
    blocking: bool
    staged_bytes: int
    snapshot_bytes: int
    blocked_bytes: int


def _free_device_bytes(index: int) -> int:
    free, _ = torch.cuda.mem_get_info(index)
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    return int(free) + max(0, int(cached))


class Stager:
    """Stages the pieces of a save into ``pool`` as the plans are made, tensor by tensor
    (:meth:`add`), so that the device-to-host copies run while the next tensors are planned; then
    :meth:`finish` handles what the budget cannot hold and waits for the copies.

    ``budget`` bounds the pinned memory (0: no bound). While the state's size is not yet known, the
    copies keep to the budget less a reserve for the background fill, a quarter of the budget and
    at most 1 GiB; if the whole state turns out to fit, the pieces held back are staged at the end.
    Pieces past the budget are filled in the background from:
      * "device": a snapshot on the device (one device-to-device copy each, made here), when the
        free device memory beside a margin holds them, else a RESOURCE_EXHAUSTED error;
      * "block": the caller's own tensors, while :func:`async_save` blocks until they are filled;
      * "auto" (the default): "device" when the snapshots fit, else "block".
    Host pieces are staged at the end, after the device pieces, and past the budget they are always
    "block" (a host snapshot would break the budget). A state with no device piece is not staged at
    all: :meth:`finish` returns None and the caller takes the host path.

    Each device piece's copy stream first waits on an event recorded on the caller's current stream
    just before the copy: what the caller queued before the call, and the contiguous copies the
    adapter queued while planning, are done before a byte is read.
    """

    def __init__(self, pool: PinnedPool, budget: int, over_budget: str) -> None:
        if over_budget not in OVER_BUDGET_MODES:
            raise CheckpointArgumentError(f"over_budget={over_budget!r}: expected one of {OVER_BUDGET_MODES}",
                                          "INVALID_ARGUMENT")
        self.pool = pool
        self.budget = budget
        self.over_budget = over_budget
        self.limit = budget - min(budget // 4, 1 << 30) if budget else 0
        self.entries: list[tuple] = []  # (name, dtype, shape, [[offsets, sizes, bytes or None], ...])
        self.held: list[tuple[int, int, torch.Tensor]] = []  # (tensor, piece, bytes) not staged yet
        self.devices: set[int] = set()
        self.total = 0
        self.staged = 0
        pool.reset()

    def _copy(self, region: torch.Tensor, data: torch.Tensor) -> None:
        if data.device.type != "cuda":
            region.copy_(data)
            return
        index = data.device.index
        stream = STREAMS.get(data.device)
        stream.wait_event(torch.cuda.current_stream(index).record_event())
        with torch.cuda.stream(stream):
            region.copy_(data, non_blocking=True)
        self.devices.add(index)

    def _stage(self, t: int, p: int, data: torch.Tensor, limit: int) -> bool:
        region = self.pool.take(int(data.numel()), limit)
        if region is None:
            return False
        self._copy(region, data)
        self.staged += int(data.numel())
        self.entries[t][3][p][2] = region
        return True

    def add(self, entry: tuple) -> None:
        """One tensor's core entry (name, dtype, shape, pieces[, layout]), in the order of the save's
        entries."""
        name, dtype, shape, pieces = entry[:4]
        t = len(self.entries)
        self.entries.append((name, dtype, shape, [[o, z, None] for o, z, _ in pieces], *entry[4:]))
        for p, (_, _, data) in enumerate(pieces):
            if isinstance(data, np.ndarray):
                data = torch.from_numpy(data)
            nbytes = 0 if data is None else int(data.numel())
            if nbytes == 0:
                self.entries[t][3][p][2] = data
                continue
            self.total += nbytes
            if not is_device_bytes(data) or not self._stage(t, p, data, self.limit):
                self.held.append((t, p, data))

    def abort(self) -> None:
        """After an error: waits for the copies already issued (the pool's next user may reuse it)."""
        for index in self.devices:
            STREAMS.get(torch.device("cuda", index)).synchronize()

    def finish(self) -> Optional[AsyncStaging]:
        """Stages or routes the held pieces and waits for the copies; None when no piece lies on a device."""
        if not self.devices and not any(is_device_bytes(d) for _, _, d in self.held):
            return None
        fits = not self.budget or self.total <= self.budget
        limit = self.budget if fits else self.limit
        overflow = [(t, p, d) for t, p, d in self.held if not self._stage(t, p, d, limit)]
        fill = None
        snapshot_bytes = blocked_bytes = fill_budget = 0
        if overflow:
            fill_budget = max(0, self.budget - self.pool.capacity)
            devices = {d.device.index for _, _, d in overflow if is_device_bytes(d)}
            # What the caller queued until now (the last tensors' contiguous copies included).
            events = {i: torch.cuda.current_stream(i).record_event() for i in devices}
            fill = Fill(events=events)
            device_bytes: dict[int, int] = {}
            for _, _, data in overflow:
                if is_device_bytes(data):
                    device_bytes[data.device.index] = device_bytes.get(data.device.index, 0) + int(data.numel())
            snapshot = self.over_budget != "block" and all(
                need + max(_DEVICE_MARGIN_MIN,
                           int(_DEVICE_MARGIN_FRACTION * torch.cuda.get_device_properties(i).total_memory))
                <= _free_device_bytes(i) for i, need in device_bytes.items())
            if self.over_budget == "device" and device_bytes and not snapshot:
                self.abort()
                raise error_for(
                    "RESOURCE_EXHAUSTED",
                    f"over_budget='device': {sum(device_bytes.values())} bytes past the staging budget of "
                    f"{self.budget} do not fit in the free device memory (free bytes by device: "
                    f"{ {i: _free_device_bytes(i) for i in device_bytes} }); use over_budget='block' or a "
                    f"larger budget")
            for t, p, data in overflow:
                if snapshot and is_device_bytes(data):
                    stream = STREAMS.get(data.device)
                    stream.wait_event(events[data.device.index])
                    with torch.cuda.stream(stream):
                        copy = torch.empty_like(data)
                        copy.copy_(data, non_blocking=True)
                    fill.sources[(t, p)] = copy
                    snapshot_bytes += int(data.numel())
                    self.devices.add(data.device.index)
                else:
                    fill.sources[(t, p)] = data
                    blocked_bytes += int(data.numel())
            fill.pending = sum(int(d.numel()) for d in fill.sources.values())
            # The snapshots' own copies wait on nothing more: the background fill reads them after
            # an event recorded once they are made.
            fill.events = {i: STREAMS.get(torch.device("cuda", i)).record_event() for i in devices}
        for index in self.devices:
            STREAMS.get(torch.device("cuda", index)).synchronize()
        entries = [(n, d, sh, [tuple(piece) for piece in pieces], *rest) for n, d, sh, pieces, *rest in self.entries]
        return AsyncStaging(entries, fill, fill_budget, blocked_bytes > 0, self.staged, snapshot_bytes,
                            blocked_bytes)


def stage_async(entries: list[tuple], pool: PinnedPool, budget: int, over_budget: str) -> Optional[AsyncStaging]:
    """:class:`Stager` over entries already planned (None when no piece lies on a device)."""
    stager = Stager(pool, budget, over_budget)
    try:
        for entry in entries:
            stager.add(entry)
        return stager.finish()
    except BaseException:
        stager.abort()
        raise


# --- load -------------------------------------------------------------------------------------


def region_bytes(nbytes: int) -> int:
    """The bytes a region of ``nbytes`` takes in a pool block (its start is aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def half_size(needs: list[int], half: int) -> int:
    """The block a load half is reserved at for batches needing ``needs`` bytes each: the largest
    of them, and at least ``_MIN_BLOCK`` (within ``half``) so that small loads do not register a
    new block each time they grow a little."""
    largest = max(needs, default=0)
    return max(largest, min(half, _MIN_BLOCK)) if largest else 0


class _Background:
    """A call run on a thread of its own; ``result()`` waits for it and raises its error."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: Optional[BaseException] = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # raised again by result()
                self._error = e

        self._thread = threading.Thread(target=run, name="shardpoint-pin", daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


class LoadBatches:
    """Two pinned halves for the batches of loads to the device, kept from one load to the next:
    batch i is read into half i % 2, while batch i - 1 is still read into the other half or its
    host-to-device copies run on the copy streams (``LOAD_LANES`` core loads in flight). A half is
    reused only once the copies out of it are done (their events, waited for on the host when the
    half comes round again, in this load or the next).

    Each half is one pinned block, reserved at the start of a load for the largest batch it will
    hold (``half_size``), so that the batches of a load, whatever their tensors' sizes, take their
    regions from it without registering more: the pinned memory of loads is two blocks of at most
    max(half the budget, the largest tensor), registered by the first load that needs them. A half
    that must grow is registered on a thread of its own while the batch before it is read (the
    first load of a process: half 1 while batch 0 is read)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.lock = threading.Lock()  # one load at a time, held for the whole load
        self.pools: tuple[PinnedPool, PinnedPool] = (PinnedPool(), PinnedPool())
        self._pending: list[list[torch.cuda.Event]] = [[], []]
        self._devices: set[int] = set()
        self._sizes = [0, 0]
        self._growing: Optional[_Background] = None  # half 1 being registered

    def start(self, devices: set[int], needs: list[int]) -> None:
        """Before a load's first copy: the copy streams of ``devices`` wait for the work the caller
        queued on its current streams (it may still be using the destination tensors). ``needs``:
        the bytes of each batch's regions (``region_bytes`` of each tensor), in batch order."""
        for index in devices:
            STREAMS.get(torch.device("cuda", index)).wait_event(torch.cuda.current_stream(index).record_event())
        self._devices = set(devices)
        half = max(1, self.budget // 2)
        self._sizes = [half_size(needs[0::2], half), half_size(needs[1::2], half)]
        if self._sizes[1] and not self.pools[1].holds(self._sizes[1]):
            self._wait(1)  # copies of the last load out of the blocks about to be replaced
            self._growing = _Background(lambda: self.pools[1].reserve(self._sizes[1]))

    def begin(self, batch: int) -> PinnedPool:
        """The half for ``batch``, free again (its previous copies waited for), reset and reserved."""
        i = batch % 2
        if i == 1 and self._growing is not None:
            growing, self._growing = self._growing, None
            growing.result()
        self._wait(i)
        self.pools[i].reset()
        self.pools[i].reserve(self._sizes[i])
        return self.pools[i]

    def _wait(self, i: int) -> None:
        for event in self._pending[i]:
            event.synchronize()
        self._pending[i] = []

    def to_device(self, batch: int, copies: list[Callable[[], None]]) -> None:
        """Runs a batch's copies to the device (each enters its device's copy stream itself; see
        _torch._host_view) and records an event per device for the half's reuse."""
        for copy in copies:
            copy()
        for index in self._devices:
            self._pending[batch % 2].append(STREAMS.get(torch.device("cuda", index)).record_event())

    def finish(self) -> None:
        """The caller's current streams wait for every copy of the load (on the device: the host
        returns at once). A half still being registered (a load that failed in its first batch)
        is waited for; its error, if any, is dropped: the next load registers it again."""
        if self._growing is not None:
            growing, self._growing = self._growing, None
            try:
                growing.result()
            except Exception:
                pass
        for index in self._devices:
            torch.cuda.current_stream(index).wait_stream(STREAMS.get(torch.device("cuda", index)))

    def drain(self) -> None:
        """Waits on the host for every copy out of the halves."""
        for i in (0, 1):
            self._wait(i)


_LOADS: Optional[LoadBatches] = None


def load_batches(budget: int) -> LoadBatches:
    """The process's pinned halves for loads under ``budget`` bytes (made again when the budget
    changes, once the copies out of the old ones are done)."""
    global _LOADS
    if _LOADS is None or _LOADS.budget != budget:
        if _LOADS is not None:
            _LOADS.drain()
        _LOADS = LoadBatches(budget)
    return _LOADS

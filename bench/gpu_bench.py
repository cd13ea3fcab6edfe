"""shardpoint vs torch.distributed.checkpoint with CUDA state on one GPU, against the raw floors of
the same machine, in one single-process run (no torch.distributed init).

For each size in --gib, a dict of about --tensors tensors on cuda:0 (bf16 and fp32, random data made
on the GPU) is built once, and each step is timed, median of --runs runs after one uncounted
warm-up:
  raw D2H          copy_(non_blocking=True) of every tensor into preallocated pinned host memory on
                   a side stream, then synchronize: the floor for any async save's blocking time
  raw H2D          pinned host memory -> preallocated device tensors, side stream
  raw disk write   the pinned copy written into one file per tensor (--piece-mib writes on
                   --io-threads threads), then fsync: durable
  raw disk read    those files read back cold (evicted from the page cache first) into the pinned copy
  sp.async_save    time until it returns (the caller may then change its tensors: "blocking") and
                   until wait() returns ("durable", from the start); staging budget
                   --staging-budget-gib, then again with a budget of half the state (over budget)
  dcp.async_save   with a DefaultStager (pinned memory, async staging, non-blocking copies), one per
                   size, reused across runs so that its cached pinned storages are warm after the
                   warm-up: blocking until staging completes, durable until the upload completes
  save             sp.save vs dcp.save (fresh directory each run), to durable
  load             sp.load vs dcp.load into preallocated CUDA tensors of the same shapes, cold
                   (checkpoint evicted from the page cache before each load); every sp.load is
                   checked bit-exact against the source and a mismatch stops the bench
The save floor is max(raw D2H, raw disk write), the load floor max(raw disk read, raw H2D), each
from the medians of the same size. Targets (printed as PASS/MISS per size):
  sp.async_save blocking <= 1.1x raw D2H, and >= 3x faster than dcp.async_save blocking
  sp.save and sp.async_save durable: >= 0.9x the save floor's throughput (time <= floor / 0.9)
  sp.load: >= 0.9x the load floor's throughput
plus the sp vs dcp ratios of each step.

The steps run group by group (raw, sp async, sp async over budget, dcp async, sp save/load, dcp
save/load), each group's runs back to back, so that the disk holds at most one copy of the state
(every checkpoint is deleted once timed). The destination tensors live on the GPU only during the
raw and load groups. The durable saves and
loads are warmed up at the first size only (--full-warmup: at every size). --max-seconds cuts the
runs of a size, or skips it, when the estimate from the previous size does not fit.

    python bench/gpu_bench.py                  # 1, 8, 32 GiB, 5/3/1 runs, within --max-seconds 540
    python bench/gpu_bench.py --gib 4 --runs 5 --json /tmp/gpu_bench.json
    python bench/gpu_bench.py --device cpu --gib 0.05 --runs 2 --tensors 8   # checks the script only

--steps picks the groups (raw, async, dcp-async, sp-save, dcp-save; save is both of the last two),
e.g. to time a large size's saves and loads in a run of their own: --gib 32 --steps raw,save.
--compare-one-lane adds to each sp.load the same cold load with its batches one after the other
(the load before two batches were read at once), as a baseline of the same run; the two take
turns going first.

--sweep RATIOS replaces the steps above by the over-budget sweep: at each size, raw D2H and the raw
durable write, then sp.async_save with staging_budget = state / ratio for each ratio, in
over_budget="device" and "block" modes, blocking and durable times against those floors, with
where the bytes went (staged in pinned memory, snapshotted on the device, copied while blocking):

    python bench/gpu_bench.py --gib 8 --runs 3 --sweep 1.33,2,4,8,16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

import shardpoint as sp
from bench_util import evict, fsync_path

GIB = 1 << 30
ALIGN = 4096  # offsets of the tensors in the host copy (pages)
CUDA_HOST_REGISTER_PORTABLE = 1

RAW_D2H, RAW_H2D, RAW_WRITE, RAW_READ = "raw D2H", "raw H2D", "raw disk write", "raw disk read"
SP_BLOCK, SP_DURABLE = "sp.async_save blocking", "sp.async_save durable"
SP_HALF_BLOCK, SP_HALF_DURABLE = ("sp.async_save blocking, 1/2 budget, device snapshot",
                                  "sp.async_save durable, 1/2 budget, device snapshot")
SP_HALF_WAIT, SP_HALF_WAIT_DURABLE = ("sp.async_save blocking, 1/2 budget, over_budget=block",
                                      "sp.async_save durable, 1/2 budget, over_budget=block")
DCP_BLOCK, DCP_DURABLE = "dcp.async_save blocking", "dcp.async_save durable"
SP_SAVE, DCP_SAVE, SP_LOAD, DCP_LOAD = "sp.save", "dcp.save", "sp.load (cold)", "dcp.load (cold)"
SP_LOAD_ONE = "sp.load (cold), one batch at a time"
SAVE_FLOOR, LOAD_FLOOR = "floor: save = max(D2H, write)", "floor: load = max(read, H2D)"
# What each step's ratio column is taken against (raw steps have none).
BASELINE = {SP_BLOCK: RAW_D2H, SP_HALF_BLOCK: RAW_D2H, SP_HALF_WAIT: RAW_D2H, DCP_BLOCK: RAW_D2H,
            SP_DURABLE: SAVE_FLOOR, SP_HALF_DURABLE: SAVE_FLOOR, SP_HALF_WAIT_DURABLE: SAVE_FLOOR,
            DCP_DURABLE: SAVE_FLOOR,
            SP_SAVE: SAVE_FLOOR, DCP_SAVE: SAVE_FLOOR, SP_LOAD: LOAD_FLOOR, SP_LOAD_ONE: LOAD_FLOOR,
            DCP_LOAD: LOAD_FLOOR}
ORDER = [RAW_D2H, RAW_H2D, RAW_WRITE, RAW_READ, SAVE_FLOOR, LOAD_FLOOR, SP_BLOCK, DCP_BLOCK, SP_HALF_BLOCK,
         SP_HALF_WAIT, SP_DURABLE, DCP_DURABLE, SP_HALF_DURABLE, SP_HALF_WAIT_DURABLE, SP_SAVE, DCP_SAVE, SP_LOAD,
         SP_LOAD_ONE, DCP_LOAD]
# The steps whose times add up to one run (blocking times are part of the durable ones).
RUN_COST = [RAW_D2H, RAW_H2D, RAW_WRITE, RAW_READ, SP_DURABLE, SP_HALF_DURABLE, SP_HALF_WAIT_DURABLE, DCP_DURABLE,
            SP_SAVE, SP_LOAD, SP_LOAD_ONE, DCP_SAVE, DCP_LOAD]


class Mismatch(RuntimeError):
    """A loaded tensor differs from the source: the bench stops."""


class _Skipped(Exception):
    """A group left out by --steps."""


STEPS = ("raw", "async", "dcp-async", "sp-save", "dcp-save")
# --steps names that stand for several groups.
STEP_ALIASES = {"save": ("sp-save", "dcp-save")}


class Clock:
    """Elapsed time of the whole run, the --max-seconds budget, and progress lines."""

    def __init__(self, max_seconds: float) -> None:
        self.start = time.perf_counter()
        self.max_seconds = max_seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.max_seconds - self.elapsed() if self.max_seconds > 0 else float("inf")

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)


def make_state(gib: float, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` bf16/fp32 tensors of about ``gib`` GiB in all, random, made on ``device``."""
    per_tensor = int(gib * GIB) // tensors
    g = torch.Generator(device=device).manual_seed(0)
    state = {}
    for i in range(tensors):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cols = 4096 if i % 5 else 4000
        rows = max(1, per_tensor // (cols * torch.empty((), dtype=dtype).element_size()))
        make = torch.rand if i % 3 == 0 else torch.randn
        state[f"model.layers.{i // 4}.w{i % 4}"] = make(rows, cols, dtype=dtype, device=device, generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostCopy:
    """Host memory for a copy of every tensor of a state: one buffer, each tensor at a page-aligned
    offset, pinned on CUDA with cudaHostRegister (the exact size: torch's pinned allocator rounds
    each allocation up to a power of two and keeps it cached after it is freed)."""

    def __init__(self, state: dict[str, torch.Tensor], pin: bool) -> None:
        offsets, total = {}, 0
        for k, t in state.items():
            offsets[k] = total
            total += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
        self._buffer = torch.empty(total + ALIGN, dtype=torch.uint8)
        start = (-self._buffer.data_ptr()) % ALIGN
        flat = self._buffer[start:start + total]
        self._pinned_ptr = None
        if pin:
            rc = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), total, CUDA_HOST_REGISTER_PORTABLE))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of {total} bytes failed with cudaError {rc}")
            self._pinned_ptr = flat.data_ptr()
        self.tensors: dict[str, torch.Tensor] = {}
        self.views: dict[str, memoryview] = {}  # the same bytes, for the file I/O
        for k, t in state.items():
            raw = flat[offsets[k]:offsets[k] + t.numel() * t.element_size()]
            self.tensors[k] = raw.view(t.dtype).view(t.shape)
            self.views[k] = memoryview(raw.numpy())
        # torch's is_pinned() knows only its own allocator's blocks (2.11 says False here); the
        # driver copies registered memory by DMA all the same.

    def close(self) -> None:
        self.tensors.clear()
        for v in self.views.values():
            v.release()
        self.views.clear()
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self._buffer = None


class Copier:
    """Copies tensors pairwise: on CUDA, non-blocking copies on a side stream, then synchronize;
    on the CPU, plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
        if self.stream is None:
            for k, t in src.items():
                dst[k].copy_(t)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for k, t in src.items():
                dst[k].copy_(t, non_blocking=True)
        self.stream.synchronize()


def pieces(views: dict[str, memoryview], fds: dict[str, int], piece: int) -> list[tuple[int, memoryview, int]]:
    """(fd, bytes, offset) of every ``piece``-byte part of every file, round robin over the files."""
    per_file = [[(fds[k], v[o:o + piece], o) for o in range(0, len(v), piece)] for k, v in views.items()]
    longest = max((len(p) for p in per_file), default=0)
    return [p[i] for i in range(longest) for p in per_file if i < len(p)]


def write_piece(job: tuple[int, memoryview, int]) -> None:
    fd, view, offset = job
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read_piece(job: tuple[int, memoryview, int]) -> None:
    fd, view, offset = job
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise RuntimeError(f"short read at offset {offset}")
        view, offset = view[n:], offset + n


def file_names(views: dict[str, memoryview], directory: str) -> dict[str, str]:
    return {k: os.path.join(directory, f"{i:04d}.bin") for i, k in enumerate(views)}


def raw_write(host: HostCopy, directory: str, threads: int, piece: int) -> None:
    """Writes each tensor of ``host`` into its own file under ``directory`` and fsyncs them all."""
    os.makedirs(directory, exist_ok=True)
    names = file_names(host.views, directory)
    fds = {k: os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for k, name in names.items()}
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write_piece, pieces(host.views, fds, piece)))
            list(pool.map(os.fsync, fds.values()))
    finally:
        for fd in fds.values():
            os.close(fd)
    fsync_path(directory)


def raw_read(host: HostCopy, directory: str, threads: int, piece: int) -> None:
    """Reads the files of :func:`raw_write` back into ``host``."""
    names = file_names(host.views, directory)
    fds = {k: os.open(name, os.O_RDONLY) for k, name in names.items()}
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read_piece, pieces(host.views, fds, piece)))
    finally:
        for fd in fds.values():
            os.close(fd)


def release_host_cache() -> None:
    """Hands the pinned blocks that torch's host allocator keeps cached after they are freed back
    to the system, so that one group's pinned staging is not still held through the next."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def make_stager(device: torch.device) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    # Pinned memory and non-blocking copies need an accelerator (--device cpu leaves them out).
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


def rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def poison(dest: dict[str, torch.Tensor]) -> None:
    """Fills the load destinations with NaN, so that a tensor the load leaves alone fails the check."""
    for t in dest.values():
        t.fill_(float("nan"))


def differing(dest: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in state.items() if not torch.equal(dest[k], t)]


class SizeRun:
    """The timings of one size: per step, a list of seconds (one per counted run), and the error
    that stopped a group where one did."""

    def __init__(self, gib: float, state_bytes: int, tensors: int, runs: int) -> None:
        self.gib = gib
        self.bytes = state_bytes
        self.tensors = tensors
        self.runs = runs
        self.times: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}
        self.notes: list[str] = []
        self.staging: dict[str, list[dict]] = {}  # sp.async_save's StagingReport per counted run
        self.elapsed = 0.0
        self.saves_warmed = False  # whether the durable saves and loads had a warm-up

    def median(self, label: str) -> Optional[float]:
        if label == SAVE_FLOOR:
            parts = [self.median(RAW_D2H), self.median(RAW_WRITE)]
        elif label == LOAD_FLOOR:
            parts = [self.median(RAW_READ), self.median(RAW_H2D)]
        else:
            values = self.times.get(label)
            return statistics.median(values) if values else None
        return None if None in parts else max(parts)

    def run_cost(self, labels: list[str] = RUN_COST) -> float:
        """Seconds of one run of every group (or of the steps ``labels``), from the medians."""
        return sum(m for m in (self.median(label) for label in labels) if m is not None)


def repeat(clock: Clock, result: SizeRun, group: str, labels: list[str], runs: int, warm: bool,
           step: Callable[[int], dict[str, float]], what: str = "") -> None:
    """Runs ``step(i)`` for the warm-up (i = -1, when ``warm``) and runs 0..runs-1, keeping the
    seconds it returns for the counted runs. An error ends the group: its steps are reported n/a
    with the message (a Mismatch stops the bench). Past --max-seconds, runs after the first are
    left out."""
    for i in range(-1 if warm else 0, runs):
        if i >= 1 and clock.left() <= 0:
            clock.log(f"  {group}: --max-seconds spent, {runs - i} of {runs} runs left out")
            break
        name = "warm-up" if i < 0 else f"run {i + 1}/{runs}"
        try:
            seconds = step(i)
        except Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the table, the other groups go on
            text = f"{what}{type(e).__name__}: {e}".strip()
            for label in labels:
                result.errors.setdefault(label, text)
            clock.log(f"  {group} {name}: FAILED: {text}")
            return
        if i >= 0:
            for label, s in seconds.items():
                result.times.setdefault(label, []).append(s)
        shown = ", ".join(f"{label} {s:.3f}s ({result.bytes / s / 1e9:.2f} GB/s)" for label, s in seconds.items())
        clock.log(f"  {group} {name}: {shown}")


def timed_async_save(state: dict[str, torch.Tensor], path: str, device: torch.device, budget: int, mode: str,
                     result: SizeRun, labels: list[str], counted: bool) -> dict[str, float]:
    """One sp.async_save of ``state`` into a fresh ``path``: {labels[0]: seconds until it returns,
    labels[1]: seconds until durable}; a counted run also keeps its StagingReport under labels[0]."""
    rm(path)
    sync(device)
    start = time.perf_counter()
    handle = sp.async_save(state, path, overwrite=True, staging_budget=budget, over_budget=mode)
    blocking = time.perf_counter() - start
    handle.wait()
    durable = time.perf_counter() - start
    report = getattr(handle, "staging", None)
    if report is not None and counted:
        result.staging.setdefault(labels[0], []).append(
            {k: getattr(report, k) for k in ("staged_bytes", "snapshot_bytes", "blocked_bytes") if hasattr(report, k)})
    rm(path)
    return {labels[0]: blocking, labels[1]: durable}


def bench_size(args: argparse.Namespace, clock: Clock, root: str, device: torch.device, gib: float, runs: int,
               first: bool) -> SizeRun:
    clock.log(f"{gib:g} GiB: building the state on {device}")
    state = make_state(gib, args.tensors, device)
    sync(device)
    total = nbytes(state)
    result = SizeRun(gib, total, len(state), runs)
    clock.log(f"{gib:g} GiB: {total / GIB:.2f} GiB in {len(state)} tensors, {runs} run{'s' if runs > 1 else ''}")
    copier = Copier(device)
    piece = args.piece_mib << 20
    raw_dir, sp_dir, dcp_dir = (os.path.join(root, name) for name in ("raw", "sp", "dcp"))

    def make_dest() -> dict[str, torch.Tensor]:
        dest = {k: torch.empty_like(t) for k, t in state.items()}
        sync(device)
        return dest

    # Raw copies and disk I/O (the warm-up leaves out the disk).
    if "raw" in args.steps:
        clock.log("  pinning the host copy" if device.type == "cuda" else "  allocating the host copy")
        host = HostCopy(state, pin=device.type == "cuda")
        dest = make_dest()

        def raw(i: int) -> dict[str, float]:
            out = {}
            sync(device)
            start = time.perf_counter()
            copier(host.tensors, state)
            out[RAW_D2H] = time.perf_counter() - start
            start = time.perf_counter()
            copier(dest, host.tensors)
            out[RAW_H2D] = time.perf_counter() - start
            if i < 0:
                return out
            rm(raw_dir)
            start = time.perf_counter()
            raw_write(host, raw_dir, args.io_threads, piece)
            out[RAW_WRITE] = time.perf_counter() - start
            evict(raw_dir)
            start = time.perf_counter()
            raw_read(host, raw_dir, args.io_threads, piece)
            out[RAW_READ] = time.perf_counter() - start
            rm(raw_dir)
            return out

        try:
            repeat(clock, result, "raw", [RAW_D2H, RAW_H2D, RAW_WRITE, RAW_READ], runs, True, raw)
        finally:
            rm(raw_dir)
            host.close()
            del host, dest
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # shardpoint's async save, with the budget asked for, then with half the state's bytes, the
    # half past the budget snapshotted on the device, then copied while the call blocks.
    budget = int(args.staging_budget_gib * GIB)
    half = total // 2
    for labels, group_budget, mode in (([SP_BLOCK, SP_DURABLE], budget, "auto"),
                                       ([SP_HALF_BLOCK, SP_HALF_DURABLE], half, "device"),
                                       ([SP_HALF_WAIT, SP_HALF_WAIT_DURABLE], half, "block")):
        if "async" not in args.steps:
            break

        def sp_async(i: int, labels: list[str] = labels, group_budget: int = group_budget,
                     mode: str = mode) -> dict[str, float]:
            return timed_async_save(state, sp_dir, device, group_budget, mode, result, labels, i >= 0)

        shown = f"{group_budget / GIB:.2f} GiB, over_budget={mode}" if group_budget else "unbounded"
        repeat(clock, result, f"sp.async_save (budget {shown})", labels, runs, True, sp_async)
    rm(sp_dir)

    # DCP's async save with its DefaultStager, one per size.
    stager = None
    try:
        if "dcp-async" not in args.steps:
            raise _Skipped
        stager = make_stager(device)
    except _Skipped:
        pass
    except Exception as e:  # noqa: BLE001
        text = f"DCP DefaultStager/StagingOptions not usable as called here: {type(e).__name__}: {e}"
        result.errors.update({DCP_BLOCK: text, DCP_DURABLE: text})
        clock.log(f"  dcp.async_save: {text}")
    if stager is not None:
        def dcp_async(i: int) -> dict[str, float]:
            # A stager per save: torch 2.11's DefaultStager fails its second save with KeyError
            # (<class 'type'>). Its pinned blocks come from torch's caching host allocator, so the
            # later stagers reuse the first one's memory: DCP's steady state all the same.
            nonlocal stager
            stager.close()
            stager = make_stager(device)
            rm(dcp_dir)
            sync(device)
            start = time.perf_counter()
            response = dcp.async_save(state, checkpoint_id=dcp_dir, async_stager=stager)
            if hasattr(response, "staging_completion") and hasattr(response, "upload_completion"):
                response.staging_completion.result()
                blocking = time.perf_counter() - start
                response.upload_completion.result()
            else:  # a plain Future: staging was over when it was returned
                blocking = time.perf_counter() - start
                response.result()
            durable = time.perf_counter() - start
            rm(dcp_dir)
            return {DCP_BLOCK: blocking, DCP_DURABLE: durable}

        try:
            repeat(clock, result, "dcp.async_save", [DCP_BLOCK, DCP_DURABLE], runs, True, dcp_async,
                   what="dcp.async_save with a DefaultStager: ")
        finally:
            try:
                stager.close()
            except Exception as e:  # noqa: BLE001
                clock.log(f"  dcp stager.close() failed: {type(e).__name__}: {e}")
            stager = None
            rm(dcp_dir)
            gc.collect()

    # Saves to durable and cold loads, each library's checkpoint deleted before the other's.
    warm = result.saves_warmed = first or args.full_warmup
    dest = make_dest()
    try:
        from shardpoint import _cuda

        default_lanes = _cuda.LOAD_LANES

        def sp_cold_load(what: str, lanes: int) -> float:
            """One cold sp.load into ``dest`` with ``lanes`` batches in flight, its bytes checked."""
            previous, _cuda.LOAD_LANES = _cuda.LOAD_LANES, lanes
            try:
                poison(dest)
                evict(sp_dir)
                sync(device)
                start = time.perf_counter()
                sp.load(dest, sp_dir)
                sync(device)
                seconds = time.perf_counter() - start
            finally:
                _cuda.LOAD_LANES = previous
            bad = differing(dest, state)
            if bad:
                raise Mismatch(f"{what} of {gib:g} GiB: {len(bad)} tensors differ from the source, first {bad[:3]}")
            return seconds

        def sp_save_load(i: int) -> dict[str, float]:
            rm(sp_dir)
            sync(device)
            start = time.perf_counter()
            sp.save(state, sp_dir, overwrite=True)
            times = {SP_SAVE: time.perf_counter() - start}
            loads = [(SP_LOAD, "sp.load", default_lanes)]
            if args.compare_one_lane:
                # The same load with the batches one after the other (shardpoint._cuda.LOAD_LANES),
                # first in every other run: the first load after a save tends to be the slower one.
                loads.insert(i % 2, (SP_LOAD_ONE, "sp.load one batch at a time", 1))
            for label, what, lanes in loads:
                times[label] = sp_cold_load(what, lanes)
            rm(sp_dir)
            return {label: times[label] for label in (SP_SAVE, SP_LOAD, SP_LOAD_ONE) if label in times}

        def dcp_save_load(i: int) -> dict[str, float]:
            rm(dcp_dir)
            sync(device)
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=dcp_dir)
            saved = time.perf_counter() - start
            poison(dest)
            evict(dcp_dir)
            sync(device)
            start = time.perf_counter()
            dcp.load(dest, checkpoint_id=dcp_dir)
            sync(device)
            loaded = time.perf_counter() - start
            bad = differing(dest, state)
            if bad and not any("dcp.load" in n for n in result.notes):
                result.notes.append(f"dcp.load: {len(bad)} tensors differ from the source (first {bad[:3]})")
            rm(dcp_dir)
            return {DCP_SAVE: saved, DCP_LOAD: loaded}

        if "sp-save" in args.steps:
            repeat(clock, result, "sp.save + sp.load", [SP_SAVE, SP_LOAD] + ([SP_LOAD_ONE] if args.compare_one_lane
                                                                           else []), runs, warm, sp_save_load)
            rm(sp_dir)
        if "dcp-save" in args.steps:
            repeat(clock, result, "dcp.save + dcp.load", [DCP_SAVE, DCP_LOAD], runs, warm, dcp_save_load,
                   what="dcp.save/dcp.load: ")
    finally:
        rm(sp_dir)
        rm(dcp_dir)
        del dest, state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            release_host_cache()
    return result


def sweep_size(args: argparse.Namespace, clock: Clock, root: str, device: torch.device, gib: float, runs: int,
               ratios: list[float]) -> dict:
    """The over-budget sweep of one size (--sweep): the floors, then each ratio in both modes."""
    clock.log(f"{gib:g} GiB: building the state on {device}")
    state = make_state(gib, args.tensors, device)
    sync(device)
    total = nbytes(state)
    result = SizeRun(gib, total, len(state), runs)
    copier = Copier(device)
    raw_dir, sp_dir = os.path.join(root, "raw"), os.path.join(root, "sp")
    host = HostCopy(state, pin=device.type == "cuda")

    def raw(i: int) -> dict[str, float]:
        sync(device)
        start = time.perf_counter()
        copier(host.tensors, state)
        out = {RAW_D2H: time.perf_counter() - start}
        if i < 0:
            return out
        rm(raw_dir)
        start = time.perf_counter()
        raw_write(host, raw_dir, args.io_threads, args.piece_mib << 20)
        out[RAW_WRITE] = time.perf_counter() - start
        rm(raw_dir)
        return out

    try:
        repeat(clock, result, "raw", [RAW_D2H, RAW_WRITE], runs, True, raw)
    finally:
        rm(raw_dir)
        host.close()
        del host
        gc.collect()
    d2h, floor = result.median(RAW_D2H), result.median(SAVE_FLOOR)
    rows = []
    for ratio in ratios:
        budget = int(total / ratio)
        for mode in ("device", "block"):
            block, durable = f"blocking {ratio:g}x {mode}", f"durable {ratio:g}x {mode}"

            def step(i: int, budget: int = budget, mode: str = mode, block: str = block,
                     durable: str = durable) -> dict[str, float]:
                return timed_async_save(state, sp_dir, device, budget, mode, result, [block, durable], i >= 0)

            repeat(clock, result, f"sp.async_save budget {budget / GIB:.2f} GiB (1/{ratio:g}), {mode}",
                   [block, durable], runs, True, step)
            b, d = result.median(block), result.median(durable)
            last = result.staging.get(block, [{}])[-1]
            rows.append({"ratio": ratio, "budget_bytes": budget, "mode": mode, "blocking_s": b, "durable_s": d,
                         "blocking_over_d2h": b / d2h if b is not None and d2h else None,
                         "durable_over_floor": d / floor if d is not None and floor else None,
                         "staging": last, "error": result.errors.get(block)})
    rm(sp_dir)
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(flush=True)
    print(f"== over-budget sweep, {gib:g} GiB: {total / GIB:.2f} GiB in {result.tensors} "
          f"tensors on {device}; median of up to {runs} runs after a warm-up; raw D2H {fmt_s(d2h)}, "
          f"save floor max(D2H, raw write) {fmt_s(floor)}")
    print(f"{'state/budget':>12}{'budget GiB':>11}  {'mode':7}{'blocking s':>11}{'x D2H':>8}{'durable s':>11}"
          f"{'x floor':>9}  {'staged GiB':>10}{'snapshot GiB':>13}{'blocked GiB':>12}")
    for row in rows:
        st = row["staging"]
        gi = (lambda k: f"{st[k] / GIB:.2f}" if k in st else "n/a")
        print(f"{row['ratio']:>12g}{row['budget_bytes'] / GIB:>11.2f}  {row['mode']:7}{fmt_s(row['blocking_s']):>11}"
              f"{fmt_ratio(row['blocking_over_d2h']):>8}{fmt_s(row['durable_s']):>11}"
              f"{fmt_ratio(row['durable_over_floor']):>9}  {gi('staged_bytes'):>10}{gi('snapshot_bytes'):>13}"
              f"{gi('blocked_bytes'):>12}" + (f"  FAILED: {row['error']}" if row["error"] else ""))
    print(flush=True)
    return {"gib": gib, "bytes": total, "tensors": result.tensors, "runs": runs, "raw_d2h_s": d2h,
            "save_floor_s": floor, "times": result.times, "errors": result.errors, "sweep": rows}


def fmt_s(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def targets(r: SizeRun) -> tuple[list[dict], list[dict]]:
    """The issue's targets (with PASS/MISS) and the sp vs dcp ratios of a size."""
    m = r.median

    def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None or b == 0 else a / b

    checks = [
        ("sp.async_save blocking <= 1.1x raw D2H", div(m(SP_BLOCK), m(RAW_D2H)), lambda v: v <= 1.1),
        ("sp.async_save blocking >= 3x faster than dcp.async_save blocking", div(m(DCP_BLOCK), m(SP_BLOCK)),
         lambda v: v >= 3),
        ("sp.save >= 0.9x the save floor's throughput (time <= max(raw D2H, raw write) / 0.9)",
         div(m(SAVE_FLOOR), m(SP_SAVE)), lambda v: v >= 0.9),
        ("sp.async_save durable >= 0.9x the save floor's throughput", div(m(SAVE_FLOOR), m(SP_DURABLE)),
         lambda v: v >= 0.9),
        ("sp.load >= 0.9x the load floor's throughput (time <= max(raw read, raw H2D) / 0.9)",
         div(m(LOAD_FLOOR), m(SP_LOAD)), lambda v: v >= 0.9),
    ]
    out = [{"target": name, "value": value, "pass": None if value is None else bool(ok(value))}
           for name, value, ok in checks]
    versus = [{"step": name, "dcp_over_sp": div(m(d), m(s))} for name, s, d in (
        ("save", SP_SAVE, DCP_SAVE), ("load", SP_LOAD, DCP_LOAD), ("async blocking", SP_BLOCK, DCP_BLOCK),
        ("async durable", SP_DURABLE, DCP_DURABLE))]
    return out, versus


def table(r: SizeRun) -> list[dict]:
    rows = []
    for label in ORDER:
        med = r.median(label)
        values = r.times.get(label, [])
        base = BASELINE.get(label)
        base_med = r.median(base) if base else None
        rows.append({"step": label, "median_s": med, "gb_per_s": r.bytes / med / 1e9 if med else None,
                     "min_s": min(values) if values else None, "max_s": max(values) if values else None,
                     "runs": len(values), "baseline": base,
                     "ratio": med / base_med if med is not None and base_med else None,
                     "error": r.errors.get(label)})
    return rows


def report(r: SizeRun, args: argparse.Namespace, device: torch.device, device_name: str) -> dict:
    rows = table(r)
    checks, versus = targets(r)
    budget = f"{args.staging_budget_gib:g} GiB" if args.staging_budget_gib else "unbounded (0)"
    print(flush=True)
    print(f"== {r.gib:g} GiB: {r.bytes / GIB:.2f} GiB ({r.bytes} bytes) in {r.tensors} tensors on {device} "
          f"({device_name}); median of up to {r.runs} runs after a warm-up; sp staging budget {budget}, "
          f"over-budget rows {r.bytes // 2 / GIB:.2f} GiB; {r.elapsed:.0f} s")
    if device.type == "cpu":
        print("   (--device cpu: 'D2H'/'H2D' are host copies and the figures only check the script)")
    print(f"{'step':56}{'median s':>10}{'GB/s':>9}{'spread s (min-max)':>22}  {'ratio to':32}{'ratio':>7}")
    for row in rows:
        if row["median_s"] is None:
            print(f"{row['step']:56}{'n/a':>10}")
            continue
        spread = f"{row['min_s']:.3f}-{row['max_s']:.3f}" if row["min_s"] is not None else ""
        n = f" ({row['runs']} runs)" if row["runs"] and row["runs"] != r.runs else ""
        base = f"{row['baseline']}" if row["baseline"] else ""
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        print(f"{row['step']:56}{row['median_s']:10.3f}{row['gb_per_s']:9.2f}{spread:>22}  {base:32}{ratio:>7}{n}")
    print("ratio = the step's time / its baseline's time (lower is better)")
    print("targets:")
    for c in checks:
        mark = "n/a " if c["pass"] is None else ("PASS" if c["pass"] else "MISS")
        print(f"  {mark}  {c['target']}: {fmt_ratio(c['value'])}")
    print("sp vs dcp (dcp time / sp time, > 1: sp faster): "
          + ", ".join(f"{v['step']} {fmt_ratio(v['dcp_over_sp'])}" for v in versus))
    for label, reports in r.staging.items():
        print(f"{label}: staging of the last run {reports[-1]}")
    for note in r.notes:
        print(f"note: {note}")
    for label, text in r.errors.items():
        print(f"n/a {label}: {text}")
    print(flush=True)
    return {"gib": r.gib, "bytes": r.bytes, "tensors": r.tensors, "runs": r.runs, "elapsed_s": r.elapsed,
            "times": r.times, "errors": r.errors, "notes": r.notes, "sp_staging": r.staging, "table": rows,
            "targets": checks, "sp_vs_dcp": versus}


def estimate(prev: SizeRun, state_bytes: int, runs: int, saves_warmed: bool) -> float:
    """Seconds a size of ``state_bytes`` with ``runs`` runs should take, scaled from ``prev``: its
    time outside the counted runs (warm-ups, setup) and the cost of one run, both in proportion to
    the bytes, with the warm-up of the durable saves and loads where the new size has one."""
    scale = state_bytes / prev.bytes
    per_run = prev.run_cost()
    saves = prev.run_cost([SP_SAVE, SP_LOAD, DCP_SAVE, DCP_LOAD])
    fixed = max(0.0, prev.elapsed - prev.runs * per_run - (saves if prev.saves_warmed else 0.0))
    return scale * (fixed + (saves if saves_warmed else 0.0) + runs * per_run)


def parse_list(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def default_runs(gib: float) -> int:
    return 5 if gib <= 2 else 3 if gib <= 16 else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="1,8,32", help="state sizes in GiB, comma-separated (default 1,8,32)")
    parser.add_argument("--runs", default=None,
                        help="counted runs: one number for every size, or one per size of --gib "
                             "(default: 5 up to 2 GiB, 3 up to 16 GiB, 1 above: 5,3,1 for the default sizes)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64)")
    parser.add_argument("--staging-budget-gib", type=float, default=0.0,
                        help="staging_budget of sp.async_save in GiB (default 0: no bound); the over-budget "
                             "rows always use half the state")
    parser.add_argument("--dir", default=None,
                        help="where the files go, in a temporary directory removed at the end "
                             "(default: one under /var/tmp)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the benchmark, on cuda:0) or cpu: CPU tensors through the same steps, "
                             "only to check the script on a machine without a GPU (its figures mean nothing)")
    parser.add_argument("--io-threads", type=int, default=min(16, os.cpu_count() or 4),
                        help="threads of the raw disk write and read (default: the cores, at most 16)")
    parser.add_argument("--piece-mib", type=int, default=32, help="size of each raw write and read (default 32 MiB)")
    parser.add_argument("--full-warmup", action="store_true",
                        help="warm up the durable saves and loads at every size (default: the first size only)")
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="time budget of the whole run (default 540; 0: none): a size whose estimate "
                             "from the previous one does not fit gets fewer runs or is skipped, and runs "
                             "after the first are left out once it is spent")
    parser.add_argument("--compare-one-lane", action="store_true",
                        help="beside each sp.load, the same cold load with its batches one after the other "
                             "(shardpoint._cuda.LOAD_LANES = 1) as a baseline of the same run; the two "
                             "take turns going first")
    parser.add_argument("--json", default=None, help="also write every timing and the tables as JSON here")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="groups to run, comma-separated: raw (copies and disk floors), async "
                             "(sp.async_save), dcp-async, sp-save and dcp-save (save and cold load; save: "
                             "both); default all")
    parser.add_argument("--sweep", default=None, metavar="RATIOS",
                        help="run only the over-budget sweep: state/budget ratios, comma-separated (e.g. "
                             "1.33,2,4,8,16), each in over_budget 'device' and 'block' modes")
    args = parser.parse_args()

    sizes = parse_list(args.gib, float)
    if args.runs is None:
        runs = [default_runs(g) for g in sizes]
    else:
        runs = parse_list(args.runs, int)
        if len(runs) == 1:
            runs = runs * len(sizes)
        if len(runs) != len(sizes) or min(runs) < 1:
            parser.error(f"--runs {args.runs}: give one number >= 1, or one per size of --gib ({len(sizes)})")
    named = set(parse_list(args.steps, str))
    if not named or not named <= set(STEPS) | set(STEP_ALIASES):
        parser.error(f"--steps: expected some of {', '.join(STEPS + tuple(STEP_ALIASES))}")
    args.steps = {step for name in named for step in STEP_ALIASES.get(name, (name,))}
    if args.sweep is not None and (not parse_list(args.sweep, float) or min(parse_list(args.sweep, float)) <= 0):
        parser.error(f"--sweep {args.sweep}: give state/budget ratios > 0, comma-separated")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available; this benchmark needs a GPU (use --device cpu only to check "
              "the script)", file=sys.stderr, flush=True)
        sys.exit(2)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = "host"
    os.environ.setdefault("SHARDPOINT_QUIET", "1")
    # A kill by timeout still removes the files (the temporary directory's cleanup runs on exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    clock = Clock(args.max_seconds)
    parent = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    output: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()}, "sizes_gib": sizes, "runs": runs,
        "torch": torch.__version__, "shardpoint": getattr(sp, "__version__", None), "device": str(device),
        "device_name": device_name, "cpu_count": os.cpu_count(), "results": []}
    failed_sp = False
    with tempfile.TemporaryDirectory(dir=parent, prefix="gpu_bench-") as root:
        clock.log(f"gpu_bench: sizes {sizes} GiB, runs {runs}, {args.tensors} tensors, {device} ({device_name}), "
                  f"torch {torch.__version__}, dir {root}")
        prev: Optional[SizeRun] = None
        for index, (gib, n) in enumerate(zip(sizes, runs)):
            state_bytes = int(gib * GIB)
            free = shutil.disk_usage(root).free
            if free < state_bytes * 1.1 + GIB:
                clock.log(f"{gib:g} GiB: skipped, {free / GIB:.1f} GiB free on the disk of {root} "
                          f"(one copy of the state and a margin are needed)")
                continue
            if prev is not None and args.max_seconds > 0:
                left = clock.left()
                guess = {r: estimate(prev, state_bytes, r, args.full_warmup) for r in range(1, n + 1)}
                fits = [r for r in range(n, 0, -1) if guess[r] <= left]
                if not fits:
                    clock.log(f"{gib:g} GiB: skipped, one run is estimated at {guess[1]:.0f} s and "
                              f"{max(0.0, left):.0f} s of --max-seconds are left")
                    continue
                if fits[0] < n:
                    clock.log(f"{gib:g} GiB: {fits[0]} runs instead of {n} to fit --max-seconds "
                              f"(estimated {guess[fits[0]]:.0f} s of {left:.0f} s left)")
                    n = fits[0]
                else:
                    clock.log(f"{gib:g} GiB: estimated {guess[n]:.0f} s, {left:.0f} s left")
            start = clock.elapsed()
            if args.sweep:
                swept = sweep_size(args, clock, root, device, gib, n, parse_list(args.sweep, float))
                output["results"].append(swept)
                failed_sp = failed_sp or bool(swept["errors"])
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(output, f, indent=1, default=str)
                continue
            result = bench_size(args, clock, root, device, gib, n, first=index == 0)
            result.elapsed = clock.elapsed() - start
            output["results"].append(report(result, args, device, device_name))
            failed_sp = failed_sp or any(label.startswith("sp.") for label in result.errors)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(output, f, indent=1, default=str)
            prev = result
    clock.log("done" + (": some shardpoint steps failed (n/a above)" if failed_sp else ""))
    sys.stdout.flush()
    if failed_sp:
        sys.exit(1)


if __name__ == "__main__":
    main()

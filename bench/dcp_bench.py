"""shardpoint vs torch.distributed.checkpoint on the same state dict, ranks and disk, in one run.

Spawns N gloo ranks (default 4) holding a DTensor state dict of about --gib GiB in --tensors tensors
(sharded on dim 0), and measures, median of --runs runs each:
  save           dcp.save             vs sp.save
  load           dcp.load             vs sp.load         (same layout)
  load resharded dcp.load             vs sp.load         (loaded as Shard(1) on the same ranks)
  async blocking dcp.async_save(...)  vs sp.async_save   vs a plain copy of the same bytes into
                 preallocated host memory (the floor for any async save)
Times are wall clock on rank 0 between barriers; GB/s are global bytes over that time; CPU s is the
CPU time (user and system, all threads) the ranks' processes spent on the step, summed. Targets:
save and load >= 3x faster than DCP; async blocking <= 1.2x the plain copy. Loads are read back
right after the saves, so both libraries read from the page cache when the files fit in it.

With --cold, every checkpoint is dropped from the page cache before each load (rank 0, outside
the timed step), and each run also times a raw read of the shardpoint checkpoint's files on rank 0
(bench_util.raw_read: per file, round robin, and round robin with O_DIRECT, the fastest kept,
each order cold): the disk's floor under any reader. The report then gives each load against
that raw read of the same run (separate processes on one machine; target >= 0.85x), and the
same loads again with a read gate per process (machine_read_gate=False) to show what one gate for
the machine's processes changes, and the resharded load with each process reading every chunk it
needs itself (share_reads=False) instead of the default, where each stored chunk is read once and
handed over through shared memory. Each run rotates the order of the loads and the raw read;
a number of runs that is a multiple of the steps (4, or 8 with --cold) puts every step in every
position equally often. With --cold and 5 runs the default resharded load follows the resharded
dcp.load in four of them, and looked slower than the same load with a gate per process, which
takes the same path (docs/PERFORMANCE.md, "Shared memory's pages").

    python bench/dcp_bench.py --dir /mnt/fast/bench --gib 1 --tensors 300 --runs 3
    python bench/dcp_bench.py --gib 1 --runs 5 --cold --only-loads
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import shardpoint as sp
from bench_util import evict, raw_read


def make_state(mesh, gib: float, tensors: int, placement, fill: bool) -> dict:
    """``tensors`` float32/bfloat16 DTensors of about ``gib`` GiB in all, with a few uneven shapes."""
    from torch.distributed.tensor import distribute_tensor

    per_tensor = int(gib * (1 << 30)) // tensors
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(tensors):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        cols = 1024 if i % 5 else 1000
        rows = max(8, per_tensor // (cols * torch.empty((), dtype=dtype).element_size()))
        full = torch.empty(rows, cols, dtype=dtype)
        if fill:
            full.copy_(torch.rand(rows, cols, generator=g) if i < 4 else torch.full((rows, cols), float(i)))
        else:
            full.zero_()
        state[f"model.layers.{i // 4}.w{i % 4}"] = distribute_tensor(full, mesh, [placement])
    return {"model": state, "step": 1000}


def local_bytes(state: dict) -> int:
    return sum(t._local_tensor.numel() * t._local_tensor.element_size() for t in state["model"].values())


class Timer:
    """Times a collective step on every rank between barriers, and the CPU time the ranks' processes
    spent on it (user and system, every thread, summed over the ranks: what the step costs the
    machine besides its wall time); rank 0 keeps the figures."""

    def __init__(self) -> None:
        self.results: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def run(self, label: str, fn) -> None:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        self.results.setdefault(label, []).append(time.perf_counter() - start)
        spent = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(spent)
        self.cpu.setdefault(label, []).append(float(spent.item()))


def start_rank(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Joins the gloo group; returns the state to save (Shard(0)), an empty one of the same layout
    and an empty one sharded on dim 1 (the resharded load's)."""
    torch.set_num_threads(1)
    os.environ["SHARDPOINT_QUIET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    return (make_state(mesh, args.gib, args.tensors, Shard(0), fill=True),
            make_state(mesh, args.gib, args.tensors, Shard(0), fill=False),
            make_state(mesh, args.gib, args.tensors, Shard(1), fill=False))


def bench(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    state, same, resharded = start_rank(rank, world, rendezvous, args)
    staging = {k: torch.empty_like(v._local_tensor) for k, v in state["model"].items()}
    timer = Timer()
    gates: list[int] = []  # read_gate_ranks of this rank's same-layout loads

    def fresh(name: str, i: int) -> str:
        path = os.path.join(args.dir, f"{name}-{i}")
        if rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
        dist.barrier()
        return path

    def plain_copy() -> None:
        for k, v in state["model"].items():
            staging[k].copy_(v._local_tensor)

    def cold(path: str) -> None:
        """Drops ``path`` from the page cache before a timed load (--cold), on rank 0."""
        if args.cold and rank == 0:
            evict(path)
        dist.barrier()

    for i in range(args.runs):
        dcp_path, sp_path = fresh("dcp", i), fresh("sp", i)
        timer.run("save dcp", lambda: dcp.save(state, checkpoint_id=dcp_path))
        timer.run("save sp", lambda: sp.save(state, sp_path, threads=args.threads))

        def raw() -> None:
            # The fastest raw read of the shardpoint files, timed inside raw_read on rank 0.
            if rank == 0:
                _, seconds = raw_read(sp_path, threads=args.threads or 4, evict_first=True, direct=True)
                timer.results.setdefault("raw read (fastest)", []).append(seconds)
            dist.barrier()

        def sp_load(dest: dict, **options) -> int:
            return sp.load(dest, sp_path, threads=args.threads, **args.load_options, **options).read_gate_ranks

        def check_same(label: str) -> None:
            # Untimed: the same-layout load of shardpoint is bit-exact.
            for k, v in state["model"].items():
                if not torch.equal(same["model"][k]._local_tensor, v._local_tensor):
                    raise RuntimeError(f"rank {rank}: {k} differs after {label}")
                same["model"][k]._local_tensor.zero_()

        steps = [("load dcp", dcp_path, lambda: dcp.load(same, checkpoint_id=dcp_path)),
                 ("load sp", sp_path, lambda: gates.append(sp_load(same))),
                 ("load resharded dcp", dcp_path, lambda: dcp.load(resharded, checkpoint_id=dcp_path)),
                 ("load resharded sp", sp_path, lambda: sp_load(resharded))]
        if args.cold:
            # The raw read, and the loads with a read gate per process instead of one for the
            # machine.
            steps += [("raw read (fastest)", None, raw),
                      ("load sp, own gates", sp_path,
                       lambda: gates.append(sp_load(same, machine_read_gate=False))),
                      ("load resharded sp, own gates", sp_path,
                       lambda: sp_load(resharded, machine_read_gate=False)),
                      ("load resharded sp, own reads", sp_path,
                       lambda: sp_load(resharded, share_reads=False))]
        # What a read takes depends on what ran just before (the disk throttles after long
        # transfers, the page cache holds what the last step left), so each run rotates the order:
        # every step takes every position about equally often.
        shift = i % len(steps)
        for label, path, fn in steps[shift:] + steps[:shift]:
            if path is None:
                fn()
                continue
            cold(path)
            timer.run(label, fn)
            if label.startswith("load sp"):
                check_same(label)
        if args.only_loads:
            dist.barrier()
            if rank == 0:
                for path in (dcp_path, sp_path):
                    shutil.rmtree(path, ignore_errors=True)
            continue
        timer.run("async plain copy", plain_copy)
        adcp_path, asp_path = fresh("adcp", i), fresh("asp", i)
        futures = []
        timer.run("async dcp", lambda: futures.append(dcp.async_save(state, checkpoint_id=adcp_path)))
        futures[-1].result()
        handles = []
        timer.run("async sp", lambda: handles.append(sp.async_save(state, asp_path, threads=args.threads)))
        handles[-1].wait()
        dist.barrier()
        if rank == 0:
            for path in (dcp_path, sp_path, adcp_path, asp_path):
                shutil.rmtree(path, ignore_errors=True)

    total = torch.tensor([local_bytes(state)], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        report(timer.results, timer.cpu, int(total.item()), world, args)
        print(f"read_gate_ranks of rank 0's same-layout loads: {sorted(set(gates))}")
    dist.destroy_process_group()


def report(results: dict[str, list[float]], cpu: dict[str, list[float]], total_bytes: int, world: int,
           args: argparse.Namespace) -> None:
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"state: {total_bytes / (1 << 30):.2f} GiB in {args.tensors} tensors over {world} gloo ranks; "
          f"median of {args.runs} runs; shardpoint threads per rank: {args.threads or 'default'}; "
          f"sp.load direct_io: {args.direct_io}; dir {args.dir}")
    print(f"{'':30}{'seconds':>10}{'GB/s':>9}{'CPU s':>9}  (CPU: seconds of all ranks' processes, median)")
    for label, seconds in median.items():
        spent = f"{statistics.median(cpu[label]):9.2f}" if label in cpu else f"{'-':>9}"
        print(f"{label:30}{seconds:10.3f}{total_bytes / seconds / 1e9:9.2f}{spent}")
    print("ratios:")
    for what in ("save", "load", "load resharded"):
        ratio = median[f"{what} dcp"] / median[f"{what} sp"]
        print(f"  {what:16} sp is {ratio:5.2f}x faster than dcp (target >= 3x): {'met' if ratio >= 3 else 'NOT met'}")
    if "raw read (fastest)" in results:
        raw = results["raw read (fastest)"]
        for what in ("load sp", "load resharded sp", "load sp, own gates",
                     "load resharded sp, own gates",
                     "load dcp"):
            each = [r / t for r, t in zip(raw, results[what])]
            ratio = median["raw read (fastest)"] / median[what]
            print(f"  {what:30} = {ratio:4.2f}x the raw read (cold; each run against its own: median "
                  f"{statistics.median(each):.2f}x, min {min(each):.2f}x, max {max(each):.2f}x)"
                  + (f" (target >= 0.85x): {'met' if ratio >= 0.85 else 'NOT met'}" if "sp" in what else ""))
    if "async sp" not in median:
        return
    ratio = median["async sp"] / median["async plain copy"]
    print(f"  async blocking   sp = {ratio:5.2f}x the plain copy (target <= 1.2x): {'met' if ratio <= 1.2 else 'NOT met'};"
          f" dcp = {median['async dcp'] / median['async plain copy']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    parser.add_argument("--gib", type=float, default=1.0, help="global state size in GiB")
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="shardpoint threads per rank (default: max(4, cores) shared among the ranks on the machine)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the checkpoints from the page cache before each load, and time a raw read of the files")
    parser.add_argument("--only-loads", action="store_true", help="leave out the async saves")
    parser.add_argument("--direct-io", choices=["default", "false", "true", "auto"], default="default",
                        help="sp.load's direct_io: its default, False, True or None (auto: per file, "
                             "direct where the file is not in the page cache)")
    args = parser.parse_args()
    args.load_options = {} if args.direct_io == "default" else {
        "direct_io": {"false": False, "true": True, "auto": None}[args.direct_io]}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.start_processes(bench, args=(args.ranks, rendezvous, args), nprocs=args.ranks, join=True,
                           start_method="spawn")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

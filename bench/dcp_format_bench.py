"""shardpoint vs torch.distributed.checkpoint reading the same PyTorch DCP checkpoint, in one run.

N gloo ranks (default 4) save a DTensor state dict of about --gib GiB in --tensors tensors (Shard(0)
over the ranks) once, with torch's dcp.save. Then, median of --runs runs each:
  load            dcp.load             vs sp.load          (same layout, N ranks)
  load resharded  dcp.load             vs sp.load          (ranks 0 and 1 only: Shard(0) over 2 ranks)
  to torch file   dcp_to_torch_save    vs shardpoint consolidate SRC OUT --format torch --max-shard-size 1000GB
  to native       (the same dcp_to_torch_save figure)  vs shardpoint convert SRC OUT --to native
Loads are wall clock on rank 0 between barriers; the conversions run on rank 0 alone (the CLI as a
child process). GB/s are the checkpoint's tensor bytes over that time. dcp_to_torch_save's output
is fsynced inside its timing, as the shardpoint commands make theirs durable. Before every timed
step the checkpoint's files are fsynced and dropped from the page cache (posix_fadvise DONTNEED),
so both sides read cold where the kernel honours it (--warm leaves the files cached, as
bench/dcp_bench.py does). A raw read of the checkpoint's files (16 MiB preads on 4 threads,
rank 0, each file front to back by one thread and again round robin across the files, the faster
kept) is timed the same way: the floor no reader goes below, so dcp.load's time over it is the
largest ratio any reader can reach on this disk. Each conversion's output is measured and removed
after its step, and the disk flushed (os.sync), so that no step pays for an earlier one's writes.
Target: shardpoint >= 3x faster than torch.

    python bench/dcp_format_bench.py --dir /mnt/fast/bench --gib 1 --tensors 300 --runs 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardpoint as sp
from bench_util import evict, fsync_path, raw_read

CLI = shutil.which("shardpoint") or os.path.join(os.path.dirname(sys.executable), "shardpoint")


def make_state(mesh, gib: float, tensors: int, fill: bool) -> dict:
    """``tensors`` float32/bfloat16 DTensors (Shard(0)) of about ``gib`` GiB in all, a few uneven."""
    from torch.distributed.tensor import Shard, distribute_tensor

    per_tensor = int(gib * (1 << 30)) // tensors
    state = {}
    for i in range(tensors):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        cols = 1024 if i % 5 else 1000
        rows = max(8, per_tensor // (cols * torch.empty((), dtype=dtype).element_size())) + (i % 7)
        full = torch.full((rows, cols), float(i % 251) if fill else 0.0, dtype=dtype)
        state[f"model.layers.{i // 4}.w{i % 4}"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    return {"model": state, "step": 1000}


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


class Timer:
    """Times a step on every rank between barriers, the cache dropped first; rank 0 keeps the figures."""

    def __init__(self, rank: int, source: str, warm: bool = False) -> None:
        self.rank = rank
        self.source = source
        self.results: dict[str, list[float]] = {}
        self.warm = warm
        self.evicted = not warm

    def run(self, label: str, fn, on_ranks=None) -> None:
        if self.rank == 0 and not self.warm:
            self.evicted = evict(self.source) and self.evicted
        dist.barrier()
        start = time.perf_counter()
        if on_ranks is None or self.rank in on_ranks:
            fn()
        dist.barrier()
        self.results.setdefault(label, []).append(time.perf_counter() - start)


    def raw_read(self, label: str) -> None:
        """The raw read of the source on rank 0, timed inside raw_read (the faster of its orders)."""
        dist.barrier()
        if self.rank == 0:
            _, seconds = raw_read(self.source, evict_first=not self.warm)
            self.results.setdefault(label, []).append(seconds)
        dist.barrier()


def run_cli(*args: str) -> None:
    run = subprocess.run([CLI, *args], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"shardpoint {' '.join(args)} failed ({run.returncode}): {run.stderr}")


def torch_file(source: str, out: str) -> None:
    dcp_to_torch_save(source, out)
    fsync_path(out)


def check_equal(rank: int, label: str, got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        if not torch.equal(got["model"][k]._local_tensor, v._local_tensor):
            raise RuntimeError(f"rank {rank}: {k} differs after {label}")


def bench(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ["SHARDPOINT_QUIET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    pair_mesh = DeviceMesh("cpu", torch.arange(2))  # every rank takes part in creating the groups
    pair = dist.new_group([0, 1])
    source = os.path.join(args.dir, "source")
    state = make_state(mesh, args.gib, args.tensors, fill=True)
    dcp.save(state, checkpoint_id=source)
    same = make_state(mesh, args.gib, args.tensors, fill=False)
    want_pair = make_state(pair_mesh, args.gib, args.tensors, fill=True) if rank < 2 else None
    resharded = make_state(pair_mesh, args.gib, args.tensors, fill=False) if rank < 2 else None
    timer = Timer(rank, source, args.warm)
    outputs = {name: os.path.join(args.dir, name) for name in ("torch.pt", "consolidated", "native")}

    def clean() -> None:
        if rank == 0:
            for path in outputs.values():
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)

    sizes = {}

    def settle(name: str) -> None:
        if rank == 0:
            sizes[name] = tree_bytes(outputs[name])
        clean()
        if rank == 0:
            os.sync()
        dist.barrier()

    for _ in range(args.runs):
        timer.raw_read("raw read of the files")
        timer.run("load dcp", lambda: dcp.load(same, checkpoint_id=source))
        timer.run("load sp", lambda: sp.load(same, source, allow_pickle=True, threads=args.threads))
        check_equal(rank, "sp.load", same, state)
        timer.run("load resharded dcp", lambda: dcp.load(resharded, checkpoint_id=source, process_group=pair),
                  on_ranks=(0, 1))
        timer.run("load resharded sp", lambda: sp.load(resharded, source, process_group=pair, allow_pickle=True,
                                                       threads=args.threads), on_ranks=(0, 1))
        if rank < 2:
            check_equal(rank, "resharded sp.load", resharded, want_pair)
        clean()
        # Each output is measured and removed before the next step, and the disk left idle
        # (os.sync), so that no step pays for the previous one's writes or page cache.
        timer.run("to torch file dcp_to_torch_save", lambda: torch_file(source, outputs["torch.pt"]), on_ranks=(0,))
        settle("torch.pt")
        timer.run("to torch file sp consolidate", lambda: run_cli(
            "consolidate", source, outputs["consolidated"], "--format", "torch", "--max-shard-size", "1000GB"),
            on_ranks=(0,))
        settle("consolidated")
        timer.run("to native sp convert", lambda: run_cli("convert", source, outputs["native"], "--to", "native"),
                  on_ranks=(0,))
        settle("native")

    total = torch.tensor([sum(t._local_tensor.numel() * t._local_tensor.element_size()
                              for t in state["model"].values())], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        report(timer.results, int(total.item()), world, args, timer.evicted, sizes)
    dist.destroy_process_group()


def report(results: dict[str, list[float]], total_bytes: int, world: int, args: argparse.Namespace,
           evicted: bool, sizes: dict[str, int]) -> None:
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"checkpoint: {total_bytes / (1 << 30):.2f} GiB in {args.tensors} tensors written by torch dcp.save from "
          f"{world} gloo ranks (DTensor Shard(0)); median of {args.runs} runs; shardpoint threads per rank: "
          f"{args.threads or 'default'}; dir {args.dir}")
    print("page cache: " + ("the checkpoint's files fsynced and dropped (posix_fadvise DONTNEED) before every "
                            "timed step: cold reads" if evicted else
                            "not dropped (--warm, or no posix_fadvise): both sides read from memory"))
    print("outputs: " + ", ".join(f"{name} {size / (1 << 30):.2f} GiB" for name, size in sizes.items()))
    print(f"{'':34}{'seconds':>10}{'GB/s':>9}")
    for label, seconds in median.items():
        print(f"{label:34}{seconds:10.3f}{total_bytes / seconds / 1e9:9.2f}")
    print("ratios (torch's time / shardpoint's time; target >= 3x):")
    pairs = [("load, same layout", "load dcp", "load sp"),
             ("load, resharded 4 -> 2", "load resharded dcp", "load resharded sp"),
             ("one torch file", "to torch file dcp_to_torch_save", "to torch file sp consolidate"),
             ("to native (vs dcp_to_torch_save)", "to torch file dcp_to_torch_save", "to native sp convert")]
    for what, theirs, ours in pairs:
        ratio = median[theirs] / median[ours]
        print(f"  {what:34} sp is {ratio:5.2f}x faster: {'met' if ratio >= 3 else 'NOT met'}")
    raw = median["raw read of the files"]
    print(f"ceiling: reading the files alone (16 MiB preads, 4 threads) takes {raw:.3f} s, so no reader can "
          f"load {median['load dcp'] / raw:.2f}x faster than dcp.load here; sp.load takes "
          f"{median['load sp'] / raw:.2f}x that time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warm", action="store_true",
                        help="leave the checkpoint in the page cache (measures the readers, not the disk)")
    parser.add_argument("--threads", type=int, default=None,
                        help="shardpoint threads per rank (default: max(4, cores) shared among the ranks on the machine)")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (the resharded load uses ranks 0 and 1)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.start_processes(bench, args=(args.ranks, rendezvous, args), nprocs=args.ranks, join=True,
                           start_method="spawn")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

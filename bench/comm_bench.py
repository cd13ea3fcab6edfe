"""The collectives a load or save makes between processes, as shardpoint makes them, against
torch.distributed's object collectives on the same payloads, in one run.

Spawns N gloo ranks (default 4) and times, per payload size, median of --runs runs of --iters
calls each (between barriers, on rank 0):

  all_gather   shardpoint._dist.TorchComm.all_gather  vs dist.all_gather_object
  broadcast    TorchComm.broadcast                    vs dist.broadcast_object_list
  gather       TorchComm.gather                       vs dist.gather_object
  scatter      TorchComm.scatter                      vs dist.scatter_object_list
  agree        TorchComm.any_rank (an all-reduce of one flag; how the ranks agree that none failed
               preparing a save or load) vs dist.all_gather_object of empty messages (how they did)

with the CPU time rank 0's process spent per call (all threads) and the ratio of the two. Each of
TorchComm's collectives is one gloo collective of fixed slots while the payloads fit them (64 KiB
a rank at 16 ranks or fewer, docs/PERFORMANCE.md); torch's take two and a pickle. A load of a
sharded state dict makes about five of these, a save about four, so on a machine whose processes
share few cores their cost is much of what a small checkpoint takes.

    python bench/comm_bench.py
    python bench/comm_bench.py --ranks 8 --sizes 0,12000,200000 --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, iters: int, runs: int) -> tuple[float, float]:
    """Median seconds and CPU seconds per call of ``fn`` over ``runs`` runs of ``iters`` calls."""
    walls, cpus = [], []
    for _ in range(runs):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            fn()
        walls.append((time.perf_counter() - wall) / iters)
        cpus.append((time.process_time() - cpu) / iters)
    return statistics.median(walls), statistics.median(cpus)


def cases(comm, world: int, rank: int, size: int) -> list[tuple[str, object, object]]:
    data = bytes((rank + i) % 251 for i in range(251)) * (size // 251 + 1)
    data = data[:size]
    chunks = [data] * world

    def object_gather() -> None:
        dist.gather_object(data, [None] * world if rank == 0 else None, dst=0)

    def object_scatter() -> None:
        dist.scatter_object_list([None], chunks if rank == 0 else None, src=0)

    agree = [("agree", lambda: comm.any_rank(False), lambda: dist.all_gather_object([None] * world, b""))]
    return (agree if size == 0 else []) + [
        ("all_gather", lambda: comm.all_gather(data), lambda: dist.all_gather_object([None] * world, data)),
        ("broadcast", lambda: comm.broadcast(data if rank == 0 else None, 0),
         lambda: dist.broadcast_object_list([data if rank == 0 else None], src=0)),
        ("gather", lambda: comm.gather(data, 0), object_gather),
        ("scatter", lambda: comm.scatter(chunks if rank == 0 else None, 0), object_scatter),
    ]


def bench(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from shardpoint import _dist

    comm = _dist.TorchComm(dist.group.WORLD)
    rows = []
    for size in args.sizes:
        for name, ours, theirs in cases(comm, world, rank, size):
            ours(), theirs()  # warm up
            sp_wall, sp_cpu = timed(ours, args.iters, args.runs)
            torch_wall, torch_cpu = timed(theirs, args.iters, args.runs)
            rows.append((name, size, sp_wall, sp_cpu, torch_wall, torch_cpu))
    if rank == 0:
        print(f"{world} gloo ranks on {os.cpu_count()} cores; median of {args.runs} runs of {args.iters} calls; "
              "ms per call (CPU: rank 0's process)")
        print(f"{'collective':<11}{'bytes':>9}  {'sp ms':>7} {'CPU':>6}  {'torch ms':>8} {'CPU':>6}  sp faster")
        for name, size, sp_wall, sp_cpu, torch_wall, torch_cpu in rows:
            print(f"{name:<11}{size:>9}  {sp_wall * 1e3:7.2f} {sp_cpu * 1e3:6.2f}  {torch_wall * 1e3:8.2f} "
                  f"{torch_cpu * 1e3:6.2f}  {torch_wall / sp_wall:5.2f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="0,12000,200000",
                        help="payload bytes per rank, comma separated (the load's needs at 300 tensors: ~12 KB)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(bench, args=(args.ranks, os.path.join(tmp, "rendezvous"), args), nprocs=args.ranks,
                           join=True, start_method="spawn")


if __name__ == "__main__":
    main()

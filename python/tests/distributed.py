"""Runs a function on N gloo ranks (separate processes) and returns each rank's result."""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, rendezvous: str, out_dir: str, fn: Callable[..., Any], args: tuple,
           setup: Optional[Callable[[], None]]) -> None:
    torch.set_num_threads(1)
    os.environ["SHARDPOINT_QUIET"] = "1"
    if setup is not None:
        setup()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, preload: Sequence[str] = (),
              setup: Optional[Callable[[], None]] = None) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` processes of one gloo group.

    ``fn`` must be a module-level function; its return values (picklable) come back in rank order.
    A rank that raises makes this raise (torch.multiprocessing.ProcessRaisedException).
    ``preload``: more modules the fork server imports once; ``setup``: a module-level function each
    rank calls before joining the group (a third-party package's CPU patches, say).
    """
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        # A fork server that has imported torch once starts the ranks quickly, without the hazards of
        # forking a process whose thread pools are running.
        mp.set_forkserver_preload(["torch", "torch.distributed", "numpy", "shardpoint", "distributed", *preload])
        mp.start_processes(_entry, args=(world_size, rendezvous, tmp, fn, args, setup), nprocs=world_size,
                           join=True, start_method="forkserver")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results

"""What the Python front costs a load before and around the core, per tensor, in one process.

Builds the DTensor state dict of bench/dcp_bench.py (one gloo rank, a mesh of one) for each
--tensors count and times, median of --runs runs of --iters calls each:

  tied weights     shardpoint._mapped_load.tied_groups (only leaves whose first elements share an
                   address are compared) vs the signature of every leaf grouped (storage, offset,
                   shape, strides, dtype, mesh and placements: how every load looked for them
                   before), on the same leaves; both must find the same groups
  tensor plans     the plan of every leaf as a load makes it (shardpoint._values.tensor_plan)
  sp.load          the whole call, on a checkpoint of the state in the page cache

Every load runs the tied-weight lookup and the plans on every rank; with hundreds to thousands of
tensors they are a visible part of a small load (docs/PERFORMANCE.md).

    python bench/front_bench.py
    python bench/front_bench.py --tensors 300,3000 --runs 5 --iters 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint import _mapped_load, _values

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_bench import make_state  # noqa: E402 - the same state dict as the DCP comparison


def every_signature(flat: dict) -> list[list[str]]:
    """The lookup before: every leaf's signature, grouped (the baseline of the same run)."""
    groups: dict[tuple, list[str]] = {}
    for key, value in flat.items():
        signature = _mapped_load._signature(value)
        if signature is not None:
            groups.setdefault(signature, []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def timed(fn, iters: int, runs: int) -> float:
    """Median seconds per call of ``fn`` over ``runs`` runs of ``iters`` calls."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="300,3000", help="comma-separated tensor counts")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    os.environ["SHARDPOINT_QUIET"] = "1"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard

        mesh = init_device_mesh("cpu", (1,))
        print(f"one process, DTensors on a mesh of one; median of {args.runs} runs of {args.iters} calls")
        for count in (int(n) for n in args.tensors.split(",")):
            state = make_state(mesh, 0.002 * count / 300, count, Shard(0), fill=True)
            flat = dict(state["model"])
            flat["tied.twin"] = next(iter(flat.values()))  # one tie, which both must find
            found, expected = _mapped_load.tied_groups(flat), every_signature(flat)
            if found != expected or len(found) != 1:
                raise SystemExit(f"tied_groups found {found}, the signatures of every leaf {expected}")
            before = timed(lambda: every_signature(flat), args.iters, args.runs)
            after = timed(lambda: _mapped_load.tied_groups(flat), args.iters, args.runs)
            plans = timed(lambda: [_values.tensor_plan(k, v, 0, True) for k, v in state["model"].items()],
                          args.iters, args.runs)
            path = os.path.join(tmp, f"ckpt-{count}")
            sp.save(state, path)
            dest = make_state(mesh, 0.002 * count / 300, count, Shard(0), fill=False)
            load = timed(lambda: sp.load(dest, path), args.iters, args.runs)
            print(f"{count} tensors:")
            print(f"  tied weights, every signature (before) {before * 1e3:9.3f} ms")
            print(f"  tied weights, by address               {after * 1e3:9.3f} ms  = {before / after:.1f}x faster")
            each = plans / count * 1e6
            print(f"  tensor plans                           {plans * 1e3:9.3f} ms  ({each:.1f} us a tensor)")
            print(f"  sp.load (page cache)                   {load * 1e3:9.3f} ms")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

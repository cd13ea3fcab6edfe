"""One rank of a multi-process crash trial, or its checker (scripts/crash_trials.py --mp).

  save DIR --seed S [--async] [--overwrite]   rank RANK of WORLD_SIZE (torch.distributed, gloo,
      MASTER_ADDR/MASTER_PORT from the environment) saves its shards of the state of seed S with
      shardpoint.save or shardpoint.async_save; prints "saving" once the group is up and the state
      is built, and "committed" after. With --async the rank overwrites its tensors as soon as
      async_save returns.
  check DIR=S[,S...] [DIR=S...]               one process loads each DIR with shardpoint.load and
      compares it bit-exactly with the state of the seed it names; prints one line per DIR:
      "<code> <message>", codes as the exit codes of tools/crash_driver.cc: 0 loaded and expected
      ("loaded seed S"), 3 no committed checkpoint, 4 refused with another error, 5 loaded but
      WRONG. Exits 0.

The state (about 9 MB): float32 rows split over the ranks, bfloat16 columns split, an int64
tensor every rank holds whole, and plain objects naming the seed.
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import shardpoint as sp


def full_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1531, 1024, generator=g),
            "h": torch.randn(1024, 777, generator=g).to(torch.bfloat16),
            "steps": torch.randint(-2 ** 62, 2 ** 62, (4093,), generator=g, dtype=torch.int64),
            "seed": seed, "config": {"seed": seed, "lr": 0.001, "name": f"trial-{seed}"}}


def rank_state(seed, rank, world):
    full = full_state(seed)
    rows = [len(part) for part in torch.tensor_split(torch.arange(1531), world)]
    cols = [len(part) for part in torch.tensor_split(torch.arange(777), world)]
    r0, c0 = sum(rows[:rank]), sum(cols[:rank])
    full["w"] = sp.ShardedTensor(full["w"][r0:r0 + rows[rank]].clone(), (1531, 1024), (r0, 0))
    full["h"] = sp.ShardedTensor(full["h"][:, c0:c0 + cols[rank]].contiguous(), (1024, 777), (0, c0))
    return full


def save(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    state = rank_state(args.seed, rank, world)
    dist.barrier()
    print("saving", flush=True)
    if args.async_:
        handle = sp.async_save(state, args.items[0], overwrite=args.overwrite)
        for value in (state["w"].data, state["h"].data, state["steps"]):
            value.fill_(7)
        handle.wait()
    else:
        sp.save(state, args.items[0], overwrite=args.overwrite)
    print("committed", flush=True)
    dist.destroy_process_group()
    return 0


def check_one(path, expect):
    template = {"w": torch.zeros(1531, 1024), "h": torch.zeros(1024, 777, dtype=torch.bfloat16),
                "steps": torch.zeros(4093, dtype=torch.int64), "seed": None,
                # a dict of objects is stored as one object per key (config.seed, ...)
                "config": {"seed": None, "lr": None, "name": None}}
    try:
        sp.load(template, path)
    except sp.CheckpointNotFoundError as e:
        return 3, f"no checkpoint: {e}"
    except sp.CheckpointError as e:
        return 4, f"refused: {type(e).__name__}: {e}"
    seed = template["seed"]
    if seed not in expect:
        return 5, f"WRONG: {path} holds the state of seed {seed!r}, which is not an expected one"
    want = full_state(seed)
    for key in ("w", "h", "steps"):
        if not torch.equal(template[key].view(torch.uint8), want[key].contiguous().view(torch.uint8)):
            return 5, f"WRONG: {path}: tensor {key} differs from the state of seed {seed}"
    if template["config"] != want["config"]:
        return 5, f"WRONG: {path}: object config is {template['config']!r}, expected {want['config']!r}"
    return 0, f"loaded seed {seed}"


def check(args):
    for item in args.items:
        path, _, seeds = item.rpartition("=")
        code, message = check_one(path, {int(s) for s in seeds.split(",")})
        print(code, message.replace("\n", " "), flush=True)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "check"])
    p.add_argument("items", nargs="+", help="save: DIR; check: DIR=S[,S...] ...")
    p.add_argument("--seed", type=int)
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0, help="gloo collective timeout (s)")
    args = p.parse_args()
    return save(args) if args.mode == "save" else check(args)


if __name__ == "__main__":
    sys.exit(main())

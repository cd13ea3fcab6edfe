"""async_save over gloo: values are captured at the call, saves queue, failures reach every rank."""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from distributed import run_ranks


def async_worker(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    weight = distribute_tensor(full.clone(), mesh, [Shard(0)])
    plain = torch.ones(1000)
    state = {"w": weight, "plain": plain, "step": 1}
    first = sp.async_save(state, os.path.join(root, "one"))
    weight._local_tensor.add_(1000.0)           # training continues right away
    plain.mul_(-1)
    state["step"] = 2
    second = sp.async_save(state, os.path.join(root, "two"))   # waits for the first internally
    weight._local_tensor.zero_()
    plain.zero_()
    second.wait()
    first.wait()
    assert first.done() and second.done()
    torch.distributed.barrier()
    one, two = sp.load_full(os.path.join(root, "one")), sp.load_full(os.path.join(root, "two"))
    ok = (torch.equal(one["w"], full) and torch.equal(one["plain"], torch.ones(1000)) and one["step"] == 1
          and torch.equal(two["w"], full + 1000) and torch.equal(two["plain"], -torch.ones(1000)) and two["step"] == 2)
    # A failing async save: the path holds a committed checkpoint and overwrite is not given.
    error = None
    try:
        sp.async_save(state, os.path.join(root, "one")).wait()
    except sp.CheckpointError as e:
        error = (type(e).__name__, e.code)
    after = sp.load_full(os.path.join(root, "one"))
    return ok, error, torch.equal(after["w"], full)


def test_async_save_captures_values_at_the_call(tmp_path):
    results = run_ranks(2, async_worker, str(tmp_path))
    assert results == [(True, ("CheckpointExistsError", "ALREADY_EXISTS"), True)] * 2

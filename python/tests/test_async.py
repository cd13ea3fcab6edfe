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


class NotPlainData:
    """An object that is not plain data: saving it needs allow_pickle."""


def failing_prep_worker(rank, world, root):
    path = os.path.join(root, "failed")
    state = {"w": torch.full((16,), float(rank)), "cfg": NotPlainData() if rank == 1 else {"lr": 0.1}}
    raised_at_call = raised_at_wait = None
    try:
        handle = sp.async_save(state, path)   # no collective call: rank 0 returns at once
    except sp.CheckpointError as e:
        raised_at_call = (type(e).__name__, e.message)
    else:
        try:
            handle.wait()
        except sp.CheckpointError as e:
            raised_at_wait = (type(e).__name__, e.message)
    torch.distributed.barrier()
    # The failure is not raised again by the next save on the failing rank.
    sp.async_save({"w": torch.full((16,), float(rank))}, os.path.join(root, "next")).wait()
    return raised_at_call, raised_at_wait, os.path.exists(os.path.join(path, "shardpoint.metadata"))


def test_a_rank_failing_before_its_copy_fails_the_other_ranks_wait(tmp_path):
    (call0, wait0, committed0), (call1, wait1, committed1) = run_ranks(2, failing_prep_worker, str(tmp_path))
    assert call0 is None and call1 is not None and wait1 is None
    assert call1[0] == "CheckpointArgumentError" and "allow_pickle" in call1[1]
    assert wait0[0] == "CheckpointArgumentError" and wait0[1].startswith("rank 1: ") and "allow_pickle" in wait0[1]
    assert not committed0 and not committed1
    assert sp.load_full(str(tmp_path / "next"))["w"].shape == (16,)

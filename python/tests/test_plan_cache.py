"""Cached save plans through the Python front: repeated saves of one layout skip planning, any
change plans afresh, and every checkpoint loads bit-exactly (shardpoint/engine/save_plan_cache.h)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint import _dist
from distributed import run_ranks


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).to(torch.bfloat16),
            "step": step, "opt": {"lr": 0.1 * step}}


def test_an_explicit_cache_is_hit_by_unchanged_layouts_and_missed_by_any_change(tmp_path):
    cache = sp.SavePlanCache()
    sp.save(_state(1), tmp_path / "a", plan_cache=cache)
    assert (cache.hits, cache.misses) == (0, 1)
    sp.save(_state(2), tmp_path / "b", plan_cache=cache)
    assert (cache.hits, cache.misses) == (1, 1)
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16), "step": 0, "opt": {"lr": 0.0}}
    sp.load(out, tmp_path / "b")
    want = _state(2)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    assert out["step"] == 2 and out["opt"] == {"lr": 0.2}

    changed = _state(3)
    changed["b"] = changed["b"].float()  # the same shape, another dtype
    sp.save(changed, tmp_path / "c", plan_cache=cache)
    assert (cache.hits, cache.misses) == (1, 2)
    assert sp.inspect(tmp_path / "c").tensors["b"].dtype == "float32"
    cache.clear()
    sp.save(changed, tmp_path / "d", plan_cache=cache)
    assert (cache.hits, cache.misses) == (1, 3)
    sp.save(changed, tmp_path / "d", plan_cache=cache, overwrite=True)
    assert (cache.hits, cache.misses) == (2, 3)
    assert sp.verify(tmp_path / "d").ok


def test_a_cache_keeps_a_large_plan_as_its_committed_file_between_saves(tmp_path):
    # keep_file_above_bytes=0 keeps even this small plan as the metadata file last committed from
    # it; the default keeps a plan this small whole (its chunks, 128 bytes each).
    small = sp.SavePlanCache()
    as_file = sp.SavePlanCache(keep_file_above_bytes=0)
    for step in (1, 2, 3):
        for name, cache in (("whole", small), ("file", as_file)):
            sp.save(_state(step), tmp_path / f"{name}{step}", plan_cache=cache)
        committed = (tmp_path / f"file{step}" / "shardpoint.metadata").stat().st_size
        assert as_file.plan_bytes == committed
        assert 0 < small.plan_bytes <= 2 * 128  # one chunk of each tensor, 128 bytes or less
    assert (as_file.hits, as_file.misses) == (2, 1)
    out = {
        "w": torch.zeros(16, 8),
        "b": torch.zeros(8, dtype=torch.bfloat16),
        "step": 0,
        "opt": {"lr": 0.0},
    }
    sp.load(out, tmp_path / "file3")
    want = _state(3)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    assert out["step"] == 3 and sp.verify(tmp_path / "file3").ok


def test_plan_cache_false_never_caches_and_a_wrong_value_is_refused(tmp_path):
    sp.save(_state(1), tmp_path / "a", plan_cache=False)
    try:
        sp.save(_state(1), tmp_path / "b", plan_cache="yes")
    except sp.CheckpointArgumentError as e:
        assert "plan_cache='yes': expected True, False or a SavePlanCache" in str(e)
    else:
        raise AssertionError("plan_cache='yes' was accepted")


def test_the_default_cache_is_one_per_process_and_purpose(tmp_path):
    sp.save(_state(1), tmp_path / "a")
    cache = _dist.plan_cache(None, True, "sync")
    before = (cache.hits, cache.misses)
    sp.save(_state(2), tmp_path / "b")
    assert (cache.hits, cache.misses) == (before[0] + 1, before[1])
    assert _dist.plan_cache(None, True, "async") is not cache
    handle = sp.async_save(_state(3), tmp_path / "c")
    handle.wait()
    handle = sp.async_save(_state(4), tmp_path / "d")
    handle.wait()
    assert _dist.plan_cache(None, True, "async").hits >= 1


def _ranks_save_twice_then_change(rank: int, world: int, root: str) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    seen = []
    for step, placement in [(1, Shard(0)), (2, Shard(0)), (3, Shard(1)), (4, Shard(1))]:
        full = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6) * step
        state = {"w": distribute_tensor(full, mesh, [placement]),
                 "n": distribute_tensor(torch.full((6,), float(step)), mesh, [Replicate()]), "step": step}
        sp.save(state, f"{root}/s{step}")
        cache = _dist.plan_cache(_dist.resolve(None), True, "sync")
        seen.append((cache.hits, cache.misses))
        dist.barrier()
    # Each checkpoint holds its own step's values, loaded whole on every rank.
    for step in range(1, 5):
        out = {"w": torch.zeros(12, 6), "n": torch.zeros(6), "step": 0}
        sp.load(out, f"{root}/s{step}")
        assert torch.equal(out["w"], torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6) * step)
        assert torch.equal(out["n"], torch.full((6,), float(step))) and out["step"] == step
    return seen


def test_gloo_ranks_take_the_cached_plan_until_the_layout_changes(tmp_path):
    seen = run_ranks(2, _ranks_save_twice_then_change, str(tmp_path))
    # Saves 1 and 3 plan (the first, then a new split); 2 and 4 take the cached plan.
    assert seen == [[(0, 1), (1, 1), (1, 2), (2, 2)]] * 2

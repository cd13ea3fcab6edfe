"""CheckpointManager: retention (keep_last / keep_every), safety (never the newest committed or an
uncommitted checkpoint), load_latest after a restart, agreement across 2 gloo ranks; and the
separation_hint save option."""

import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from distributed import run_ranks


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step},
            "optim": {"m": torch.full((5,), float(step))}, "step": step}


def _steps(manager: sp.CheckpointManager) -> list[int]:
    return [e.step for e in manager.list()]


def test_fresh_directory_has_nothing_to_load(tmp_path):
    manager = sp.CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.list() == []
    assert manager.latest_step() is None
    assert manager.load_latest(_state(0)) is None


def test_keep_last_and_keep_every(tmp_path):
    manager = sp.CheckpointManager(tmp_path, keep_last=2, keep_every=300)
    for step in range(100, 800, 100):
        path = manager.save(step, _state(step))
        assert path == os.path.join(str(tmp_path), f"step_{step:09d}")
    # 700 and 600 are the last two; 300 and 600 are multiples of 300.
    assert _steps(manager) == [300, 600, 700]
    assert manager.latest_step() == 700
    entries = manager.list()
    assert [e.latest for e in entries] == [False, False, True]
    assert all(e.committed and e.format == "native" and e.nbytes > 0 for e in entries)
    assert sorted(os.listdir(tmp_path)) == [f"step_{s:09d}" for s in (300, 600, 700)]


def test_never_deletes_an_uncommitted_checkpoint(tmp_path):
    manager = sp.CheckpointManager(tmp_path, keep_last=1)
    # A save in progress (or interrupted) at an older and at a newer step: data, no metadata.
    for name in ("step_000000050", "step_000009999"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "d-x-r00000-f000.safetensors.tmp").write_bytes(b"partial")
    manager.save(100, _state(100))
    manager.save(200, _state(200))
    entries = {e.step: e for e in manager.list()}
    assert sorted(entries) == [50, 200, 9999]
    assert not entries[50].committed and not entries[9999].committed
    # The newest *committed* one is the latest, even though an uncommitted one has a higher step.
    assert manager.latest_step() == 200
    assert entries[200].latest


def test_load_latest_after_a_restart(tmp_path):
    first = sp.CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        first.save(step, _state(step))
    # A new process: a fresh manager over the same directory, and a state to fill in.
    restarted = sp.CheckpointManager(tmp_path, keep_last=3)
    target = {"model": {"w": torch.zeros(3, 4)}, "optim": {"m": torch.zeros(5)}, "step": None}
    step, result = restarted.load_latest(target)
    assert step == 30
    assert result.missing_keys == []
    assert torch.equal(target["model"]["w"], _state(30)["model"]["w"])
    assert torch.equal(target["optim"]["m"], torch.full((5,), 30.0))
    assert target["step"] == 30


def test_load_latest_skips_a_damaged_newest_metadata(tmp_path):
    manager = sp.CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    (tmp_path / "step_000000002" / "shardpoint.metadata").write_bytes(b"torn")
    assert manager.latest_step() == 1
    target = _state(0)
    assert manager.load_latest(target)[0] == 1
    assert torch.equal(target["model"]["w"], _state(1)["model"]["w"])
    # gc after the next save keeps the damaged one: it is not committed.
    manager.save(3, _state(3))
    assert _steps(manager) == [1, 2, 3]


def test_save_kwargs_pass_through_and_failed_saves_do_not_collect(tmp_path):
    manager = sp.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, _state(1))
    with pytest.raises(sp.CheckpointExistsError):
        manager.save(1, _state(1))
    manager.save(1, _state(5), overwrite=True)
    target = _state(0)
    assert manager.load_latest(target)[0] == 1
    assert target["step"] == 5
    with pytest.raises(sp.CheckpointArgumentError):
        manager.save(2, {"bad": object()})  # not plain data, no allow_pickle
    assert _steps(manager) == [1]


def test_bad_arguments():
    with pytest.raises(sp.CheckpointArgumentError, match="keep_last must be an integer >= 1, got 0"):
        sp.CheckpointManager("x", keep_last=0)
    with pytest.raises(sp.CheckpointArgumentError, match="keep_every"):
        sp.CheckpointManager("x", keep_last=1, keep_every=-5)
    with pytest.raises(sp.CheckpointArgumentError, match="step must be an integer >= 0"):
        sp.CheckpointManager("x").save(-1, {})


def _two_ranks(rank: int, world_size: int, directory: str) -> dict:
    manager = sp.CheckpointManager(directory, keep_last=2, keep_every=20)
    seen = []
    for step in (10, 20, 30, 40, 50):
        # Each rank holds half of the rows; the values depend on the step.
        w = torch.arange(8, dtype=torch.float32).reshape(4, 2)[2 * rank:2 * rank + 2] + step
        manager.save(step, {"w": sp.ShardedTensor(w, (4, 2), (2 * rank, 0)), "step": step})
        seen.append(_steps(manager))
    target = {"w": sp.ShardedTensor(torch.zeros(2, 2), (4, 2), (2 * rank, 0)), "step": None}
    restarted = sp.CheckpointManager(directory, keep_last=2, keep_every=20)
    step, _ = restarted.load_latest(target)
    return {"seen": seen, "latest": restarted.latest_step(), "loaded_step": step,
            "w": target["w"].data.tolist(),
            "step": target["step"], "files": sorted(os.listdir(directory))}


def test_two_ranks_agree_and_one_deletes(tmp_path):
    results = run_ranks(2, _two_ranks, str(tmp_path))
    assert results[0]["seen"] == results[1]["seen"] == [
        [10], [10, 20], [20, 30], [20, 30, 40], [20, 40, 50]]
    for rank, r in enumerate(results):
        assert r["latest"] == r["loaded_step"] == 50
        assert r["step"] == 50
        assert r["files"] == ["step_000000020", "step_000000040", "step_000000050"]
        expected = torch.arange(8, dtype=torch.float32).reshape(4, 2)[2 * rank:2 * rank + 2] + 50
        assert r["w"] == expected.tolist()
    # Every rank resumed from the same checkpoint, each its own rows.
    full = sp.load_full(str(tmp_path / "step_000000050"))
    assert torch.equal(torch.as_tensor(full["w"]), torch.arange(8, dtype=torch.float32).reshape(4, 2) + 50)


def test_separation_hint_round_trip_and_file_split(tmp_path):
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)},
             "optim": {"m": torch.randn(6, 4), "v": torch.randn(6, 4)}, "step": 3}
    sp.save(state, tmp_path / "sep", separation_hint="optim.")
    info = sp.inspect(tmp_path / "sep")
    assert len(info.files) == 2
    target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)},
              "optim": {"m": torch.zeros(6, 4), "v": torch.zeros(6, 4)}, "step": None}
    sp.load(target, tmp_path / "sep")
    for group in ("model", "optim"):
        for key, value in state[group].items():
            assert torch.equal(target[group][key], value)
    assert target["step"] == 3
    # Without the hint one rank writes one file; a list of prefixes gives one file per group.
    sp.save(state, tmp_path / "plain")
    assert len(sp.inspect(tmp_path / "plain").files) == 1
    sp.save(state, tmp_path / "two", separation_hint=["optim.m", "optim.v"])
    assert len(sp.inspect(tmp_path / "two").files) == 3

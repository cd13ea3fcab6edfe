"""CUDA state (docs/GPU.md): saves that copy device pieces to the host as they are written, async
saves staged in reused pinned memory (over the budget through device snapshots or a blocking fill),
loads to the device in pinned batches, DTensors on a CUDA mesh. Skipped without a CUDA device."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

import shardpoint as sp
from shardpoint import _api

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(seed: int = 0, device: str = "cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "w": torch.randn(512, 256, device=device, generator=g),
        "bf": torch.randn(300, 130, device=device, generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 96, device=device, generator=g).t(),  # not contiguous
        "i": torch.randint(-2**40, 2**40, (1000,), device=device, generator=g),
        "scalar": torch.tensor(3.5, device=device),
        "empty": torch.empty(0, 7, device=device),
        "nested": {"h": torch.rand(33, 17, device=device, generator=g).to(torch.float16), "step": 7},
    }


def _like(state: dict, fill: float = float("nan")) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _like(v, fill)
        elif isinstance(v, torch.Tensor):
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            t.fill_(fill if v.is_floating_point() else -1)
            out[k] = t
        else:
            out[k] = None
    return out


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert b[k].device == a[k].device and b[k].dtype == a[k].dtype, k
            assert torch.equal(a[k].cpu(), b[k].cpu()), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("fmt", ["native", "torch-dcp"])
def test_save_and_load_of_cuda_state_are_bit_exact(tmp_path, fmt):
    source = _state()
    for _ in range(2):
        sp.save(source, tmp_path / "c", overwrite=True, format=fmt)
    target = _like(source)
    sp.load(target, tmp_path / "c")
    _assert_equal(source, target)
    full = sp.load_full(tmp_path / "c")  # what the files hold, read back on the host
    assert torch.equal(full["w"], source["w"].cpu()) and torch.equal(full["t"], source["t"].cpu())


def test_a_save_copies_through_a_small_host_budget(tmp_path):
    source = _state(1)
    sp.save(source, tmp_path / "c", staging_budget=4096)  # one piece in flight at a time
    target = _like(source)
    sp.load(target, tmp_path / "c", staging_budget=8192)  # many batches, one tensor each
    _assert_equal(source, target)


def test_a_save_sees_the_work_queued_before_it_on_the_current_stream(tmp_path):
    x = torch.zeros(4096, 1024, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the next kernel runs well after the call is made
        x.add_(1)
        sp.save({"x": x}, tmp_path / "c")
    assert torch.equal(sp.load_full(tmp_path / "c")["x"], torch.ones(4096, 1024))


def test_the_caller_stream_waits_for_a_load(tmp_path):
    from shardpoint import _cuda

    sp.save({"x": torch.full((2048, 1024), 3.0, device="cuda")}, tmp_path / "c")
    target = {"x": torch.zeros(2048, 1024, device="cuda")}
    # The load's copies to the device queue behind this on its copy stream, so they land well
    # after the call returns: only the current stream's wait on the copy stream orders them.
    with torch.cuda.stream(_cuda.STREAMS.get(torch.device("cuda", 0))):
        torch.cuda._sleep(100_000_000)
    sp.load(target, tmp_path / "c")
    y = target["x"] * 2  # on the current stream, with no synchronize in between
    assert torch.equal(y.cpu(), torch.full((2048, 1024), 6.0))


def test_dcp_load_through_the_storage_reader_goes_to_the_device_in_pinned_batches(tmp_path):
    import torch.distributed.checkpoint as dcp

    import shardpoint.dcp
    from shardpoint import _cuda

    source = {k: v for k, v in _state(8).items() if isinstance(v, torch.Tensor)}
    source["host"] = torch.arange(12.0)
    dcp.save(source, storage_writer=shardpoint.dcp.StorageWriter(tmp_path / "c"))
    target = _like(source)
    target["host"] = torch.zeros(12)
    # As for sp.load: the copies queue behind this, and the caller's stream must wait for them.
    with torch.cuda.stream(_cuda.STREAMS.get(torch.device("cuda", 0))):
        torch.cuda._sleep(100_000_000)
    # 256 KiB: "w" (512 KiB) alone, the others in batches of at most 128 KiB.
    dcp.load(target, storage_reader=shardpoint.dcp.StorageReader(tmp_path / "c", staging_budget=256 << 10))
    y = target["w"] * 2
    assert torch.equal(y.cpu(), source["w"].cpu() * 2)
    _assert_equal(source, target)
    assert target["t"].stride() == source["t"].stride()
    assert _cuda._LOADS is not None and _cuda._LOADS.budget == 256 << 10
    assert all(p.capacity > 0 for p in _cuda._LOADS.pools)  # both pinned halves took batches


@pytest.mark.parametrize("lanes", [1, 2])
def test_loads_in_batches_keep_tied_weights_and_report_keys(tmp_path, monkeypatch, lanes):
    from shardpoint import _cuda

    monkeypatch.setattr(_cuda, "LOAD_LANES", lanes)
    g = torch.Generator(device="cuda").manual_seed(3)
    source = {f"l{i}": torch.randn(128, 64, device="cuda", generator=g) for i in range(12)}
    source["host"] = torch.arange(10.0)
    sp.save(source, tmp_path / "c")
    emb = torch.zeros(128, 64, device="cuda")
    target = {f"l{i}": torch.zeros(128, 64, device="cuda") for i in range(12)}
    target["l0"] = emb
    target["tied"] = emb  # the same tensor as l0: filled by l0's load, not missing
    target["host"] = torch.zeros(10)
    target["absent"] = torch.zeros(3, device="cuda")
    del target["l5"]
    result = sp.load(target, tmp_path / "c", strict=False, staging_budget=3 * 128 * 64 * 4)
    assert result.missing_keys == ["absent"]
    assert result.unexpected_keys == ["l5"]
    for i in range(12):
        if i != 5:
            assert torch.equal(target[f"l{i}"], source[f"l{i}"]), i
    assert target["tied"] is emb and torch.equal(emb, source["l0"])
    assert torch.equal(target["host"], source["host"])
    with pytest.raises(sp.CheckpointNotFoundError, match="absent"):
        sp.load(target, tmp_path / "c", staging_budget=3 * 128 * 64 * 4)


def test_mixed_host_and_device_state_round_trips(tmp_path):
    source = {"gpu": torch.randn(100, 10, device="cuda"), "cpu": torch.randn(50, 3), "obj": {"lr": 0.1}}
    sp.save(source, tmp_path / "c")
    h = sp.async_save(source, tmp_path / "d")
    h.wait()
    for name in ("c", "d"):
        target = {"gpu": torch.zeros(100, 10, device="cuda"), "cpu": torch.zeros(50, 3), "obj": {"lr": None}}
        sp.load(target, tmp_path / name)
        _assert_equal(source, target)


@pytest.mark.parametrize("over_budget,budget", [("auto", 0), ("auto", 200_000), ("device", 200_000),
                                                ("block", 200_000)])
def test_async_save_holds_the_values_of_the_call_while_training_changes_them(tmp_path, over_budget, budget):
    params = _state(5)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in params.items() if k != "nested"}
    expected["nested"] = {"h": params["nested"]["h"].clone(), "step": 7}
    # 200 kB is below the state (about 1 MB): some of it goes past the budget.
    h = sp.async_save(params, tmp_path / "c", staging_budget=budget, over_budget=over_budget)
    for _ in range(3):  # training steps change the parameters at once
        for v in (params["w"], params["bf"], params["t"], params["nested"]["h"]):
            v.mul_(-3).add_(1)
    h.wait()
    if budget:
        assert h.staging.snapshot_bytes + h.staging.blocked_bytes > 0
        if over_budget in ("device", "auto"):  # the device has the memory
            assert h.staging.snapshot_bytes > 0 and h.staging.blocked_bytes == 0
        if over_budget == "block":
            assert h.staging.blocked_bytes > 0 and h.staging.snapshot_bytes == 0
    else:
        assert h.staging.staged_bytes > 0 and h.staging.snapshot_bytes == h.staging.blocked_bytes == 0
    target = _like(params)
    sp.load(target, tmp_path / "c")
    _assert_equal(expected, target)


def test_async_saves_keep_memory_flat(tmp_path):
    params = {f"p{i}": torch.randn(1024, 1024, device="cuda") for i in range(16)}  # 64 MiB
    _api._ASYNC.wait_last()
    rss, pinned = [], []
    for step in range(20):
        for v in params.values():
            v.add_(1)
        sp.async_save(params, tmp_path / f"c{step % 2}", overwrite=True, staging_budget=0).wait()
        gc.collect()
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        pinned.append(_api._ASYNC.pinned_bytes)
    assert pinned[0] >= 64 << 20 and len(set(pinned)) == 1, pinned  # allocated once, then reused
    assert rss[-1] - rss[1] < 64 << 10, rss  # KiB: less than 64 MiB more peak RSS after 19 more saves
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    sp.load(target, tmp_path / "c1")
    assert all(torch.equal(target[k], params[k]) for k in params)


def test_async_save_pinned_memory_stays_within_the_budget(tmp_path):
    # A state that fits, then one that does not, then both again, under one budget: the pool is
    # kept from save to save and never holds more than the budget, and every save loads back.
    budget = 300_000
    small = {"a": torch.randn(200, 256, device="cuda")}  # 204,800 bytes
    big = _state(3)  # about 1 MB
    for i, state in enumerate([small, big, small, big]):
        h = sp.async_save(state, tmp_path / f"c{i}", staging_budget=budget)
        h.wait()
        assert _api._ASYNC.pinned_bytes <= budget, (i, _api._ASYNC.pinned_bytes)
        assert h.staging.staged_bytes <= budget
        if state is small:
            assert h.staging.staged_bytes == 204_800 and h.staging.snapshot_bytes == 0
        else:
            assert h.staging.snapshot_bytes > 0  # the device has the memory: "auto" snapshots
        target = _like(state)
        sp.load(target, tmp_path / f"c{i}")
        _assert_equal(state, target)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_several_devices_in_one_state(tmp_path):
    source = {"a": torch.randn(64, 64, device="cuda:0"), "b": torch.randn(64, 64, device="cuda:1")}
    sp.save(source, tmp_path / "c")
    sp.async_save(source, tmp_path / "d").wait()
    for name in ("c", "d"):
        target = {"a": torch.zeros(64, 64, device="cuda:0"), "b": torch.zeros(64, 64, device="cuda:1")}
        sp.load(target, tmp_path / name, staging_budget=64 * 64 * 4)
        _assert_equal(source, target)


def _cuda_mesh_ranks(rank: int, world: int, path: str) -> bool:
    """Two processes on one GPU with a CUDA device mesh (gloo carries the CUDA tensors' own
    collectives here, as NCCL needs a GPU per rank): save Shard(0), load as Shard(1), on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    rows = full.shape[0] // world
    local = full[rank * rows:(rank + 1) * rows].cuda()
    src = {"w": DTensor.from_local(local, mesh, [Shard(0)]), "step": 3}
    sp.save(src, path)
    sp.async_save(src, path + "-async").wait()
    cols = full.shape[1] // world
    ok = True
    for p in (path, path + "-async"):
        dst = {"w": DTensor.from_local(torch.zeros(64, cols, device="cuda"), mesh, [Shard(1)]), "step": None}
        sp.load(dst, p, staging_budget=4096)
        ok &= torch.equal(dst["w"].to_local().cpu(), full[:, rank * cols:(rank + 1) * cols]) and dst["step"] == 3
    return ok


def _lanes_ranks(rank: int, world: int, path: str) -> list:
    """Two processes on one GPU whose loads run two batches at once (the second on a gloo group of
    its own) and a different number of batches on each rank; then an error in a late batch of one
    rank, which every rank must raise, and a load after it."""
    import shardpoint as sp

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    mine = {f"r{rank}.{k}": torch.randn(128, 64, device="cuda", generator=g) for k in range(6 + 5 * rank)}
    shared = torch.arange(4096.0, device="cuda").reshape(64, 64)
    sp.save({**mine, "shared": shared}, path)
    counts = [6 + 5 * r for r in range(world)]
    other = (rank + 1) % world
    regen = torch.Generator(device="cuda").manual_seed(100 + other)
    expect = {f"r{other}.{k}": torch.randn(128, 64, device="cuda", generator=regen) for k in range(counts[other])}
    target = {k: torch.full_like(v, float("nan")) for k, v in expect.items()}
    target["shared"] = torch.zeros(64, 64, device="cuda")
    half = 2 * 128 * 64 * 4
    out = []
    for _ in range(2):  # the second load reuses the halves and the lane's group
        sp.load(target, path, staging_budget=2 * half)
        out.append(all(torch.equal(target[k], expect[k]) for k in expect) and torch.equal(target["shared"], shared))
    # A late batch of rank 1 asks for a dtype the checkpoint does not hold (no cast allowed).
    bad = dict(target)
    if rank == 1:
        key = f"r{other}.{counts[other] - 1}"
        bad[key] = torch.zeros(128, 64, dtype=torch.float16, device="cuda")
    try:
        sp.load(bad, path, staging_budget=2 * half)
        out.append("no error")
    except sp.CheckpointError as e:
        out.append(str(e))
    sp.load(target, path, staging_budget=2 * half)
    out.append(all(torch.equal(target[k], expect[k]) for k in expect))
    return out


def test_two_batches_in_flight_on_two_processes(tmp_path):
    from distributed import run_ranks

    results = run_ranks(2, _lanes_ranks, str(tmp_path / "c"))
    for rank, out in enumerate(results):
        assert out[0] and out[1] and out[3], (rank, out)
        assert "float16" in out[2] and "r0.5" in out[2], (rank, out[2])


def test_dtensors_on_a_cuda_mesh_reshard_between_layouts(tmp_path):
    from distributed import run_ranks

    assert run_ranks(2, _cuda_mesh_ranks, str(tmp_path / "c")) == [True, True]


def test_fsdp2_on_one_gpu_round_trips(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        opt.step()
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        saved = {k: v.full_tensor().clone() for k, v in msd.items()}
        sp.save({"model": msd, "optim": osd}, tmp_path / "c")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        msd, osd = get_state_dict(model, opt)
        sp.load({"model": msd, "optim": osd}, tmp_path / "c")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        after = {k: v.full_tensor() for k, v in get_state_dict(model, opt)[0].items()}
        assert all(torch.equal(saved[k], after[k]) for k in saved)
    finally:
        dist.destroy_process_group()

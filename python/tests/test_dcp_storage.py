"""shardpoint.dcp.StorageWriter / StorageReader under torch.distributed.checkpoint's own save, async
save and load: an FSDP2 model + AdamW + LR scheduler + Stateful dataloader and train state saved at
4 ranks and resumed at 2 with the losses of an uninterrupted run; native checkpoints (verify,
inspect, sp.load); bytes items; failures."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import shardpoint as sp
import shardpoint.dcp as spdcp
from distributed import run_ranks
from fsdp_util import fsdp_setup

STEPS, SAVE_AT = 6, 3


class Loader:
    """A Stateful dataloader over a fixed list of batches."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.position = 0

    def next(self):
        batch = self.batches[self.position]
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position, "shuffle_seed": b"\x00\x01seed"}

    def load_state_dict(self, state_dict: dict) -> None:
        assert state_dict["shuffle_seed"] == b"\x00\x01seed"
        self.position = state_dict["position"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"step": self.step, "losses": list(self.losses), "best": (min(self.losses, default=0.0), self.step)}

    def load_state_dict(self, state_dict: dict) -> None:
        assert isinstance(state_dict["best"], tuple)
        self.step, self.losses = state_dict["step"], state_dict["losses"]


class Trainer:
    """Model and optimizer as one Stateful, through DCP's own state_dict helpers (as torchtitan's
    wrappers do): sharded state, FQN keys."""

    def __init__(self, world: int) -> None:
        self.model, _, batches = fsdp_setup(world, dims=(16, 33, 8), batch=32, steps=STEPS)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.loader, self.train_state = Loader(batches), TrainState()

    def state(self) -> dict:
        return {"app": self, "lr_scheduler": self.scheduler, "dataloader": self.loader,
                "train_state": self.train_state}

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])

    def train(self, steps: int) -> list[float]:
        for _ in range(steps):
            x, y = self.loader.next()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.train_state.step += 1
            self.train_state.losses.append(loss.item())
        return self.train_state.losses[-steps:]

    def full_tensors(self) -> dict:
        """Every tensor of model and optimizer, whole (collective)."""
        def walk(prefix, value, out):
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}", v, out)
            elif isinstance(value, torch.Tensor):
                out[prefix] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
            return out
        return walk("app", self.state_dict(), {})


def run(rank, world, path, phase):
    trainer = Trainer(world)
    if phase == "uninterrupted":
        return trainer.train(STEPS)
    if phase == "save":
        losses = trainer.train(SAVE_AT)
        dcp.save(trainer.state(), storage_writer=spdcp.StorageWriter(path))
        at_save = trainer.full_tensors()
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")  # as torchtitan: the background save's own group
        future = dcp.async_save(trainer.state(), process_group=group,
                                storage_writer=spdcp.StorageWriter(path + "-async", process_group=group))
        trainer.train(1)  # changes the live state while the async save writes its staged copy
        future.result()
        return losses, at_save
    if phase == "resume-dcp":
        dcp.load(trainer.state(), storage_reader=spdcp.StorageReader(path))
    else:
        sp.load(trainer.state(), path)  # tuples (AdamW's betas) are plain objects: no pickle needed
    loaded = trainer.full_tensors()
    assert trainer.loader.position == SAVE_AT and trainer.train_state.step == SAVE_AT
    assert trainer.scheduler.last_epoch == SAVE_AT
    return trainer.train(STEPS - SAVE_AT), loaded, trainer.train_state.losses[:SAVE_AT]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    uninterrupted = run_ranks(4, run, path, "uninterrupted")[0]
    results = run_ranks(4, run, path, "save")
    return path, uninterrupted, results


def _save_time_tensors(results) -> dict:
    """The full tensors at the save (every rank has them whole; rank 0's)."""
    return results[0][1]


def test_saved_at_4_resumed_at_2_with_identical_losses(saved):
    path, uninterrupted, results = saved
    first = results[0][0]
    assert first == uninterrupted[:SAVE_AT]
    resumed = run_ranks(2, run, path, "resume-dcp")
    losses, loaded, earlier = resumed[0]
    assert resumed[1][0] == losses
    assert losses == uninterrupted[SAVE_AT:]  # bit-identical, not approximately equal
    assert earlier == first


def test_checkpoint_is_native_and_read_by_sp_load(saved):
    path, uninterrupted, results = saved
    report = sp.verify(path)
    assert report.ok, report.defects
    info = sp.inspect(path)
    assert info.world_size == 4
    assert len(info.tensors["app.model.0.weight"].chunks) == 4
    assert info.objects["train_state.step"].encoding == "json"
    assert info.objects["dataloader.shuffle_seed"].encoding == "bytes"
    assert info.objects["train_state.best"].encoding == "plain"  # a tuple: stored exactly, read without pickle
    assert not any(o.encoding == "pickle" for o in info.objects.values())
    full = sp.load_full(path, keys=["train_state.step", "train_state.losses", "lr_scheduler"])
    assert full["train_state"]["step"] == SAVE_AT and full["train_state"]["losses"] == uninterrupted[:SAVE_AT]
    assert full["lr_scheduler"]["last_epoch"] == SAVE_AT
    resumed = run_ranks(2, run, path, "resume-sp")
    assert resumed[0][0] == uninterrupted[SAVE_AT:]


def test_tensors_bit_exact_after_resharding_and_async(saved):
    path, _, results = saved
    at_save = _save_time_tensors(results)
    loaded = run_ranks(2, run, path, "resume-dcp")[0][1]
    assert set(loaded) == set(at_save) and len(at_save) >= 10
    for name in at_save:
        assert torch.equal(loaded[name], at_save[name]), name
    async_full = sp.load_full(path + "-async")  # tuples (AdamW betas) are plain objects: no pickle
    sync_full = sp.load_full(path)
    assert sp.verify(path + "-async").ok
    _assert_trees_equal(sync_full, async_full, "")


def _assert_trees_equal(a, b, where):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_trees_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


class FailingPlanner(DefaultSavePlanner):
    """Fails to resolve one tensor on one rank."""

    def __init__(self, failing_rank: int) -> None:
        super().__init__()
        self.failing_rank = failing_rank

    def resolve_data(self, write_item):
        import torch.distributed as dist

        if dist.get_rank() == self.failing_rank and write_item.index.fqn == f"w{self.failing_rank}":
            raise OSError("disk full (injected)")
        return super().resolve_data(write_item)


def failing_save(rank, world, path):
    state = {f"w{rank}": torch.full((8,), float(rank)), "step": 1}  # a tensor of each rank's own
    dcp.save(state, storage_writer=spdcp.StorageWriter(path))
    state = {f"w{rank}": torch.full((8,), 100.0 + rank), "step": 2}
    errors = []
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=spdcp.StorageWriter(path, overwrite=True), planner=FailingPlanner(1))
    errors.append(str(raised.value))
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=spdcp.StorageWriter(path + "-new"), planner=FailingPlanner(1))
    errors.append(str(raised.value))
    return errors


def test_failure_on_one_rank_commits_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    errors = run_ranks(2, failing_save, path)
    for rank_errors in errors:
        for message in rank_errors:
            assert "rank 1: OSError: disk full (injected)" in message
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(path + "-new")
    kept = sp.load_full(path)  # the earlier checkpoint, whole and unchanged
    assert kept["step"] == 1 and torch.equal(kept["w0"], torch.zeros(8)) and torch.equal(kept["w1"], torch.ones(8))
    assert sp.verify(path).ok


def test_missing_checkpoint(tmp_path):
    with pytest.raises(sp.CheckpointNotFoundError, match="nothing"):
        spdcp.StorageReader(tmp_path / "nothing").read_metadata()
    with pytest.raises(CheckpointException, match="no committed checkpoint at .*nothing"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=spdcp.StorageReader(tmp_path / "nothing"))


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def test_bytes_items_single_process(tmp_path):
    path = tmp_path / "ckpt"
    state = {"n": 7, "plain": {"a": [1, 2.5, None, "x"]}, "pair": (1, 2), "raw": b"\xff\x00",
             "opaque": Opaque(3), "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    dcp.save(state, storage_writer=spdcp.StorageWriter(path), no_dist=True)
    info = sp.inspect(path)
    encodings = {name: o.encoding for name, o in info.objects.items()}
    assert encodings == {"n": "json", "plain.a": "json", "pair": "plain", "raw": "bytes",
                         "opaque": "torch-save"}
    target = {"n": 0, "plain": {"a": None}, "pair": None, "raw": None, "t": torch.zeros(2, 3, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=spdcp.StorageReader(path), no_dist=True)
    assert target["n"] == 7 and target["plain"] == {"a": [1, 2.5, None, "x"]} and target["pair"] == (1, 2)
    assert target["raw"] == b"\xff\x00" and torch.equal(target["t"], state["t"])
    with pytest.raises(CheckpointException, match="'opaque' .* needs StorageReader\\(..., allow_pickle=True\\)"):
        dcp.load({"opaque": None}, storage_reader=spdcp.StorageReader(path), no_dist=True)
    target = {"opaque": None}
    dcp.load(target, storage_reader=spdcp.StorageReader(path, allow_pickle=True), no_dist=True)
    assert target["opaque"].value == 3
    plain = {"n": 0, "plain": {"a": None}, "pair": None, "raw": None}
    sp.load(plain, path)  # no pickle needed for plain objects, a tuple included
    assert plain == {"n": 7, "plain": {"a": [1, 2.5, None, "x"]}, "pair": (1, 2), "raw": b"\xff\x00"}
    assert type(plain["pair"]) is tuple


class RecordingPlanner:
    """The two LoadPlanner calls read_data makes for a tensor item, into a given destination."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest, self.committed = dest, []

    def resolve_tensor(self, item):
        return self.dest

    def commit_tensor(self, item, tensor):
        self.committed.append((item.storage_offsets, tensor))


def test_read_item_region_and_checksums(tmp_path):
    """A read item gets exactly its region (chunk offsets + storage offsets, lengths), through the
    core's checksummed load, into a non-contiguous destination."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    path = tmp_path / "ckpt"
    big = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    dcp.save({"big": big}, storage_writer=spdcp.StorageWriter(path), no_dist=True)
    reader = spdcp.StorageReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("big"), torch.Size([0, 0]),
                    MetadataIndex("big", torch.Size([0, 0])), torch.Size([10, 3]), torch.Size([5, 7]))
    dest = torch.zeros(7, 5).t()  # non-contiguous
    planner = RecordingPlanner(dest)
    reader.read_data(LoadPlan([item]), planner).wait()
    assert torch.equal(dest, big[10:15, 3:10])
    assert planner.committed[0][1] is dest
    (data_file,) = [f["name"] for f in sp.inspect(path).files]
    data_start = os.path.getsize(path / data_file) - big.numel() * 4  # the one chunk ends the file
    with open(path / data_file, "r+b") as f:
        f.seek(data_start + 4 * (12 * 64 + 5))  # element [12, 5]: inside the item's region
        f.write(b"\x7f")
    with pytest.raises(sp.CheckpointCorruptError, match="big"):
        reader.read_data(LoadPlan([item]), RecordingPlanner(torch.zeros(5, 7)))

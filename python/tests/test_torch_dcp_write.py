"""PyTorch DCP checkpoints written by shardpoint (sp.save(format="torch-dcp")), read by torch itself.

shardpoint writes from 1, 2 and 4 gloo ranks (plain tensors, DTensors on 1-D and 2-D meshes with
uneven shards, an FSDP2 model with Adam, plain objects in nested dicts and lists) and from this
process (every dtype, 0-d and empty tensors). torch reads them with dcp.load at the same and at other
numbers of ranks and with format_utils.dcp_to_torch_save, and every tensor is compared bit for bit
with what shardpoint was given. Also: the overwrite rules across the two formats, and failures.
"""

from __future__ import annotations

import copy
import datetime
import fractions
import math
import os
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardpoint as sp
from distributed import run_ranks
from fsdp_util import fsdp_setup, train
from torch_dcp_util import bit_equal, differences, random_tensor, torch_metadata

MESH_2D = {1: (1, 1), 2: (2, 1), 4: (2, 2)}
REF_SEED, GARBAGE_SEED = 3000, 4000
# key: global shape, dtype, (mesh dims, placements) shardpoint saves with, (mesh dims, placements)
# torch loads into at another number of ranks.
DTENSORS = {
    "d1.rows": ((10, 6), torch.float32, (1, "S0"), (2, "S1 S0")),
    "d1.cols": ((5, 9), torch.bfloat16, (1, "S1"), (1, "S0")),
    "d1.rep": ((7,), torch.int64, (1, "R"), (1, "S0")),
    "d1.tiny": ((3, 2), torch.float64, (1, "S0"), (1, "S1")),  # 4 ranks: one holds nothing
    "d1.f8": ((9, 4), torch.float8_e4m3fn, (1, "S0"), (2, "R S0")),
    "d1.empty": ((0, 5), torch.float32, (1, "S1"), (1, "S0")),
    "d1.scalar": ((), torch.float64, (1, "R"), (1, "R")),
    "d2.ss": ((9, 7), torch.float64, (2, "S0 S1"), (1, "S1")),
    "d2.rs": ((6, 11), torch.float16, (2, "R S1"), (2, "S0 R")),
    "d2.s00": ((13, 3), torch.int32, (2, "S0 S0"), (1, "S0")),
    "d2.s10": ((5, 10), torch.complex128, (2, "S1 S0"), (2, "S0 S1")),
    "d2.mask": ((7, 5), torch.bool, (2, "S0 R"), (1, "S1")),
    "d2.u16": ((11, 2), torch.uint16, (2, "S1 S0"), (1, "R")),
}
SAVED, LOADED = 2, 3  # positions in the DTENSORS rows
OBJECTS = {"step": 7, "cfg": {"lr": 0.25, "name": "run-1", "betas": [0.9, 0.95], "flags": [True, None, False],
                              "nested": {"deep": [[1, 2], [3]], "empty": []}},
           "history": [{"loss": 1.5, "tag": "a"}, {"loss": -0.0, "tag": "ü ✓"}]}
PLACEHOLDERS = {"step": 0, "cfg": {"lr": 0.0, "name": "", "betas": [], "flags": [], "nested": {"deep": [], "empty": []}},
                "history": [{"loss": 0.0, "tag": ""}, {"loss": 0.0, "tag": ""}]}


def _placements(spec: str) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split()]


def _meshes(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return {1: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", MESH_2D[world])}


def _split(key: str) -> tuple[str, str]:
    head, leaf = key.split(".")
    return head, leaf


def reference_tensors(seed: int = REF_SEED) -> dict[str, torch.Tensor]:
    out = {k: random_tensor(shape, dtype, seed + i) for i, (k, (shape, dtype, *_)) in enumerate(DTENSORS.items())}
    out["plain"] = random_tensor((4, 4), torch.uint8, seed + 99)       # a plain tensor: replicated on every rank
    out["plain_u64"] = random_tensor((3,), torch.uint64, seed + 98)
    return out


def full_state(seed: int = REF_SEED, objects: dict = OBJECTS) -> dict:
    """The whole state as one process holds it: full tensors and the objects."""
    full = reference_tensors(seed)
    state: dict = {"plain": full["plain"], "plain_u64": full["plain_u64"]}
    for key in DTENSORS:
        head, leaf = _split(key)
        state.setdefault(head, {})[leaf] = full[key]
    state.update(copy.deepcopy(objects))
    return state


def sharded_state(meshes: dict, position: int, seed: int, objects: dict) -> dict:
    """The state of this rank: DTensors of the reference (or garbage) values, laid out as saved or loaded."""
    from torch.distributed.tensor import distribute_tensor

    state = full_state(seed, objects)
    for key, row in DTENSORS.items():
        head, leaf = _split(key)
        mesh_dims, spec = row[position]
        state[head][leaf] = distribute_tensor(state[head][leaf], meshes[mesh_dims], _placements(spec),
                                              src_data_rank=None)
    return state


def local_view(state: dict) -> dict:
    """``state`` with each DTensor replaced by its local tensor (for comparisons)."""
    return {k: local_view(v) if isinstance(v, dict) else v.to_local() if hasattr(v, "to_local") else v
            for k, v in state.items()}


def sp_save_sharded(rank, world, path):
    sp.save(sharded_state(_meshes(world), SAVED, REF_SEED, OBJECTS), path, format="torch-dcp")


def torch_load_sharded(rank, world, layouts):
    """dcp.load of each checkpoint into garbage laid out as ``layouts[path]`` says; returns what differs."""
    meshes = _meshes(world)
    report = {}
    for path, position in layouts.items():
        state = sharded_state(meshes, position, GARBAGE_SEED, PLACEHOLDERS)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        expected = sharded_state(meshes, position, REF_SEED, OBJECTS)
        report[os.path.basename(path)] = differences(local_view(state), local_view(expected))
    return report


@pytest.fixture(scope="module")
def written_by(tmp_path_factory):
    """written_by(world): the checkpoint shardpoint wrote from ``world`` ranks."""
    paths: dict[int, str] = {}

    def get(world: int) -> str:
        if world not in paths:
            paths[world] = str(tmp_path_factory.mktemp("sp_dcp") / f"by_{world}")
            run_ranks(world, sp_save_sharded, paths[world])
        return paths[world]

    return get


def _ordered(value):
    """``value`` with every dict's keys sorted (dcp_to_torch_save rebuilds dicts in .metadata order)."""
    if isinstance(value, dict):
        return {k: _ordered(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


def torch_save_of(path: str, out: str) -> dict:
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_metadata_torch_reads_and_dcp_to_torch_save(written_by, world, tmp_path):
    path = written_by(world)
    md = torch_metadata(path)
    for key, (shape, dtype, (mesh_dims, spec), _) in DTENSORS.items():
        entry = md.state_dict_metadata[key]
        assert (tuple(entry.size), entry.properties.dtype) == (shape, dtype), key
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        assert sorted(o for o, _ in chunks) == sorted(set(o for o, _ in chunks)), key  # each replica once
        assert sum(math.prod(s) for _, s in chunks) == math.prod(shape), key         # they tile the tensor
    assert len(md.state_dict_metadata["d2.ss"].chunks) == world
    assert len(md.state_dict_metadata["plain"].chunks) == 1
    names = {info.relative_path for info in md.storage_data.values()}
    assert names <= set(os.listdir(path)) and all(n.startswith("__") and n.endswith(".distcp") for n in names)
    assert {int(n.split("_")[2]) for n in names} == set(range(world))  # every rank wrote its own file
    assert md.planner_data["cfg.nested.deep"] == ("cfg", "nested", "deep")
    assert md.planner_data["history.1.tag"] == ("history", 1, "tag")
    whole = torch_save_of(path, str(tmp_path / "whole.pt"))
    assert differences(_ordered(whole), _ordered(full_state())) == []


def test_loaded_by_torch_at_4_ranks(written_by):
    layouts = {written_by(4): SAVED, written_by(2): LOADED, written_by(1): LOADED}  # 4 -> 4, 2 -> 4, 1 -> 4
    assert run_ranks(4, torch_load_sharded, layouts) == [{"by_4": [], "by_2": [], "by_1": []}] * 4


def test_loaded_by_torch_at_2_ranks(written_by):
    layouts = {written_by(2): SAVED, written_by(4): LOADED}  # 2 -> 2, 4 -> 2
    assert run_ranks(2, torch_load_sharded, layouts) == [{"by_2": [], "by_4": []}] * 2


def torch_load_in_process(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.load(state, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("world", [1, 4])
def test_loaded_by_torch_in_one_process(written_by, world):
    state = full_state(GARBAGE_SEED, PLACEHOLDERS)
    torch_load_in_process(state, written_by(world))
    assert differences(state, full_state()) == []


def test_read_back_by_shardpoint(written_by):
    full = sp.load_full(written_by(4), allow_pickle=True)  # objects are torch.save items in DCP
    assert differences(_ordered(full), _ordered(full_state())) == []


# ---------------------------------------------------------------------------------------------
# Every dtype, 0-d, empty and non-contiguous tensors; plain objects, from this process.

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_state() -> dict:
    return {
        "full": {_name(d): random_tensor((3, 5), d, i) for i, d in enumerate(DTYPES)},
        "scalar": {_name(d): random_tensor((), d, 100 + i) for i, d in enumerate(DTYPES)},
        "empty": {"rows": random_tensor((0, 4), torch.float32, 0), "middle": random_tensor((2, 0, 3), torch.int16, 0),
                  "flat": random_tensor((0,), torch.bfloat16, 0), "f8": random_tensor((0, 2), torch.float8_e5m2, 0)},
        "big": random_tensor((1 << 18, 9), torch.float32, 7),  # 9 MiB: written in more than one piece
    }


def test_every_dtype_scalar_and_empty_tensor(tmp_path):
    path = str(tmp_path / "dtypes")
    original = _dtype_state()
    sp.save(original, path, format="torch-dcp")
    md = torch_metadata(path)
    for group, values in original.items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            entry = md.state_dict_metadata[f"{group}.{key}" if key else group]
            assert (entry.properties.dtype, tuple(entry.size)) == (value.dtype, tuple(value.shape))
    template = {g: ({k: torch.zeros_like(v) if v.dtype != torch.bool else ~v for k, v in values.items()}
                    if isinstance(values, dict) else torch.zeros_like(values)) for g, values in original.items()}
    torch_load_in_process(template, path)
    assert differences(template, original) == []
    assert differences(_ordered(torch_save_of(path, str(tmp_path / "d.pt"))), _ordered(original)) == []
    assert differences(_ordered(sp.load_full(path)), _ordered(original)) == []


def test_non_contiguous_tensors_are_written_in_row_major_order(tmp_path):
    path = str(tmp_path / "strided")
    base = random_tensor((10, 10), torch.float64, 8)
    original = {"transposed": random_tensor((6, 4), torch.float32, 9).t(), "slice": base[2:5, 1:4],
                "channels_last": random_tensor((2, 3, 4, 5), torch.bfloat16, 10).to(memory_format=torch.channels_last)}
    sp.save(original, path, format="torch-dcp")
    loaded = torch_save_of(path, str(tmp_path / "s.pt"))
    assert all(bit_equal(loaded[k], v.contiguous()) for k, v in original.items())


NESTED = {
    "model": {"layers": [{"w": random_tensor((3, 2), torch.float32, 20), "cfg": {"k": 3, "act": "gelu"}},
                         {"w": random_tensor((2, 2), torch.float32, 21), "norm": {"eps": 1e-5, "affine": False}}]},
    "mixed": [random_tensor((4,), torch.int8, 22), 7, "s", [random_tensor((1,), torch.float16, 23)]],
    "matrix": [[1, 2], [3]],        # a list of lists of scalars: one object, as DCP stores it
    "names": ["x", "y", "ü ✓ \"quoted\" \\ \n\t\x00"],
    "numbers": {"int": -12345678901234, "int64_min": -(2 ** 63), "int64_max": 2 ** 63 - 1, "float": 0.1,
                "tiny": 5e-324, "huge": 1.7976931348623157e308, "negative_zero": -0.0, "whole": 3.0},
    "flags": {"yes": True, "no": False, "nothing": None},
    "empty_list": [],
    "empty_dict": {},
    "deep": {"a": {"b": {"c": {"d": [{"e": [1, {"f": None}]}]}}}},
    "top": 1.5,
}


def test_nested_dicts_and_lists_of_plain_objects(tmp_path):
    path = str(tmp_path / "nested")
    sp.save(NESTED, path, format="torch-dcp")
    planner_data = torch_metadata(path).planner_data
    assert planner_data["model.layers.1.norm.eps"] == ("model", "layers", 1, "norm", "eps")
    assert planner_data["deep.a.b.c.d.0.e.1.f"] == ("deep", "a", "b", "c", "d", 0, "e", 1, "f")
    assert "empty_dict" not in planner_data  # torch stores nothing for an empty dict either
    stored = {k: v for k, v in NESTED.items() if k != "empty_dict"}
    whole = torch_save_of(path, str(tmp_path / "n.pt"))
    assert differences(_ordered(whole), _ordered(stored)) == []
    template = copy.deepcopy(NESTED)
    template["model"]["layers"][0]["w"].zero_()
    template["mixed"][3][0].fill_(-1)
    template.update(matrix=[], names=[], top=0.0, flags={"yes": None, "no": None, "nothing": 1},
                    numbers={k: 0 for k in NESTED["numbers"]}, deep={"a": {"b": {"c": {"d": [{"e": [0, {"f": 1}]}]}}}})
    torch_load_in_process(template, path)
    assert differences(template, NESTED) == []
    assert differences(_ordered(sp.load_full(path, allow_pickle=True)), _ordered(stored)) == []


def test_regression_empty_dict_beside_a_list_of_dicts_loads_in_torch(tmp_path):
    # An item for the empty dict made torch's dcp.load fall back to its pre-2.4 keys, in which
    # param_groups is one key: "Missing key in checkpoint state_dict: optim.".
    original = {"w": torch.arange(4.0), "extra": {},
                "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    path = str(tmp_path / "ckpt")
    sp.save(original, path, format="torch-dcp")
    template = copy.deepcopy(original)
    template["w"].zero_()
    template["optim"]["param_groups"][0]["lr"] = 0.0
    torch_load_in_process(template, path)
    assert differences(template, original) == []


def test_bytes_and_pickled_objects_come_back_through_torch(tmp_path):
    path = str(tmp_path / "pickled")
    original = {"w": torch.ones(2), "raw": b"\x00\xff" * 50, "fraction": fractions.Fraction(1, 3),
                "date": datetime.date(2024, 5, 6), "set": {1, 2}}
    sp.save(original, path, format="torch-dcp", allow_pickle=True)
    assert differences(_ordered(torch_save_of(path, str(tmp_path / "p.pt"))), _ordered(original)) == []
    template = {"w": torch.zeros(2), "raw": b"", "fraction": None, "date": None, "set": set()}
    torch_load_in_process(template, path)
    assert differences(template, original) == []


def test_non_finite_floats_among_the_objects(tmp_path):
    path = str(tmp_path / "non_finite")
    original = {"w": torch.ones(2), "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}
    sp.save(original, path, format="torch-dcp")
    whole = torch_save_of(path, str(tmp_path / "nf.pt"))
    assert math.isnan(whole["nan"]) and whole["inf"] == math.inf and whole["ninf"] == -math.inf


@pytest.mark.parametrize("value", [2 ** 63, 2 ** 64 - 1, -(2 ** 63) - 1, 2 ** 80])
def test_an_int_beyond_64_bits_is_refused_not_rounded(tmp_path, value):
    path = str(tmp_path / "big_int")
    try:
        sp.save({"w": torch.ones(2), "n": value}, path, format="torch-dcp")
    except sp.CheckpointArgumentError as e:
        assert "'n'" in str(e) and str(value) in str(e) and "64" in str(e)
        assert not os.path.exists(os.path.join(path, ".metadata"))
        return
    loaded = torch_save_of(path, str(tmp_path / "n.pt"))["n"]
    assert type(loaded) is int and loaded == value


# ---------------------------------------------------------------------------------------------
# FSDP2 model and Adam state saved by shardpoint at 4 ranks, resumed by torch at 2.

STEPS, SAVE_AT = 6, 3


def fsdp_save(rank, world, path):
    """Trains, saves with shardpoint at SAVE_AT, trains on; returns the losses and (rank 0) the full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer, batches = fsdp_setup(world)
    losses = train(model, optimizer, batches[:SAVE_AT])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sp.save({"model": model_sd, "optim": optim_sd, "step": SAVE_AT}, path, format="torch-dcp")
    full_model, full_optim = get_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A copy: the full optimizer state holds the live "step" tensors, which training goes on changing.
    full = copy.deepcopy({"model": full_model, "optim": full_optim}) if rank == 0 else None
    return losses + train(model, optimizer, batches[SAVE_AT:]), full


def fsdp_resume(rank, world, path):
    """Resumes from the checkpoint with torch's dcp.load and set_state_dict; returns the losses."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, batches = fsdp_setup(world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train(model, optimizer, batches[state["step"]:])


def test_fsdp2_adam_saved_by_shardpoint_at_4_resumed_by_torch_at_2(tmp_path):
    path = str(tmp_path / "fsdp")
    uninterrupted, full = run_ranks(4, fsdp_save, path)[0]
    md = torch_metadata(path)
    assert len(md.state_dict_metadata["model.0.weight"].chunks) == 4
    assert "optim.state.0.weight.exp_avg_sq" in md.state_dict_metadata
    whole = torch_save_of(path, str(tmp_path / "fsdp.pt"))
    assert whole["step"] == SAVE_AT
    assert differences(_ordered(whole["model"]), _ordered(full["model"])) == []
    assert differences(_ordered(whole["optim"]["state"]), _ordered(full["optim"]["state"])) == []
    assert whole["optim"]["param_groups"][0]["lr"] == 1e-2
    assert whole["optim"]["param_groups"][0]["params"] == full["optim"]["param_groups"][0]["params"]
    resumed = run_ranks(2, fsdp_resume, path)
    assert resumed[0] == resumed[1]
    assert resumed[0] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Overwrite rules between the formats.

NATIVE_METADATA = "shardpoint.metadata"


def test_saving_over_a_committed_checkpoint_needs_overwrite(tmp_path):
    for first in ("native", "torch-dcp"):
        path = str(tmp_path / first)
        sp.save({"w": torch.ones(3)}, path, format=first)
        for second in ("native", "torch-dcp"):
            with pytest.raises(sp.CheckpointExistsError) as e:
                sp.save({"w": torch.zeros(3)}, path, format=second)
            assert path in str(e.value) and "overwrite" in str(e.value)
        assert torch.equal(sp.load_full(path)["w"], torch.ones(3))


def _data_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if not f.startswith((".metadata", NATIVE_METADATA)))


def _dcp_files(path: str) -> list[str]:
    """The data files .metadata names, after checking that they are all the directory holds and
    have torch's names ("__<rank>_<k>.distcp", with the save id when they replaced another DCP save)."""
    named = sorted({info.relative_path for info in torch_metadata(path).storage_data.values()})
    assert _data_files(path) == named
    assert all(re.fullmatch(r"__\d+_\d+(-[0-9a-f]+)?\.distcp", n) for n in named), named
    return [re.sub(r"-[0-9a-f]+\.distcp$", ".distcp", n) for n in named]


def test_overwriting_across_formats_leaves_one_checkpoint_and_no_stale_files(tmp_path):
    path = str(tmp_path / "ckpt")
    sp.save({"w": torch.ones(3), "old": torch.ones(5), "note": "native"}, path)
    sp.save({"w": torch.full((3,), 2.0), "step": 1}, path, format="torch-dcp", overwrite=True)
    assert ".metadata" in os.listdir(path) and NATIVE_METADATA not in os.listdir(path)
    assert _dcp_files(path) == ["__0_0.distcp", "__0_1.distcp"]  # the tensors; the objects
    assert sp.inspect(path).tensors.keys() == {"w"}
    state = {"w": torch.zeros(3), "step": 0}
    torch_load_in_process(state, path)
    assert torch.equal(state["w"], torch.full((3,), 2.0)) and state["step"] == 1

    sp.save({"w": torch.full((3,), 3.0)}, path, format="torch-dcp", overwrite=True)  # fewer files than before
    assert _dcp_files(path) == ["__0_0.distcp"]
    assert differences(torch_save_of(path, str(tmp_path / "w.pt")), {"w": torch.full((3,), 3.0)}) == []

    sp.save({"w": torch.full((3,), 4.0), "note": "native again"}, path, overwrite=True)
    assert NATIVE_METADATA in os.listdir(path) and ".metadata" not in os.listdir(path)
    assert len(_data_files(path)) == 1 and _data_files(path)[0].endswith(".safetensors")
    assert differences(sp.load_full(path), {"w": torch.full((3,), 4.0), "note": "native again"}) == []


def sp_save_ranks(rank, world, path, value, fmt):
    state = {"x": sp.ShardedTensor(torch.full((2,), value), (2 * world,), (2 * rank,)), "v": value}
    sp.save(state, path, format=fmt, overwrite=True)


def test_overwriting_2_ranks_with_1_removes_the_files_of_rank_1(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, sp_save_ranks, path, 1.0, "torch-dcp")
    assert _dcp_files(path) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp"]
    sp_save_ranks(0, 1, path, 5.0, "torch-dcp")  # this process alone
    assert _dcp_files(path) == ["__0_0.distcp", "__0_1.distcp"]
    state = {"x": torch.zeros(2), "v": 0.0}
    torch_load_in_process(state, path)
    assert torch.equal(state["x"], torch.full((2,), 5.0)) and state["v"] == 5.0


# ---------------------------------------------------------------------------------------------
# Failures: the same error on every rank, and no .metadata.

def failing_rank(rank, world, path):
    state = {"x": torch.arange(8, dtype=torch.float32) + rank, "obj": object() if rank == 1 else 1}
    try:
        sp.save(state, path, format="torch-dcp")
    except sp.CheckpointError as e:
        return type(e).__name__, str(e)
    return None


def test_a_rank_failing_mid_save_fails_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, failing_rank, path)
    assert all(r is not None and r[0] == "CheckpointArgumentError" for r in results)
    assert all("rank 1" in r[1] and "'obj'" in r[1] and "allow_pickle" in r[1] for r in results)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(path)


def blocked_writer(rank, world, path, value, fmt):
    try:
        sp_save_ranks(rank, world, path, value, fmt)
    except sp.CheckpointError as e:
        return str(e)
    return None


def test_a_rank_failing_to_write_leaves_no_metadata_and_no_files(tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(path, "__1_0.distcp.tmp"))  # rank 1 cannot create its data file
    results = run_ranks(2, blocked_writer, path, 1.0, "torch-dcp")
    assert all(r is not None and "rank 1" in r and "__1_0.distcp.tmp" in r for r in results)
    assert sorted(os.listdir(path)) == ["__1_0.distcp.tmp"]

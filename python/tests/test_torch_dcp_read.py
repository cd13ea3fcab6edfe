"""PyTorch DCP checkpoints written by torch.distributed.checkpoint itself, read by shardpoint.

torch writes with FileSystemWriter(thread_count=3, single_file_per_rank=False) from 1, 2 and 4 gloo
ranks (DTensors on 1-D and 2-D meshes, an FSDP2 model with Adam) and from this process (every dtype,
non-contiguous tensors, zstd items, objects, nested state dicts). shardpoint loads them into other
layouts and numbers of ranks, and every tensor is compared bit for bit with what torch held.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import fractions
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardpoint as sp
from distributed import run_ranks
from fsdp_util import fsdp_setup, train
from torch_dcp_util import (bit_equal, cli, differences, flipped, random_tensor, save_in_process, storage_of,
                            stored_item, torch_metadata, writer)

# ---------------------------------------------------------------------------------------------
# DTensors saved by torch at 1, 2 and 4 ranks, loaded by shardpoint at other ranks and layouts.

MESH_2D = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2)}
REF_SEED, GARBAGE_SEED = 1000, 2000
# key: global shape, dtype, (mesh dims, placements) torch saves with, (mesh dims, placements) loaded into
DTENSORS = {
    "d1.rows": ((10, 6), torch.float32, (1, "S0"), (2, "S1 S0")),
    "d1.cols": ((5, 9), torch.bfloat16, (1, "S1"), (1, "S0")),
    "d1.rep": ((7,), torch.int64, (1, "R"), (1, "S0")),
    "d1.tiny": ((3, 2), torch.float64, (1, "S0"), (1, "S1")),  # 4 ranks: one holds nothing
    "d2.ss": ((9, 7), torch.float64, (2, "S0 S1"), (1, "S1")),
    "d2.rs": ((6, 11), torch.float16, (2, "R S1"), (2, "S0 R")),
    "d2.s00": ((13, 3), torch.int32, (2, "S0 S0"), (1, "S0")),
    "d2.s10": ((5, 10), torch.complex64, (2, "S1 S0"), (2, "S0 S1")),
}
SAVED, LOADED = 2, 3  # positions in the DTENSORS rows
OBJECTS = {"step": 7, "cfg": {"lr": 0.25, "name": "run"}}


def _placements(spec: str) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split()]


def _meshes(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return {1: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", MESH_2D[world])}


def _put(state: dict, key: str, value) -> None:
    head, leaf = key.split(".")
    state.setdefault(head, {})[leaf] = value


def reference_tensors(seed: int = REF_SEED) -> dict[str, torch.Tensor]:
    out = {k: random_tensor(shape, dtype, seed + i) for i, (k, (shape, dtype, *_)) in enumerate(DTENSORS.items())}
    out["plain"] = random_tensor((4, 4), torch.uint8, seed + 99)
    return out


def dtensor_state(meshes: dict, position: int, seed: int) -> dict:
    """DTensors of the reference (or garbage) values, laid out as saved or as loaded."""
    from torch.distributed.tensor import distribute_tensor

    full = reference_tensors(seed)
    state: dict = {"plain": full["plain"]}
    for key, row in DTENSORS.items():
        mesh_dims, spec = row[position]
        _put(state, key, distribute_tensor(full[key], meshes[mesh_dims], _placements(spec), src_data_rank=None))
    return state


def write_dtensor_checkpoints(rank, world, root, variants):
    state = dtensor_state(_meshes(world), SAVED, REF_SEED)
    state.update(copy.deepcopy(OBJECTS))
    dcp.save(state, storage_writer=writer(os.path.join(root, "plain")))
    if variants:  # items zstd-compressed; items at offsets in torch's default files (thread_count of them)
        dcp.save(state, storage_writer=writer(os.path.join(root, "zstd"), zstd=True))
        dcp.save(state, storage_writer=writer(os.path.join(root, "few_files"), single_file_per_rank=True))


def load_resharded(rank, world, paths):
    """Loads each checkpoint into the LOADED layouts over ``world`` ranks; returns what went wrong."""
    meshes = _meshes(world)
    expected = dtensor_state(meshes, LOADED, REF_SEED)
    report = {}
    for path in paths:
        state = dtensor_state(meshes, LOADED, GARBAGE_SEED)
        state.update(step=0, cfg={"lr": 0.0, "name": ""})
        result = sp.load(state, path, allow_pickle=True)
        wrong = [k for k in DTENSORS
                 if not bit_equal(state[k.split(".")[0]][k.split(".")[1]].to_local(),
                                  expected[k.split(".")[0]][k.split(".")[1]].to_local())]
        wrong += [] if bit_equal(state["plain"], expected["plain"]) else ["plain"]
        wrong += [] if {"step": state["step"], "cfg": state["cfg"]} == OBJECTS else ["objects"]
        report[os.path.basename(path)] = (wrong, result.missing_keys, result.unexpected_keys)
    return report


@pytest.fixture(scope="module")
def written_by(tmp_path_factory):
    """written_by(world): the directory holding the "plain" (at 2 ranks also "zstd" and "few_files")
    checkpoints."""
    roots: dict[int, str] = {}

    def get(world: int) -> str:
        if world not in roots:
            root = str(tmp_path_factory.mktemp(f"dcp_by_{world}"))
            run_ranks(world, write_dtensor_checkpoints, root, world == 2)
            roots[world] = root
        return roots[world]

    return get


@pytest.mark.parametrize("world", [1, 2, 4])
def test_written_by_ranks_inspected_and_loaded_whole(written_by, world):
    path = os.path.join(written_by(world), "plain")
    md = torch_metadata(path)
    info = sp.inspect(path)
    on_disk = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert sorted(f["name"] for f in info.files) == on_disk
    assert all(f["bytes"] == os.path.getsize(os.path.join(path, f["name"])) for f in info.files)
    assert {int(f["name"].split("_")[2]) for f in info.files} == set(range(world))  # every rank wrote
    for key, (shape, dtype, *_) in DTENSORS.items():
        stored = info.tensors[key]
        assert (stored.dtype, stored.shape) == (str(dtype).removeprefix("torch."), shape)
        torch_chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks]
        assert sorted(stored.chunks) == sorted(torch_chunks), key
    assert len(info.tensors["d2.ss"].chunks) == world
    full = sp.load_full(path, allow_pickle=True)
    ref = reference_tensors()
    assert sorted(full) == sorted(["d1", "d2", "plain", "step", "cfg"])
    for key in DTENSORS:
        assert bit_equal(full[key.split(".")[0]][key.split(".")[1]], ref[key]), key
    assert bit_equal(full["plain"], ref["plain"])
    assert (full["step"], full["cfg"]) == (OBJECTS["step"], OBJECTS["cfg"])


def test_inspect_reports_the_writer_rank_of_each_file(written_by):
    info = sp.inspect(os.path.join(written_by(4), "plain"))
    assert all(f["writer_rank"] == int(f["name"].split("_")[2]) for f in info.files)
    assert info.world_size == 4


def test_saved_at_4_loaded_at_2_other_layouts(written_by):
    path = os.path.join(written_by(4), "plain")
    assert run_ranks(2, load_resharded, [path]) == [{"plain": ([], [], [])}] * 2


def test_saved_at_2_loaded_at_3_plain_zstd_and_few_files(written_by):
    names = ("plain", "zstd", "few_files")
    assert len(os.listdir(os.path.join(written_by(2), "few_files"))) == 1 + 2 * 3  # 3 files per rank, many items each
    paths = [os.path.join(written_by(2), name) for name in names]
    assert run_ranks(3, load_resharded, paths) == [{name: ([], [], []) for name in names}] * 3


def test_saved_at_4_loaded_in_one_process(written_by):
    path = os.path.join(written_by(4), "plain")
    ref = reference_tensors()
    template: dict = {"plain": torch.zeros(4, 4, dtype=torch.uint8), "step": 0, "cfg": {"lr": 0.0, "name": ""}}
    for key in DTENSORS:
        _put(template, key, torch.zeros_like(ref[key]))
    result = sp.load(template, path, allow_pickle=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for key in DTENSORS:
        assert bit_equal(template[key.split(".")[0]][key.split(".")[1]], ref[key]), key
    assert (template["step"], template["cfg"]) == (OBJECTS["step"], OBJECTS["cfg"])
    # A region crossing the chunks of several writers, through an explicit shard.
    region = torch.zeros(7, 4, dtype=torch.float64)
    sp.load({"d2": {"ss": sp.ShardedTensor(region, (9, 7), (1, 2))}}, path, strict=False)
    assert bit_equal(region, ref["d2.ss"][1:8, 2:6])


def test_verify_good_checkpoints_exit_0_and_say_no_checksums(written_by):
    for name in ("plain", "zstd", "few_files"):
        path = os.path.join(written_by(2), name)
        run = cli("verify", path)
        assert run.returncode == 0, run.stderr
        assert "no checksums" in run.stdout
        report = sp.verify(path)
        assert report.ok and report.defects == [] and report.files_checked == len(os.listdir(path)) - 1


# ---------------------------------------------------------------------------------------------
# FSDP2 model and Adam state saved by torch at 4 ranks, resumed by shardpoint at 2.

STEPS, SAVE_AT = 6, 3


def _leaves(value, prefix=""):
    """{dotted key: local tensor or value} of a (model or optimizer) state dict."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value.to_local() if hasattr(value, "to_local") else value}


def fsdp_save(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, batches = fsdp_setup(world)
    losses = train(model, optimizer, batches[:SAVE_AT])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer(path))
    return losses + train(model, optimizer, batches[SAVE_AT:])


def fsdp_resume(rank, world, path):
    """Resumes twice, with torch's dcp.load and with sp.load; returns both losses and what differs."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    resumed = {}
    for reader in ("torch", "shardpoint"):
        model, optimizer, batches = fsdp_setup(world)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        refusal = None
        if reader == "torch":
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        else:
            try:
                sp.load(state, path)
            except sp.CheckpointArgumentError as e:
                refusal = str(e)
            result = sp.load(state, path, allow_pickle=True)
            assert (result.missing_keys, result.unexpected_keys) == ([], [])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        leaves = _leaves(dict(zip(("model", "optim"), get_state_dict(model, optimizer))))
        resumed[reader] = (leaves, train(model, optimizer, batches[SAVE_AT:]), refusal)
    theirs, ours = resumed["torch"][0], resumed["shardpoint"][0]
    same = lambda a, b: bit_equal(a, b) if isinstance(b, torch.Tensor) else a == b  # noqa: E731
    return {"torch_losses": resumed["torch"][1], "losses": resumed["shardpoint"][1],
            "differing": sorted(k for k in theirs if not same(ours.get(k), theirs[k])),
            "same_keys": sorted(theirs) == sorted(ours), "refusal": resumed["shardpoint"][2]}


def test_fsdp2_adam_saved_by_torch_at_4_resumed_by_shardpoint_at_2(tmp_path):
    path = str(tmp_path / "fsdp")
    uninterrupted = run_ranks(4, fsdp_save, path)[0]
    info = sp.inspect(path)
    assert len(info.tensors["model.0.weight"].chunks) == 4 and info.tensors["model.0.weight"].shape == (35, 12)
    optimizer_keys = {"optim.state.0.weight.exp_avg", "optim.state.2.bias.exp_avg_sq", "optim.state.0.weight.step"}
    assert optimizer_keys <= set(info.tensors)
    # Object items are not read by inspect (docs/TORCH_DCP.md); the resume below reads them as plain
    # data, with no allow_pickle.
    assert info.objects["optim.param_groups.0.lr"].encoding == "torch-save"
    for rank in run_ranks(2, fsdp_resume, path):
        assert rank["refusal"] is None
        assert rank["same_keys"] and rank["differing"] == []
        assert rank["losses"] == rank["torch_losses"]  # the same bytes loaded: the same arithmetic
        assert rank["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Nested state dicts: planner_data gives load_full the saved structure back.

def _nested_original() -> dict:
    t = lambda shape, seed: random_tensor(shape, torch.float32, seed)  # noqa: E731
    return {
        "model": {"layers": [{"w": t((3, 2), 1), "cfg": {"k": 3}}, {"w": t((2, 2), 2), "norm": {"eps": 1e-5}}]},
        "mixed": [t((4,), 3), 7, "s", [t((1,), 4)]],
        "deep": {"a": {"b": {"c": random_tensor((), torch.int64, 5)}}},
        "matrix": [[1, 2], [3]],        # a list of lists of scalars: one object in DCP
        "pair": (0.9, 0.999),           # a tuple: one object
        "names": ["x", "y"],
        "none": [],
        "top": 1.5,
    }


def test_nested_state_dict_rebuilt_with_its_structure(tmp_path):
    path = str(tmp_path / "nested")
    original = _nested_original()
    save_in_process(original, path)
    planner_data = torch_metadata(path).planner_data
    assert planner_data["model.layers.1.norm.eps"] == ("model", "layers", 1, "norm", "eps")
    shown = json.loads(cli("inspect", "--json", path).stdout)["attributes"]["python.state_dict_paths"]
    assert {key: tuple(p) for key, p in json.loads(shown)} == planner_data
    assert differences(sp.load_full(path, allow_pickle=True), original) == []
    assert differences(sp.load_full(path, keys=["deep"]), {"deep": original["deep"]}) == []
    assert differences(sp.load_full(path, keys=["model"]), {"model": original["model"]}) == []  # plain: no flag


def test_nested_state_dict_loaded_into_a_template(tmp_path):
    path = str(tmp_path / "nested")
    original = _nested_original()
    save_in_process(original, path)
    template = copy.deepcopy(original)
    template["model"]["layers"][0]["w"].zero_()
    template["mixed"][3][0].fill_(-1)
    template["deep"]["a"]["b"]["c"].fill_(0)
    template.update(matrix=[[0], [0, 0]], pair=(0.0, 0.0), names=[], top=0.0, optimizer_state={})
    result = sp.load(template, path, allow_pickle=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    # DCP stores nothing for an empty dict (torch's own load leaves it as it is): so does shardpoint.
    assert differences(template, dict(original, optimizer_state={})) == []


def test_tuple_holding_a_tensor_loaded_into_a_template(tmp_path):
    # DCP never walks into a tuple: ('w', (t, 2)) is one torch-save object; so is it in sp.load, and
    # torch.load(weights_only=True) reads it with no allow_pickle.
    path = str(tmp_path / "tuple")
    original = {"w": (torch.arange(3.0), 2)}
    save_in_process(original, path)
    assert sp.inspect(path).objects["w"].encoding == "torch-save"
    template = {"w": (torch.zeros(3), 0)}
    sp.load(template, path)
    assert differences(template, original) == []
    assert differences(sp.load_full(path), original) == []


# ---------------------------------------------------------------------------------------------
# Every dtype, 0-d, empty and non-contiguous tensors.

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def _dtype_state() -> dict:
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    base = random_tensor((10, 10), torch.float64, 7)
    return {
        "full": {name(d): random_tensor((3, 5), d, i) for i, d in enumerate(DTYPES)},
        "scalar": {name(d): random_tensor((), d, 100 + i) for i, d in enumerate(DTYPES)},
        "empty": {"rows": random_tensor((0, 4), torch.float32, 0), "middle": random_tensor((2, 0, 3), torch.int16, 0),
                  "flat": random_tensor((0,), torch.bfloat16, 0)},
        "strided": {
            "transposed": random_tensor((6, 4), torch.float32, 200).t(),
            "permuted": random_tensor((2, 3, 4), torch.int8, 201).permute(2, 0, 1),
            "channels_last": random_tensor((2, 3, 4, 5), torch.bfloat16, 202).to(memory_format=torch.channels_last),
            "slice_view": base[2:5, 1:4],          # storage larger than the view: DCP clones it
            "offset_view": base.reshape(-1)[10:30],
            "expanded": random_tensor((3, 1), torch.int16, 203).expand(3, 4),
        },
    }


def test_every_dtype_scalar_empty_and_strided_tensor(tmp_path):
    path = str(tmp_path / "dtypes")
    original = _dtype_state()
    save_in_process(original, path)
    # DCP kept the transposed layouts as they were: shardpoint decodes those items whole.
    assert not stored_item(path, "strided.transposed").is_contiguous()
    assert stored_item(path, "strided.channels_last").is_contiguous(memory_format=torch.channels_last)
    info = sp.inspect(path)
    assert info.tensors["full.float8_e8m0fnu"].dtype == "float8_e8m0fnu" and info.tensors["scalar.uint64"].shape == ()
    assert info.tensors["empty.middle"].shape == (2, 0, 3)
    assert differences(sp.load_full(path), original) == []
    template = {group: {k: flipped(v) for k, v in values.items()} for group, values in original.items()}
    result = sp.load(template, path)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert differences(template, original) == []


def test_regions_of_strided_items(tmp_path):
    path = str(tmp_path / "strided")
    original = _dtype_state()["strided"]
    save_in_process(original, path)
    rows = torch.zeros(2, 6, dtype=torch.float32)
    block = torch.zeros(1, 3, 2, 5, dtype=torch.bfloat16)
    cube = torch.zeros(2, 2, 3, dtype=torch.int8)
    sp.load({"transposed": sp.ShardedTensor(rows, (4, 6), (1, 0)),
             "channels_last": sp.ShardedTensor(block, (2, 3, 4, 5), (1, 0, 1, 0)),
             "permuted": sp.ShardedTensor(cube, (4, 2, 3), (2, 0, 0))}, path, strict=False)
    assert bit_equal(rows, original["transposed"][1:3])
    assert bit_equal(block, original["channels_last"][1:2, :, 1:3])
    assert bit_equal(cube, original["permuted"][2:4])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_is_refused_by_name(tmp_path):
    path = str(tmp_path / "chalf")
    save_in_process({"half_complex": torch.zeros(2, dtype=torch.complex32)}, path)
    with pytest.raises(sp.CheckpointError) as e:
        sp.inspect(path)
    assert e.value.code == "UNIMPLEMENTED"
    assert ".metadata" in str(e.value) and "'half_complex'" in str(e.value) and "complex32" in str(e.value)


# ---------------------------------------------------------------------------------------------
# zstd items (torch.distributed.checkpoint._extension.ZStandard).

def _zstd_state() -> dict:
    return {
        "big": torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64) % 17,  # compresses well
        "ints": random_tensor((7, 3), torch.int64, 300),
        "transposed": random_tensor((5, 8), torch.bfloat16, 301).t(),
        "scalar": random_tensor((), torch.float64, 302),
        "empty": torch.zeros(0, 4),
        "mask": random_tensor((9,), torch.bool, 303),
        "note": "compressed",
    }


def test_zstd_items(tmp_path):
    path = str(tmp_path / "zstd")
    original = _zstd_state()
    save_in_process(original, path, zstd=True)
    big = storage_of(path, "big")
    assert big.transform_descriptors == ["stream.zstd/1"] and big.length < 256 * 64 * 4 // 4
    assert storage_of(path, "note").transform_descriptors == ["stream.zstd/1"]
    assert differences(sp.load_full(path, allow_pickle=True), original) == []
    template = {k: flipped(v) if isinstance(v, torch.Tensor) else "" for k, v in original.items()}
    sp.load(template, path, allow_pickle=True)
    assert differences(template, original) == []
    rows = torch.zeros(40, 64)
    sp.load({"big": sp.ShardedTensor(rows, (256, 64), (100, 0))}, path, strict=False)
    assert bit_equal(rows, original["big"][100:140])
    assert cli("verify", path).returncode == 0


def test_zstd_item_cut_short_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "zstd")
    save_in_process(_zstd_state(), path, zstd=True)
    md = torch_metadata(path)
    index = next(i for i in md.storage_data if i.fqn == "big")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], length=md.storage_data[index].length - 9)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(sp.CheckpointCorruptError) as e:
        sp.load({"big": torch.zeros(256, 64)}, path, strict=False)
    assert "'big'" in str(e.value) and storage_of(path, "big").relative_path in str(e.value)


# ---------------------------------------------------------------------------------------------
# Non-tensor items: plain data needs no flag; other objects need allow_pickle.

NEEDS_CODE = {"obj.fraction": "fractions.Fraction", "obj.date": "datetime.date"}


def _object_state() -> dict:
    return {"t": random_tensor((4, 3), torch.float32, 400),
            "obj": {"int": 7, "float": 0.5, "text": "x" * 3000, "numbers": list(range(500)), "raw": b"\x00\xff" * 100,
                    "none": None, "flag": True, "fraction": fractions.Fraction(1, 3),
                    "date": datetime.date(2024, 5, 6)}}


def test_objects_named_and_sized_by_inspect(tmp_path):
    path = str(tmp_path / "objects")
    save_in_process(_object_state(), path)
    md = torch_metadata(path)
    sizes = {index.fqn: info.length for index, info in md.storage_data.items()
             if type(md.state_dict_metadata[index.fqn]).__name__ == "BytesStorageMetadata"}
    assert sorted(sizes) == sorted(f"obj.{k}" for k in _object_state()["obj"])
    assert len(set(sizes.values())) > 2  # sizes that tell the items apart
    info = sp.inspect(path)
    expected = {k: (o.encoding, o.nbytes) for k, o in info.objects.items()}
    # Not read when the checkpoint is opened: each is shown as the torch.save item it is, with its size.
    assert expected == {k: ("torch-save", sizes[k]) for k in sizes}
    assert list(info.tensors) == ["t"]
    shown = json.loads(cli("inspect", "--json", path).stdout)
    assert {o["name"]: (o["encoding"], o["bytes"]) for o in shown["objects"]} == expected


def test_objects_need_allow_pickle_only_when_they_need_code(tmp_path):
    path = str(tmp_path / "objects")
    original = _object_state()
    save_in_process(original, path)
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load_full(path)
    assert str(e.value) == ("object 'obj.date' needs global 'datetime.date', which torch.load(weights_only=True) does "
                            "not allow; loading it runs code from the checkpoint; pass allow_pickle=True")
    plain = [f"obj.{k}" for k in original["obj"] if f"obj.{k}" not in NEEDS_CODE]
    expected = {"obj": {k: v for k, v in original["obj"].items() if f"obj.{k}" not in NEEDS_CODE}}
    assert differences(sp.load_full(path, keys=plain), expected) == []  # plain data: no opt-in needed
    assert bit_equal(sp.load_full(path, keys=["t"])["t"], original["t"])
    template = {"t": torch.zeros(4, 3), "obj": {k: None for k in original["obj"]}}
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load(template, path)
    assert any(f"object '{k}' needs global '{g}'" in str(e.value) for k, g in NEEDS_CODE.items()), str(e.value)
    full = sp.load_full(path, allow_pickle=True)
    assert differences(full, original) == [] and type(full["obj"]["fraction"]) is fractions.Fraction
    result = sp.load(template, path, allow_pickle=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert differences(template, original) == []


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: clear errors, no crash.

def _damage_base(root) -> str:
    path = str(root / "good")
    save_in_process({"w": random_tensor((64, 32), torch.float32, 500), "b": random_tensor((32,), torch.float32, 501),
                     "step": 3}, path)
    return path


def _damaged(good: str, root, name: str, damage) -> str:
    path = str(root / name)
    shutil.copytree(good, path)
    damage(path, storage_of(path, "w"))
    return path


def _truncate_item_file(path, w):
    os.truncate(os.path.join(path, w.relative_path), w.length // 2)


def _remove_item_file(path, w):
    os.remove(os.path.join(path, w.relative_path))


def _point_past_the_end(path, w):
    md = torch_metadata(path)
    index = next(i for i in md.storage_data if i.fqn == "w")
    md.storage_data[index] = dataclasses.replace(w, length=w.length + 4096)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _truncate_metadata(path, w):
    os.truncate(os.path.join(path, ".metadata"), os.path.getsize(os.path.join(path, ".metadata")) // 2)


class _RunsACommand:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _metadata_running_os_system(path, w):
    evil = _RunsACommand()
    evil.marker = os.path.join(os.path.dirname(path), "command-ran")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(evil, f)


DAMAGES = {  # name: (damage, exception class, what the message names besides the file)
    "truncated_item_file": (_truncate_item_file, sp.CheckpointCorruptError, ["'w'", "past the end"]),
    "missing_item_file": (_remove_item_file, sp.CheckpointCorruptError, ["missing"]),
    "storage_past_the_end": (_point_past_the_end, sp.CheckpointCorruptError, ["'w'", "past the end"]),
    "truncated_metadata": (_truncate_metadata, sp.CheckpointCorruptError, ["truncated"]),
    "metadata_calling_os_system": (_metadata_running_os_system, sp.CheckpointCorruptError,
                                   ["posix.system", "not in the DCP metadata allowlist"]),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_checkpoint_errors_are_clear(tmp_path, name):
    good = _damage_base(tmp_path)
    damage, error_class, words = DAMAGES[name]
    path = _damaged(good, tmp_path, name, damage)
    in_metadata = name.endswith("metadata") or name.endswith("os_system")
    culprit = ".metadata" if in_metadata else storage_of(good, "w").relative_path
    template = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "step": 0}
    for attempt in (lambda: sp.load(template, path, allow_pickle=True), lambda: sp.load_full(path, allow_pickle=True)):
        with pytest.raises(error_class) as e:
            attempt()
        assert culprit in str(e.value) and all(word in str(e.value) for word in words), str(e.value)
    for verb in ("verify", "inspect"):
        run = cli(verb, path)
        assert run.returncode == 1 and culprit in run.stderr, (verb, run.returncode, run.stderr)
    assert not os.path.exists(os.path.join(tmp_path, "command-ran"))


def test_missing_item_file_error_names_the_key(tmp_path):
    path = _damaged(_damage_base(tmp_path), tmp_path, "missing", _remove_item_file)
    with pytest.raises(sp.CheckpointCorruptError) as e:
        sp.load({"w": torch.zeros(64, 32)}, path, strict=False)
    assert "'w'" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Reading only what is needed.

def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_one_shard_of_a_big_item_reads_about_that_shard(tmp_path):
    path = str(tmp_path / "big")
    big = random_tensor((1024, 256), torch.float32, 600)  # 1 MiB in one item
    save_in_process({"big": big}, path)
    assert storage_of(path, "big").length > 1 << 20
    shard = torch.zeros(256, 256)
    before = _rchar()
    result = sp.load({"big": sp.ShardedTensor(shard, (1024, 256), (256, 0))}, path)
    read = _rchar() - before
    assert bit_equal(shard, big[256:512])
    assert result.bytes_read == shard.numel() * 4
    assert read < shard.numel() * 4 + (128 << 10)  # the shard, .metadata and item headers; not the whole item
    whole = torch.zeros(1024, 256)
    assert sp.load({"big": whole}, path).bytes_read == 1 << 20 and bit_equal(whole, big)

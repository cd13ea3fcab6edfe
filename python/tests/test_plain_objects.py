"""Plain Python objects come back exactly, in both formats and through torch's own DCP.

Every plain type and nesting (tuples, dicts with non-str keys, NaN / inf / -0.0, bytes inside
containers, None, bool vs int vs float, the int64 limits) goes through (a) sp.save native ->
sp.load / sp.load_full, (b) sp.save torch-dcp -> dcp.load / sp.load, (c) torch's dcp.save ->
sp.load / sp.load_full without allow_pickle. Types are compared, not only values: a tuple must be a
tuple, 1, True and 1.0 differ, NaN is compared by its bits. DCP BYTE_IO items that need code are
refused naming the global that needs it, and are never run.
"""

from __future__ import annotations

import copy
import fractions
import math
import os
import struct
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardpoint as sp
from shardpoint import _core
from torch_dcp_util import bit_equal, cli, save_in_process

NAN, INF = float("nan"), float("inf")
# Leaves as DCP sees them too: a dict with non-str keys only inside a tuple (DCP walks dicts).
VALUES = {
    "int": 7, "bool": True, "float": 1.0, "none": None, "str": "h\u00e9llo \u2603", "neg_zero": -0.0,
    "nan": NAN, "inf": INF, "ninf": -INF, "int64_min": -2 ** 63, "int64_max": 2 ** 63 - 1,
    "betas": (0.9, 0.999), "empty_tuple": (), "single": (1,), "nested_tuples": ((1, (2.5, (None,))), "x"),
    "list_of_tuples": [(1, 2), (3, (4,))],
    "one_true_float": [1, True, 1.0, 0, False, 0.0, (1, True, 1.0)],
    "bytes_inside": ([b"\x00\xff", b""], {"k": b"\x80"}),
    "keyed": ({1: "a", 2.5: "b", None: "c", (1, "x"): "d", b"k": "e", False: "f", "s": (NAN,)},),
    "non_finite": (NAN, -0.0, INF, -INF),
    "grid": [[1, 2], [3]],
    "mixed_list": [1, "a", None, [2.5, (3,)]],
}
# The leaves JSON holds exactly (stored as "json"); the others are stored as "plain".
JSON_KEYS = {"int", "bool", "float", "none", "str", "neg_zero", "int64_min", "int64_max", "grid"}


def same(a, b) -> bool:
    """Equal with equal types at every level; floats by their bits (NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(b, torch.Tensor):
        return bit_equal(a, b)
    if isinstance(b, dict):  # keys matched by type and bits (1, True and 1.0 are one dict key in Python)
        return len(a) == len(b) and all(any(same(ka, kb) and same(va, vb) for ka, va in a.items())
                                        for kb, vb in b.items())
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def differing(actual: dict, expected: dict) -> list[str]:
    return [k for k in expected if k not in actual or not same(actual[k], expected[k])]


def torch_load(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.load(state, checkpoint_id=path, no_dist=True)


def with_tensor(values: dict) -> dict:
    return {"w": torch.arange(6.0).reshape(2, 3), **copy.deepcopy(values)}


def test_same_tells_types_and_nan_bits_apart():
    assert same(VALUES, copy.deepcopy(VALUES))
    assert not same((1,), [1]) and not same(1, True) and not same(1, 1.0) and not same(0.0, -0.0)
    assert not same({1: "a"}, {1.0: "a"}) and same(NAN, NAN) and not same(NAN, -NAN)


def test_native_round_trip_is_exact(tmp_path):
    path = str(tmp_path / "native")
    values = {**VALUES, "int_keys": {1: "a", 2: {"b": (1,)}}}  # a dict with int keys is one object here
    sp.save(with_tensor(values), path)
    encodings = {k: o.encoding for k, o in sp.inspect(path).objects.items()}
    assert encodings == {k: "json" if k in JSON_KEYS else "plain" for k in values}
    full = sp.load_full(path)
    assert differing(full, with_tensor(values)) == []
    assert list(full["keyed"][0]) == list(values["keyed"][0])  # a plain dict keeps its order
    template = {"w": torch.zeros(2, 3), **{k: None for k in values}}
    sp.load(template, path)
    assert differing(template, with_tensor(values)) == []


def read_encodings(path):
    """The encodings of a DCP checkpoint's objects once read: opening it (inspect) reads no
    object item, so inspect shows each as the torch.save archive it is stored as."""
    names = list(sp.inspect(path).objects)
    return {name: encoding for name, encoding, _ in _core.read_objects(path, names)}


def test_torch_dcp_written_by_shardpoint_is_exact_for_torch_and_shardpoint(tmp_path):
    path = str(tmp_path / "dcp")
    sp.save(with_tensor(VALUES), path, format="torch-dcp")
    theirs = {"w": torch.zeros(2, 3), **{k: None for k in VALUES}}
    torch_load(theirs, path)
    assert differing(theirs, with_tensor(VALUES)) == []
    assert set(read_encodings(path).values()) == {"plain"}
    assert differing(sp.load_full(path), with_tensor(VALUES)) == []
    ours = {"w": torch.zeros(2, 3), **{k: None for k in VALUES}}
    sp.load(ours, path)
    assert differing(ours, with_tensor(VALUES)) == []


def test_torch_dcp_written_by_torch_needs_no_allow_pickle_for_plain_data(tmp_path):
    path = str(tmp_path / "torch")
    save_in_process(with_tensor(VALUES), path)
    assert set(read_encodings(path).values()) == {"plain"}
    assert differing(sp.load_full(path), with_tensor(VALUES)) == []
    template = {"w": torch.zeros(2, 3), **{k: None for k in VALUES}}
    sp.load(template, path)
    assert differing(template, with_tensor(VALUES)) == []
    shown = cli("inspect", path).stdout
    assert "betas  torch-save" in shown  # as stored: inspect reads no object item


def test_tensors_inside_objects_load_without_allow_pickle(tmp_path):
    original = {"w": (torch.arange(3.0), 2), "size": torch.Size([2, 3]),
                "pairs": [(torch.ones(2, dtype=torch.bfloat16), "x")]}
    for fmt in ("native", "torch-dcp", "torch"):
        path = str(tmp_path / fmt)
        if fmt == "torch":
            save_in_process(original, path)
        else:
            sp.save(original, path, format=fmt)
        assert {o.encoding for o in sp.inspect(path).objects.values()} == {"torch-save"}, fmt
        assert differing(sp.load_full(path), original) == [], fmt
        template = {"w": (torch.zeros(3), 0), "size": None, "pairs": []}
        sp.load(template, path)
        assert differing(template, original) == [], fmt


def _adamw(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _train_state(seed: int) -> dict:
    model, optimizer = _adamw(seed)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": dict(model_sd), "optim": optim_sd, "train_state": {"step": 3, "ntokens_seen": 4096}}


@pytest.mark.parametrize("writer", ["native", "torch-dcp", "torch"])
def test_adamw_state_dict_round_trip_keeps_betas_a_tuple(tmp_path, writer):
    path = str(tmp_path / writer)
    original = _train_state(1)
    if writer == "torch":
        save_in_process(original, path)
    else:
        sp.save(original, path, format=writer)
    template = _train_state(2)
    sp.load(template, path)
    betas = template["optim"]["param_groups"][0]["betas"]
    assert type(betas) is tuple and betas == (0.8, 0.95)
    assert differing(template, original) == []
    assert differing(sp.load_full(path), original) == []
    if writer != "native":
        theirs = _train_state(3)
        torch_load(theirs, path)
        assert type(theirs["optim"]["param_groups"][0]["betas"]) is tuple
        assert differing(theirs, original) == []
    model, optimizer = _adamw(4)
    set_state_dict(model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"])
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)


def test_cli_convert_keeps_plain_objects_exact_both_ways(tmp_path):
    native, dcp_path, back = (str(tmp_path / n) for n in ("native", "dcp", "back"))
    sp.save(with_tensor(VALUES), native)
    assert cli("convert", native, dcp_path, "--to", "torch-dcp").returncode == 0
    theirs = {"w": torch.zeros(2, 3), **{k: None for k in VALUES}}
    torch_load(theirs, dcp_path)
    assert differing(theirs, with_tensor(VALUES)) == []
    assert cli("convert", dcp_path, back, "--to", "native").returncode == 0
    assert sp.inspect(back).objects["betas"].encoding == "plain"
    assert differing(sp.load_full(back), with_tensor(VALUES)) == []


@pytest.mark.parametrize("fmt", ["native", "torch-dcp"])
@pytest.mark.parametrize("value", [2 ** 63, -(2 ** 63) - 1, 2 ** 80])
def test_an_int_beyond_64_bits_is_refused_naming_key_and_value(tmp_path, fmt, value):
    path = str(tmp_path / "big")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.save({"w": torch.ones(2), "sched": {"counts": (1, [value])}}, path, format=fmt)
    assert str(e.value) == (f"state dict key 'sched.counts' holds the int {value}, which does not fit in 64 bits; "
                            f"checkpoints store ints from -2**63 to 2**63-1 (store a larger one as a str)")
    assert not os.path.exists(path) or not os.listdir(path)


def test_an_object_needing_code_is_refused_naming_the_global(tmp_path):
    path = str(tmp_path / "fraction")
    original = {"w": torch.ones(2), "lr_scheduler": {"scale": fractions.Fraction(1, 3), "step": 2}}
    save_in_process(original, path)
    encodings = read_encodings(path)
    assert encodings["lr_scheduler.scale"] == "torch-save"
    assert encodings["lr_scheduler.step"] == "plain"
    expected = ("object 'lr_scheduler.scale' needs global 'fractions.Fraction', which torch.load(weights_only=True) "
                "does not allow; loading it runs code from the checkpoint; pass allow_pickle=True")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load_full(path)
    assert str(e.value) == expected
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load({"w": torch.zeros(2), "lr_scheduler": {"scale": None, "step": 0}}, path)
    assert str(e.value) == expected
    full = sp.load_full(path, allow_pickle=True)
    assert type(full["lr_scheduler"]["scale"]) is fractions.Fraction and differing(full, original) == []


class RunsACommand:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_byte_io_item_never_runs(tmp_path):
    path, marker = str(tmp_path / "hostile"), str(tmp_path / "ran")
    save_in_process({"w": torch.ones(2), "evil": RunsACommand(marker)}, path)
    assert sp.inspect(path).objects["evil"].encoding == "torch-save"
    expected = ("object 'evil' needs global 'posix.system', which torch.load(weights_only=True) does not allow; "
                "loading it runs code from the checkpoint; pass allow_pickle=True")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load_full(path)
    assert str(e.value) == expected
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load({"w": torch.zeros(2), "evil": None}, path)
    assert str(e.value) == expected
    native = str(tmp_path / "native")
    assert cli("convert", path, native, "--to", "native").returncode == 0
    assert "torch-save" in cli("inspect", native).stdout
    with pytest.raises(sp.CheckpointArgumentError, match="global 'posix.system'"):
        sp.load_full(native)
    assert bit_equal(sp.load_full(path, keys=["w"])["w"], torch.ones(2))
    assert not os.path.exists(marker)


def test_a_plain_payload_holding_code_is_corrupt_and_never_runs(tmp_path):
    import pickle

    from shardpoint._values import decode_object

    marker = str(tmp_path / "ran")
    with pytest.raises(sp.CheckpointCorruptError, match="object 'x' .*global 'posix.system' is not plain data"):
        decode_object("x", "plain", pickle.dumps(RunsACommand(marker), protocol=2), allow_pickle=True)
    with pytest.raises(sp.CheckpointCorruptError, match="_codecs.encode with encoding 'rot13'"):
        decode_object("x", "plain", b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.",
                      allow_pickle=False)
    assert not os.path.exists(marker)


def test_json_objects_of_older_checkpoints_still_take_tuples_from_the_template():
    from shardpoint._values import decode_object

    assert decode_object("b", "json", b"[0.9,[1,2]]", False, template=(0.0, (0, 0))) == (0.9, (1, 2))
    assert type(decode_object("b", "json", b"[0.9,[1,2]]", False, template=(0.0, (0, 0)))[1]) is tuple

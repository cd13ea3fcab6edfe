"""Single-process behaviour of the public API: round trips, structure, keys, dtypes, objects, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint import _errors, _flatten

NUMPY_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def random_numpy(rng: np.random.Generator, dtype: str, shape) -> np.ndarray:
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    if np.dtype(dtype).kind in "fc":
        array[~np.isfinite(array)] = 0  # NaNs would make == comparisons fail; the bits still vary
    if dtype == "bool":
        array = raw.reshape(shape).astype(bool) if raw.size else np.zeros(shape, bool)
    return array


def random_torch(g: torch.Generator, dtype: torch.dtype, shape) -> torch.Tensor:
    bits = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                         generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (bits % 2).bool().reshape(shape)
    return bits.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def test_numpy_round_trip_every_dtype(tmp_path):
    rng = np.random.default_rng(7)
    state = {dtype: random_numpy(rng, dtype, (3, 5)) for dtype in NUMPY_DTYPES}
    state["empty"] = np.zeros((0, 4), np.float32)
    state["scalar"] = np.array(2.5)
    sp.save(state, tmp_path / "c")
    target = {k: np.zeros_like(v) for k, v in state.items()}
    sp.load(target, tmp_path / "c")
    for key in state:
        assert target[key].dtype == state[key].dtype
        assert target[key].tobytes() == state[key].tobytes(), key


def test_torch_round_trip_every_dtype_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {str(d).removeprefix("torch."): random_torch(g, d, (4, 6)) for d in TORCH_DTYPES}
    sp.save(state, str(tmp_path / "c"))
    info = sp.inspect(str(tmp_path / "c"))
    assert {k: v.dtype for k, v in info.tensors.items()} == {k: k for k in state}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    sp.load(target, str(tmp_path / "c"))
    full = sp.load_full(str(tmp_path / "c"))
    for key in state:
        assert same_bits(target[key], state[key]), key
        assert same_bits(full[key], state[key]), key


def test_nested_structure_is_flattened_and_rebuilt(tmp_path):
    state = {"model": {"layers": [{"w": torch.arange(6.0).reshape(2, 3)}, {"w": torch.ones(2, 3)}]},
             "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"]}]},
             "empty": {}, "none": None, "blob": b"\x00\x01", "np": np.arange(4)}
    sp.save(state, tmp_path / "c")
    info = sp.inspect(tmp_path / "c")
    assert set(info.tensors) == {"model.layers.0.w", "model.layers.1.w", "np"}
    assert {k: v.encoding for k, v in info.objects.items()} == {
        "optim.param_groups.0.lr": "json", "optim.param_groups.0.betas": "plain", "optim.param_groups.0.params": "json",
        "empty": "json", "none": "json", "blob": "bytes"}
    full = sp.load_full(tmp_path / "c")
    assert list(full) == ["model", "optim", "empty", "none", "blob", "np"]
    assert torch.equal(full["model"]["layers"][0]["w"], state["model"]["layers"][0]["w"])
    assert full["optim"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"]}
    assert type(full["optim"]["param_groups"][0]["betas"]) is tuple
    assert full["empty"] == {} and full["none"] is None and full["blob"] == b"\x00\x01"
    assert torch.equal(full["np"], torch.arange(4))
    template = {"model": {"layers": [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)}]},
                "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
                "empty": {}, "none": 1, "blob": b"", "np": np.zeros(4, np.int64)}
    sp.load(template, tmp_path / "c")
    assert template["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert template["empty"] == {} and template["none"] is None and template["blob"] == b"\x00\x01"
    assert torch.equal(template["model"]["layers"][1]["w"], torch.ones(2, 3))


def test_nested_plain_lists_are_one_object_and_tuples_come_back(tmp_path):
    # As in DCP: a list of lists of scalars is one object; tuples are stored exactly ("plain").
    state = {"grid": [[1, 2], [3]], "pairs": ((1, 2), (3, 4)), "w": torch.ones(2)}
    sp.save(state, tmp_path / "c")
    assert {k: v.encoding for k, v in sp.inspect(tmp_path / "c").objects.items()} == {"grid": "json", "pairs": "plain"}
    assert sp.load_full(tmp_path / "c")["pairs"] == ((1, 2), (3, 4))
    template = {"grid": [], "pairs": None, "w": torch.zeros(2)}
    sp.load(template, tmp_path / "c")
    assert template["grid"] == [[1, 2], [3]] and template["pairs"] == ((1, 2), (3, 4))


def test_load_full_keys_selects_by_name_or_prefix(tmp_path):
    state = {"a": {"x": torch.ones(2), "y": torch.zeros(3)}, "b": torch.full((2,), 7.0), "n": 3}
    sp.save(state, tmp_path / "c")
    assert set(sp.load_full(tmp_path / "c", keys=["a"])["a"]) == {"x", "y"}
    part = sp.load_full(tmp_path / "c", keys=["a.y", "n"])
    assert set(part) == {"a", "n"} and set(part["a"]) == {"y"} and part["n"] == 3
    with pytest.raises(sp.CheckpointNotFoundError, match="nope"):
        sp.load_full(tmp_path / "c", keys=["nope"])


def test_strict_and_non_strict_keys(tmp_path):
    sp.save({"a": torch.ones(2), "b": torch.ones(3), "o": 1}, tmp_path / "c")
    with pytest.raises(sp.CheckpointNotFoundError, match="extra"):
        sp.load({"a": torch.zeros(2), "extra": torch.zeros(1)}, tmp_path / "c")
    target = {"a": torch.zeros(2), "extra": torch.zeros(1), "o2": 5}
    result = sp.load(target, tmp_path / "c", strict=False)
    assert sorted(result.missing_keys) == ["extra", "o2"]
    assert sorted(result.unexpected_keys) == ["b", "o"]
    assert torch.equal(target["a"], torch.ones(2)) and target["o2"] == 5


def test_dtype_mismatch_is_an_error_unless_cast(tmp_path):
    source = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    sp.save({"w": source}, tmp_path / "c")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load({"w": torch.zeros(3, dtype=torch.bfloat16)}, tmp_path / "c")
    assert "w" in str(e.value) and "float32" in str(e.value) and "bfloat16" in str(e.value)
    target = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    sp.load(target, tmp_path / "c", cast=True)
    assert torch.equal(target["w"], source.to(torch.bfloat16))
    with pytest.raises(sp.CheckpointArgumentError, match="w"):
        sp.load({"w": torch.zeros(4)}, tmp_path / "c")


class Opaque:
    def __init__(self, value):
        self.value = value


def test_pickle_is_refused_unless_allowed(tmp_path):
    with pytest.raises(sp.CheckpointArgumentError, match=r"'extra.cfg'.*allow_pickle"):
        sp.save({"extra": {"cfg": Opaque(1)}}, tmp_path / "c")
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(tmp_path / "c")
    sp.save({"extra": {"cfg": Opaque(4)}, "t": torch.ones(1)}, tmp_path / "c", allow_pickle=True)
    assert sp.inspect(tmp_path / "c").objects["extra.cfg"].encoding == "pickle"
    with pytest.raises(sp.CheckpointArgumentError, match=r"'extra.cfg'.*allow_pickle"):
        sp.load({"extra": {"cfg": None}}, tmp_path / "c", strict=False)
    with pytest.raises(sp.CheckpointArgumentError, match="allow_pickle"):
        sp.load_full(tmp_path / "c")
    target = {"extra": {"cfg": None}}
    sp.load(target, tmp_path / "c", strict=False, allow_pickle=True)
    assert target["extra"]["cfg"].value == 4
    assert sp.load_full(tmp_path / "c", allow_pickle=True)["extra"]["cfg"].value == 4


def test_non_contiguous_tensors_save_and_load_in_place(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sp.save({"t": base.t(), "s": base[:, ::2]}, tmp_path / "c")
    full = sp.load_full(tmp_path / "c")
    assert torch.equal(full["t"], base.t()) and torch.equal(full["s"], base[:, ::2])
    holder = torch.zeros(4, 6)
    target = {"t": holder.t(), "s": torch.zeros(4, 6)[:, ::2]}
    sp.load(target, tmp_path / "c")
    assert torch.equal(holder, base)                # written through the transposed view
    assert torch.equal(target["s"], base[:, ::2])


def test_existing_checkpoint_needs_overwrite(tmp_path):
    sp.save({"a": torch.ones(1)}, tmp_path / "c")
    with pytest.raises(sp.CheckpointExistsError) as e:
        sp.save({"a": torch.zeros(1)}, tmp_path / "c")
    assert isinstance(e.value, FileExistsError) and e.value.code == "ALREADY_EXISTS"
    sp.save({"a": torch.full((1,), 2.0)}, tmp_path / "c", overwrite=True)
    assert sp.load_full(tmp_path / "c")["a"].item() == 2.0


def test_missing_checkpoint_errors(tmp_path):
    for call in (lambda: sp.inspect(tmp_path / "none"), lambda: sp.load({"a": torch.ones(1)}, tmp_path / "none"),
                 lambda: sp.load_full(tmp_path / "none"), lambda: sp.verify(tmp_path / "none")):
        with pytest.raises(sp.CheckpointNotFoundError) as e:
            call()
        assert isinstance(e.value, FileNotFoundError) and e.value.code == "NOT_FOUND"


def test_verify_reports_sound_and_damaged_checkpoints(tmp_path):
    sp.save({"a": torch.arange(1000, dtype=torch.float32)}, tmp_path / "c")
    report = sp.verify(tmp_path / "c")
    assert report.ok and report.defects == [] and report.bytes_checked >= 4000
    data = [p for p in (tmp_path / "c").iterdir() if p.suffix == ".safetensors"]
    raw = bytearray(data[0].read_bytes())
    raw[-5] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    report = sp.verify(tmp_path / "c")
    assert not report.ok and any(data[0].name in d for d in report.defects)
    with pytest.raises(sp.CheckpointCorruptError):
        sp.load({"a": torch.zeros(1000)}, tmp_path / "c")


def test_error_codes_map_to_exception_classes():
    cases = {"NOT_FOUND": (sp.CheckpointNotFoundError, FileNotFoundError),
             "ALREADY_EXISTS": (sp.CheckpointExistsError, FileExistsError),
             "DATA_LOSS": (sp.CheckpointCorruptError, sp.CheckpointError),
             "FAILED_PRECONDITION": (sp.CheckpointVersionError, sp.CheckpointError),
             "INVALID_ARGUMENT": (sp.CheckpointArgumentError, ValueError),
             "UNAVAILABLE": (sp.CheckpointError, RuntimeError)}
    for code, (cls, base) in cases.items():
        error = _errors.error_for(code, "message")
        assert type(error) is cls and isinstance(error, base) and error.code == code and str(error) == "message"


def test_flatten_rejects_colliding_keys_and_non_string_keys():
    with pytest.raises(ValueError, match="a.b"):
        _flatten.flatten({"a.b": 1, "a": {"b": 2}}, lambda v: False)
    with pytest.raises(TypeError, match="key 1.5 under a is not a str or an int"):
        _flatten.flatten({"a": {1.5: torch.ones(1)}}, lambda v: isinstance(v, torch.Tensor))
    with pytest.raises(TypeError, match="key 1 under <root> is not a str"):
        _flatten.flatten({1: torch.ones(1)}, lambda v: isinstance(v, torch.Tensor))
    flat, paths = _flatten.flatten({"a": {1: torch.ones(1)}}, lambda v: isinstance(v, torch.Tensor))
    assert list(flat) == ["a.1"] and type(paths["a.1"][1]) is _flatten.IntKey  # walked as DCP walks it
    assert _flatten.flatten({"a": {1: 2}}, lambda v: False) == ({"a": {1: 2}}, {"a": ("a",)})  # one plain object
    flat, paths = _flatten.flatten({"a": [torch.ones(1), {"b": 2}], "c": [1, 2]}, lambda v: isinstance(v, torch.Tensor))
    assert list(flat) == ["a.0", "a.1.b", "c"] and paths["a.1.b"] == ("a", 1, "b")
    assert json.loads(json.dumps(_flatten.encode_paths(paths))) == [["a.0", ["a", 0]], ["a.1.b", ["a", 1, "b"]], ["c", ["c"]]]


def test_works_with_numpy_alone_when_torch_cannot_be_imported(tmp_path):
    import subprocess
    import sys

    script = f"""
import sys
sys.modules["torch"] = None  # import torch now raises ImportError
import numpy as np
import shardpoint as sp
state = {{"w": np.arange(12, dtype=np.float32).reshape(3, 4), "opt": {{"lr": 0.5, "m": np.ones(3, np.int16)}}}}
sp.save(state, {str(tmp_path / "c")!r})
full = sp.load_full({str(tmp_path / "c")!r})
assert type(full["w"]) is np.ndarray and np.array_equal(full["w"], state["w"]), full
assert full["opt"]["lr"] == 0.5 and full["opt"]["m"].dtype == np.int16
target = {{"w": np.zeros((3, 4), np.float32), "opt": {{"lr": 0.0, "m": np.zeros(3, np.int16)}}}}
sp.load(target, {str(tmp_path / "c")!r})
assert np.array_equal(target["w"], state["w"]) and target["opt"]["lr"] == 0.5
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m == "torch"]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_progress_bar_on_a_terminal_and_quiet_otherwise():
    import io

    from shardpoint._progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = Progress("load", 3 << 20, stream=terminal)
    progress.enabled = True  # SHARDPOINT_QUIET is set for the test session
    progress.advance(1 << 20)
    progress.advance(2 << 20)
    progress.finish()
    text = terminal.getvalue()
    assert "[##########" in text and "1.0 MiB / 3.0 MiB" in text and "load: 3.0 MiB in" in text and "GB/s" in text
    quiet = io.StringIO()
    progress = Progress("load", 10, stream=quiet)
    progress.advance(10)
    progress.finish()
    assert not progress.enabled and quiet.getvalue() == ""
    assert not Progress("load", 10, rank=1, stream=Terminal()).enabled


def test_default_threads_share_the_machine_among_its_ranks_with_at_least_two_each(monkeypatch):
    from shardpoint import _dist

    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank = rank

    assert _dist.default_threads(None) == 0  # one process: the core's own default
    monkeypatch.setattr(_dist, "_cores", lambda: 2)
    monkeypatch.setattr(_dist, "_hosts", lambda comm: [b"node0"] * 4)
    assert _dist.default_threads(Rank(3)) == 2  # max(4, 2) // 4 = 1, raised to 2
    monkeypatch.setattr(_dist, "_cores", lambda: 64)
    monkeypatch.setattr(_dist, "_hosts", lambda comm: [b"node0"] * 8)
    assert _dist.default_threads(Rank(5)) == 8
    monkeypatch.setattr(_dist, "_hosts", lambda comm: [b"node0", b"node0", b"node1", b"node1", b"node1", b"node1"])
    assert _dist.default_threads(Rank(0)) == 32
    assert _dist.default_threads(Rank(4)) == 16


def _trained_model_and_adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        model(torch.randn(3, 5)).square().sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("fmt", ["native", "torch-dcp"])
def test_a_raw_optimizer_state_dict_with_int_keys_round_trips(tmp_path, fmt):
    """optimizer.state_dict()["state"] is keyed by int parameter ids and holds tensors: walked as
    DCP walks it ("optimizer.state.0.exp_avg"), loaded back under the int keys, rebuilt with int keys
    by load_full; torch's dcp.load reads the torch-dcp checkpoint into the same structure."""
    model, optimizer = _trained_model_and_adamw(0)
    path = str(tmp_path / "ckpt")
    sp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path, format=fmt)
    names = set(sp.inspect(path).tensors)
    assert "optimizer.state.0.exp_avg" in names and "optimizer.state.3.exp_avg_sq" in names

    fresh_model, fresh_optimizer = _trained_model_and_adamw(1)
    template = {"model": fresh_model.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    sp.load(template, path)
    fresh_optimizer.load_state_dict(template["optimizer"])
    expected, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert sorted(got["state"]) == [0, 1, 2, 3]
    for pid, state in expected["state"].items():
        for name, value in state.items():
            assert same_bits(got["state"][pid][name], value), (pid, name)
    assert got["param_groups"][0]["betas"] == (0.8, 0.95)

    full = sp.load_full(path)
    assert sorted(full["optimizer"]["state"]) == ([0, 1, 2, 3] if fmt == "native" else ["0", "1", "2", "3"])
    if fmt == "torch-dcp":  # DCP names dict keys by str(key); its own load walks the template the same way
        import torch.distributed.checkpoint as dcp

        model_b, optimizer_b = _trained_model_and_adamw(2)
        target = {"model": model_b.state_dict(), "optimizer": optimizer_b.state_dict()}
        dcp.load(target, checkpoint_id=path, no_dist=True)
        assert same_bits(target["optimizer"]["state"][2]["exp_avg"], expected["state"][2]["exp_avg"])


def test_int_key_paths_are_tagged_so_lists_and_dicts_come_back_apart():
    is_tensor = lambda v: isinstance(v, torch.Tensor)  # noqa: E731
    flat, paths = _flatten.flatten({"opt": {0: {"m": torch.zeros(1)}}, "layers": [torch.ones(1)]}, is_tensor)
    assert list(flat) == ["opt.0.m", "layers.0"]
    encoded = _flatten.encode_paths(paths)
    assert json.loads(json.dumps(encoded)) == [["opt.0.m", ["opt", {"int": 0}, "m"]], ["layers.0", ["layers", 0]]]
    rebuilt = _flatten.unflatten(flat, _flatten.decode_paths(json.loads(json.dumps(encoded))))
    assert list(rebuilt["opt"]) == [0] and type(list(rebuilt["opt"])[0]) is int
    assert isinstance(rebuilt["layers"], list)
    with pytest.raises(TypeError, match=r"state dict key 1.5 under opt is not a str or an int"):
        _flatten.flatten({"opt": {1.5: torch.zeros(1)}}, is_tensor)

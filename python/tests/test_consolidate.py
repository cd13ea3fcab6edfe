"""sp.consolidate: bit-exact Hugging Face outputs from multi-rank and Hugging Face sources, dtype
conversion against torch, selection and renaming, refusals, bounded memory; and Hugging Face
directories as sources of sp.load, sp.inspect and sp.verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardpoint as sp
from distributed import run_ranks


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {
        "model.embed.weight": torch.randn(37, 16, generator=g),
        "model.layers.0.mlp.w1": (torch.randn(24, 16, generator=g) * 10).to(torch.bfloat16),
        "model.layers.0.mlp.w2": torch.randn(16, 24, generator=g, dtype=torch.float64),
        "model.layers.1.mlp.w1": torch.randn(24, 16, generator=g).to(torch.float16),
        "model.norm.bias": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(37, 16, generator=g),
        "step": torch.tensor(1234, dtype=torch.int64),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
    }
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def read_outputs(out_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a consolidated directory, through safetensors itself, checked against the index."""
    names = sorted(n for n in os.listdir(out_dir) if n.endswith(".safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for name in names:
        for key, t in load_file(os.path.join(out_dir, name)).items():
            assert key not in tensors, key
            tensors[key], where[key] = t, name
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if len(names) > 1:
        with open(index) as f:
            idx = json.load(f)
        assert idx["weight_map"] == where
        assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    else:
        assert not os.path.exists(index)
    return tensors


def _save_two_ranks(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for i, (name, t) in enumerate(reference().items()):
        if t.dim() == 0 or t.dtype == torch.bool:
            state[name] = t  # plain tensors: the same on every rank (replicas)
        else:
            placement = Shard(i % t.dim()) if t.dim() > 1 else Shard(0)
            state[name] = distribute_tensor(t, mesh, [placement if i % 3 else Replicate()])
    sp.save(state, path)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step_1")
    run_ranks(2, _save_two_ranks, path)
    assert sp.inspect(path).world_size == 2
    return path


def test_two_rank_dtensor_save_consolidates_bit_exact_into_shards(two_rank_checkpoint, tmp_path):
    result = sp.consolidate(two_rank_checkpoint, tmp_path / "hf", max_shard_size=3000)
    assert result.index_file == "model.safetensors.index.json"
    assert len(result.files) > 1 and result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    got = read_outputs(tmp_path / "hf")
    ref = reference()
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name
    assert result.tensors == len(ref)
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in ref.values())
    # Every file is at most the shard size unless it holds one larger tensor.
    for f in result.files:
        with open(tmp_path / "hf" / f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        assert header["__metadata__"] == {"format": "pt"}
        data = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        assert data <= 3000 or len(header) == 2


def test_single_file_and_refusal_to_overwrite(two_rank_checkpoint, tmp_path):
    result = sp.consolidate(two_rank_checkpoint, tmp_path, max_shard_size="5GB")
    assert result.files == ["model.safetensors"] and result.index_file is None
    assert os.listdir(tmp_path) == ["model.safetensors"]
    with pytest.raises(sp.CheckpointExistsError, match="already holds model.safetensors"):
        sp.consolidate(two_rank_checkpoint, tmp_path)
    sp.consolidate(two_rank_checkpoint, tmp_path, max_shard_size="2KB", overwrite=True)
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert set(read_outputs(tmp_path)) == set(reference())


@pytest.mark.parametrize("dtype", [torch.bfloat16, "fp16"])
def test_dtype_conversion_matches_torch_bit_for_bit(tmp_path, dtype):
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.0e38, -3.4e38, 1e-40, -1e-45, 65504.0,
                            65520.0, 1e-8, float("inf"), float("-inf")], dtype=torch.float32)
    state = {"f32": torch.cat([torch.randn(5000, generator=g) * 1e3, special]),
             "f64": torch.randn(40, 7, generator=g, dtype=torch.float64) * 1e5,
             "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
             "ints": torch.arange(-5, 5, dtype=torch.int32)}
    sp.save(state, tmp_path / "c")
    sp.consolidate(tmp_path / "c", tmp_path / "out", dtype=dtype)
    got = read_outputs(tmp_path / "out")
    target = torch.bfloat16 if dtype is torch.bfloat16 else torch.float16
    for name, t in state.items():
        want = t.to(target) if t.is_floating_point() else t
        assert same_bits(got[name], want), name


def test_keys_prefixes_and_rename(two_rank_checkpoint, tmp_path):
    result = sp.consolidate(two_rank_checkpoint, tmp_path, keys=["model.layers.0", "step"], prefixes="lm_",
                            rename={"model.layers.": "layers.", "lm_head.": "head."})
    got = read_outputs(tmp_path)
    ref = reference()
    assert set(got) == {"layers.0.mlp.w1", "layers.0.mlp.w2", "step", "head.weight"}
    assert same_bits(got["layers.0.mlp.w2"], ref["model.layers.0.mlp.w2"])
    assert same_bits(got["head.weight"], ref["lm_head.weight"])
    assert result.tensors == 4
    with pytest.raises(sp.CheckpointNotFoundError, match="key 'model.layers.7' selects no tensor"):
        sp.consolidate(two_rank_checkpoint, tmp_path / "x", keys=["model.layers.7"])
    with pytest.raises(sp.CheckpointArgumentError, match="would both be written as 'w'"):
        sp.consolidate(two_rank_checkpoint, tmp_path / "y", rename=[("model.embed.weight", "w"),
                                                                    ("lm_head.weight", "w")])


def test_argument_errors(two_rank_checkpoint, tmp_path):
    with pytest.raises(sp.CheckpointArgumentError, match="invalid size '5XB'"):
        sp.consolidate(two_rank_checkpoint, tmp_path, max_shard_size="5XB")
    with pytest.raises(sp.CheckpointArgumentError, match="unknown dtype 'fp12'"):
        sp.consolidate(two_rank_checkpoint, tmp_path, dtype="fp12")
    with pytest.raises(ValueError, match="format must be"):
        sp.consolidate(two_rank_checkpoint, tmp_path, format="onnx")
    with pytest.raises(sp.CheckpointNotFoundError, match="no committed checkpoint"):
        sp.consolidate(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(sp.CheckpointArgumentError, match="holds the source checkpoint"):
        sp.consolidate(two_rank_checkpoint, two_rank_checkpoint)
    assert os.listdir(tmp_path) == []


def test_torch_format_is_read_by_torch_load(two_rank_checkpoint, tmp_path):
    result = sp.consolidate(two_rank_checkpoint, tmp_path, format="torch", max_shard_size=3000)
    assert result.index_file == "pytorch_model.bin.index.json"
    assert result.files[0] == f"pytorch_model-00001-of-{len(result.files):05d}.bin"
    with open(tmp_path / result.index_file) as f:
        weight_map = json.load(f)["weight_map"]
    got = {}
    for name in result.files:
        part = torch.load(tmp_path / name, weights_only=True)
        assert all(weight_map[k] == name for k in part)
        got.update(part)
    ref = reference()
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name
    single = sp.consolidate(two_rank_checkpoint, tmp_path / "one", format="torch", dtype=torch.bfloat16)
    assert single.files == ["pytorch_model.bin"]
    one = torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True)
    assert same_bits(one["model.embed.weight"], ref["model.embed.weight"].to(torch.bfloat16))


def _dcp_save_two_ranks(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {name: distribute_tensor(t, mesh, [Shard(0)]) if t.dim() > 0 and t.dtype != torch.bool else t
             for name, t in reference().items()}
    dcp.save(state, checkpoint_id=path)


def test_a_torch_dcp_checkpoint_consolidates_bit_exact(tmp_path):
    run_ranks(2, _dcp_save_two_ranks, str(tmp_path / "dcp"))
    result = sp.consolidate(tmp_path / "dcp", tmp_path / "hf", max_shard_size="3KB")
    assert result.index_file is not None
    got = read_outputs(tmp_path / "hf")
    ref = reference()
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name


def write_hf_directory(directory, tensors: dict[str, torch.Tensor], files: int) -> None:
    """A Hugging Face checkpoint written by the safetensors library: `files` shards and an index."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(files):
        part = names[k::files]
        fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)


def test_hugging_face_directory_is_a_source(tmp_path):
    ref = reference()
    write_hf_directory(tmp_path / "hf", ref, files=3)
    info = sp.inspect(tmp_path / "hf")
    assert set(info.tensors) == set(ref)
    assert info.tensors["model.embed.weight"].shape == (37, 16)
    report = sp.verify(tmp_path / "hf")
    assert report.ok, report.defects
    result = sp.consolidate(tmp_path / "hf", tmp_path / "out", max_shard_size="2KB", dtype="bf16",
                            prefixes="model.")
    assert len(result.files) == 2
    got = read_outputs(tmp_path / "out")
    assert set(got) == {n for n in ref if n.startswith("model.")}
    for name in got:
        want = ref[name].to(torch.bfloat16) if ref[name].is_floating_point() else ref[name]
        assert same_bits(got[name], want), name
    # One file is a checkpoint too.
    first = tmp_path / "out" / result.files[0]
    sp.consolidate(first, tmp_path / "single")
    assert set(read_outputs(tmp_path / "single")) == set(load_file(first))


def test_a_key_in_two_files_is_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "y.safetensors")
    with pytest.raises(sp.CheckpointCorruptError, match="tensor 'a' is in both .*x.safetensors and .*y.safetensors"):
        sp.inspect(tmp_path)


def _load_hf_two_ranks(rank: int, world_size: int, path: str) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    ref = reference()
    state = {name: distribute_tensor(torch.zeros_like(t), mesh, [Shard(t.dim() - 1)])
             for name, t in ref.items() if t.dim() == 2}
    result = sp.load(state, path, strict=False)
    ok = [name for name, d in state.items()
          if same_bits(d.to_local(), distribute_tensor(ref[name], mesh, [Shard(ref[name].dim() - 1)]).to_local())]
    return [sorted(ok), sorted(state), result.bytes_read]


def test_sp_load_of_a_hugging_face_directory_into_a_sharded_layout(tmp_path):
    ref = reference()
    write_hf_directory(tmp_path / "hf", ref, files=2)
    results = run_ranks(2, _load_hf_two_ranks, str(tmp_path / "hf"))
    wanted_bytes = sum(t.numel() * t.element_size() for t in ref.values() if t.dim() == 2)
    for ok, names, _ in results:
        assert ok == names
    # Column halves read whole rows (row-major files), so together the ranks read each byte at most twice.
    assert sum(r[2] for r in results) <= 2 * wanted_bytes


_MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import shardpoint as sp

    def vm(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    before = vm("VmHWM")
    result = sp.consolidate(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], memory_budget=sys.argv[4],
                            threads=4)
    print(json.dumps({"before": before, "peak": vm("VmHWM"), "files": result.files}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (VmHWM)")
def test_peak_memory_stays_within_the_budget_whatever_the_checkpoint_size(tmp_path):
    # 192 MiB of tensors (six of 32 MiB) into 64 MB shards with a 16 MiB budget.
    g = torch.Generator().manual_seed(2)
    state = {f"layer.{i}.w": torch.randn(2048, 4096, generator=g) for i in range(6)}
    sp.save(state, tmp_path / "big")
    del state
    env = dict(os.environ, SHARDPOINT_QUIET="1")
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(tmp_path / "big"), str(tmp_path / "out"), "64MB",
                          "16MiB"], check=True, capture_output=True, text=True, env=env)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["before"]
    assert len(figures["files"]) == 6  # two 32 MiB tensors would pass 64 MB: one per shard
    # The budget plus slack for allocator and thread overheads; far below one shard (64 MB), a
    # tensor (32 MiB) or the checkpoint (192 MiB).
    assert growth < 16 * 2**20 + 12 * 2**20, figures
    got = load_file(tmp_path / "out" / "model-00003-of-00006.safetensors")
    g = torch.Generator().manual_seed(2)
    ref = [torch.randn(2048, 4096, generator=g) for _ in range(6)]
    assert same_bits(got["layer.2.w"], ref[2])


def test_a_training_checkpoint_exports_its_model_weights_by_default_and_says_so(tmp_path, capfd, monkeypatch):
    """sp.save of model + AdamW: consolidate picks the model's weights (the 'model.' prefix removed),
    says what it left out, and keys / all_tensors override it."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    path = str(tmp_path / "train")
    sp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)

    monkeypatch.delenv("SHARDPOINT_QUIET", raising=False)
    result = sp.consolidate(path, tmp_path / "weights")
    got = read_outputs(tmp_path / "weights")
    assert sorted(got) == sorted(model.state_dict())
    for name, t in model.state_dict().items():
        assert same_bits(got[name], t), name
    assert result.selection == (
        "exported the model weights: 4 tensors under 'model.' (the prefix removed); left out the training "
        "state: optimizer (12 tensors); pass keys or prefixes (or all tensors) to choose otherwise")
    assert result.selection in capfd.readouterr().err

    everything = sp.consolidate(path, tmp_path / "all", all_tensors=True)
    assert everything.tensors == 16 and everything.selection == "exported every tensor"
    assert "optimizer.state.0.exp_avg" in read_outputs(tmp_path / "all")
    chosen = sp.consolidate(path, tmp_path / "moments", keys=["optimizer.state.0"])
    assert sorted(read_outputs(tmp_path / "moments")) == [
        "optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"]
    assert chosen.selection == "exported the tensors the given keys and prefixes select"
    assert chosen.selection not in capfd.readouterr().err  # said only when shardpoint picked


def test_inspect_text_output_stays_readable(tmp_path):
    """Long attributes are cut to one line (--json keeps them whole); a Hugging Face directory has
    no save id, and the text has no empty 'save ,' field."""
    state = {f"model.layers.{i}.block.mlp.weight": torch.zeros(2) for i in range(400)}
    path = str(tmp_path / "many")
    sp.save(state, path)
    from torch_dcp_util import CLI as shardpoint

    text = subprocess.run([shardpoint, "inspect", path], capture_output=True, text=True, check=True).stdout
    assert max(len(line) for line in text.splitlines()) < 200, max(text.splitlines(), key=len)[:300]
    assert "--json prints it whole)" in text
    whole = json.loads(subprocess.run([shardpoint, "inspect", path, "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert len(whole["attributes"]["python.state_dict_paths"]) > 20000

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(3)}, str(hf / "model.safetensors"))
    text = subprocess.run([shardpoint, "inspect", str(hf)], capture_output=True, text=True, check=True).stdout
    header = text.splitlines()[1]
    assert "save ," not in text and header.startswith("  format safetensors"), header

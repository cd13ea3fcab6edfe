"""Key mappings on load: renames, fused (stacked / concatenated) targets, tied weights, shipped MoE
mappings against real transformers models (tiny configs, random weights, nothing downloaded)."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

import shardpoint as sp
from distributed import run_ranks
from shardpoint._mapped_load import to_stored
from shardpoint._mapping import Layouts
from shardpoint._pieces import Box, numpy_local_plan

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The planner against numpy, with randomized shapes, fusions and boxes (no I/O).

def _random_fusion(rng: random.Random):
    """Stored arrays, a fusion of them and the numpy reference of the target it makes."""
    experts, rank = rng.randint(1, 4), rng.randint(1, 3)
    cat_dim, stack_dim = rng.randrange(rank), rng.randint(0, rank)
    widths = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    base = [rng.randint(1, 4) for _ in range(rank)]
    stored, experts_ref = {}, []
    for e in range(experts):
        parts = []
        for p, width in enumerate(widths):
            shape = list(base)
            shape[cat_dim] = width
            parts.append(np.random.default_rng(e * 10 + p).standard_normal(shape).astype(np.float32))
            stored[f"blk.{e}.p{p}"] = parts[-1]
        experts_ref.append(np.concatenate(parts, axis=cat_dim))
    target = np.stack(experts_ref, axis=stack_dim)
    source = sp.Stack("e", stack_dim, sp.Cat(cat_dim, [f"blk.{{e}}.p{p}" for p in range(len(widths))]))
    return stored, sp.KeyMapping(fusions=[sp.Fuse("fused", source)]), target


def _random_boxes(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """Boxes of a grid that splits some dims at random points (as FSDP / EP / TP shards do)."""
    cuts = []
    for size in shape:
        points = sorted(rng.sample(range(1, size), min(size - 1, rng.randint(0, 2)))) if size > 1 else []
        cuts.append(list(zip([0] + points, points + [size])))
    boxes = [Box((), ())]
    for dim_cuts in cuts:
        boxes = [Box(b.offsets + (lo,), b.sizes + (hi - lo,)) for b in boxes for lo, hi in dim_cuts]
    return boxes


def _read_like_core(plans, stored) -> None:
    for plan in plans:
        for offsets, sizes, data in plan.pieces:
            region = stored[plan.name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            data[...] = np.ascontiguousarray(region).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("seed", range(40))
def test_planner_matches_numpy_stack_and_cat(seed):
    rng = random.Random(seed)
    stored, mapping, target = _random_fusion(rng)
    layouts = Layouts(mapping, {k: ("float32", v.shape) for k, v in stored.items()})
    fuse, bindings = layouts.fusion("fused")
    shape, regions = layouts.regions("fused", fuse, bindings)
    assert shape == target.shape
    boxes = _random_boxes(rng, target.shape)
    locals_ = [np.zeros(b.sizes, np.float32) for b in boxes]
    plans = [numpy_local_plan("fused", a, target.shape, [(b, 0)], for_load=True) for a, b in zip(locals_, boxes)]
    mapped = to_stored(plans, {"fused": regions})
    assert {p.name for p in mapped.plans} == set(stored)
    _read_like_core(mapped.plans, stored)
    for copy_back in mapped.after_load:
        copy_back()
    for a, b in zip(locals_, boxes):
        np.testing.assert_array_equal(a, target[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))])


@pytest.mark.parametrize("seed", range(4))
def test_random_fusions_through_the_core_into_sharded_tensors(tmp_path, seed):
    rng = random.Random(100 + seed)
    stored, mapping, target = _random_fusion(rng)
    sp.save(stored, tmp_path / "ckpt")
    boxes = _random_boxes(rng, target.shape)
    locals_ = [np.zeros(b.sizes, np.float32) for b in boxes]
    for a, b in zip(locals_, boxes):  # one "rank" per box
        result = sp.load({"fused": sp.ShardedTensor(a, target.shape, b.offsets)}, tmp_path / "ckpt", mapping=mapping)
        np.testing.assert_array_equal(a, target[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))])
        assert result.missing_keys == []
    full = sp.load_full(tmp_path / "ckpt", mapping=mapping)
    assert list(full) == ["fused"]
    np.testing.assert_array_equal(full["fused"].numpy(), target)


# ---------------------------------------------------------------------------------------------
# Errors.

def _fuse_ab():
    return sp.KeyMapping(renames=[(r"old\.(.*)", r"new.\1")],
                         fusions=[sp.Fuse("w.{i}", sp.Stack("e", 0, sp.Cat(1, ["a.{i}.{e}", "b.{i}.{e}"])))])


def test_renamed_and_fused_keys_load_and_report_unexpected(tmp_path):
    a = {f"a.0.{e}": np.full((2, 3), e, np.float32) for e in range(2)}
    b = {f"b.0.{e}": np.full((2, 1), 10 + e, np.float32) for e in range(2)}
    sp.save({**a, **b, "old.x": np.arange(3.0), "extra": np.zeros(1)}, tmp_path / "c")
    state = {"w.0": np.zeros((2, 2, 4), np.float32), "new.x": np.zeros(3)}
    result = sp.load(state, tmp_path / "c", mapping=_fuse_ab())
    expected = np.stack([np.concatenate([a[f"a.0.{e}"], b[f"b.0.{e}"]], axis=1) for e in range(2)])
    np.testing.assert_array_equal(state["w.0"], expected)
    np.testing.assert_array_equal(state["new.x"], np.arange(3.0))
    assert (result.missing_keys, result.unexpected_keys) == ([], ["extra"])


def test_missing_source_names_target_and_source(tmp_path):
    sp.save({"a.0.0": np.zeros((2, 3), np.float32), "b.0.0": np.zeros((2, 1), np.float32),
             "a.0.1": np.zeros((2, 3), np.float32)}, tmp_path / "c")
    state = {"w.0": np.zeros((2, 2, 4), np.float32)}
    with pytest.raises(sp.CheckpointNotFoundError) as e:
        sp.load(state, tmp_path / "c", mapping=_fuse_ab())
    assert e.value.message == (f"1 key(s) missing from the checkpoint {str(tmp_path / 'c')!r}: target 'w.0': "
                               f"stored tensor 'b.0.1' is missing from the checkpoint")
    result = sp.load(state, tmp_path / "c", mapping=_fuse_ab(), strict=False)
    assert result.missing_keys == ["w.0"]


def test_shapes_that_do_not_tile_are_named(tmp_path):
    sp.save({"a.0.0": np.zeros((2, 3), np.float32), "b.0.0": np.zeros((3, 1), np.float32)}, tmp_path / "c")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load({"w.0": np.zeros((1, 2, 4), np.float32)}, tmp_path / "c", mapping=_fuse_ab())
    assert e.value.message == ("target 'w.0': stored tensors ['b.0.0'] have shape (3, 1), expected (2, '*') "
                               "to concatenate along dim 1")
    sp.save({"a.0.0": np.zeros((2, 3), np.float32), "b.0.0": np.zeros((2, 1), np.float32)}, tmp_path / "d")
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load({"w.0": np.zeros((2, 2, 4), np.float32)}, tmp_path / "d", mapping=_fuse_ab())
    assert e.value.message == ("target 'w.0' has shape (2, 2, 4), but its stored tensors ['a.0.0', 'b.0.0'] make "
                               "shape (1, 2, 4)")


def test_dtype_mismatch_is_named_and_cast_converts(tmp_path):
    sp.save({"a.0.0": np.ones((2, 3), np.float64), "b.0.0": np.ones((2, 1), np.float64)}, tmp_path / "c")
    state = {"w.0": np.zeros((1, 2, 4), np.float32)}
    with pytest.raises(sp.CheckpointArgumentError) as e:
        sp.load(state, tmp_path / "c", mapping=_fuse_ab())
    assert e.value.message == ("target 'w.0' has dtype float32, stored tensor 'a.0.0' has dtype float64 "
                               "(pass cast=True to convert)")
    sp.load(state, tmp_path / "c", mapping=_fuse_ab(), cast=True)
    np.testing.assert_array_equal(state["w.0"], np.ones((1, 2, 4), np.float32))


def test_mapping_data_is_checked():
    with pytest.raises(sp.CheckpointArgumentError, match="is not a name template"):
        sp.mappings.mapping_from_data({"fusions": [{"target": "x", "source": {"stack": "e"}}]})
    with pytest.raises(sp.CheckpointArgumentError, match="no shipped key mapping named 'llama'"):
        sp.mappings.get("llama")


# ---------------------------------------------------------------------------------------------
# Tied weights.

def test_tied_key_absent_from_checkpoint_is_filled_by_its_twin(tmp_path):
    embed = torch.randn(5, 3)
    sp.save({"embed.weight": embed}, tmp_path / "c")
    shared = torch.zeros(5, 3)
    result = sp.load({"embed.weight": shared, "head.weight": shared.detach()}, tmp_path / "c")
    assert torch.equal(shared, embed) and result.missing_keys == []
    with pytest.raises(sp.CheckpointNotFoundError, match="head.weight"):  # not tied: still missing
        sp.load({"embed.weight": torch.zeros(5, 3), "head.weight": torch.zeros(5, 3)}, tmp_path / "c")
    with pytest.raises(sp.CheckpointNotFoundError, match="head.weight"):  # a view, not the tensor
        sp.load({"embed.weight": shared, "head.weight": shared[1:]}, tmp_path / "c")


def test_tied_groups_compare_only_leaves_at_one_address_and_find_every_tie():
    from shardpoint._mapped_load import tied_groups

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    array = np.arange(6, dtype=np.int64)

    class NoStorage(torch.Tensor):  # a subclass whose address cannot be read: still compared
        def data_ptr(self):
            raise RuntimeError("no storage")

    odd = torch.ones(3).as_subclass(NoStorage)
    flat = {"a": base, "b": base.detach(), "view": base.view(6, 4), "row": base[1:], "first_row": base[0],
            "copy": base.clone(), "np": array, "np_twin": array[:], "np_other": array.copy(),
            "empty": torch.empty(0), "empty2": torch.empty(0), "meta": torch.empty(3, device="meta"),
            "meta2": torch.empty(3, device="meta"), "odd": odd, "odd2": odd.detach(), "n": 7, "s": "x"}
    # Same memory, offset, shape, strides and dtype only: a view of another shape, a row, a copy,
    # empty and meta tensors are not ties; the subclass pair is found by its signature.
    assert tied_groups(flat) == [["a", "b"], ["np", "np_twin"], ["odd", "odd2"]]
    rng = np.random.default_rng(3)  # many leaves, the ties anywhere among them
    leaves = [torch.randn(3) for _ in range(200)]
    names = [f"w{i}" for i in range(200)]
    for i in rng.choice(200, 20, replace=False):
        names.append(f"t{i}")
        leaves.append(leaves[i].detach())
    order = rng.permutation(len(names))
    flat = {names[k]: leaves[k] for k in order}
    expected = sorted(sorted([f"w{i}", f"t{i}"]) for i in range(200) if f"t{i}" in flat)
    assert sorted(sorted(g) for g in tied_groups(flat)) == expected


# ---------------------------------------------------------------------------------------------
# transformers 5 MoE models: hub-layout (per-expert) directories into fused-expert models.

def mixtral_config(tied: bool = False):
    return transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=tied)


def mixtral(tied: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(mixtral_config(tied)).eval()


def hub_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under the per-expert names and shapes of Mixtral's hub checkpoints:
    w1 (gate) and w3 (up) [intermediate, hidden], w2 (down) [hidden, intermediate] per expert."""
    inter = model.config.intermediate_size
    out = {}
    for key, value in model.state_dict().items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(.*)", key)
        prefix = f"model.layers.{layer.group(1)}.block_sparse_moe" if layer else ""
        if layer and layer.group(2) == "experts.gate_up_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.w1.weight"] = value[e, :inter].clone()
                out[f"{prefix}.experts.{e}.w3.weight"] = value[e, inter:].clone()
        elif layer and layer.group(2) == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.w2.weight"] = value[e].clone()
        elif layer and layer.group(2) == "gate.weight":
            out[f"{prefix}.gate.weight"] = value.clone()
        elif not (key == "lm_head.weight" and model.config.tie_word_embeddings):
            out[key] = value.clone()
    return out


def write_hub_dir(model, path) -> dict[str, torch.Tensor]:
    """Two safetensors shards and their index, as hub checkpoints are laid out."""
    tensors = hub_tensors(model)
    os.makedirs(path)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return tensors


def assert_same_weights(model, reference) -> None:
    expected = reference.state_dict()
    got = model.state_dict()
    assert list(got) == list(expected)
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key


def assert_same_logits(model, reference) -> None:
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_hub_dir_into_fused_model(tmp_path, tied):
    reference = mixtral(tied)
    write_hub_dir(reference, tmp_path / "hub")
    model = mixtral(tied, seed=1)
    result = sp.load(model.state_dict(), tmp_path / "hub", mapping=sp.mappings.for_model(model))
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert_same_weights(model, reference)
    assert_same_logits(model, reference)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(sp.CheckpointNotFoundError, match="mlp.experts.gate_up_proj"):  # without the mapping
        sp.load(mixtral(tied, seed=1).state_dict(), tmp_path / "hub")


def test_mixtral_load_full_with_mapping(tmp_path):
    reference = mixtral()
    write_hub_dir(reference, tmp_path / "hub")
    full = sp.load_full(tmp_path / "hub", mapping=sp.mappings.get("mixtral"))
    expected = reference.state_dict()
    assert sorted(full) == sorted(expected)
    assert all(torch.equal(full[k], expected[k]) for k in expected)
    part = sp.load_full(tmp_path / "hub", mapping=sp.mappings.get("mixtral"), keys=["model.layers.1.mlp"])
    assert sorted(part) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                            "model.layers.1.mlp.gate.weight"]


def test_mixtral_save_pretrained_dir(tmp_path):
    reference = mixtral(tied=True)
    reference.save_pretrained(tmp_path / "pretrained")
    stored = sp.inspect(tmp_path / "pretrained").tensors
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in stored and "lm_head.weight" not in stored
    model = mixtral(tied=True, seed=1)
    sp.load(model.state_dict(), tmp_path / "pretrained", mapping=sp.mappings.for_model(model))
    assert_same_weights(model, reference)
    assert_same_logits(model, reference)


@pytest.mark.parametrize("name", ["Qwen2Moe", "Qwen3Moe"])
def test_qwen_moe_save_pretrained_dir(tmp_path, name):
    config_class = getattr(transformers, f"{name}Config")
    model_class = getattr(transformers, f"{name}ForCausalLM")
    extra = {"shared_expert_intermediate_size": 16} if name == "Qwen2Moe" else {}
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=16, moe_intermediate_size=8,
                          num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    reference = model_class(config).eval()
    reference.save_pretrained(tmp_path / "pretrained")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sp.inspect(tmp_path / "pretrained").tensors
    torch.manual_seed(1)
    model = model_class(config).eval()
    result = sp.load(model.state_dict(), tmp_path / "pretrained", mapping=sp.mappings.for_model(model))
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert_same_weights(model, reference)
    assert_same_logits(model, reference)


def _distributed_loads(rank, world, hub_tied, hub):
    """FSDP2 (tied embeddings) and expert-parallel loads on one gloo group; what each rank found."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    model = mixtral(tied=True, seed=1)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = sp.load(model.state_dict(), hub_tied, mapping=sp.mappings.for_model(model))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    reference = mixtral(tied=True).state_dict()
    out["fsdp"] = (result.missing_keys, [k for k in reference if not torch.equal(full[k], reference[k])])

    model = mixtral(seed=1)
    n = model.config.num_local_experts // world
    state = {k: (v[rank * n:(rank + 1) * n].clone() if ".experts." in k else v) for k, v in model.state_dict().items()}
    marked = sp.mark_experts(state, ep_rank=rank, ep_size=world, predicate=lambda key: ".experts." in key)
    # Each rank reading for itself, so that its bytes_read says what it read of the stored tensors
    # (by default the two processes would read the tensors both hold once, between them).
    result = sp.load(marked, hub, mapping=sp.mappings.for_model(model), share_reads=False)
    reference = mixtral().state_dict()
    wrong = [k for k, v in state.items()
             if not torch.equal(v, reference[k][rank * n:(rank + 1) * n] if ".experts." in k else reference[k])]
    out["ep"] = (result.missing_keys, result.unexpected_keys, wrong, result.bytes_read)
    return out


def test_mixtral_fsdp2_and_expert_parallel_at_2_ranks(tmp_path):
    write_hub_dir(mixtral(tied=True), tmp_path / "hub_tied")
    tensors = write_hub_dir(mixtral(), tmp_path / "hub")
    results = run_ranks(2, _distributed_loads, str(tmp_path / "hub_tied"), str(tmp_path / "hub"))
    for rank, found in enumerate(results):
        assert found["fsdp"] == ([], []), rank
        missing, unexpected, wrong, bytes_read = found["ep"]
        assert (missing, unexpected, wrong) == ([], [], []), rank
        mine = {str(2 * rank), str(2 * rank + 1)}
        expected = sum(t.nbytes for k, t in tensors.items()
                       if ".experts." not in k or k.split(".experts.")[1].split(".")[0] in mine)
        assert bytes_read == expected, rank
        assert expected < sum(t.nbytes for t in tensors.values())


def test_consolidate_with_mapping_writes_fused_tensors(tmp_path):
    from safetensors.torch import load_file

    reference = mixtral()
    write_hub_dir(reference, tmp_path / "hub")
    result = sp.consolidate(tmp_path / "hub", tmp_path / "out", mapping=sp.mappings.get("mixtral"))
    assert result.files == ["model.safetensors"] and os.listdir(tmp_path / "out") == ["model.safetensors"]
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = reference.state_dict()
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[k], expected[k]) for k in expected)


def test_consolidate_with_random_fusions_matches_numpy(tmp_path):
    """Random stack / cat fusions of a sharded native checkpoint, consolidated: the fused tensors
    are numpy's stack of concatenations, bit for bit, whatever slabs the budget cuts."""
    from safetensors.numpy import load_file

    rng = random.Random(7)
    for trial in range(6):
        stored, mapping, target = _random_fusion(rng)
        stored["other"] = np.arange(5, dtype=np.int64)
        path, out = tmp_path / f"ckpt{trial}", tmp_path / f"out{trial}"
        sp.save(stored, path)
        mapping = sp.KeyMapping(renames=[("other", "kept")], fusions=mapping.fusions)
        result = sp.consolidate(path, out, mapping=mapping, memory_budget=1)
        written = load_file(out / "model.safetensors")
        assert sorted(written) == ["fused", "kept"] and result.tensors == 2, trial
        assert written["fused"].shape == target.shape and written["fused"].tobytes() == target.tobytes(), trial
        assert np.array_equal(written["kept"], stored["other"])


_MAPPED_MEMORY_CHILD = """
import json, sys
import shardpoint as sp

def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

mapping = sp.KeyMapping(fusions=[sp.Fuse("layers.0.gate_up", sp.Stack("e", 0, sp.Cat(0, [
    "layers.0.experts.{e}.w1", "layers.0.experts.{e}.w3"])))])
before = vm("VmHWM")
result = sp.consolidate(sys.argv[1], sys.argv[2], memory_budget="8MiB", threads=4, mapping=mapping)
print(json.dumps({"before": before, "peak": vm("VmHWM"), "bytes_read": result.bytes_read,
                  "total": result.total_bytes}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (VmHWM)")
def test_mapped_consolidation_peak_memory_stays_near_the_budget(tmp_path):
    """A 64 MiB fused target (4 experts of w1 and w3, 8 MiB each) consolidated with an 8 MiB budget:
    memory grows by about the budget, not by the target or the checkpoint, and nothing is staged."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.0.experts.{e}.{w}": torch.randn(1024, 2048, generator=g) for e in range(4) for w in ("w1", "w3")}
    os.makedirs(tmp_path / "hub")
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    env = dict(os.environ, SHARDPOINT_QUIET="1")
    out = subprocess.run([sys.executable, "-c", _MAPPED_MEMORY_CHILD, str(tmp_path / "hub"), str(tmp_path / "out")],
                         check=True, capture_output=True, text=True, env=env)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    # The budget plus slack for allocator and thread overheads; far below the fused tensor (64 MiB).
    assert figures["peak"] - figures["before"] < 8 * 2**20 + 12 * 2**20, figures
    assert figures["bytes_read"] == figures["total"] == 64 * 2**20, figures  # each stored byte once
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]  # the outputs alone: nothing staged
    fused = load_file(tmp_path / "out" / "model.safetensors")["layers.0.gate_up"]
    expected = torch.stack([torch.cat([tensors[f"layers.0.experts.{e}.w1"], tensors[f"layers.0.experts.{e}.w3"]])
                            for e in range(4)])
    assert fused.shape == (4, 2048, 2048) and torch.equal(fused, expected)


@pytest.mark.parametrize("zstd", [False, True])
def test_consolidate_with_mapping_decodes_dcp_items_into_fused_targets(tmp_path, zstd):
    """torch DCP items that are decoded whole (strided views; zstd streams) lie in their fused
    target at lifted boxes (size-1 dim inserted, offsets shifted): decoded into place, bit-exact."""
    from safetensors.torch import load_file
    from torch_dcp_util import save_in_process, stored_item

    g = torch.Generator().manual_seed(5)
    state = {}
    for e in range(3):
        state[f"experts.{e}.w1"] = torch.randn(6, 4, generator=g).t()  # a strided [4, 6] view
        state[f"experts.{e}.w3"] = torch.randn(2, 6, generator=g)
    save_in_process(state, str(tmp_path / "dcp"), zstd=zstd)
    assert zstd or stored_item(str(tmp_path / "dcp"), "experts.0.w1").stride() == (1, 4)
    mapping = sp.KeyMapping(fusions=[sp.Fuse("gate_up", sp.Stack("e", 0, sp.Cat(0, ["experts.{e}.w1",
                                                                                     "experts.{e}.w3"])))])
    sp.consolidate(tmp_path / "dcp", tmp_path / "out", mapping=mapping)
    fused = load_file(tmp_path / "out" / "model.safetensors")["gate_up"]
    expected = torch.stack([torch.cat([state[f"experts.{e}.w1"], state[f"experts.{e}.w3"]]) for e in range(3)])
    assert fused.shape == (3, 6, 6) and torch.equal(fused, expected)

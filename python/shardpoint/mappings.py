"""Key mappings shipped as data: Hugging Face hub checkpoints of MoE models into transformers 5 models.

Hub checkpoints (and transformers 5's own ``save_pretrained``) store one tensor per expert, while
transformers 5's MoE modules hold each layer's experts fused into two 3-D tensors:

* ``mlp.experts.gate_up_proj`` ``[experts, 2 * intermediate, hidden]``: per expert, the gate
  projection's ``[intermediate, hidden]`` weight followed (along dim 0) by the up projection's;
* ``mlp.experts.down_proj`` ``[experts, hidden, intermediate]``: the down projections stacked.

Mixtral's stored names are ``model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight`` (gate),
``.w3.weight`` (up), ``.w2.weight`` (down), and its router ``block_sparse_moe.gate.weight`` (loaded
as ``mlp.gate.weight``). Qwen2-MoE and Qwen3-MoE store ``model.layers.{L}.mlp.experts.{E}.gate_proj
.weight``, ``.up_proj.weight``, ``.down_proj.weight``; their routers and Qwen2-MoE's shared expert
keep their names.

    model = MixtralForCausalLM(config)
    sp.load(model.state_dict(), "Mixtral-dir/", mapping=sp.mappings.for_model(model))
"""

from __future__ import annotations

from typing import Any, Union

from ._errors import CheckpointArgumentError
from ._mapping import KeyMapping, mapping_from_data  # noqa: F401 (mapping_from_data: public here)


def _experts(layer: str, gate: str, up: str, down: str) -> list[dict[str, Any]]:
    expert = layer + ".{expert}."
    return [
        {"target": "model.layers.{layer}.mlp.experts.gate_up_proj",
         "source": {"stack": "expert", "dim": 0, "of": {"cat": 0, "of": [expert + gate, expert + up]}}},
        {"target": "model.layers.{layer}.mlp.experts.down_proj",
         "source": {"stack": "expert", "dim": 0, "of": expert + down}},
    ]


# The data: renames are [stored pattern, target replacement]; fusions name stored templates.
DATA: dict[str, dict[str, Any]] = {
    "mixtral": {
        "renames": [[r"(model\.layers\.[0-9]+)\.block_sparse_moe\.gate\.weight", r"\1.mlp.gate.weight"]],
        "fusions": _experts("model.layers.{layer}.block_sparse_moe.experts", "w1.weight", "w3.weight", "w2.weight"),
    },
    "qwen_moe": {
        "renames": [],
        "fusions": _experts("model.layers.{layer}.mlp.experts", "gate_proj.weight", "up_proj.weight",
                            "down_proj.weight"),
    },
}

# transformers' config.model_type (and lower-cased class-name prefixes) -> mapping name.
_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen_moe", "qwen3_moe": "qwen_moe", "qwen2moe": "qwen_moe",
                "qwen3moe": "qwen_moe"}


def get(name: str) -> KeyMapping:
    """The shipped mapping ``name`` ("mixtral", "qwen_moe", or a transformers model_type such as
    "qwen3_moe"). Raises CheckpointArgumentError listing the known names."""
    key = _MODEL_TYPES.get(name.lower(), name.lower())
    if key not in DATA:
        known = sorted(set(DATA) | set(_MODEL_TYPES))
        raise CheckpointArgumentError(f"no shipped key mapping named {name!r} (known: {known})", "INVALID_ARGUMENT")
    return mapping_from_data(DATA[key])


def for_model(model: Union[str, Any]) -> KeyMapping:
    """The shipped mapping for a transformers model (by ``config.model_type``, else its class name)
    or a name (see :func:`get`). Raises CheckpointArgumentError when none fits."""
    if isinstance(model, str):
        return get(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and _MODEL_TYPES.get(model_type) in DATA:
        return get(model_type)
    cls = type(model).__name__.lower()
    for prefix, key in _MODEL_TYPES.items():
        if cls.startswith(prefix.replace("_", "")):
            return get(key)
    raise CheckpointArgumentError(f"no shipped key mapping for {type(model).__name__} (model_type {model_type!r}); "
                                  f"known: {sorted(DATA)}", "INVALID_ARGUMENT")

"""State-dict leaves: which are tensors (and their plans), which are objects (and their encoding)."""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any

import numpy as np

from ._errors import CheckpointArgumentError
from ._pieces import TensorPlan, numpy_plan


def _torch_module() -> Any:
    return sys.modules.get("torch")


def is_tensor_leaf(value: Any) -> bool:
    """True for values saved as tensors: numpy arrays, torch tensors, DTensors, layout wrappers."""
    if isinstance(value, np.ndarray) or hasattr(value, "_shardpoint_plan"):
        return True
    torch = _torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_plan(name: str, value: Any, rank: int, for_load: bool) -> TensorPlan:
    """The plan of one tensor leaf on this rank (``rank`` is the rank in the save's group)."""
    if isinstance(value, np.ndarray):
        return numpy_plan(name, value, for_load)
    if hasattr(value, "_shardpoint_plan"):
        return value._shardpoint_plan(name, rank, for_load)
    from . import _torch

    return _torch.tensor_plan(name, value, for_load)


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def encode_object(name: str, value: Any, allow_pickle: bool) -> tuple[str, str, bytes]:
    """The core's ObjectEntry for a leaf: "json" for plain data, "bytes" for bytes, else "pickle".

    Raises CheckpointArgumentError naming the key for a non-plain value without ``allow_pickle``.
    """
    if isinstance(value, (bytes, bytearray)):
        return (name, "bytes", bytes(value))
    if _is_plain(value):
        return (name, "json", json.dumps(value, separators=(",", ":")).encode())
    if not allow_pickle:
        raise CheckpointArgumentError(
            f"state dict key {name!r} holds a {type(value).__module__}.{type(value).__qualname__}, which is not "
            f"plain data (numbers, strings, bool, None, bytes, lists, dicts with str keys); pass "
            f"allow_pickle=True to store it with pickle", "INVALID_ARGUMENT")
    return (name, "pickle", pickle.dumps(value))


def _shaped_like(template: Any, value: Any) -> Any:
    """``value`` (decoded JSON) with its lists turned back into tuples where ``template`` has tuples."""
    if not isinstance(value, list) or not isinstance(template, (list, tuple)):
        return value
    items = [_shaped_like(template[i] if i < len(template) else None, v) for i, v in enumerate(value)]
    return tuple(items) if isinstance(template, tuple) else items


def decode_object(name: str, encoding: str, payload: bytes, allow_pickle: bool, template: Any = None) -> Any:
    """The value of a stored object. Where ``template`` (the value it replaces) has tuples, JSON
    lists become tuples again, at any depth.

    Raises CheckpointArgumentError for a pickled object without ``allow_pickle`` or an unknown encoding.
    """
    if encoding == "json":
        return _shaped_like(template, json.loads(payload))
    if encoding == "bytes":
        return bytes(payload)
    if encoding in ("pickle", "torch-save"):
        if not allow_pickle:
            raise CheckpointArgumentError(
                f"object {name!r} is stored with {encoding}; loading it runs code from the checkpoint, so it needs "
                f"allow_pickle=True", "INVALID_ARGUMENT")
        if encoding == "torch-save":
            import io

            import torch

            return torch.load(io.BytesIO(payload), weights_only=False)
        return pickle.loads(payload)
    raise CheckpointArgumentError(f"object {name!r} has unknown encoding {encoding!r}", "INVALID_ARGUMENT")

"""State-dict leaves: which are tensors (and their plans), which are objects (and their encoding).

Objects are stored exactly (docs/FORMAT.md §3.6): plain data that JSON represents exactly as
"json", other plain data (tuples, non-str dict keys, NaN/inf, bytes inside containers) as "plain"
(a protocol-2 pickle that only a restricted unpickler ever reads), bytes as "bytes", values that
``torch.load(weights_only=True)`` can read (tensors inside tuples, torch.Size) as "torch-save",
and anything else as "pickle", only with ``allow_pickle``.
"""

from __future__ import annotations

import codecs
import collections
import io
import json
import math
import pickle
import re
import sys
from typing import Any, Optional

import numpy as np

from ._errors import CheckpointArgumentError, CheckpointCorruptError
from ._pieces import TensorPlan, numpy_plan

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Deepest nesting stored as plain data (the native core walks plain values to depth 128).
_MAX_PLAIN_DEPTH = 100
_NOT_PLAIN, _PLAIN, _JSON = 0, 1, 2


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


def _classify(name: str, value: Any, depth: int) -> int:
    """_JSON when JSON holds ``value`` exactly, _PLAIN when only the plain pickle does, else _NOT_PLAIN.

    Only the exact built-in types count (a numpy scalar or a namedtuple is not plain data), plus
    collections.OrderedDict. Raises CheckpointArgumentError for an int outside 64 bits.
    """
    kind = type(value)
    if depth > _MAX_PLAIN_DEPTH:
        return _NOT_PLAIN
    if value is None or kind is bool or kind is str:
        return _JSON
    if kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise CheckpointArgumentError(
                f"state dict key {name!r} holds the int {value}, which does not fit in 64 bits; checkpoints "
                f"store ints from -2**63 to 2**63-1 (store a larger one as a str)", "INVALID_ARGUMENT")
        return _JSON
    if kind is float:
        return _JSON if math.isfinite(value) else _PLAIN
    if kind is bytes:
        return _PLAIN
    if kind is list or kind is tuple:
        level = _JSON if kind is list else _PLAIN
        for item in value:
            level = min(level, _classify(name, item, depth + 1))
        return level
    if kind is dict or kind is collections.OrderedDict:
        level = _JSON if kind is dict else _PLAIN
        for key, item in value.items():
            key_level = _JSON if type(key) is str else min(_PLAIN, _classify(name, key, depth + 1))
            level = min(level, key_level, _classify(name, item, depth + 1))
        return level
    return _NOT_PLAIN


def _torch_save_bytes(value: Any) -> Optional[tuple[bytes, list[str]]]:
    """(torch.save bytes of ``value``, the globals torch.load(weights_only=True) would refuse), or
    None when torch is not imported or cannot save it."""
    torch = _torch_module()
    if torch is None:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception:  # noqa: BLE001 - not savable by torch: pickle decides below
        return None
    payload = buffer.getvalue()
    return payload, list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload)))


def encode_object(name: str, value: Any, allow_pickle: bool) -> tuple[str, str, bytes]:
    """The core's ObjectEntry (name, encoding, payload) for a non-tensor leaf.

    Raises CheckpointArgumentError naming the key for an int outside 64 bits, and for a value
    that needs code to load (naming the global that needs it) without ``allow_pickle``.
    """
    if isinstance(value, (bytes, bytearray)):
        return (name, "bytes", bytes(value))
    level = _classify(name, value, 0)
    if level == _JSON:
        return (name, "json", json.dumps(value, separators=(",", ":")).encode())
    if level == _PLAIN:
        return (name, "plain", pickle.dumps(value, protocol=2))
    saved = _torch_save_bytes(value)
    if saved is not None and not saved[1]:
        return (name, "torch-save", saved[0])
    if not allow_pickle:
        needs = f" (it needs global {saved[1][0]!r})" if saved is not None else ""
        raise CheckpointArgumentError(
            f"state dict key {name!r} holds a {type(value).__module__}.{type(value).__qualname__}, which is not "
            f"plain data (None, bool, int, float, str, bytes, and lists, tuples and dicts of them) nor "
            f"tensors{needs}; pass allow_pickle=True to store it with pickle", "INVALID_ARGUMENT")
    return (name, "pickle", pickle.dumps(value))


def _latin1_encode(text: str, encoding: str) -> bytes:
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}; plain data uses 'latin1'")
    return codecs.encode(text, "latin1")


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: the globals of protocol-2 bytes and OrderedDict, nothing else."""

    _GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict, ("_codecs", "encode"): _latin1_encode,
                ("builtins", "bytes"): bytes, ("__builtin__", "bytes"): bytes}

    def find_class(self, module: str, name: str) -> Any:
        found = self._GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not plain data")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id is not plain data")


def _in(where: str) -> str:
    return f"{where}: " if where else ""


def _load_plain(name: str, payload: bytes, where: str = "") -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(payload)).load()
    except Exception as e:  # noqa: BLE001 - any failure of hostile bytes is one corrupt object
        raise CheckpointCorruptError(f"{_in(where)}object {name!r} (encoding 'plain'): {e}", "DATA_LOSS") from None


def _load_json(name: str, payload: bytes, template: Any, where: str) -> Any:
    try:
        return _shaped_like(template, json.loads(bytes(payload)))
    except RecursionError:
        raise CheckpointCorruptError(f"{_in(where)}object {name!r} (encoding 'json') is nested too deeply to decode",
                                     "DATA_LOSS") from None
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointCorruptError(f"{_in(where)}object {name!r} (encoding 'json') is not valid JSON: "
                                     f"{type(e).__name__}: {e}", "DATA_LOSS") from None


def decode_paths_attribute(where: str, key: str, encoded: str) -> dict:
    """The state-dict paths stored as the JSON attribute ``key`` (see ``_flatten.encode_paths``).

    Raises CheckpointCorruptError naming ``where`` (the checkpoint) and ``key`` when the attribute
    is not valid JSON, is nested too deeply, or does not have the shape encode_paths writes.
    """
    from ._flatten import decode_paths

    try:
        return decode_paths(json.loads(encoded))
    except RecursionError:
        problem = "is nested too deeply to decode"
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError, unpacking errors
        problem = f"is not valid: {type(e).__name__}: {e}"
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        problem = f"does not list [key, [path components]] pairs: {type(e).__name__}: {e}"
    raise CheckpointCorruptError(f"{_in(where)}attribute {key!r} {problem}", "DATA_LOSS")


def _refused_global(payload: bytes, error: Exception) -> str:
    """The first global torch.load(weights_only=True) refuses in ``payload``."""
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload))
    except Exception:  # noqa: BLE001 - fall back to torch's message
        unsafe = []
    if unsafe:
        return unsafe[0]
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else str(error).strip().splitlines()[0]


def _load_torch_save(name: str, payload: bytes, allow_pickle: bool) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            return torch.load(io.BytesIO(payload), weights_only=False)
        raise CheckpointArgumentError(
            f"object {name!r} needs global {_refused_global(payload, e)!r}, which torch.load(weights_only=True) "
            f"does not allow; loading it runs code from the checkpoint; pass allow_pickle=True",
            "INVALID_ARGUMENT") from None


def _shaped_like(template: Any, value: Any) -> Any:
    """``value`` (decoded JSON) with its lists turned back into tuples where ``template`` has tuples."""
    if not isinstance(value, list) or not isinstance(template, (list, tuple)):
        return value
    items = [_shaped_like(template[i] if i < len(template) else None, v) for i, v in enumerate(value)]
    return tuple(items) if isinstance(template, tuple) else items


def decode_object(name: str, encoding: str, payload: bytes, allow_pickle: bool, template: Any = None,
                  where: str = "") -> Any:
    """The value of a stored object.

    "plain" is read by a restricted unpickler (never runs code); "torch-save" by
    ``torch.load(weights_only=True)``, and with ``allow_pickle`` by ``weights_only=False`` when
    that refuses. "json" objects written before the "plain" encoding existed held tuples as lists:
    where ``template`` (the value it replaces) has tuples, they become tuples again, at any depth.

    Raises CheckpointArgumentError for an object that needs code without ``allow_pickle`` (naming
    the global) or an unknown encoding, CheckpointCorruptError for a "plain" payload that is not
    plain data or a "json" payload that is not JSON (bad UTF-8, bad syntax, nested too deeply).
    Messages start with ``where`` (the checkpoint's path) when given.
    """
    if encoding == "json":
        return _load_json(name, payload, template, where)
    if encoding == "plain":
        return _load_plain(name, bytes(payload), where)
    if encoding == "bytes":
        return bytes(payload)
    if encoding == "torch-save":
        return _load_torch_save(name, bytes(payload), allow_pickle)
    if encoding == "pickle":
        if not allow_pickle:
            raise CheckpointArgumentError(
                f"object {name!r} is stored with pickle; loading it runs code from the checkpoint, so it needs "
                f"allow_pickle=True", "INVALID_ARGUMENT")
        return pickle.loads(payload)
    raise CheckpointArgumentError(f"object {name!r} has unknown encoding {encoding!r}", "INVALID_ARGUMENT")

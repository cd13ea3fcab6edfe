"""Helpers for the tests in which torch.distributed.checkpoint writes a checkpoint and shardpoint
reads it: torch's writer as these tests configure it, random tensors of any dtype, bit-exact
comparison and structure comparison."""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

CLI = os.path.join(os.path.dirname(sys.executable), "shardpoint")  # installed beside the interpreter
if not os.path.exists(CLI):
    CLI = shutil.which("shardpoint") or CLI


def writer(path: str, *, zstd: bool = False, single_file_per_rank: bool = False) -> dcp.FileSystemWriter:
    """torch's FileSystemWriter with three writer threads and (by default) one file per item."""
    extensions = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        extensions = [ZStandard()]
    return dcp.FileSystemWriter(path, thread_count=3, single_file_per_rank=single_file_per_rank,
                                _extensions=extensions)


def save_in_process(state: dict, path: str, *, zstd: bool = False) -> None:
    """torch's dcp.save from this process alone (no process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(state, storage_writer=writer(path, zstd=zstd), no_dist=True)


def torch_metadata(path: str) -> Any:
    """torch's own decoding of ``path``/.metadata."""
    return dcp.FileSystemReader(path).read_metadata()


def storage_of(path: str, key: str) -> Any:
    """The _StorageInfo of the single item (chunk or object) stored for ``key``."""
    found = [info for index, info in torch_metadata(path).storage_data.items() if index.fqn == key]
    assert len(found) == 1, f"{key!r} has {len(found)} items"
    return found[0]


def stored_item(path: str, key: str) -> Any:
    """What torch.load makes of the (untransformed) item stored for ``key``."""
    info = storage_of(path, key)
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def random_tensor(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs included for floating types); 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in row-major order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def flipped(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like ``t`` whose every element differs from ``t``'s (every bit flipped)."""
    if t.dtype == torch.bool:
        return t.logical_not().contiguous()
    return (bits(t) ^ 0xFF).view(t.dtype).reshape(t.shape)


def bit_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b)))


def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``: container types, keys, lengths, tensor bits, values."""
    if isinstance(expected, torch.Tensor):
        return [] if bit_equal(actual, expected) else [f"{where}: tensor differs"]
    if type(actual) is not type(expected):
        return [f"{where}: {type(actual).__name__} instead of {type(expected).__name__}"]
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return [f"{where}: keys {list(actual)} instead of {list(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{where}.{k}")]
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return [f"{where}: length {len(actual)} instead of {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in differences(a, e, f"{where}.{i}")]
    return [] if actual == expected else [f"{where}: {actual!r} instead of {expected!r}"]


def cli(*args: str) -> subprocess.CompletedProcess:
    """Runs the shardpoint command-line tool."""
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)

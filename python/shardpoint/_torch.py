"""PyTorch adapter: torch.Tensor and DTensor leaves as pieces for the core.

Local chunks and global offsets of a DTensor come from DTensor's own
``compute_local_shape_and_global_offset``. CUDA tensors go through reusable pinned host buffers;
non-contiguous tensors are saved from a contiguous copy and loaded through a contiguous temporary
that is copied back. This module imports torch; the rest of the package only does so when torch is
already loaded or a caller asks for torch tensors.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import torch

from ._errors import CheckpointArgumentError
from ._pieces import Box, TensorPlan, split_local

_ALIGN = 64
_BLOCK_BYTES = 64 << 20


class HostStaging:
    """Grow-only pinned (or pageable, without CUDA) host blocks, reused across operations.

    ``reset()`` starts a new operation; ``take(nbytes)`` hands out aligned byte regions valid until
    the next reset. Not thread-safe: callers hold ``lock`` for the whole operation.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._blocks: list[torch.Tensor] = []
        self._block = 0
        self._used = 0

    def reset(self) -> None:
        """Makes every block free again (the previous operation's regions become invalid)."""
        self._block = 0
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 region of ``nbytes`` bytes."""
        while self._block < len(self._blocks):
            start = -(-self._used // _ALIGN) * _ALIGN
            if start + nbytes <= self._blocks[self._block].numel():
                self._used = start + nbytes
                return self._blocks[self._block][start:start + nbytes]
            self._block += 1
            self._used = 0
        pin = torch.cuda.is_available()
        self._blocks.append(torch.empty(max(nbytes, _BLOCK_BYTES), dtype=torch.uint8, pin_memory=pin))
        self._block = len(self._blocks) - 1
        self._used = nbytes
        return self._blocks[-1][:nbytes]


STAGING = HostStaging()


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype, e.g. "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def is_tensor(value: Any) -> bool:
    """True for torch.Tensor (DTensor included)."""
    return isinstance(value, torch.Tensor)


def is_dtensor(value: Any) -> bool:
    """True for a DTensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(value, DTensor)


def _host_view(local: torch.Tensor, for_load: bool, after: list[Callable[[], None]]) -> torch.Tensor:
    """A contiguous CPU tensor with ``local``'s data (save) or to be copied into ``local`` (load)."""
    if local.device.type == "cpu" and local.is_contiguous():
        return local
    if local.device.type == "cpu":
        host = torch.empty(local.shape, dtype=local.dtype)
    else:
        region = STAGING.take(local.numel() * local.element_size())
        host = region.view(local.dtype).view(local.shape) if local.numel() else torch.empty(local.shape, dtype=local.dtype)
    if for_load:
        after.append(lambda: local.copy_(host, non_blocking=local.device.type != "cpu"))
    else:
        host.copy_(local, non_blocking=local.device.type != "cpu")
    return host


def local_plan(name: str, local: torch.Tensor, shape: tuple[int, ...], boxes: list[tuple[Box, int]],
               for_load: bool) -> TensorPlan:
    """The plan of a local tensor whose row-major data holds ``boxes`` (box, element offset)."""
    after: list[Callable[[], None]] = []
    host = _host_view(local, for_load, after)
    flat = host.reshape(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8)
    pieces = split_local(name, flat, host.element_size(), host.numel(), boxes)
    return TensorPlan(name, dtype_name(local.dtype), tuple(shape), pieces, after)


def tensor_plan(name: str, value: torch.Tensor, for_load: bool) -> TensorPlan:
    """A plain tensor: the whole tensor, held (as a replica) by every rank."""
    if is_dtensor(value):
        return dtensor_plan(name, value, for_load)
    shape = tuple(value.shape)
    return local_plan(name, value.detach(), shape, [(Box(tuple(0 for _ in shape), shape), 0)], for_load)


def _check_placements(name: str, placements: tuple) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Replicate, _StridedShard

    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            follows = any(isinstance(q, Shard) and not isinstance(q, _StridedShard) and q.dim == p.dim
                          for q in placements[i + 1:])
            if not follows:
                raise CheckpointArgumentError(
                    f"tensor {name!r}: placement {p} on mesh dim {i} leaves a non-contiguous local chunk "
                    f"(expected a Shard({p.dim}) on a later mesh dim, as FSDP2 + TP produce); placements {placements}",
                    "INVALID_ARGUMENT")
        elif not isinstance(p, (Shard, Replicate)):
            raise CheckpointArgumentError(
                f"tensor {name!r}: placement {p} cannot be saved (expected Shard, Replicate or _StridedShard); "
                f"redistribute it first", "INVALID_ARGUMENT")


@functools.lru_cache(maxsize=65536)
def _local_box(shape: tuple, mesh: Any, placements: tuple) -> Optional[Box]:
    """DTensor's own answer for (global shape, mesh, placements); cached: a training loop saves the
    same layouts again and again."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if mesh.get_coordinate() is None:
        return None
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape))


def dtensor_box(name: str, value: Any) -> Optional[Box]:
    """The global box of this rank's local tensor of a DTensor (None when the rank is outside the mesh).

    Raises CheckpointArgumentError naming the tensor for a placement that cannot be stored (Partial,
    a _StridedShard not followed by a Shard of the same dim) or a local tensor of another shape.
    """
    placements = tuple(value.placements)
    _check_placements(name, placements)
    box = _local_box(tuple(value.shape), value.device_mesh, placements)
    if box is None:
        return None
    local = value._local_tensor
    if tuple(local.shape) != box.sizes:
        raise CheckpointArgumentError(
            f"tensor {name!r}: local tensor has shape {tuple(local.shape)}, expected {box.sizes} "
            f"for global shape {tuple(value.shape)} and placements {placements}", "INVALID_ARGUMENT")
    return box


def dtensor_plan(name: str, value: Any, for_load: bool) -> TensorPlan:
    """A DTensor: its local tensor as one chunk at the offsets DTensor reports."""
    shape = tuple(value.shape)
    box = dtensor_box(name, value)
    if box is None:
        return TensorPlan(name, dtype_name(value.dtype), shape, [], [])
    return local_plan(name, value._local_tensor.detach(), shape, [(box, 0)], for_load)


def synchronize(plans: list[TensorPlan]) -> None:
    """Waits for the asynchronous device copies started while making ``plans`` (if any)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def empty_like_stored(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A new CPU tensor of a stored tensor's dtype and shape."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise CheckpointArgumentError(f"stored dtype {dtype!r} has no torch counterpart", "INVALID_ARGUMENT")
    return torch.empty(shape, dtype=torch_dtype)

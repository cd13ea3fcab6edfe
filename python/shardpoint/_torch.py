"""PyTorch adapter: torch.Tensor and DTensor leaves as pieces for the core.

Local chunks and global offsets of a DTensor come from DTensor's own
``compute_local_shape_and_global_offset``. A CUDA tensor's pieces are views of its device memory
when saving (shardpoint._cuda copies them to the host as they are written or staged); when loading
they are regions of the pinned pool of the running batch, copied to the device on a copy stream
afterwards (shardpoint._cuda.LoadBatches). Non-contiguous tensors are saved from a contiguous copy
and loaded through a contiguous temporary that is copied back. This module imports torch; the rest
of the package only does so when torch is already loaded or a caller asks for torch tensors.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from ._errors import CheckpointArgumentError
from ._pieces import Box, TensorPlan, split_local

# The pinned pool that CUDA destinations of the running load batch take their regions from (set
# by the load, one batch at a time; see shardpoint._cuda.LoadBatches).
_LOAD_POOL: Optional[Any] = None


def set_load_pool(pool: Optional[Any]) -> None:
    """Makes ``pool`` (a shardpoint._cuda.PinnedPool) the source of the host regions of CUDA load
    destinations, or none (None)."""
    global _LOAD_POOL
    _LOAD_POOL = pool


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype, e.g. "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def is_tensor(value: Any) -> bool:
    """True for torch.Tensor (DTensor included)."""
    return isinstance(value, torch.Tensor)


_DTENSOR: Any = None  # the DTensor class once is_dtensor has looked for it; () without one


def is_dtensor(value: Any) -> bool:
    """True for a DTensor."""
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            _DTENSOR = ()
        else:
            _DTENSOR = DTensor
    return isinstance(value, _DTENSOR)


def _host_view(local: torch.Tensor, for_load: bool, after: list[Callable[[], None]]) -> torch.Tensor:
    """A contiguous tensor with ``local``'s data (save: on its own device) or a contiguous CPU
    tensor to be copied into ``local`` (load; a region of the batch's pinned pool for a CUDA one)."""
    if local.is_contiguous() and (local.device.type == "cpu" or not for_load):
        return local
    if not for_load:
        return local.contiguous()
    if local.device.type == "cpu":
        host = torch.empty(local.shape, dtype=local.dtype)
        after.append(lambda: local.copy_(host))
        return host
    if _LOAD_POOL is None:
        raise CheckpointArgumentError(f"a {local.device} tensor is loaded outside a device load batch",
                                      "INTERNAL")
    nbytes = local.numel() * local.element_size()
    region = _LOAD_POOL.take(nbytes)
    host = region.view(local.dtype).view(local.shape) if local.numel() else torch.empty(local.shape, dtype=local.dtype)

    def to_device() -> None:
        from . import _cuda

        with torch.cuda.stream(_cuda.STREAMS.get(local.device)):
            local.copy_(host, non_blocking=True)
    after.append(to_device)
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
    try:
        problem = _placement_problem(placements)
    except TypeError:  # a placement that cannot be hashed: checked without the cache
        problem = _placement_problem.__wrapped__(placements)
    if problem is not None:
        raise CheckpointArgumentError(f"tensor {name!r}: {problem}", "INVALID_ARGUMENT")


@functools.lru_cache(maxsize=4096)
def _placement_problem(placements: tuple) -> Optional[str]:
    """Why ``placements`` cannot be stored, or None; cached: a state dict has few distinct ones."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Replicate, _StridedShard

    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            follows = any(isinstance(q, Shard) and not isinstance(q, _StridedShard) and q.dim == p.dim
                          for q in placements[i + 1:])
            if not follows:
                return (f"placement {p} on mesh dim {i} leaves a non-contiguous local chunk (expected a "
                        f"Shard({p.dim}) on a later mesh dim, as FSDP2 + TP produce); placements {placements}")
        elif not isinstance(p, (Shard, Replicate)):
            return (f"placement {p} cannot be saved (expected Shard, Replicate or _StridedShard); "
                    f"redistribute it first")
    return None


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


@functools.lru_cache(maxsize=65536)
def _mesh_layout(mesh: Any, placements: tuple, ndim: int) -> tuple:
    """The core's layout tuple of a device mesh and its placements on a tensor of ``ndim`` dims
    (TensorPlan.layout)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    rules = []
    for p in placements:
        if isinstance(p, _StridedShard):
            rules.append((2, int(p.dim) % ndim, int(p.split_factor)))
        elif isinstance(p, Shard):
            rules.append((1, int(p.dim) % ndim, 1))
        else:
            rules.append((0, 0, 1))
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks == tuple(range(len(ranks))):
        ranks = ()
    return (tuple(int(n) for n in mesh.mesh.shape), tuple(rules), ranks)


def dtensor_plan(name: str, value: Any, for_load: bool) -> TensorPlan:
    """A DTensor: its local tensor as one chunk at the offsets DTensor reports; on save, with its
    mesh and placements, which the core sends instead of the box (TensorPlan.layout)."""
    shape = tuple(value.shape)
    box = dtensor_box(name, value)
    if box is None:
        return TensorPlan(name, dtype_name(value.dtype), shape, [], [])
    plan = local_plan(name, value._local_tensor.detach(), shape, [(box, 0)], for_load)
    if not for_load:
        plan.layout = _mesh_layout(value.device_mesh, tuple(value.placements), len(shape))
    return plan


def empty_like_stored(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A new CPU tensor of a stored tensor's dtype and shape."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise CheckpointArgumentError(f"stored dtype {dtype!r} has no torch counterpart", "INVALID_ARGUMENT")
    return torch.empty(shape, dtype=torch_dtype)

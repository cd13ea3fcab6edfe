"""Layouts given as state-dict values: a hyper_parallel tensor_map layout and an explicit sharded
tensor (Megatron's ShardedTensor, optionally a flat range of its box).

Both wrap this rank's local data (a torch tensor or a numpy array) and say where it lies in the
global tensor. The boxes are computed by the core (shardpoint/layout/tensor_map.h and
shardpoint/geometry/flat_range.h, bound in shardpoint._core); this module only adapts. On load the
local data is written in place.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from ._errors import CheckpointArgumentError, CheckpointError, translated
from ._pieces import Box, TensorPlan, flat_range_pieces, int_list, numpy_local_plan


def local_plan(name: str, local: Any, shape: Sequence[int], boxes: list[tuple[Box, int]], for_load: bool) -> TensorPlan:
    """The plan of a local torch tensor or numpy array holding ``boxes`` (box, element offset)."""
    import numpy as np

    if isinstance(local, np.ndarray):
        return numpy_local_plan(name, local, shape, boxes, for_load)
    from . import _torch

    if _torch.is_dtensor(local):
        raise CheckpointArgumentError(f"tensor {name!r}: expected a local tensor, found a DTensor", "INVALID_ARGUMENT")
    return _torch.local_plan(name, local.detach(), tuple(shape), boxes, for_load)


def _argument_error(message: str) -> CheckpointArgumentError:
    return CheckpointArgumentError(message, "INVALID_ARGUMENT")


@contextlib.contextmanager
def _for_tensor(name: str) -> Iterator[None]:
    """Runs a core layout call, prefixing the tensor's name to the message of the error it raises."""
    try:
        with translated():
            yield
    except CheckpointError as e:
        raise type(e)(f"tensor {name!r}: {e.message}", e.code) from None


def _mesh_dim_lists(tensor_map: Sequence[Any]) -> list[list[int]]:
    """``tensor_map`` with each entry (-1, a mesh dim, or a list of them) as a list of ints."""
    return [[int(m) for m in entry] if isinstance(entry, (list, tuple)) else [int(entry)] for entry in tensor_map]


def tensor_map_box(global_shape: Sequence[int], mesh_shape: Sequence[int], tensor_map: Sequence[Any],
                   inner_rank: int, uneven_mesh_dims: Sequence[int] = ()) -> Box:
    """The slice of inner rank ``inner_rank`` under a hyper_parallel tensor_map.

    ``tensor_map[d]`` is -1, a mesh dim counted from the right, or a list of them (split by the
    first listed, then each piece by the next); splits are balanced (the first L % n get one more),
    or like torch.chunk on ``uneven_mesh_dims`` (counted from the left). Computed by the core
    (shardpoint/layout/tensor_map.h). Raises CheckpointArgumentError for a malformed layout.
    """
    from . import _core

    with translated():
        offsets, sizes = _core.tensor_map_chunk(int_list(global_shape), int_list(mesh_shape),
                                                _mesh_dim_lists(tensor_map), int(inner_rank),
                                                int_list(uneven_mesh_dims))
    return Box(offsets, sizes)


@dataclass
class HyperParallelTensor:
    """A local tensor laid out by a hyper_parallel / MindSpore layout.

    ``mesh_shape`` is the device matrix, ``tensor_map`` one entry per tensor dim (see
    :func:`tensor_map_box`), ``rank_list`` the global rank of each inner rank (default 0..N-1; ranks
    not listed hold nothing). ``global_shape`` defaults to the local shape times the number of
    pieces on each dim, which is right for even splits only.
    """

    local: Any
    mesh_shape: Sequence[int]
    tensor_map: Sequence[Any]
    rank_list: Optional[Sequence[int]] = None
    global_shape: Optional[Sequence[int]] = None
    uneven_mesh_dims: Sequence[int] = field(default_factory=tuple)

    def shape(self) -> tuple[int, ...]:
        """The global shape (given, or inferred for even splits)."""
        if self.global_shape is not None:
            return tuple(int(s) for s in self.global_shape)
        out = []
        for dim, entry in enumerate(_mesh_dim_lists(self.tensor_map)):
            mesh_dims = [m for m in entry if m != -1]
            out.append(int(self.local.shape[dim]) * math.prod(self.mesh_shape[len(self.mesh_shape) - 1 - m]
                                                              for m in mesh_dims))
        return tuple(out)

    def _shardpoint_plan(self, name: str, rank: int, for_load: bool) -> TensorPlan:
        from . import _core

        shape = self.shape()
        with _for_tensor(name):
            chunk = _core.tensor_map_chunk_for_rank(
                list(shape), int_list(self.mesh_shape), _mesh_dim_lists(self.tensor_map), int(rank),
                int_list(self.rank_list) if self.rank_list is not None else [], int_list(self.uneven_mesh_dims))
        boxes: list[tuple[Box, int]] = []
        if chunk is not None:
            box = Box(*chunk)
            if tuple(self.local.shape) != box.sizes:
                raise _argument_error(f"tensor {name!r}: local shape {tuple(self.local.shape)} on rank {rank}, "
                                      f"expected {box.sizes} for global shape {shape} and tensor_map "
                                      f"{list(self.tensor_map)}")
            boxes.append((box, 0))
        return local_plan(name, self.local, shape, boxes, for_load)


@dataclass
class ShardedTensor:
    """An explicit shard: ``data`` is the box at ``global_offset`` of a ``global_shape`` tensor.

    As Megatron's ShardedTensor: the box's sizes are ``local_shape`` (default: ``data``'s shape,
    with leading 1s for prepended axes); with ``flattened_range`` (a slice or (begin, end)) ``data``
    is 1-D and holds elements [begin, end) of the row-major flattening of that box.
    """

    data: Any
    global_shape: Sequence[int]
    global_offset: Sequence[int]
    local_shape: Optional[Sequence[int]] = None
    flattened_range: Union[slice, tuple[int, int], None] = None

    def box(self) -> Box:
        """The box of the global tensor the shard belongs to."""
        sizes = tuple(self.local_shape) if self.local_shape is not None else tuple(self.data.shape)
        sizes = (1,) * (len(self.global_shape) - len(sizes)) + tuple(int(s) for s in sizes)
        return Box(tuple(int(o) for o in self.global_offset), sizes)

    def _shardpoint_plan(self, name: str, rank: int, for_load: bool) -> TensorPlan:
        box = self.box()
        if len(box.offsets) != len(self.global_shape):
            raise _argument_error(f"tensor {name!r}: global_offset {tuple(box.offsets)} does not match "
                                  f"global shape {tuple(self.global_shape)}")
        if self.flattened_range is None:
            if math.prod(self.data.shape) != box.volume:
                raise _argument_error(f"tensor {name!r}: data shape {tuple(self.data.shape)} does not fill "
                                      f"box sizes {box.sizes}")
            return local_plan(name, self.data, self.global_shape, [(box, 0)], for_load)
        rng = self.flattened_range
        begin, end = (rng.start, rng.stop) if isinstance(rng, slice) else rng
        if len(self.data.shape) != 1 or self.data.shape[0] != end - begin:
            raise _argument_error(f"tensor {name!r}: flattened_range [{begin}, {end}) needs 1-D data of "
                                  f"{end - begin} elements, found shape {tuple(self.data.shape)}")
        with _for_tensor(name):
            boxes = flat_range_pieces(self.global_shape, box, begin, end)
        return local_plan(name, self.data, self.global_shape, boxes, for_load)

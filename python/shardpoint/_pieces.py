"""Value types shared by the adapters: boxes, tensor plans, flat ranges, and numpy arrays.

Flat-range geometry is the core's (bound in shardpoint._core); this module only converts.

A :class:`TensorPlan` is what one rank hands to the core for one tensor: its name, dtype (torch's
name), global shape, and pieces ``(offsets, sizes, bytes)`` where ``bytes`` is a contiguous uint8
view of the caller's memory (or of a temporary that ``after_load`` copies back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ._errors import CheckpointArgumentError, translated

Piece = tuple  # (offsets tuple, sizes tuple, contiguous byte array)


@dataclass(frozen=True)
class Box:
    """An N-D region of a tensor: per-dimension offsets and sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def volume(self) -> int:
        """The number of elements (1 for a 0-d box)."""
        return math.prod(self.sizes)


@dataclass
class TensorPlan:
    """One rank's part of one tensor, ready for the core."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    after_load: list[Callable[[], None]] = field(default_factory=list)
    # Save only: the device-mesh rule of a DTensor, (mesh shape, placements as (kind, dim,
    # split_factor) with kind 0 Replicate / 1 Shard / 2 _StridedShard, the mesh's ranks in
    # row-major order or () for 0..n-1). The core then sends the rule instead of the box.
    layout: Optional[tuple] = None

    def entry(self) -> tuple:
        """The core's TensorEntry tuple."""
        if self.layout is not None:
            return (self.name, self.dtype, self.shape, self.pieces, self.layout)
        return (self.name, self.dtype, self.shape, self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds of the tensor."""
        return sum(int(p[2].nbytes) for p in self.pieces)


def split_local(name: str, flat_bytes: Any, itemsize: int, numel: int,
                boxes: Sequence[tuple[Box, int]]) -> list[Piece]:
    """Pieces of a local buffer (a 1-D uint8 view) holding ``boxes`` at element offsets.

    Empty boxes give no piece. Raises CheckpointArgumentError naming the tensor when a box runs
    past the local buffer.
    """
    pieces: list[Piece] = []
    for box, element_offset in boxes:
        volume = box.volume
        if volume == 0:
            continue
        if element_offset < 0 or element_offset + volume > numel:
            raise CheckpointArgumentError(
                f"tensor {name!r}: box offsets {box.offsets} sizes {box.sizes} at element {element_offset} "
                f"needs {element_offset + volume} local elements, found {numel}", "INVALID_ARGUMENT")
        begin = element_offset * itemsize
        # A box that is the whole buffer (a tensor's one local chunk) takes it as it is: slicing a
        # torch tensor costs more than the rest of the piece.
        whole = begin == 0 and volume == numel
        data = flat_bytes if whole else flat_bytes[begin:begin + volume * itemsize]
        pieces.append((tuple(box.offsets), tuple(box.sizes), data))
    return pieces


def decompose_flat_range(box: Box, flat_begin: int, flat_end: int) -> list[Box]:
    """Boxes whose row-major contents, concatenated, are elements [flat_begin, flat_end) of ``box``.

    Each box fixes the dims before some k, takes a range on dim k and the whole box on later dims;
    at most 2 * rank - 1 boxes, none empty. Computed by the core (shardpoint/geometry/flat_range.h).
    Raises CheckpointArgumentError for a range outside the box.
    """
    from . import _core

    with translated():
        pairs = _core.decompose_flat_range(int_list(box.offsets), int_list(box.sizes), int(flat_begin), int(flat_end))
    return [Box(offsets, sizes) for offsets, sizes in pairs]


def flat_range_pieces(shape: Sequence[int], box: Box, flat_begin: int, flat_end: int) -> list[tuple[Box, int]]:
    """The boxes of :func:`decompose_flat_range`, each with its element offset in a buffer holding the range.

    Computed by the core (shardpoint/layout/pieces.h). Raises CheckpointArgumentError for a box
    outside ``shape`` or a range outside the box.
    """
    from . import _core

    with translated():
        pieces = _core.flat_range_pieces(int_list(shape), int_list(box.offsets), int_list(box.sizes), int(flat_begin),
                                         int(flat_end))
    return [(Box(offsets, sizes), element_offset) for (offsets, sizes), element_offset in pieces]


def int_list(values: Sequence[Any]) -> list[int]:
    """``values`` as a list of Python ints (for the core's integer sequences)."""
    return [int(v) for v in values]


# numpy dtypes by torch's dtype names (those numpy has natively).
_NUMPY_NAMES = {
    "bool": "bool", "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "float16": "float16", "float32": "float32",
    "float64": "float64", "complex64": "complex64", "complex128": "complex128",
}
_EXTENDED = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def numpy_dtype_name(array: np.ndarray, name: str) -> str:
    """torch's name of a numpy array's dtype; CheckpointArgumentError naming the tensor otherwise."""
    dtype_name = array.dtype.name
    if dtype_name in _NUMPY_NAMES or dtype_name in _EXTENDED:  # ml_dtypes names match torch's
        return dtype_name
    raise CheckpointArgumentError(
        f"tensor {name!r}: numpy dtype {array.dtype} is not supported "
        f"(expected one of {sorted(_NUMPY_NAMES) + list(_EXTENDED)})", "INVALID_ARGUMENT")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a stored (torch-named) dtype; bfloat16 and float8 need ml_dtypes."""
    if dtype in _NUMPY_NAMES:
        return np.dtype(_NUMPY_NAMES[dtype])
    try:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, dtype))
    except (ImportError, AttributeError):
        raise CheckpointArgumentError(
            f"stored dtype {dtype!r} has no numpy counterpart (install torch or ml_dtypes)",
            "INVALID_ARGUMENT") from None


def numpy_local_plan(name: str, local: np.ndarray, shape: Sequence[int], boxes: Sequence[tuple[Box, int]],
                     for_load: bool) -> TensorPlan:
    """The plan of a local numpy array whose row-major data holds ``boxes``."""
    after: list[Callable[[], None]] = []
    host = local
    if not local.flags["C_CONTIGUOUS"]:
        host = np.ascontiguousarray(local)
        if for_load:
            after.append(lambda: np.copyto(local, host))
    if for_load and not local.flags["WRITEABLE"]:
        raise CheckpointArgumentError(f"tensor {name!r}: numpy array is read-only", "INVALID_ARGUMENT")
    flat = host.reshape(-1).view(np.uint8)
    pieces = split_local(name, flat, host.itemsize, host.size, boxes)
    return TensorPlan(name, numpy_dtype_name(local, name), tuple(int(s) for s in shape), pieces, after)


def numpy_plan(name: str, array: np.ndarray, for_load: bool) -> TensorPlan:
    """A whole numpy array, held (as a replica) by every rank."""
    shape = tuple(int(s) for s in array.shape)
    return numpy_local_plan(name, array, shape, [(Box(tuple(0 for _ in shape), shape), 0)], for_load)

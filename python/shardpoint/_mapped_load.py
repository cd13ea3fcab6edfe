"""Loads through a :class:`~shardpoint.KeyMapping` and with tied weights.

The plans of target tensors (what this rank holds, in target names and coordinates) become plans
of stored tensors: a renamed target's pieces are asked of its stored name; a fused target's pieces
are cut by the region each stored source covers (see ``_mapping.Layouts``) and asked of that
source in its own coordinates. A cut that is not contiguous in its piece is read into a temporary
and scattered into place afterwards (``MappedLoad.after_load``, which runs before the targets' own
copy-backs).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from . import _core
from ._errors import CheckpointArgumentError, CheckpointNotFoundError, translated
from ._mapping import KeyMapping, Layouts, Region, _names_of
from ._pieces import Box, Piece, TensorPlan

Stored = Mapping[str, tuple[str, tuple[int, ...]]]


@dataclass
class MappedLoad:
    """What the core is asked for and what to do after it has read."""

    plans: list[TensorPlan]                                           # in stored names
    after_load: list[Callable[[], None]] = field(default_factory=list)  # scatters, then the targets' own
    missing: list[str] = field(default_factory=list)                  # target keys left out (not strict)
    targets: dict[str, str] = field(default_factory=dict)             # stored name -> target key (renames)

    def missing_keys(self, core_missing: Sequence[str]) -> list[str]:
        """All target keys not loaded: those found missing here and those the core reports."""
        return self.missing + [self.targets.get(name, name) for name in core_missing]


def stored_tensors(path: str, allow_external_links: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the checkpoint at ``path`` (CheckpointNotFoundError when none)."""
    with translated():
        md = _core.read_metadata(path, allow_external_links=allow_external_links)
    return {t.name: (t.dtype, t.shape) for t in md.tensors}


def _signature(value: Any) -> Optional[tuple]:
    """What makes two leaves the same tensor: memory, offset, shape, strides, dtype (None: not comparable)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        from . import _torch

        local, extra = value, ()
        if _torch.is_dtensor(value):
            local = value._local_tensor
            extra = (id(value.device_mesh), tuple(value.placements), tuple(value.shape))
        if local.device.type == "meta" or local.numel() == 0:
            return None
        return ("torch", str(local.device), local.untyped_storage().data_ptr(), local.storage_offset(),
                tuple(local.shape), tuple(local.stride()), str(local.dtype)) + extra
    if isinstance(value, np.ndarray) and value.size:
        return ("numpy", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
    return None


_UNKNOWN = object()  # _addresses: a leaf whose first element's address is not known cheaply


def _addresses(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The address of each leaf's first element, which leaves that are the same tensor share; None
    for a leaf that is no tensor or holds no memory, and _UNKNOWN where it cannot be read."""
    torch = sys.modules.get("torch")
    if torch is not None:
        from ._torch import is_dtensor
    out: dict[str, Any] = {}
    for key, value in flat.items():
        address = None
        if torch is not None and isinstance(value, torch.Tensor):
            local = value._local_tensor if is_dtensor(value) else value
            try:
                address = None if local.is_meta or local.numel() == 0 else local.data_ptr()
            except Exception:  # noqa: BLE001 - a tensor subclass without storage: compare signatures
                address = _UNKNOWN
        elif isinstance(value, np.ndarray) and value.size:
            address = value.__array_interface__["data"][0]
        out[key] = address
    return out


def tied_groups(flat: Mapping[str, Any]) -> list[list[str]]:
    """Groups of keys (two or more) whose leaves are the same tensor. Only leaves whose first
    elements share an address can be: the others are not compared (a state dict has hundreds to
    thousands of leaves, and nearly always no ties)."""
    addresses = _addresses(flat)
    shared = Counter(a for a in addresses.values() if a is not None and a is not _UNKNOWN)
    groups: dict[tuple, list[str]] = {}
    for key, value in flat.items():
        address = addresses[key]
        if address is None or (address is not _UNKNOWN and shared[address] < 2):
            continue
        signature = _signature(value)
        if signature is not None:
            groups.setdefault(signature, []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def _resolve(layouts: Layouts, plan: TensorPlan, cast: bool) -> Any:
    """The regions of a fused target, or the stored name of any other; NotFound when not stored."""
    hit = layouts.fusion(plan.name)
    if hit is None:
        name = layouts.stored_name(plan.name)
        if name not in layouts.stored:
            via = f" (renamed from stored {name!r})" if name != plan.name else ""
            raise CheckpointNotFoundError(f"key {plan.name!r}{via} is missing from the checkpoint", "NOT_FOUND")
        return name
    shape, regions = layouts.regions(plan.name, *hit)
    if shape != tuple(plan.shape):
        raise CheckpointArgumentError(f"target {plan.name!r} has shape {tuple(plan.shape)}, but its stored tensors "
                                      f"{_names_of(regions)} make shape {shape}", "INVALID_ARGUMENT")
    for region in regions:
        dtype = layouts.stored[region.source][0]
        if dtype != plan.dtype and not cast:
            raise CheckpointArgumentError(f"target {plan.name!r} has dtype {plan.dtype}, stored tensor "
                                          f"{region.source!r} has dtype {dtype} (pass cast=True to convert)",
                                          "INVALID_ARGUMENT")
    return regions


def map_load(path: str, flat: Mapping[str, Any], plans: list[TensorPlan], mapping: Optional[KeyMapping],
             strict: bool, cast: bool, allow_external_links: bool = False) -> Optional[MappedLoad]:
    """The core's plans for a load of ``plans`` through ``mapping`` and tied weights; None when
    neither applies (no mapping and no tied keys), so the plans go to the core as they are.

    Raises CheckpointNotFoundError (``strict``) naming the missing keys and their missing sources,
    CheckpointArgumentError for shapes that do not tile a target or dtypes that differ.
    """
    tied = tied_groups({p.name: flat[p.name] for p in plans if p.name in flat})
    if mapping is None and not tied:
        return None
    layouts = Layouts(mapping or KeyMapping(), stored_tensors(path, allow_external_links))
    resolved: dict[str, Any] = {}
    absent: dict[str, CheckpointNotFoundError] = {}
    for plan in plans:
        try:
            resolved[plan.name] = _resolve(layouts, plan, cast)
        except CheckpointNotFoundError as e:
            absent[plan.name] = e
    for group in tied:  # filled by the load of a key it is tied to
        if any(key in resolved for key in group):
            for key in group:
                absent.pop(key, None)
    if absent and strict:
        shown = "; ".join(e.message for e in list(absent.values())[:5])
        raise CheckpointNotFoundError(f"{len(absent)} key(s) missing from the checkpoint {path!r}: {shown}"
                                      f"{' ...' if len(absent) > 5 else ''}", "NOT_FOUND")
    out = to_stored([p for p in plans if p.name in resolved], resolved)
    out.missing = sorted(absent)
    return out


def to_stored(plans: Sequence[TensorPlan], resolved: Mapping[str, Any]) -> MappedLoad:
    """Plans in stored names for target ``plans`` whose ``resolved`` entry is a stored name or regions."""
    by_source: dict[str, TensorPlan] = {}
    out = MappedLoad([])
    scatters: list[Callable[[], None]] = []

    def pieces_of(source: str, dtype: str, shape: tuple[int, ...]) -> list[Piece]:
        plan = by_source.setdefault(source, TensorPlan(source, dtype, shape, []))
        if plan.dtype != dtype:
            raise CheckpointArgumentError(f"stored tensor {source!r} is loaded into targets of dtypes {plan.dtype} and "
                                          f"{dtype}", "INVALID_ARGUMENT")
        return plan.pieces

    for plan in plans:
        target = resolved[plan.name]
        if isinstance(target, str):
            pieces_of(target, plan.dtype, tuple(plan.shape)).extend(plan.pieces)
            if target != plan.name:
                out.targets[target] = plan.name
        else:
            for region in target:
                pieces_of(region.source, plan.dtype, tuple(region.sizes[d] for d in region.kept))
            for offsets, sizes, data in plan.pieces:
                for source, piece, scatter in _cut(Box(tuple(offsets), tuple(sizes)), data, target):
                    by_source[source].pieces.append(piece)
                    if scatter is not None:
                        scatters.append(scatter)
    out.plans = list(by_source.values())
    out.after_load = scatters + [c for plan in plans for c in plan.after_load]
    return out


def _cut(box: Box, data: Any, regions: Sequence[Region]) -> list[tuple[str, Piece, Optional[Callable[[], None]]]]:
    """Each region's part of a piece ``box`` whose bytes are ``data``, as a piece of that region's source."""
    itemsize = int(data.nbytes) // box.volume
    out = []
    for region in regions:
        lo = [max(a, b) for a, b in zip(box.offsets, region.offsets)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(box.offsets, box.sizes, region.offsets, region.sizes)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        inter = Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi)))
        part, scatter = _bytes_of(data, box, inter, itemsize)
        offsets = tuple(inter.offsets[d] - region.offsets[d] for d in region.kept)
        out.append((region.source, (offsets, tuple(inter.sizes[d] for d in region.kept), part), scatter))
    return out


def _contiguous(outer: Sequence[int], inner: Sequence[int]) -> bool:
    """Whether a sub-box of sizes ``inner`` is one contiguous run of a row-major box of sizes ``outer``."""
    differs = [d for d in range(len(outer)) if inner[d] != outer[d]]
    return not differs or all(inner[d] == 1 for d in range(differs[-1]))


def _bytes_of(data: Any, box: Box, inter: Box, itemsize: int) -> tuple[Any, Optional[Callable[[], None]]]:
    """Contiguous bytes for sub-box ``inter`` of ``box`` (row-major ``data``): a view where the
    sub-box is contiguous, else a temporary and the function that scatters it into ``data``."""
    relative = [i - b for i, b in zip(inter.offsets, box.offsets)]
    nbytes = inter.volume * itemsize
    if _contiguous(box.sizes, inter.sizes):
        start = 0
        for r, s in zip(relative, box.sizes):
            start = start * s + r
        return data[start * itemsize:start * itemsize + nbytes], None
    if isinstance(data, np.ndarray):
        temp = np.empty(nbytes, dtype=np.uint8)
    else:
        import torch

        temp = torch.empty(nbytes, dtype=torch.uint8)
    where = tuple(slice(r, r + s) for r, s in zip(relative, inter.sizes))

    def scatter() -> None:
        data.reshape(*box.sizes, itemsize)[where] = temp.reshape(*inter.sizes, itemsize)

    return temp, scatter


def full_targets(mapping: KeyMapping, stored: Stored) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, Any]]:
    """For a load without a template: ``{target: (dtype, shape)}`` in stored order, and each target's
    stored name or regions. Stored tensors that no fusion uses keep their (renamed) names."""
    layouts = Layouts(mapping, stored)
    fused = {}
    for target, (fuse, bindings) in layouts.fused_targets().items():
        shape, regions = layouts.regions(target, fuse, bindings)
        dtypes = sorted({stored[r.source][0] for r in regions})
        if len(dtypes) > 1:
            raise CheckpointArgumentError(f"target {target!r}: stored tensors {_names_of(regions)} have dtypes "
                                          f"{dtypes}, expected one", "INVALID_ARGUMENT")
        fused[regions[0].source] = (target, dtypes[0], shape, regions)
    used = {r.source for *_, regions in fused.values() for r in regions}
    targets: dict[str, tuple[str, tuple[int, ...]]] = {}
    resolved: dict[str, Any] = {}
    for name, (dtype, shape) in stored.items():
        if name in fused:
            target, dtype, shape, regions = fused[name]
            targets[target], resolved[target] = (dtype, shape), regions
        elif name not in used:
            target = mapping.target_name(name)
            if target in targets:
                raise CheckpointArgumentError(f"stored tensor {name!r} is renamed to {target!r}, a name another tensor "
                                              f"already loads into", "INVALID_ARGUMENT")
            targets[target], resolved[target] = (dtype, shape), name
    return targets, resolved


Placement = tuple[str, str, tuple[int, ...], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]


def consolidation_mapping(path: str, mapping: KeyMapping,
                          allow_external_links: bool = False) -> tuple[list[Placement], dict[str, str]]:
    """``mapping`` over the checkpoint at ``path`` as the consolidation engine applies it: each fused
    target as ``(target, dtype, shape, [(stored name, offsets, sizes)])``, where each stored tensor
    lies in the target (see ``_mapping.Layouts.regions``), and ``{stored name: target name}`` for
    the renamed tensors no fusion uses. The engine reads the targets straight from the stored
    chunks (shardpoint/engine/mapped_metadata.h).

    Raises CheckpointNotFoundError (no checkpoint; a fusion's source missing), CheckpointArgumentError
    (sources whose shapes or dtypes do not make their target, names that collide).
    """
    targets, resolved = full_targets(mapping, stored_tensors(path, allow_external_links))
    placements: list[Placement] = []
    renames: dict[str, str] = {}
    for target, source in resolved.items():
        if isinstance(source, str):
            if source != target:
                renames[source] = target
            continue
        dtype, shape = targets[target]
        placements.append((target, dtype, tuple(shape), [(r.source, r.offsets, r.sizes) for r in source]))
    return placements, renames

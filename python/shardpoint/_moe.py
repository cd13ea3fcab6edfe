"""Expert parallelism: expert parameters saved as slices of the global expert tensor.

With expert parallelism each EP rank holds ``num_experts / ep_size`` consecutive experts of every
expert parameter (dim ``dim`` is the expert dimension), possibly further sharded inside the EP group
as a DTensor (e.g. FSDP over an ``efsdp`` mesh dim). :class:`ExpertShard` says so for one tensor;
:func:`mark_experts` wraps the expert entries of a state dict. The checkpoint then holds the global
expert tensor ``[num_experts, ...]``, and loading with any other EP size reads the right experts:
no "drop / restore EP dim" conversions, no special load planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from ._errors import CheckpointArgumentError
from ._flatten import flatten, set_by_path
from ._pieces import Box, TensorPlan


@dataclass
class ExpertShard:
    """This EP rank's experts of one expert tensor.

    ``local`` holds experts ``[ep_rank * n, (ep_rank + 1) * n)`` along ``dim``, where ``n`` is
    ``local``'s (global, for a DTensor) size on ``dim``. A DTensor ``local`` is sharded within the
    EP group; its own placements are honoured.
    """

    local: Any
    ep_rank: int
    ep_size: int
    dim: int = 0

    def _shardpoint_plan(self, name: str, rank: int, for_load: bool) -> TensorPlan:
        if not 0 <= self.ep_rank < self.ep_size:
            raise CheckpointArgumentError(f"tensor {name!r}: ep_rank {self.ep_rank} outside ep_size {self.ep_size}",
                                          "INVALID_ARGUMENT")
        inner_shape = tuple(int(s) for s in self.local.shape)
        if not 0 <= self.dim < len(inner_shape):
            raise CheckpointArgumentError(f"tensor {name!r}: expert dim {self.dim} outside shape {inner_shape}",
                                          "INVALID_ARGUMENT")
        experts = inner_shape[self.dim]
        shape = tuple(s * self.ep_size if d == self.dim else s for d, s in enumerate(inner_shape))
        from . import _layouts

        data = self.local
        inner_box: Optional[Box] = Box((0,) * len(inner_shape), inner_shape)
        if _is_dtensor(self.local):
            from . import _torch

            inner_box = _torch.dtensor_box(name, self.local)
            data = self.local._local_tensor
        boxes = []
        if inner_box is not None:
            offsets = tuple(o + self.ep_rank * experts if d == self.dim else o
                            for d, o in enumerate(inner_box.offsets))
            boxes.append((Box(offsets, inner_box.sizes), 0))
        return _layouts.local_plan(name, data, shape, boxes, for_load)


def _is_dtensor(value: Any) -> bool:
    import sys

    if sys.modules.get("torch") is None:
        return False
    from . import _torch

    return _torch.is_dtensor(value)


def _is_array(value: Any) -> bool:
    import sys

    import numpy as np

    torch = sys.modules.get("torch")
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def _mentions(key: str, fqn: str) -> bool:
    return f".{fqn}." in f".{key}."


def _module_param_names(model: Any, modules: Iterable[Any]) -> list[str]:
    by_id = {id(m): name for name, m in model.named_modules()}
    names = []
    for module in modules:
        if isinstance(module, str):
            prefix = module
        elif id(module) in by_id:
            prefix = by_id[id(module)]
        else:
            raise CheckpointArgumentError(f"module {type(module).__name__} is not part of the model",
                                          "INVALID_ARGUMENT")
        sub = model.get_submodule(prefix) if prefix else model
        names += [f"{prefix}.{p}" if prefix else p for p, _ in sub.named_parameters()]
    return names


def mark_experts(state_dict: Mapping[str, Any], *, ep_rank: Optional[int] = None, ep_size: Optional[int] = None,
                 dim: int = 0, predicate: Optional[Callable[[str], bool]] = None, model: Any = None,
                 modules: Optional[Iterable[Any]] = None, ep_group: Any = None) -> dict[str, Any]:
    """A copy of ``state_dict`` whose expert tensors are wrapped in :class:`ExpertShard`.

    Expert entries are the tensor leaves whose dotted key satisfies ``predicate(key)``, or that
    belong to a parameter of one of ``modules`` (modules of ``model`` or their qualified names;
    optimizer-state keys like ``state.<param>.exp_avg`` match too). ``ep_rank`` / ``ep_size``
    default to the rank and size of ``ep_group``. The copy shares every tensor with the original
    (loads write into the original tensors); containers are new. Raises CheckpointArgumentError when
    neither predicate nor modules is given or the EP coordinates are missing.
    """
    if ep_group is not None:
        import torch.distributed as dist

        ep_rank = dist.get_rank(ep_group) if ep_rank is None else ep_rank
        ep_size = dist.get_world_size(ep_group) if ep_size is None else ep_size
    if ep_rank is None or ep_size is None:
        raise CheckpointArgumentError("mark_experts needs ep_rank and ep_size, or ep_group", "INVALID_ARGUMENT")
    if predicate is None and modules is None:
        raise CheckpointArgumentError("mark_experts needs a predicate or modules", "INVALID_ARGUMENT")
    if modules is not None:
        if model is None:
            raise CheckpointArgumentError("mark_experts with modules needs the model", "INVALID_ARGUMENT")
        fqns = _module_param_names(model, modules)
        by_name = predicate
        predicate = lambda key: any(_mentions(key, f) for f in fqns) or (by_name is not None and by_name(key))  # noqa: E731

    out = _copy_containers(state_dict)
    flat, paths = flatten(out, _is_array)
    for key, value in flat.items():
        if _is_array(value) and predicate(key):
            set_by_path(out, paths[key], ExpertShard(value, ep_rank, ep_size, dim))
    return out


def _copy_containers(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value

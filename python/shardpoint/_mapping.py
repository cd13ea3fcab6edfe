"""Key mappings: stored tensors loaded under other names, and target tensors made of several stored ones.

    mapping = sp.KeyMapping(
        renames=[(r"(.*)\\.block_sparse_moe\\.gate\\.weight", r"\\1.mlp.gate.weight")],
        fusions=[sp.Fuse("model.layers.{layer}.mlp.experts.gate_up_proj", sp.Stack("expert", 0, sp.Cat(0, [
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight"])))])
    sp.load(model.state_dict(), path, mapping=mapping)

Directions: a rename takes a *stored* name to the *target* name it loads into; a fusion names a
target (a template whose ``{placeholders}`` match one dot-free name part each) and the stored
tensors it is made of (templates over the same placeholders plus each :class:`Stack`'s counter,
which numbers the stacked tensors 0..n-1; n is found in the checkpoint). Fusion sources are stored
names (renames do not apply to them).

Planning is geometric: each stored source covers one region of its target (a stack inserts a
dimension of size 1 at the source's index, a concatenation shifts along its dim). For every piece
of the target this rank holds (any layout: plain, DTensor, FSDP2, ShardedTensor, ExpertShard), the
core is asked for the intersection of that piece with each source's region, in the source's own
coordinates, so only those bytes are read. Intersections that are not contiguous in the piece go
through a temporary that is copied into place after the read.

Tied weights: a template key absent from the checkpoint whose tensor is the very tensor (same
memory, shape and strides) of another template key that is loaded is filled by that load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ._errors import CheckpointArgumentError, CheckpointNotFoundError


def _argument_error(message: str) -> CheckpointArgumentError:
    return CheckpointArgumentError(message, "INVALID_ARGUMENT")


def _not_found(message: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(message, "NOT_FOUND")


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Stack:
    """Stored tensors numbered by placeholder ``over`` (0, 1, ...) stacked along a new dim ``dim``."""

    over: str
    dim: int
    part: "Node"


@dataclass(frozen=True)
class Cat:
    """The concatenation of ``parts`` along their existing dim ``dim``, in the order given."""

    dim: int
    parts: Sequence["Node"]


Node = Union[str, Stack, Cat]


@dataclass(frozen=True)
class Fuse:
    """Target tensor ``target`` (a name template) is ``source`` (a stored name template, or a
    :class:`Stack` / :class:`Cat` of them)."""

    target: str
    source: Node


Rename = Union[tuple[str, str], Callable[[str], Optional[str]]]


@dataclass(frozen=True)
class KeyMapping:
    """Renames (stored name -> target name) and fusions (target <- stored tensors).

    A rename is ``(pattern, replacement)``: a stored name that ``re.fullmatch``es ``pattern`` loads
    into ``match.expand(replacement)``; or a callable returning the target name (or None to keep
    the stored name). The first rename that applies wins. A stored name that no rename applies to
    loads under its own name.
    """

    renames: Sequence[Rename] = ()
    fusions: Sequence[Fuse] = ()

    def target_name(self, stored: str) -> str:
        """The target name a stored tensor (one that no fusion uses) loads into."""
        for rename in self.renames:
            if callable(rename):
                out = rename(stored)
                if out is not None:
                    return out
                continue
            pattern, replacement = rename
            match = re.fullmatch(pattern, stored)
            if match:
                return match.expand(replacement)
        return stored


@dataclass(frozen=True)
class Region:
    """Where stored tensor ``source`` lies in its target: a box, and the target dims that are the
    source's dims (in order; the others are dims a stack inserted, of size 1)."""

    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    kept: tuple[int, ...]


def _names_of(regions: Sequence[Region], limit: int = 4) -> str:
    names = [r.source for r in regions]
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def _leaves(node: Node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, Stack):
        return _leaves(node.part)
    return [leaf for part in node.parts for leaf in _leaves(part)]


def _template_regex(template: str, fixed: Mapping[str, str], counter: Optional[str] = None) -> re.Pattern:
    """A regex for ``template``: fixed placeholders literal, ``counter`` as digits, the rest one name part."""
    out, seen, last = [], set(), 0
    for match in _PLACEHOLDER.finditer(template):
        out.append(re.escape(template[last:match.start()]))
        name = match.group(1)
        if name in fixed:
            out.append(re.escape(fixed[name]))
        elif name in seen:
            out.append(f"(?P={name})")
        else:
            out.append(f"(?P<{name}>{'[0-9]+' if name == counter else '[^.]+'})")
            seen.add(name)
        last = match.end()
    out.append(re.escape(template[last:]))
    return re.compile("".join(out))


def _format(template: str, bindings: Mapping[str, str], target: str) -> str:
    def value(match: re.Match) -> str:
        if match.group(1) not in bindings:
            raise _argument_error(f"target {target!r}: placeholder {{{match.group(1)}}} of stored name template "
                                  f"{template!r} is bound neither by the target nor by a Stack")
        return bindings[match.group(1)]
    return _PLACEHOLDER.sub(value, template)


class Layouts:
    """Resolves target names against one checkpoint's stored tensors ``{name: (dtype, shape)}``."""

    def __init__(self, mapping: KeyMapping, stored: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.mapping = mapping
        self.stored = stored
        self._targets = [(_template_regex(f.target, {}), f) for f in mapping.fusions]
        self._renamed: dict[str, str] = {}
        self._counter_cache: dict[tuple[str, str], dict[tuple[str, ...], int]] = {}
        for name in stored:
            target = mapping.target_name(name)
            if target != name:
                if target in self._renamed:
                    raise _argument_error(f"renames take both stored {self._renamed[target]!r} and {name!r} "
                                          f"to target {target!r}")
                self._renamed[target] = name

    def fusion(self, target: str) -> Optional[tuple[Fuse, dict[str, str]]]:
        """The first fusion whose target template matches ``target``, with its placeholder values."""
        for regex, fuse in self._targets:
            match = regex.fullmatch(target)
            if match:
                return fuse, match.groupdict()
        return None

    def stored_name(self, target: str) -> str:
        """The stored name a target that no fusion makes loads from (after renames)."""
        return self._renamed.get(target, target)

    def regions(self, target: str, fuse: Fuse, bindings: Mapping[str, str]) -> tuple[tuple[int, ...], list[Region]]:
        """The shape the stored sources of ``target`` make, and where each lies in it.

        Raises CheckpointNotFoundError naming the target and a missing source, CheckpointArgumentError
        when the sources' shapes do not tile (expected vs found).
        """
        return self._layout(fuse.source, dict(bindings), target)

    def _layout(self, node: Node, bindings: dict[str, str], target: str) -> tuple[tuple[int, ...], list[Region]]:
        if isinstance(node, str):
            name = _format(node, bindings, target)
            if name not in self.stored:
                raise _not_found(f"target {target!r}: stored tensor {name!r} is missing from the checkpoint")
            shape = tuple(self.stored[name][1])
            return shape, [Region(name, (0,) * len(shape), shape, tuple(range(len(shape))))]
        if isinstance(node, Stack):
            return self._stack(node, bindings, target)
        return self._cat(node, bindings, target)

    def _count(self, node: Stack, bindings: Mapping[str, str]) -> int:
        """1 + the largest value of the stack's counter among stored names (1 when none: its 0 is then missing)."""
        largest = -1
        for leaf in _leaves(node.part):
            table = self._counters(leaf, node.over)
            others = [name for name in dict.fromkeys(_PLACEHOLDER.findall(leaf)) if name != node.over]
            if all(name in bindings for name in others):
                largest = max(largest, table.get(tuple(bindings[name] for name in others), -1))
                continue
            for values, value in table.items():  # a nested stack's counter is still free
                if all(bindings.get(name, v) == v for name, v in zip(others, values)):
                    largest = max(largest, value)
        return largest + 1

    def _counters(self, leaf: str, counter: str) -> dict[tuple[str, ...], int]:
        """{values of the other placeholders: largest counter value} over the stored names ``leaf``
        matches; the stored names are scanned once per (template, counter)."""
        key = (leaf, counter)
        if key not in self._counter_cache:
            regex, found = _template_regex(leaf, {}, counter), {}
            for name in self.stored:
                match = regex.fullmatch(name)
                if match and counter in match.groupdict():
                    groups = match.groupdict()
                    values = tuple(v for k, v in groups.items() if k != counter)
                    found[values] = max(found.get(values, -1), int(groups[counter]))
            self._counter_cache[key] = found
        return self._counter_cache[key]

    def _stack(self, node: Stack, bindings: dict[str, str], target: str) -> tuple[tuple[int, ...], list[Region]]:
        count = self._count(node, bindings)
        parts = [self._layout(node.part, {**bindings, node.over: str(i)}, target) for i in range(count)]
        shape = parts[0][0]
        for other, regions in parts:
            if other != shape:
                raise _argument_error(
                    f"target {target!r}: stored tensors {_names_of(regions)} have shape {other}, expected {shape} "
                    f"as the other tensors stacked over {{{node.over}}}")
        if not 0 <= node.dim <= len(shape):
            raise _argument_error(f"target {target!r}: stack dim {node.dim} outside 0..{len(shape)} for parts "
                                  f"of shape {shape}")
        d = node.dim
        out = []
        for i, (_, regions) in enumerate(parts):
            for r in regions:
                out.append(Region(r.source, r.offsets[:d] + (i,) + r.offsets[d:], r.sizes[:d] + (1,) + r.sizes[d:],
                                  tuple(k if k < d else k + 1 for k in r.kept)))
        return shape[:d] + (len(parts),) + shape[d:], out

    def _cat(self, node: Cat, bindings: dict[str, str], target: str) -> tuple[tuple[int, ...], list[Region]]:
        parts = [self._layout(part, bindings, target) for part in node.parts]
        shape = list(parts[0][0])
        d = node.dim
        if not 0 <= d < len(shape):
            raise _argument_error(f"target {target!r}: concatenation dim {d} outside shape {tuple(shape)}")
        out, offset = [], 0
        for other, regions in parts:
            if len(other) != len(shape) or any(a != b for k, (a, b) in enumerate(zip(other, shape)) if k != d):
                expected = tuple("*" if k == d else s for k, s in enumerate(shape))
                raise CheckpointArgumentError(
                    f"target {target!r}: stored tensors {_names_of(regions)} have shape {other}, expected {expected} "
                    f"to concatenate along dim {d}")
            for r in regions:
                shifted = r.offsets[:d] + (r.offsets[d] + offset,) + r.offsets[d + 1:]
                out.append(Region(r.source, shifted, r.sizes, r.kept))
            offset += other[d]
        shape[d] = offset
        return tuple(shape), out

    def fused_targets(self) -> dict[str, tuple[Fuse, dict[str, str]]]:
        """Every target a fusion makes from this checkpoint's stored names (for loads without a template)."""
        found: dict[str, tuple[Fuse, dict[str, str]]] = {}
        for fuse in self.mapping.fusions:
            target_vars = set(_PLACEHOLDER.findall(fuse.target))
            for leaf in _leaves(fuse.source):
                regex = _template_regex(leaf, {})
                for name in self.stored:
                    match = regex.fullmatch(name)
                    if match is None:
                        continue
                    bindings = {k: v for k, v in match.groupdict().items() if k in target_vars}
                    if set(bindings) == target_vars:
                        target = _format(fuse.target, bindings, fuse.target)
                        found.setdefault(target, (fuse, bindings))
        return found


def node_from_data(data: Any) -> Node:
    """A source node from JSON-able data: a name template, ``{"stack": over, "dim": d, "of": node}``
    or ``{"cat": d, "of": [node, ...]}``. Raises CheckpointArgumentError for anything else."""
    if isinstance(data, str):
        return data
    if isinstance(data, Mapping) and set(data) == {"stack", "dim", "of"}:
        return Stack(str(data["stack"]), int(data["dim"]), node_from_data(data["of"]))
    if isinstance(data, Mapping) and set(data) == {"cat", "of"} and isinstance(data["of"], (list, tuple)):
        return Cat(int(data["cat"]), tuple(node_from_data(part) for part in data["of"]))
    raise _argument_error(f"mapping source {data!r} is not a name template, a stack "
                          f"({{'stack', 'dim', 'of'}}) or a concatenation ({{'cat', 'of'}})")


def mapping_from_data(data: Mapping[str, Any]) -> KeyMapping:
    """A :class:`KeyMapping` from JSON-able data: ``{"renames": [[pattern, replacement], ...],
    "fusions": [{"target": template, "source": node}, ...]}`` (see :func:`node_from_data`)."""
    unknown = set(data) - {"renames", "fusions"}
    if unknown:
        raise _argument_error(f"mapping data has unknown fields {sorted(unknown)} (expected 'renames', "
                              f"'fusions')")
    renames = []
    for rename in data.get("renames", []):
        if not (isinstance(rename, (list, tuple)) and len(rename) == 2 and all(isinstance(r, str) for r in rename)):
            raise _argument_error(f"mapping rename {rename!r} is not [pattern, replacement]")
        renames.append((rename[0], rename[1]))
    fusions = []
    for fuse in data.get("fusions", []):
        if not isinstance(fuse, Mapping) or set(fuse) != {"target", "source"}:
            raise _argument_error(f"mapping fusion {fuse!r} is not {{'target', 'source'}}")
        fusions.append(Fuse(str(fuse["target"]), node_from_data(fuse["source"])))
    return KeyMapping(tuple(renames), tuple(fusions))

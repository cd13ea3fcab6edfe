"""Flattening of nested state dicts to dotted keys, and rebuilding them.

As torch.distributed.checkpoint does: dicts are walked with their (string) keys, lists that hold
tensors, mappings or such lists are walked with their indices, and the keys along the way are
joined with ".". Everything else is a leaf; in particular a tuple is always one leaf, even when it
holds tensors (DCP stores it as one object, and so does shardpoint). An empty dict or list is a
leaf too (stored as a plain object), so the structure comes back whole, and so is a mapping with a
key that is not a str (``{1: "a"}``, stored exactly) unless it holds tensors. A mapping holding
tensors is walked when its keys are str or int, as DCP walks ``optimizer.state_dict()["state"]``
(``{0: {"exp_avg": t}}`` gives ``state.0.exp_avg``); other keys are refused. A path records, per
level, whether it went through a dict with a str key, a dict with an int key (an :class:`IntKey`)
or a list (a plain int index), which is what :func:`unflatten` needs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

Path = tuple  # tuple[str | IntKey | int, ...]


class IntKey(int):
    """A path step through a dict whose key is an int (a plain int step is a list index)."""

    def __repr__(self) -> str:
        return f"IntKey({int(self)})"

    def __str__(self) -> str:  # the dotted key shows the number, as DCP's does
        return str(int(self))


def _is_int_key(k: Any) -> bool:
    return isinstance(k, int) and not isinstance(k, bool)


def _step(k: Any) -> Any:
    """The container key of a path step (an IntKey is the plain int it stands for)."""
    return int(k) if type(k) is IntKey else k


def _walks_into(value: Any, is_leaf: Callable[[Any], bool]) -> bool:
    if is_leaf(value):
        return False
    if isinstance(value, Mapping):
        return len(value) > 0 and (all(isinstance(k, str) for k in value) or _holds_leaf(value, is_leaf))
    if isinstance(value, list):
        return not _is_terminal_list(value, is_leaf)
    return False



def _holds_leaf(value: Any, is_leaf: Callable[[Any], bool], depth: int = 0) -> bool:
    """True when a tensor lies anywhere inside ``value`` (mappings, lists and tuples)."""
    if is_leaf(value):
        return True
    if depth > 100:
        return False
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(_holds_leaf(v, is_leaf, depth + 1) for v in items)


def _is_terminal_list(value: Sequence[Any], is_leaf: Callable[[Any], bool]) -> bool:
    """A list is one object unless an item is a tensor, a mapping or a list that is walked, as in
    DCP (``[[1, 2], [3]]`` and ``[(t, 1)]`` are stored under their own key, not as ``x.0``...)."""
    return all(not is_leaf(v) and not isinstance(v, Mapping)
               and (not isinstance(v, list) or _is_terminal_list(v, is_leaf)) for v in value)


def flatten(state_dict: Mapping[str, Any], is_leaf: Callable[[Any], bool]) -> tuple[dict[str, Any], dict[str, Path]]:
    """Flattens ``state_dict``; returns ({dotted key: leaf}, {dotted key: path}).

    ``is_leaf(value)`` tells which values are tensors (never walked into). Raises ValueError naming
    both paths when two different paths give the same dotted key, and TypeError for a key that is
    neither a str nor an int in a dict that holds tensors (without tensors such a dict is one leaf).
    """
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}

    def visit(value: Any, path: Path) -> None:
        if path and not _walks_into(value, is_leaf):
            key = ".".join(str(p) for p in path)
            if key in flat:
                raise ValueError(f"state dict key {key!r} is produced by two paths: {paths[key]} and {path}")
            flat[key] = value
            paths[key] = path
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str) and (not path or not _is_int_key(k)):
                    raise TypeError(f"state dict key {k!r} under {'.'.join(map(str, path)) or '<root>'} is not a str"
                                    f"{' or an int' if path else ''}")
                visit(v, path + (k if isinstance(k, str) else IntKey(k),))
        else:
            for i, v in enumerate(value):
                visit(v, path + (i,))

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict must be a mapping, found {type(state_dict).__name__}")
    visit(state_dict, ())
    return flat, paths


def set_by_path(root: Any, path: Path, value: Any) -> None:
    """Replaces the leaf at ``path`` inside ``root`` (dicts and lists; a tuple on the way is rebuilt)."""
    parent = root
    for step in path[:-1]:
        child = parent[_step(step)]
        if isinstance(child, tuple):
            child = list(child)
            _assign(parent, step, child)
        parent = child
    _assign(parent, path[-1], value)


def _assign(container: Any, step: Any, value: Any) -> None:
    container[_step(step)] = value


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """Rebuilds the nested structure from leaves and their paths (keys without a path stay flat)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = tuple(paths.get(key, (key,)))
        node: Any = root
        for step, next_step in zip(path[:-1], path[1:]):
            node = _child(node, step, [] if isinstance(next_step, int) and type(next_step) is not IntKey else {})
        _put(node, path[-1], value)
    return root


def _child(node: Any, step: Any, empty: Any) -> Any:
    if isinstance(node, list):
        while len(node) <= step:
            node.append(None)
        if node[step] is None:
            node[step] = empty
        return node[step]
    return node.setdefault(_step(step), empty)


def _put(node: Any, step: Any, value: Any) -> None:
    if isinstance(node, list):
        while len(node) <= step:
            node.append(None)
    node[_step(step)] = value


def encode_paths(paths: Mapping[str, Path]) -> list[list[Any]]:
    """JSON-able form of the paths (stored as a checkpoint attribute), in key order: a str step is
    a string, a list index a number, an int dict key ``{"int": n}``."""
    return [[key, [{"int": int(p)} if type(p) is IntKey else p for p in path]] for key, path in paths.items()]


def decode_paths(encoded: Sequence[Sequence[Any]]) -> dict[str, Path]:
    """Inverse of :func:`encode_paths`."""
    return {key: tuple(IntKey(p["int"]) if isinstance(p, dict) else p for p in path) for key, path in encoded}

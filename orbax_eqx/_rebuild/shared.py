"""Stand-ins for `eqx.nn.Shared`'s `where` and `get`, from recorded key paths.

`Shared` ties nodes with two functions, usually lambdas, which cannot be
imported by name. A save records which nodes of `Shared.pytree` each one
selects (`_tree/nodes.py`); a rebuild puts in their place a `Selector` that
selects the same nodes. It carries the recorded function's name, so that it
compares equal to the checkpoint's record, and selects by attribute, index
and key only: it runs no code of the checkpoint's.

A recorded step may only go to a node of the saved tree: a dynamic field of a
recorded module or namedtuple, an index of a recorded list or tuple, a key of
a recorded dict (`route`, checked before anything is built), and a selector
steps through exactly such nodes when called (`Selector`), never through an
attribute that is no field (`__class__`, `__globals__`...).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from .._tree import nodes as _nodes
from .._tree.names import label


class Selector:
    """Selects the nodes at recorded key paths, as the saved `where`/`get` did."""

    def __init__(self, name: str, many: bool, paths: list[list[list[Any]]]):
        module, _, qualname = name.partition(".")
        # What `qualified_name` reads: the record's name, unchanged.
        self.__module__ = module
        self.__qualname__ = qualname
        self._many = many
        self._paths = [[(kind, key) for kind, key in path] for path in paths]

    def __call__(self, tree: Any) -> Any:
        found = [_select(tree, path) for path in self._paths]
        return tuple(found) if self._many else found[0]

    def __repr__(self) -> str:
        paths = ["".join(_show(step) for step in path) for path in self._paths]
        return f"<selects {', '.join(paths)}: stands in for {self.__module__}." + (
            f"{self.__qualname__}>"
        )


def selectors(
    leaves, nodes, name: str, rec: dict[str, Any], damaged: Callable[[str], Exception]
) -> dict[str, Selector]:
    """`eqx.nn.Shared` node `name`'s `where` and `get` leaves, as selectors of
    what the save recorded they select: `{leaf name: Selector}` (none if the
    save recorded no selection). Each recorded step must go to a recorded
    node (`route`), or this raises `damaged(what)`."""
    wiring = _wiring(rec)
    if wiring is None or rec.get("fields") != ["pytree", "where", "get"]:
        return {}
    start, *named = rec.get("children", [])
    ready = {}
    for field, child in zip(("where", "get"), named, strict=False):
        if child is None or child not in leaves:
            continue
        many, paths = wiring[field]
        for path in paths:
            bad = None if start is None else route(nodes, start, path)
            if start is None or bad is not None:
                raise damaged(
                    f"`eqx.nn.Shared` node {label(name, rec['path'])} records "
                    f"that `{field}` selects {_shown(path)}, which is no node "
                    f"of the saved tree (at step {bad})"
                )
        value = leaves[child].value
        text = value.get("callable") if isinstance(value, dict) else None
        ready[child] = Selector(str(text), many, paths)
    return ready


def _wiring(rec: dict[str, Any]) -> dict[str, tuple[bool, list]] | None:
    """`eqx.nn.Shared`'s recorded `where` and `get` selections, if well formed."""
    wiring = rec.get("wiring")
    if not isinstance(wiring, dict):
        return None
    found = {}
    for field in ("where", "get"):
        entry = wiring.get(field)
        if not (
            isinstance(entry, dict)
            and type(entry.get("many")) is bool
            and isinstance(entry.get("paths"), list)
            and entry["paths"]
            and all(is_path(p) for p in entry["paths"])
        ):
            return None
        found[field] = (entry["many"], entry["paths"])
    return found


def _shown(path: list) -> str:
    steps = "".join(_show(step) for step in path)
    return f"`{steps or '<the whole pytree>'}`"


def is_path(path: Any) -> bool:
    """Whether `path` is a recorded key path: `[[kind, key], ...]`."""
    return isinstance(path, list) and all(
        isinstance(step, list)
        and len(step) == 2
        and (
            (step[0] == "attr" and type(step[1]) is str)
            or (step[0] == "index" and type(step[1]) is int)
            or (step[0] == "key" and type(step[1]) in (int, str))
        )
        for step in path
    )


def route(nodes: dict[str, dict[str, Any]], start: str, path) -> str | None:
    """Follows a recorded key path through the recorded nodes from node (or
    leaf) `start`; returns the step it cannot take, as text, or None if every
    step goes to a node or leaf of the saved tree."""
    name: str | None = start
    for step in path:
        rec = nodes.get(name) if name is not None else None
        if rec is None:
            return f"{_show(step)} (a leaf has nothing to step into)"
        children = rec.get("children", [])
        at = _position(rec, *step)
        if at is None or at >= len(children) or children[at] is None:
            return f"{_show(step)} (no such field, index or key of a {rec['type']})"
        name = children[at]
    return None


def _position(rec: dict[str, Any], kind: str, key: Any) -> int | None:
    """Where step `(kind, key)` goes among the recorded node's children."""
    if kind == "attr" and rec["type"] in (_nodes.MODULE, _nodes.NAMEDTUPLE):
        fields = rec.get("fields", [])
        return fields.index(key) if key in fields else None
    if kind == "index" and rec["type"] in (_nodes.LIST, _nodes.TUPLE):
        return key if 0 <= key < len(rec.get("children", [])) else None
    if kind == "key" and rec["type"] == _nodes.DICT:
        # Recorded keys are encoded; a str or a small int is itself. The
        # type too: `True == 1`, but a key `True` is no key `1`.
        keys = rec.get("keys", [])
        found = [i for i, k in enumerate(keys) if type(k) is type(key) and k == key]
        return found[0] if found else None
    return None


def _select(tree: Any, path) -> Any:
    for kind, key in path:
        tree = _step(tree, kind, key)
    return tree


def _step(tree: Any, kind: str, key: Any) -> Any:
    """One step, only to a node: a dataclass's field, a namedtuple's field, a
    list's or tuple's index, a dict's key."""
    if kind == "attr":
        fields = getattr(type(tree), "_fields", None)  # a namedtuple's
        if not (
            (dataclasses.is_dataclass(tree) and not isinstance(tree, type))
            or isinstance(fields, tuple)
        ):
            raise LookupError(f"{_show((kind, key))}: not a module or namedtuple")
        names = (
            fields
            if isinstance(tree, tuple) and isinstance(fields, tuple)
            else _field_names(tree)
        )
        if key not in names:
            raise LookupError(f"{_show((kind, key))}: no such field")
        return getattr(tree, key)
    if kind == "index" and isinstance(tree, (list, tuple)):
        return tree[key]
    if kind == "key" and isinstance(tree, dict):
        return tree[key]
    raise LookupError(f"{_show((kind, key))}: not a step into {type(tree).__name__}")


def _field_names(tree: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(tree))


def _show(step) -> str:
    kind, key = step
    return f".{key}" if kind == "attr" else f"[{key!r}]"

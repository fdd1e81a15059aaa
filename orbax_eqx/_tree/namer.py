"""How a walk names leaves: key paths to leaf names (`Namer`, `eqx.nn.State`
entries by the layer that owns them) and to the text `jtu.keystr` prints
(`Labels`), each built on its parent's, in loops (deep trees must not recurse).
"""

import ast
import itertools
import re
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .names import SEPARATOR, join, key_part


class Labels:
    """A key path's leaf name (in a tree that crosses no `eqx.nn.State`) and
    its text as `jtu.keystr` prints it, at once, each built on its parent's:
    the leaves of a module share all but their last part, and a walk asks
    for tens of thousands. Inner nodes' are kept (for one walk: within one
    tree, equal paths are one node); found from the nearest one known in a
    loop, not a recursion, so that trees as deep as JAX flattens walk."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[str, str]] = {(): ("", "")}

    def __call__(self, path: tuple) -> tuple[str, str]:
        if not path:
            return "", ""
        parent = path[:-1]
        known = self._known.get(parent)
        if known is None:
            at = len(parent) - 1
            while parent[:at] not in self._known:
                at -= 1
            name, shown = self._known[parent[:at]]
            for end in range(at + 1, len(parent) + 1):
                entry = parent[end - 1]
                part = key_part(entry)
                name = name + SEPARATOR + part if end > 1 else part
                shown += str(entry)
                self._known[parent[:end]] = (name, shown)
            known = (name, shown)
        last = path[-1]
        if parent:
            return known[0] + SEPARATOR + key_part(last), known[1] + str(last)
        return key_part(last), str(last)


class Namer:
    """Turns key paths into leaf names."""

    def __init__(self, states: dict[tuple, tuple], modules: list, labels: Labels):
        self._states = states
        self._labels = labels
        owners: dict[Any, tuple] = {}
        if states:
            for path, m in modules:
                if isinstance(m, eqx.nn.StateIndex):
                    owners.setdefault(_hashable(m.marker), path)
        self._owners = owners
        self._relative = {path: _relative_parts(m) for path, m in states.items()}

    def __call__(self, path: tuple, old: bool = False) -> str:
        if not self._states:
            return self._labels(path)[0]
        parts = []
        for i, entry in enumerate(path):
            markers = self._states.get(path[:i])
            if markers is None or not isinstance(entry, jtu.FlattenedIndexKey):
                parts.append(key_part(entry))
                continue
            relative = self._relative[path[:i]]
            if not old and relative is not None:
                parts.extend(relative[entry.key])
            else:
                parts.append(self._old_part(markers[entry.key], entry.key, old))
        return join(parts)

    def _old_part(self, marker: Any, index: int, old: bool) -> str:
        owner = self._owners.get(_hashable(marker))
        if owner is not None and (old or not isinstance(marker, str)):
            return self(owner, old)
        if isinstance(marker, str):
            return key_part(jtu.DictKey(marker))
        return str(index)


# One step of a key path as `jtu.keystr` prints it: `.name`, `[3]`, `['key']`.
_KEY_STEP = re.compile(
    r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(-?[0-9]+)\]"
    r"|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]"
)


def _relative_parts(markers: tuple) -> list[list[str]] | None:
    """Each entry's name parts from its marker, or None if some marker is not a
    path `eqx.nn.make_with_state` wrote or two entries would share a name."""
    found = []
    for marker in markers:
        parts = _marker_parts(marker) if isinstance(marker, str) else None
        if parts is None:
            return None
        found.append(parts)
    # Injective: no entry's name is another's, or a prefix of another's.
    ordered = sorted(tuple(p) for p in found)
    for a, b in itertools.pairwise(ordered):
        if b[: len(a)] == a:
            return None
    return found


def _marker_parts(marker: str) -> list[str] | None:
    """`BNModel.bn.state_index` -> [`bn`, `state_index`]: the class name that
    `make_with_state` puts first dropped, the key path's steps named as a
    walk names them."""
    start = next((i for i, c in enumerate(marker) if c in ".["), len(marker))
    parts, at = [], start
    while at < len(marker):
        step = _KEY_STEP.match(marker, at)
        if step is None:
            return None
        attr, index, key = step.groups()
        if attr is not None:
            parts.append(attr)
        elif index is not None:
            parts.append(str(int(index)))
        else:
            parts.append(key_part(jtu.DictKey(ast.literal_eval(key))))
        at = step.end()
    return parts or None


def _hashable(marker: Any) -> Any:
    try:
        hash(marker)
        return marker
    except TypeError:
        return id(marker)

"""Paths read off leaf names (`compact`): a record whose path
its name reads as does not write it."""

from collections.abc import Collection
from typing import Any

from .._tree.names import ESCAPE, SEPARATOR
from .._tree.walk import display_path

ROOT = display_path("")  # the root's path: `<root>`


class Paths:
    """The paths names read as, given which names are modules'.

    A name's parts become the path's: an index (`3`) is `[3]`, a part under a
    module (an attribute) is `.part`, any other part (a dict key) is
    `['part']`, as `jax.tree_util.keystr` prints them. A name with escaped
    parts reads as no path (None): its record writes it. Each parent's path
    is made once, from its own parent's, for all its children."""

    def __init__(self, modules: Collection[str]):
        self._modules = modules
        self._parents: dict[str, str | None] = {"": ""}  # the root: no part

    def __call__(self, name: str) -> str | None:
        known = self._parents.get(name, _UNKNOWN)  # a module's or node's, mostly
        if known is not _UNKNOWN:
            return known if name else ROOT  # the root's, as the walk records it
        if ESCAPE in name or name.count(SEPARATOR) >= CHAIN:
            return None
        cut = name.rfind(SEPARATOR)
        parent = name[:cut] if cut >= 0 else ""
        head = self._parent(parent)
        if head is None:
            return None
        part, under = name[cut + 1 :], parent in self._modules
        if under and part.isidentifier():  # (most leaves)
            return f"{head}{SEPARATOR}{part}"
        last = _segment(part, under)
        return None if last is None else head + last

    def _parent(self, name: str) -> str | None:
        """The path of `name` as a parent (`""` for the root), made from its
        nearest ancestor's already made, each one kept: a loop, fewer than
        `CHAIN` deep."""
        known = self._parents.get(name, _UNKNOWN)
        if known is not _UNKNOWN:  # (most: made for a sibling already)
            return known
        missing, cut = [name], name.rfind(SEPARATOR)
        while cut >= 0 and name[:cut] not in self._parents:
            missing.append(name[:cut])
            cut = name.rfind(SEPARATOR, 0, cut)
        for parent in reversed(missing):
            cut = parent.rfind(SEPARATOR)
            above = parent[:cut] if cut >= 0 else ""
            head = self._parents[above]
            last = _segment(parent[cut + 1 :], above in self._modules)
            self._parents[parent] = (
                None if head is None or last is None else head + last
            )
        return self._parents[name]

    def of(self, name: str) -> str:
        """The path of a record that writes none: read off its name, or (a
        name that reads as none, which no save leaves without one) the name."""
        return self(name) or name


_UNKNOWN: Any = object()
# The most parts a name that reads as a path has: a deeper name's record
# writes its path. So a name makes fewer than `CHAIN` ancestors, each a slice
# of it (without a bound, a file of long, deep, unrelated names written by
# someone else would cost the square of its size), and what a name reads as
# depends on the name and the modules' names only, never on which names were
# read before it: a reader reads every short record as its writer meant it,
# in any order.
CHAIN = 32


def _segment(part: str, under_module: bool) -> str | None:
    if part.isdigit() and part.isascii() and (part == "0" or part[0] != "0"):
        return f"[{part}]"
    if under_module:
        return SEPARATOR + part if part.isidentifier() else None
    return f"[{part!r}]" if part else None

"""`inspect --params`: parameter counts per module subtree, and per dtype.

From the sidecar (or a plain Orbax item's metadata) alone: no array data is
read. A parameter is an element of a stored array (a typed PRNG key counts
once); tied weights count once, as they are stored, under the leaf that holds
the bytes. Every inner node of the tree (a module, a list, a dict) gets the
count of the arrays under it.
"""

import dataclasses
import math

from .._format.sidecar import ALIAS, Metadata
from .._tree.walk import ARRAY
from .tree_view import build


@dataclasses.dataclass(frozen=True)
class NodeCount:
    """One inner node: its name (`""` for the root), depth, class (modules;
    "" otherwise), and the parameters and bytes stored under it."""

    name: str
    depth: int
    cls: str
    params: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class DtypeCount:
    dtype: str
    arrays: int
    params: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Counts:
    total: int  # parameters
    arrays: int  # stored arrays (tied weights once)
    nbytes: int
    nodes: list[NodeCount]  # depth first, in the sidecar's order
    dtypes: list[DtypeCount]  # most bytes first
    # Leaves `nodes` leaves out: past what the tree view lays out (see
    # `tree_view.MAX_LAID_OUT`); `total`, `arrays` and `dtypes` count them.
    left_out: list[str] = dataclasses.field(default_factory=list)


def _stored(saved: Metadata):
    return [r for r in saved.leaves.values() if r.kind == ARRAY and r.data != ALIAS]


def _elements(record) -> int:
    return math.prod(record.shape or ())


def counts(saved: Metadata, depth: int | None = None) -> Counts:
    """Parameter counts of the item `saved` describes; inner nodes down to
    `depth` levels below the root (all if None)."""
    stored = {r.name: r for r in _stored(saved)}
    tree = build(saved)
    root = tree.root
    nodes: list[NodeCount] = []
    # Depth first with a stack: trees nest as deep as models do.
    stack = [(root, "", 0)]
    while stack:
        node, name, level = stack.pop()
        params, nbytes = _under(node, stored)
        cls = ""
        if node.module is not None:
            cls = saved.modules[node.module].cls.rsplit(".", 1)[-1]
        if node.children or node is root:
            nodes.append(NodeCount(name, level, cls, params, nbytes))
        if depth is not None and level >= depth:
            continue
        inner = [
            (child, f"{name}.{part}" if name else part, level + 1)
            for part, child in node.children.items()
            if child.children
        ]
        stack.extend(reversed(inner))
    dtypes: dict[str, list[int]] = {}
    for record in stored.values():
        entry = dtypes.setdefault(str(record.dtype), [0, 0, 0])
        entry[0] += 1
        entry[1] += _elements(record)
        entry[2] += record.nbytes
    by_dtype = [DtypeCount(d, *v) for d, v in dtypes.items()]
    by_dtype.sort(key=lambda c: (-c.nbytes, c.dtype))
    return Counts(
        total=sum(_elements(r) for r in stored.values()),
        arrays=len(stored),
        nbytes=sum(r.nbytes for r in stored.values()),
        nodes=nodes,
        dtypes=by_dtype,
        left_out=tree.left_out,
    )


def _under(node, stored) -> tuple[int, int]:
    params = nbytes = 0
    todo = [node]
    while todo:
        current = todo.pop()
        leaf = current.leaf
        if leaf is not None and leaf.name in stored:
            params += _elements(leaf)
            nbytes += leaf.nbytes
        todo.extend(current.children.values())
    return params, nbytes

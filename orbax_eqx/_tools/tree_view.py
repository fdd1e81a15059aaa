"""`inspect`'s tree view: a checkpoint's leaves grouped by module path.

Each module shows its class, static fields and the bytes stored under it;
each array its dtype, shape, bytes, where its bytes are stored (the pack file
or Orbax's array store: a storage layout, which says nothing of sharding) and
the sharding it was saved with (where known); each Python leaf its value.
"""

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

from .._errors import inline_list
from .._format.sidecar import (
    ALIAS,
    EMPTY,
    PACKED,
    SHARDS,
    STORED,
    LeafMetadata,
    Metadata,
)
from .._tree.names import ESCAPE, SEPARATOR
from .._tree.values import describe, scalar_type
from .._tree.walk import ARRAY, NUMPY, NUMPY_SCALAR, SCALAR, SHARED, display_path
from .text import cut, human_bytes

_INDENT = "  "
PYTHON = "python"  # a Python scalar stored by Orbax (see `plain_items`)
_MAX_FIELD = 40  # longer static field values are cut


def split(name: str) -> list[str]:
    """The parts of a leaf name, split at unescaped separators (kept escaped)."""
    if ESCAPE not in name:  # most names
        return name.split(SEPARATOR)
    parts, current, chars = [], [], iter(name)
    for c in chars:
        if c == ESCAPE:
            current.append(c + next(chars, ""))
        elif c == SEPARATOR:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


class _Node:
    """A leaf or inner node of the view (one per name part: a 50,000-leaf
    tree makes ~85,000 of them, so slots and a plain `__init__`: a
    dataclass with a default factory took 1.5 us each)."""

    __slots__ = ("part", "children", "leaf", "module", "nbytes", "kind")

    def __init__(self, part: str, module: str | None = None):
        self.part = part
        self.children: dict[str, _Node] = {}
        self.leaf: LeafMetadata | None = None
        self.module = module  # the module's name in the sidecar
        self.nbytes = 0
        self.kind = 0  # alike nodes alike (see `_signatures`)


# What the view lays out, at most: rows holding this many name parts in all,
# a row counting the parts of its node's name (`a.b.c`: 3, for its own and
# the two its indentation stands for). Models come nowhere near (50,000 leaves
# make ~250,000; a module nested 1,000 deep, 500,500); a sidecar of a leaf
# named with 100,000 parts would make 5 billion, and rows 20 GB of indents.
MAX_LAID_OUT = 4_000_000


@dataclasses.dataclass
class Tree:
    """The view's tree: `root`, every node parents first (`nodes`), and the
    names of the leaves not laid out (`left_out`: they would have taken the
    view past `MAX_LAID_OUT`)."""

    root: _Node
    nodes: list[_Node]
    left_out: list[str]


def build(saved: Metadata) -> Tree:
    """The tree of leaves and modules, in the order the sidecar lists leaves,
    as far as `MAX_LAID_OUT` allows: leaves beyond it are left out."""
    root = _Node("")
    nodes = [root]
    left_out: list[str] = []
    laid_out = 0
    # The nodes down to the last leaf's parent, and that parent's name: the
    # next leaf is most often its sibling, and goes there straight.
    parent: str | None = None
    above = [root]
    for name, leaf in saved.leaves.items():
        cut = name.rfind(SEPARATOR)
        # (None: the root, the parent of a one-part name; `.x`'s is `""`)
        if (
            name
            and (name[:cut] if cut >= 0 else None) == parent
            and (ESCAPE not in name)
        ):
            part = name[cut + 1 :]
            if part not in above[-1].children:  # (else: the general way)
                if laid_out + len(above) > MAX_LAID_OUT:  # its new row's parts
                    left_out.append(name)
                    continue
                laid_out += len(above)
                made = above[-1].children[part] = _Node(part)
                nodes.append(made)
                _add(made, leaf, above)
                continue
        parts = split(name) if name else []
        path = [root]
        for part in parts:  # down the nodes made already
            child = path[-1].children.get(part)
            if child is None:
                break
            path.append(child)
        have, depth = len(path) - 1, len(parts)
        cost = (depth * (depth + 1) - have * (have + 1)) // 2  # the new rows'
        if laid_out + cost > MAX_LAID_OUT:
            left_out.append(name)
            continue
        laid_out += cost
        node = path[-1]
        for part in parts[have:]:
            child = node.children[part] = _Node(part)
            nodes.append(child)
            path.append(child)
            node = child
        _add(node, leaf, path[:-1])
        if name and ESCAPE not in name:
            parent, above = (name[:cut] if cut >= 0 else None), path[:-1]
    _name_modules(root, saved.modules)
    return Tree(root, nodes, left_out)


def _name_modules(root: _Node, modules: Iterable[str]) -> None:
    """A node's module is said by its path; modules with no leaf laid out
    under them have no node. A module under a module found already (most:
    the sidecar lists parents first) is looked for under it."""
    found_at: dict[str, _Node] = {}
    for module in modules:
        cut = module.rfind(SEPARATOR)
        # (`""` names the root, not the part `""` that `.x` is under)
        above = found_at.get(module[:cut]) if cut > 0 else None
        if above is not None and ESCAPE not in module:
            found = above.children.get(module[cut + 1 :])
        else:
            found = _find(root, split(module) if module else [])
        if found is not None:
            found.module = module
            found_at[module] = found


def _add(node: _Node, leaf: LeafMetadata, above: list[_Node]) -> None:
    """Puts `leaf` at `node`, its bytes counted there and in every node
    `above` it."""
    node.leaf = leaf
    if leaf.kind == ARRAY and leaf.data in (STORED, PACKED):
        node.nbytes += leaf.nbytes
        for up in above:
            up.nbytes += leaf.nbytes


def _find(root: _Node, parts: list[str]) -> _Node | None:
    node = root
    for part in parts:
        child = node.children.get(part)
        if child is None:
            return None
        node = child
    return node


def left_out_line(names: list[str]) -> str:
    """What the view did not lay out (`Tree.left_out`), and why: "" if it
    laid out every leaf."""
    if not names:
        return ""
    return (
        f"Not laid out ({len(names)}): "
        f"{inline_list([cut(display_path(x)) for x in names])}: the tree lays "
        f"out at most {MAX_LAID_OUT:,} name parts in all (a row counts every "
        "part of its name), and these names would take it past that. "
        "`inspect --flat` or `--json` lists every leaf."
    )


# Where an array's bytes are, by the sidecar's `data`, as the "stored in"
# column says it.
STORED_IN = {PACKED: "pack", SHARDS: "shard packs", STORED: "Orbax"}


# A run of at least this many list items alike (the same classes, static
# fields, dtypes, shapes, storage and shardings all the way down) shows its
# first item whole and the rest as one row: a model of 48 layers is 48 times
# the same rows, and a person reads them once.
FOLD = 3


def rows(
    saved: Metadata, shardings: dict[str, str], every: bool = False
) -> list[list[str]]:
    """Rows of `[name, type, shape, bytes, stored in, sharding, value]`, names
    indented. Runs of `FOLD` or more alike list items are folded to their
    first item and one row for the rest, unless `every`."""
    return rows_of(build(saved), saved, shardings, every)


def rows_of(
    tree: Tree, saved: Metadata, shardings: dict[str, str], every: bool = False
) -> list[list[str]]:
    """`rows` of a tree `build` made."""
    root = tree.root
    if not every:
        _signatures(tree, saved, shardings)
    out: list[list[str]] = []

    def module_row(node: _Node, label: str, depth: int) -> list[str]:
        cls, static = "", ""
        if node.module is not None:
            info = saved.modules[node.module]
            cls = info.cls.rsplit(".", 1)[-1]
            # Every field, each cut short: a static field is what tells two
            # models apart (`num_heads=2` or 4), so none is dropped.
            static = ", ".join(
                f"{k}={cut(describe(v), _MAX_FIELD)}" for k, v in info.static.items()
            )
        size = human_bytes(node.nbytes) if node.nbytes else ""
        return [_INDENT * depth + label, cls, "", size, "", "", static]

    def entries(node: _Node):
        items = list(node.children.items())
        return iter(items if every else _folded(items))

    def visit(node: _Node, depth: int) -> None:
        # Depth first with a stack, not recursion: modules nest as deep as a
        # model does, and a chain of 1,000 modules is a model.
        stack = [(entries(node), depth)]
        while stack:
            children, depth = stack[-1]
            for part, child in children:
                if isinstance(child, _Run):
                    out.append(_run_row(child, depth, saved, module_row))
                elif child.leaf is not None and not child.children:
                    out.append(_leaf_row(child.leaf, depth, part, saved, shardings))
                else:
                    out.append(module_row(child, part, depth))
                    stack.append((entries(child), depth + 1))
                    break
            else:
                stack.pop()

    if root.leaf is not None:  # the whole tree is one leaf
        out.append(_leaf_row(root.leaf, 0, "<root>", saved, shardings))
    elif root.module is not None:
        out.append(module_row(root, "<root>", 0))
        visit(root, 1)
    else:
        visit(root, 0)
    return out


@dataclasses.dataclass(frozen=True)
class _Run:
    """List items `first`..`last` (as named), all alike `like`, folded."""

    like: str
    first: str
    last: str
    nodes: list[_Node]


def _index(part: str) -> int | None:
    """A list index as a name part says it (ASCII digits, not too many to
    read fast), or None."""
    if len(part) <= _MAX_INDEX_DIGITS and part.isascii() and part.isdigit():
        return int(part)
    return None


_MAX_INDEX_DIGITS = 30


def _folded(items: list[tuple[str, _Node]]):
    """`items` with each run of `FOLD` or more alike list items (consecutive
    indices) as its first item and then one `_Run` of the rest."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(items):
        j = i + 1
        part, node = items[i]
        index = _index(part)
        if index is not None:
            while (
                j < len(items)
                and _index(items[j][0]) == index + j - i
                and items[j][1].kind == node.kind
            ):
                j += 1
        out.append((part, node))
        if j - i >= FOLD:
            rest = [n for _, n in items[i + 1 : j]]
            out.append(("", _Run(part, items[i + 1][0], items[j - 1][0], rest)))
        else:
            out += items[i + 1 : j]
        i = j
    return out


def _run_row(run: _Run, depth: int, saved: Metadata, module_row) -> list[str]:
    first = run.nodes[0]
    if first.leaf is not None and not first.children:
        row = _leaf_row(first.leaf, depth, "", saved, {})
        row[3] = human_bytes(sum(n.leaf.nbytes for n in run.nodes if n.leaf))
        row[4] = row[5] = ""
    else:
        row = module_row(first, "", depth)
        row[3] = human_bytes(sum(n.nbytes for n in run.nodes))
    row[0] = _INDENT * depth + f"{run.first} .. {run.last}"
    row[-1] = f"{len(run.nodes)} more, each like {run.like} (--all shows them)"
    return row


def _signatures(tree: Tree, saved: Metadata, shardings: dict[str, str]) -> None:
    """Sets `node.kind`, the same for nodes whose rows would be the same but
    for their own names: their classes, static fields, dtypes, shapes,
    storage, shardings and values, all the way down. Children first (the
    nodes in the reverse of the order they were made in), without recursion."""
    kinds: dict[tuple, int] = {}
    modules = saved.modules
    # A module's key by its class and static fields' record (shared by the
    # modules of one type from format 6 on, and held here: its id stays its).
    module_keys: dict[tuple[str, int], tuple[tuple, Any]] = {}
    for node in reversed(tree.nodes):
        leaf, module, children = node.leaf, node.module, node.children
        if module is None:
            module_key = None
        else:
            info = modules[module]
            known = module_keys.get((info.cls, id(info.static)))
            if known is None:
                module_key = (info.cls, _static_key(info.static))
                module_keys[info.cls, id(info.static)] = (module_key, info.static)
            else:
                module_key = known[0]
        key = (
            module_key,
            None if leaf is None else _leaf_key(leaf, saved, shardings),
            tuple([(p, c.kind) for p, c in children.items()]) if children else (),
        )
        node.kind = kinds.setdefault(key, len(kinds))


def _static_key(static: dict[str, Any]) -> Any:
    """Static fields alike exactly when their keys are: the fields' JSON
    (fields recorded alike print alike), or where it has none (text with lone
    surrogates, from saves before format 6) their descriptions."""
    try:
        return msgspec.json.encode(static)
    except (TypeError, ValueError, OverflowError):
        return tuple((k, describe(v)) for k, v in static.items())


def _leaf_key(leaf: LeafMetadata, saved: Metadata, shardings) -> tuple:
    if leaf.kind == ARRAY and leaf.data != ALIAS:
        return (
            leaf.dtype,
            tuple(leaf.shape or ()),
            leaf.data,
            leaf.container,
            shardings.get(leaf.name, ""),
        )
    # Rarer leaves (values, tied arrays): by their row.
    return tuple(_leaf_row(leaf, 0, "", saved, shardings))


def _leaf_row(leaf, depth, label, saved, shardings) -> list[str]:
    indent = _INDENT * depth + label
    if leaf.kind == ARRAY:
        return [
            indent,
            str(leaf.dtype),
            str(tuple(leaf.shape or ())),
            human_bytes(leaf.nbytes),
            stored_in(leaf, saved),
            shardings.get(leaf.name, ""),
            value_text(leaf),
        ]
    return [indent, type_text(leaf), "", "", "", "", cut(value_text(leaf))]


def stored_in(leaf: LeafMetadata, saved: Metadata) -> str:
    """Where an array leaf's bytes are: `pack`, `Orbax`, or "" (zero-size);
    a tied leaf's are its twin's."""
    if leaf.data == ALIAS and leaf.alias_of in saved.leaves:
        leaf = saved.source(leaf)
    return STORED_IN.get(leaf.data or "", "")


def type_text(leaf: LeafMetadata) -> str:
    if leaf.kind == ARRAY:
        return str(leaf.dtype)
    if leaf.kind == SCALAR:
        return scalar_type(leaf.value) or SCALAR
    return leaf.kind


def value_text(leaf: LeafMetadata) -> str:
    if leaf.kind == ARRAY:
        notes = []
        if leaf.container == NUMPY:
            notes.append("numpy array")
        elif leaf.container == NUMPY_SCALAR:
            notes.append("numpy scalar")
        elif leaf.container == PYTHON:  # plain Orbax checkpoints only
            notes.append("Python scalar")
        if leaf.data == EMPTY:
            notes.append("zero-size")
        elif leaf.data == ALIAS:
            notes.append(f"same array as {leaf.alias_of}")
        return ", ".join(notes)
    if leaf.kind == SHARED:
        return "placeholder for a node tied by eqx.nn.Shared"
    return describe(leaf.value)

"""Short records (docs/guides/format.md, "The sidecar"): a sidecar about the
size of the data it describes, still one line per record.

A path that reads off its record's name (`Paths`) is not written; a packed
jax array in pack 0 is a row `[dtype, shape, offset, xxh3]`; a module is the
index of its class and static fields in `module_types`; an inner node whose
children its name and keys say is the index of the rest of its record in
`node_types` (a list's or tuple's with its `length`), or, for a module, in
its module type (`node`). Each record is written short only where the short
form expands back to the full record, value for value and type for type;
the reader reads both forms alike. A save makes packed jax arrays' rows
itself (`sidecar.build`), and the rest short here.
"""

import json
import math
import re
from typing import Any

import msgspec

from .._tree import nodes as _nodes
from .._tree.names import SEPARATOR, escape_part
from .._tree.walk import ARRAY, JAX, parse_dtype
from .paths import Paths
from .sidecar import PACKED, itemsize

MODULE_TYPES = "module_types"
NODE_TYPES = "node_types"
LENGTH = "length"  # a list's or tuple's number of children, in its node type
NODE = "node"  # a module type's index of its modules' node type
_MODULE_KEYS = frozenset(["path", "class", "static"])
# Node types whose children a name and their keys say.
_BY_FIELDS = (_nodes.MODULE, _nodes.NAMEDTUPLE)
_BY_INDEX = (_nodes.LIST, _nodes.TUPLE)
SHARED_TYPES = (*_BY_FIELDS, *_BY_INDEX, _nodes.DICT)


def row_nbytes(shape: list[int], dtype: str) -> int:
    """The bytes of a row's array (raises for a dtype no save writes)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = itemsize(parse_dtype(dtype))
        if len(_ITEMSIZE) < 256:  # (a hostile file may name many)
            _ITEMSIZE[dtype] = size
    return math.prod(shape) * size


_ITEMSIZE: dict[str, int] = {}  # a dtype's name: bytes per element


def compact(content: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's content with short records where they say the same,
    and the tables they index (`module_types` before `modules`,
    `node_types` before `nodes`). A module whose node is short too has that
    node's type in its module type (`NODE`), and no line in `nodes`."""
    out: dict[str, Any] = {}
    modules = content.get("modules")
    modules = modules if isinstance(modules, dict) else {}
    paths = Paths(modules)
    short_modules = {n: _module_type(n, r, paths) for n, r in modules.items()}
    nodes = content.get("nodes")
    kinds, node_types, carried = _node_kinds(nodes, modules, short_modules, paths)
    for key, value in content.items():
        if key == "leaves":
            value = {name: compact_leaf(name, r, paths) for name, r in value.items()}
        elif key == "modules" and isinstance(value, dict):
            value, out[MODULE_TYPES] = _short_modules(value, short_modules, carried)
        elif key == "nodes" and isinstance(value, dict):
            value = {
                n: node_types.index(kinds[n]) if n in kinds else r
                for n, r in value.items()
                if n not in carried
            }
            out[NODE_TYPES] = node_types.types
        out[key] = value
    return out


def _node_kinds(nodes: Any, modules: dict, short_modules: dict, paths: Paths):
    """Each node's short type, where it has one; the table of node types,
    begun with the short modules' (`carried`, each module's index in it)."""
    kinds: dict[str, dict[str, Any]] = {}
    for name, record in nodes.items() if isinstance(nodes, dict) else ():
        # A short module's path is the one its name reads as.
        known = modules[name]["path"] if short_modules.get(name) else None
        kind = _node_type(name, record, paths, known)
        if kind is not None:
            kinds[name] = kind
    # Node types are listed modules' first, in the modules' order, then the
    # rest in the nodes' order: the same table however `nodes` is ordered.
    node_types = _Table()
    carried = {
        name: node_types.index(kinds[name])
        for name, kind in short_modules.items()
        if kind is not None and name in kinds and kinds[name]["type"] == _nodes.MODULE
    }
    return kinds, node_types, carried


def _short_modules(
    modules: dict[str, Any], short_modules: dict[str, Any], carried: dict[str, int]
) -> tuple[dict[str, Any], list[Any]]:
    """`modules` with short records, and the module types they index; a
    module type holds its node's type where that is `carried`."""
    module_types = _Table()
    out = {}
    for name, record in modules.items():
        kind, at = short_modules[name], carried.get(name)
        if kind is not None:
            record = module_types.index(kind if at is None else {**kind, NODE: at})
        out[name] = record
    return out, module_types.types


class _Table:
    """A table of types, each listed once (by its exact JSON text)."""

    def __init__(self):
        self.types: list[Any] = []
        self._at: dict[Any, int] = {}

    def index(self, kind: Any) -> int:
        key = _text(kind)
        at = self._at.get(key)
        if at is None:
            at = self._at[key] = len(self.types)
            self.types.append(kind)
        return at


def compact_leaf(name: str, record: Any, paths: Paths) -> Any:
    """A leaf's record as a row, or without the path its name reads as, or
    as it is."""
    if not isinstance(record, dict):
        return record
    row = _row(name, record, paths)
    if row is not None:
        return row
    path = paths(name)
    if path is not None and _is_str(record.get("path"), path):
        return {k: v for k, v in record.items() if k != "path"}
    return record


def _row(name: str, r: dict[str, Any], paths: Paths) -> list | None:
    """The row of a record that a row says exactly, or None. (Written out
    for speed: a save asks it of every leaf.)"""
    try:
        if r["data"] != PACKED or r["kind"] != ARRAY or r["container"] != JAX:
            return None
        pack, offset, dtype = r["pack"], r["offset"], r["dtype"]
        shape, size, path = r["shape"], r["nbytes"], r["path"]
    except KeyError:
        return None
    sum_, ident = r.get("xxh3"), r.get("xxh3_128")
    # The nine keys read are there: so with this many, no others.
    if len(r) != 9 + ("xxh3" in r) + ("xxh3_128" in r):
        return None
    if not _placed(pack, offset, sum_, ident) or path != paths(name):
        return None
    if not (type(path) is str and _sized(shape, dtype, size)):
        return None
    return [dtype, shape, offset, sum_ if ident is None else [sum_, ident, pack]]


def _placed(pack: Any, offset: Any, sum_: Any, ident: Any) -> bool:
    """Whether a row says where the array is and its checksums: pack 0, or
    with its XXH3-128 (dedup) any pack."""
    return (
        type(pack) is int
        and (pack == 0 or ident is not None)
        and type(offset) is int
        and offset >= 0
        and (sum_ is None or _is_hex64(sum_))
        and (ident is None or (type(ident) is str and bool(_HEX128.fullmatch(ident))))
    )


_HEX128 = re.compile("[0-9a-f]{32}")


def _sized(shape: Any, dtype: Any, size: Any) -> bool:
    """Whether `size` is the bytes of an array of `shape` and `dtype`, each
    of the type a row holds."""
    if not (
        type(size) is int
        and type(dtype) is str
        and type(shape) is list
        and _INT.issuperset(map(type, shape))
        and (not shape or min(shape) >= 0)
    ):
        return False
    try:
        return size == row_nbytes(shape, dtype)
    except (TypeError, ValueError, OverflowError, SyntaxError, MemoryError):
        return False


_INT = frozenset([int])


def _module_type(name: str, record: Any, paths: Paths) -> dict[str, Any] | None:
    if not (
        isinstance(record, dict)
        and record.keys() == _MODULE_KEYS
        and _is_str(record["path"], paths(name))
        and type(record["class"]) is str
        and type(record["static"]) is dict
    ):
        return None
    return {"class": record["class"], "static": record["static"]}


def _node_type(
    name: str, record: Any, paths: Paths, path: str | None = None
) -> dict[str, Any] | None:
    """The type of a node record that its index says exactly, or None; `path`,
    the path its name reads as, if known."""
    if not (
        isinstance(record, dict)
        and record.get("type") in SHARED_TYPES
        and LENGTH not in record
        and _is_str(record.get("path"), path if path is not None else paths(name))
        and type(record.get("children")) is list
    ):
        return None
    kind = {k: v for k, v in record.items() if k not in ("path", "children")}
    if record["type"] in _BY_INDEX:
        kind[LENGTH] = len(record["children"])
    if children_of(name, kind) != record["children"]:
        return None
    return kind


def count_of(kind: dict[str, Any]) -> int | None:
    """How many children a node type says (None: it says none: no fields,
    keys or length of the kinds expected). Asked before `children_of` makes
    their names: a `length` is only a number in a file."""
    node = kind.get("type")
    if node in _BY_INDEX:
        length = kind.get(LENGTH)
        return length if type(length) is int and length >= 0 else None
    parts = kind.get("keys" if node == _nodes.DICT else "fields", [])
    if type(parts) is not list or not all(type(p) is str for p in parts):
        return None
    return len(parts)


def children_of(name: str, kind: dict[str, Any]) -> list[str] | None:
    """The children's names a node type says for node `name` (None: see
    `count_of`)."""
    count = count_of(kind)
    if count is None:
        return None
    prefix = name + SEPARATOR if name else ""
    node = kind["type"]
    if node in _BY_INDEX:
        return [f"{prefix}{i}" for i in range(count)]
    if node == _nodes.DICT:
        return [prefix + escape_part(p) for p in kind.get("keys", [])]
    return [prefix + p for p in kind.get("fields", [])]


def _text(value: Any) -> Any:
    """JSON text of `value`, the same exactly for equal values of equal types
    (`1`, `1.0` and `true` apart): types are interned by it."""
    try:
        data = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError):  # lone surrogates
        return json.dumps(value, ensure_ascii=False)
    # msgspec writes NaN as null: those by the standard library, apart.
    return json.dumps(value, ensure_ascii=False) if b"null" in data else data


def _is_hex64(value: Any) -> bool:
    """An XXH3-64 as a row holds one: 16 lower-case hexadecimal digits."""
    return type(value) is str and _HEX64.fullmatch(value) is not None


_HEX64 = re.compile(r"[0-9a-f]{16}")


def _is_str(value: Any, expected: str | None) -> bool:
    return type(value) is str and value == expected

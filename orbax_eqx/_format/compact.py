"""Format 6's short records: a sidecar about the size of the data it
describes, still JSON with one line per record.

A tree of small arrays used to get a sidecar 4.5 times its data: every
record spelled out its path, its kind, its container and its size, and every
layer repeated its class and static fields. From format 6 on a save writes
these records short, where the short form says exactly the same:

- *A path that reads off the name* (`path_of`) is not written: the leaf,
  module or node `blocks.3.lin1.weight` has the path `.blocks[3].lin1.weight`
  (each part an attribute name, `.part`, or an index, `[3]`). A record whose
  path reads otherwise (a dict key, `['model']`) writes it.
- *A row*: a packed jax array in pack 0 is `[dtype, shape, offset, xxh3]`
  (`xxh3` null when saved without checksums); its kind, container, place and
  size (`nbytes`, that of its shape and dtype) are those of every row.
- *A module* is the index of its class and static fields in the list
  `module_types`, which holds each distinct pair once.
- *An inner node* is the index of the rest of its record in the list
  `node_types`, when its children are named by its own name and their keys
  (a module's or namedtuple's fields, a list's or tuple's indices, a dict's
  string keys): a list or tuple's type records its `length` instead.

Each record is written short only where expanding the short form
(`expand_leaf`, `expand_module`, `expand_node`) gives back the full record,
value for value and type for type; any other record is written whole, as
format 5 writes it. The reader reads both forms (`schema`, `records_read`):
what it makes of a short record is what it would make of the full one.
"""

import json
import math
from typing import Any

import msgspec

from .._tree import nodes as _nodes
from .._tree.names import ESCAPE, SEPARATOR, escape_part
from .._tree.walk import ARRAY, JAX, parse_dtype
from .checksum import XXH3
from .sidecar import PACKED, itemsize

MODULE_TYPES = "module_types"
NODE_TYPES = "node_types"
LENGTH = "length"  # a list's or tuple's number of children, in its node type
# Keys of an array record that a row stands for (and `XXH3`, where saved).
_ROW_KEYS = frozenset(
    ["path", "kind", "shape", "dtype", "container", "nbytes", "data", "pack", "offset"]
)
_MODULE_KEYS = frozenset(["path", "class", "static"])
# Node types whose children a name and their keys say.
_BY_FIELDS = (_nodes.MODULE, _nodes.NAMEDTUPLE)
_BY_INDEX = (_nodes.LIST, _nodes.TUPLE)
SHARED_TYPES = (*_BY_FIELDS, *_BY_INDEX, _nodes.DICT)


def path_of(name: str) -> str | None:
    """The path a name reads as: each part an attribute (`.part`) or an
    index (`[3]`); None for a name with other parts (escaped, empty)."""
    if not name or ESCAPE in name:
        return None
    out = []
    for part in name.split(SEPARATOR):
        if part.isdigit() and part.isascii() and (part == "0" or part[0] != "0"):
            out.append(f"[{part}]")
        elif part.isidentifier():
            out.append(SEPARATOR + part)
        else:
            return None
    return "".join(out)


def row_nbytes(shape: list[int], dtype: str) -> int:
    """The bytes of a row's array (raises for a dtype no save writes)."""
    return math.prod(shape) * itemsize(parse_dtype(dtype))


def compact(content: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's content with short records where they say the same,
    and the tables they index (`module_types` before `modules`,
    `node_types` before `nodes`)."""
    out: dict[str, Any] = {}
    for key, value in content.items():
        if key == "leaves":
            value = {name: compact_leaf(name, r) for name, r in value.items()}
        elif key == "modules" and isinstance(value, dict):
            out[MODULE_TYPES], value = _interned(value, _module_type)
        elif key == "nodes" and isinstance(value, dict):
            out[NODE_TYPES], value = _interned(value, _node_type)
        out[key] = value
    return out


def _interned(records: dict[str, Any], short) -> tuple[list, dict[str, Any]]:
    """`(types, entries)`: each record as the index of its type in `types`
    where `short(name, record)` gives one, else as it is."""
    types: list[Any] = []
    index: dict[Any, int] = {}
    entries = {}
    for name, record in records.items():
        kind = short(name, record)
        if kind is None:
            entries[name] = record
            continue
        key = _text(kind)
        at = index.get(key)
        if at is None:
            at = index[key] = len(types)
            types.append(kind)
        entries[name] = at
    return types, entries


def compact_leaf(name: str, record: Any) -> Any:
    """A leaf's record as a row, or without the path its name reads as, or
    as it is."""
    if not isinstance(record, dict):
        return record
    row = _row(name, record)
    if row is not None:
        return row
    path = path_of(name)
    if path is not None and _is_str(record.get("path"), path):
        return {k: v for k, v in record.items() if k != "path"}
    return record


def _row(name: str, r: dict[str, Any]) -> list | None:
    shape, dtype, offset = r.get("shape"), r.get("dtype"), r.get("offset")
    sum_ = r.get(XXH3)
    if not (
        r.keys() - {XXH3} == _ROW_KEYS
        and r["kind"] == ARRAY
        and r["container"] == JAX
        and r["data"] == PACKED
        and type(r["pack"]) is int
        and r["pack"] == 0
        and type(offset) is int
        and type(dtype) is str
        and type(shape) is list
        and all(type(d) is int and d >= 0 for d in shape)
        and (type(sum_) is str or (sum_ is None and XXH3 not in r))
        and _is_str(r["path"], path_of(name))
        and type(r["nbytes"]) is int
    ):
        return None
    try:
        if r["nbytes"] != row_nbytes(shape, dtype):
            return None
    except (TypeError, ValueError, OverflowError, SyntaxError, MemoryError):
        return None
    return [dtype, shape, offset, sum_]


def expand_leaf(name: str, entry: Any) -> Any:
    """The full record of a leaf's entry, as format 5 writes it."""
    if isinstance(entry, list) and len(entry) == 4:
        dtype, shape, offset, sum_ = entry
        record = {
            "path": path_of(name) or name,
            "kind": ARRAY,
            "shape": shape,
            "dtype": dtype,
            "container": JAX,
            "nbytes": row_nbytes(shape, dtype),
            "data": PACKED,
            "pack": 0,
            "offset": offset,
        }
        if sum_ is not None:
            record[XXH3] = sum_
        return record
    if isinstance(entry, dict) and "path" not in entry:
        return {"path": path_of(name) or name, **entry}
    return entry


def _module_type(name: str, record: Any) -> dict[str, Any] | None:
    if not (
        isinstance(record, dict)
        and record.keys() == _MODULE_KEYS
        and _is_str(record["path"], path_of(name))
        and type(record["class"]) is str
        and type(record["static"]) is dict
    ):
        return None
    return {"class": record["class"], "static": record["static"]}


def expand_module(name: str, entry: Any, types: list[Any]) -> Any:
    """The full record of a module's entry (an index into `types`)."""
    if type(entry) is not int:
        return entry
    return {"path": path_of(name) or name, **types[entry]}


def _node_type(name: str, record: Any) -> dict[str, Any] | None:
    if not (
        isinstance(record, dict)
        and record.get("type") in SHARED_TYPES
        and LENGTH not in record
        and _is_str(record.get("path"), path_of(name))
        and type(record.get("children")) is list
    ):
        return None
    kind = {k: v for k, v in record.items() if k not in ("path", "children")}
    if record["type"] in _BY_INDEX:
        kind[LENGTH] = len(record["children"])
    if children_of(name, kind) != record["children"]:
        return None
    return kind


def children_of(name: str, kind: dict[str, Any]) -> list[str] | None:
    """The children's names a node type says for node `name` (None: it says
    none: no fields, keys or length of the kinds expected)."""
    prefix = name + SEPARATOR if name else ""
    node = kind.get("type")
    if node in _BY_INDEX:
        length = kind.get(LENGTH)
        if type(length) is not int or length < 0:
            return None
        return [f"{prefix}{i}" for i in range(length)]
    parts = kind.get("keys") if node == _nodes.DICT else kind.get("fields")
    if type(parts) is not list or not all(type(p) is str for p in parts):
        return None
    if node == _nodes.DICT:
        return [prefix + escape_part(p) for p in parts]
    return [prefix + p for p in parts]


def expand_node(name: str, entry: Any, types: list[Any]) -> Any:
    """The full record of a node's entry (an index into `types`)."""
    if type(entry) is not int:
        return entry
    kind = dict(types[entry])
    children = children_of(name, kind)
    kind.pop(LENGTH, None)
    return {"path": path_of(name) or name, **kind, "children": children}


def expand(content: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's content with every record whole, as format 5 writes it
    (the tables dropped): what `compact` makes short, back."""
    out = dict(content)
    module_types = out.pop(MODULE_TYPES, [])
    node_types = out.pop(NODE_TYPES, [])
    out["leaves"] = {n: expand_leaf(n, e) for n, e in content["leaves"].items()}
    out["modules"] = {
        n: expand_module(n, e, module_types) for n, e in content["modules"].items()
    }
    if isinstance(content.get("nodes"), dict):
        out["nodes"] = {
            n: expand_node(n, e, node_types) for n, e in content["nodes"].items()
        }
    return out


def _text(value: Any) -> Any:
    """JSON text of `value`, the same exactly for equal values of equal types
    (`1`, `1.0` and `true` apart): types are interned by it."""
    try:
        data = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError):  # lone surrogates
        return json.dumps(value, ensure_ascii=False)
    # msgspec writes NaN as null: those by the standard library, apart.
    return json.dumps(value, ensure_ascii=False) if b"null" in data else data


def _is_str(value: Any, expected: str | None) -> bool:
    return type(value) is str and value == expected

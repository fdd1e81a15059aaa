"""The sidecar's records of the tree's structure, read one by one: each
module's (its class, path and static fields) and each inner node's, and from
format 6 on the tables of their types (`compact`). As for leaves
(`records_read`), a record that fails its schema is damage naming it.
"""

from typing import Any

import msgspec

from .._tree import nodes as _nodes
from .._tree.values import too_deep
from .._tree.walk import ModuleInfo
from . import compact as _compact
from . import schema as _schema
from .paths import Paths
from .records_read import TOO_DEEP, decoded, failed_field


def module(
    name: str,
    record: Any,
    bad,
    version: int = 5,
    types: list | None = None,
    paths: Paths | None = None,
) -> ModuleInfo:
    """One module's record: its class, path and static fields; from format
    6 on, or the index of its class and static fields in `types` (read by
    `module_types`), its path read off its name by `paths`."""
    rec = record
    if not (version >= 6 and type(record) is int):
        try:
            rec = decoded(record, _schema.module_record(version))
        except (msgspec.ValidationError, RecursionError):
            raise bad(f"module {name!r} has no class, path or static fields") from None
    if type(rec) is int:
        if types is None or not 0 <= rec < len(types):
            listed = len(types or ())
            raise bad(
                f"module {name!r} is of module type {rec}, but the sidecar lists "
                f"{listed} module type{'' if listed == 1 else 's'}"
            )
        kind = types[rec]
        path = paths.of(name) if paths is not None else name
        return ModuleInfo(path, kind.cls, kind.static)
    _check_static(name, rec.static, bad)
    path = rec.path
    if path is _schema.UNSET:
        path = paths.of(name) if paths is not None else name
    return ModuleInfo(path, rec.cls, rec.static)


def module_types(records: Any, bad) -> list[_schema.ModuleType]:
    """Format 6's table of modules' classes and static fields (`compact`)."""
    if records is _schema.UNSET:
        return []
    if not isinstance(records, list):
        raise bad('"module_types" must be a JSON list')
    out = []
    for i, record in enumerate(records):
        try:
            kind = msgspec.convert(record, _schema.ModuleType)
        except msgspec.ValidationError as e:
            if failed_field(e) == "node":
                raise bad(
                    f"module type {i} gives its node type as {_shown(record['node'])}"
                    ', not an index into "node_types"'
                ) from None
            raise bad(f"module type {i} has no class or static fields") from None
        except RecursionError:
            raise bad(f"module type {i} has no class or static fields") from None
        _check_static(f"of type {i}", kind.static, bad)
        out.append(kind)
    return out


def _check_static(name: str, static: dict[str, Any], bad) -> None:
    for field, value in static.items():
        if too_deep(value):
            raise bad(f"static field {field!r} of module {name!r} {TOO_DEEP}")


def node_types(records: Any, bad) -> list[dict[str, Any]]:
    """Format 6's table of inner nodes' types (`compact`), each checked by
    its schema, kept as the plain dicts the rebuild reads."""
    if records is _schema.UNSET:
        return []
    if not isinstance(records, list):
        raise bad('"node_types" must be a JSON list')
    for i, record in enumerate(records):
        try:
            kind = msgspec.convert(record, _schema.NodeType)
        except (msgspec.ValidationError, RecursionError):
            raise bad(f"node type {i} is malformed") from None
        if _compact.count_of(record) is None:
            raise bad(
                f"node type {i} (a {kind.type}) says no children: a list or "
                'tuple records its "length", a module or namedtuple its '
                '"fields", a dict its "keys"'
            )
    return records


def carried_nodes(
    modules: dict[str, Any], types: list[_schema.ModuleType], kinds: list, bad
) -> dict[str, int]:
    """`{name: node type}` of the modules whose module type holds their node's
    type (`compact.NODE`): an index into the node types `kinds`, of a module."""
    carried = {}
    checked: dict[int, Any] = {}  # a module type: its node type, checked
    for name, rec in modules.items():
        if type(rec) is not int or not 0 <= rec < len(types):
            continue  # (read as a module, or refused there)
        at = checked.get(rec, _UNCHECKED)
        if at is not _UNCHECKED:  # (most: a model has a few module types)
            if at is not None:
                carried[name] = at
            continue
        at = types[rec].node
        if not isinstance(at, int):  # (unset)
            checked[rec] = None
            continue
        if not (at < len(kinds) and kinds[at]["type"] == _nodes.MODULE):
            raise bad(
                f"module type {rec} (of module {name!r}) gives its node type as "
                f"{at}, which is no module's node type among the sidecar's "
                f"{len(kinds)} node type{'' if len(kinds) == 1 else 's'}"
            )
        carried[name] = checked[rec] = at
    return carried


_UNCHECKED: Any = object()


def node(name: str, record: Any, bad) -> None:
    """Checks one inner node's record (as a plain dict: the rebuild reads
    them as such) for shape only: how nodes refer to each other is checked
    by the rebuild."""
    try:
        rec = decoded(record, _schema.NodeRecord)
    except msgspec.ValidationError as e:
        field = failed_field(e)
        if field in ("keys", "markers"):
            raise bad(f"the {field} of node {name!r} are malformed") from None
        raise bad(f"node {name!r} has no valid type, path or children") from None
    except RecursionError:
        raise bad(f"node {name!r} {TOO_DEEP}") from None
    for key in ("keys", "markers"):
        if too_deep(getattr(rec, key)):
            raise bad(f"the {key} of node {name!r} are malformed")


def _shown(value: Any) -> str:
    """A malformed index in a message: a small number as it is, else its type."""
    if type(value) is int and abs(value) < 10**12:
        return str(value)
    return f"a JSON {_JSON_TYPES.get(type(value), 'value')}"


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "list",
    dict: "object",
}

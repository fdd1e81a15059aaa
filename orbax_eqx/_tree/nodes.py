"""The inner nodes of a walked tree as plain data (the sidecar's `"nodes"`),
what `restore(..., allow=[...])` needs to rebuild the tree without a skeleton."""

from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .values import encode, qualified_name
from .walk import Walked, display_path, fields_of

MODULE = "module"
DICT = "dict"
LIST = "list"
TUPLE = "tuple"
NAMEDTUPLE = "namedtuple"
STATE = "state"
OTHER = "other"
TYPES = (MODULE, DICT, LIST, TUPLE, NAMEDTUPLE, STATE, OTHER)


def record(walked: Walked) -> dict[str, dict[str, Any]]:
    """`{node name: record}` for every inner node of the walked tree."""
    if walked.name_of is None:
        raise ValueError("walked without names for inner nodes")
    leaf_names = iter([leaf.name for leaf in walked.leaves])
    nodes: dict[str, dict[str, Any]] = {}
    shared: list = []
    _visit(walked.treedef, (), walked.name_of, leaf_names, nodes, shared)
    if shared:
        values = {leaf.name: leaf.value for leaf in walked.leaves}
        for rec, pytree in shared:
            wiring = _shared_wiring(rec, pytree, values)
            if wiring is not None:
                rec["wiring"] = wiring
    return nodes


def _visit(treedef, path, name_of, leaf_names, nodes, shared) -> None:
    # Depth first, children in order (pushed reversed), so that leaves come in
    # the order of the walk. Iterative: trees can nest deeper than Python
    # recurses.
    work: list[tuple[Any, tuple, list]] = [(treedef, path, [])]
    while work:
        td, p, parent_children = work.pop()
        data = td.node_data()
        if data is None:  # a leaf
            parent_children.append(next(leaf_names))
            continue
        cls, aux = data
        if _is_missing(cls):
            parent_children.append(None)
            continue
        name = name_of(p)
        rec, keys = _describe(cls, aux, td, p)
        nodes[name] = rec
        parent_children.append(name)
        if cls is eqx.nn.Shared and keys is not None:
            shared.append((rec, td.children()[0]))
        if keys is None:  # not rebuildable; its leaves are still passed over
            for _ in range(td.num_leaves):
                next(leaf_names)
            continue
        for child, key in reversed(list(zip(td.children(), keys, strict=True))):
            work.append((child, p + (key,), rec["children"]))


def _describe(cls, aux, td, path) -> tuple[dict[str, Any], list | None]:
    shown = display_path(jtu.keystr(path))
    n = len(td.children())
    rec: dict[str, Any]
    if cls is dict:
        keys = list(aux)
        rec = {"path": shown, "type": DICT, "keys": [encode(k) for k in keys]}
        return _with_children(rec), [jtu.DictKey(k) for k in keys]
    if cls is list or cls is tuple:
        rec = {"path": shown, "type": LIST if cls is list else TUPLE}
        return _with_children(rec), [jtu.SequenceKey(i) for i in range(n)]
    if isinstance(cls, type) and issubclass(cls, eqx.nn.State):
        markers = [encode(m) for m in aux]
        rec = {"path": shown, "type": STATE, "markers": markers}
        return _with_children(rec), [jtu.FlattenedIndexKey(i) for i in range(n)]
    if isinstance(cls, type) and issubclass(cls, eqx.Module):
        return _describe_module(cls, aux, shown)
    if _is_namedtuple(cls):
        fields = list(cls._fields)
        rec = {"path": shown, "type": NAMEDTUPLE, "class": qualified_name(cls)}
        return _with_children(rec | {"fields": fields}), _attr_keys(fields)
    return {"path": shown, "type": OTHER, "class": qualified_name(cls)}, None


def _describe_module(cls, aux, shown: str) -> tuple[dict[str, Any], list | None]:
    dynamic, static = fields_of(cls)
    rec: dict[str, Any] = {"path": shown, "type": MODULE, "fields": list(dynamic)}
    wrapper, *static_values = aux
    # Pairs what both have, whatever Equinox adds to `aux`.
    pairs = zip(static, static_values, strict=False)
    absent = [f for f, v in pairs if _is_missing(type(v))]
    if absent:
        rec["absent"] = absent
    if not _is_missing(type(wrapper)):
        rec["wrapper"] = True
        return rec, None
    return _with_children(rec), _attr_keys(dynamic)


def _attr_keys(fields) -> list:
    return [jtu.GetAttrKey(f) for f in fields]


def _with_children(rec: dict[str, Any]) -> dict[str, Any]:
    rec["children"] = []
    return rec


def _is_missing(cls: Any) -> bool:
    # Equinox's placeholder for a field that is not set (`_module/_flatten.py`).
    return (
        isinstance(cls, type)
        and cls.__name__ == "_Missing"
        and cls.__module__.startswith("equinox")
    )


def _is_namedtuple(cls: Any) -> bool:
    return (
        isinstance(cls, type)
        and issubclass(cls, tuple)
        and isinstance(getattr(cls, "_fields", None), tuple)
    )


# `eqx.nn.Shared` ties nodes with two functions, `where` and `get`, usually
# lambdas, which cannot be rebuilt by name. What they select is recorded
# instead, as key paths into `Shared.pytree`: found by calling them once, at
# save, on a stand-in tree of the same structure whose leaves are markers
# (no array is touched). A `get` that computes (`jnp.transpose(...)`) selects
# no node, and is not recorded.


class _Mark:
    __slots__ = ()


def _shared_wiring(rec, pytree_def, values) -> dict[str, Any] | None:
    if rec.get("fields") != ["pytree", "where", "get"]:
        return None
    _, where_name, get_name = rec["children"]
    if where_name not in values or get_name not in values:
        return None
    stand_in = jtu.tree_unflatten(
        pytree_def, [_Mark() for _ in range(pytree_def.num_leaves)]
    )
    paths: dict[int, list] = {}
    _index(stand_in, [], paths)
    wiring = {}
    for field, name in (("where", where_name), ("get", get_name)):
        try:
            found = values[name](stand_in)
        except Exception:
            return None
        many = isinstance(found, (list, tuple)) and id(found) not in paths
        selected = [paths.get(id(x)) for x in (found if many else [found])]
        if any(p is None for p in selected):
            return None
        wiring[field] = {"many": many, "paths": selected}
    return wiring


def _index(node, path: list, paths: dict[int, list]) -> None:
    """Each node of a stand-in tree (by `id`) -> its key path as JSON steps."""
    paths.setdefault(id(node), path)
    flat = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is node:
        return  # a leaf
    for key_path, child in flat:
        (key,) = key_path
        if isinstance(key, jtu.GetAttrKey):
            step = ["attr", key.name]
        elif isinstance(key, jtu.SequenceKey):
            step = ["index", key.idx]
        elif isinstance(key, jtu.DictKey) and type(key.key) in (str, int):
            step = ["key", key.key]
        else:
            continue  # not selectable by a recorded path
        _index(child, path + [step], paths)

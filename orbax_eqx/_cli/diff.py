"""`diff`: how two checkpoints (or a checkpoint and a skeleton) differ, in
structure from the metadata and, with `--values`, in array values (floats as
`numpy.isclose` with B as the reference); two steps are compared item by item."""

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from .._errors import OrbaxEqxError
from .._format.locate import as_path
from .._format.sidecar import ALIAS, EMPTY, STORED, LeafMetadata, Metadata
from .._orbax import items as _items
from .._orbax.plain import PlainMetadata, StoreReader
from .._restore.read import LeafReader, read_cost
from .._tree.values import describe, encode, scalar_type
from .._tree.walk import (
    ARRAY,
    SCALAR,
    SHARED,
    container,
    display_path,
    dtype_str,
    is_key_dtype,
    key_data_struct,
    walk,
)
from . import skeleton as _skeleton
from .render import Progress, count, handler_text, number, table

_CHUNK = 1 << 20  # elements compared at once: bounds the float64 temporaries
_NOT_COMPARED = " Array values were not compared: "


class ItemNotFoundError(OrbaxEqxError, FileNotFoundError):
    """`--item NAME` names no item of a step, or a step needs `--item`."""


@dataclasses.dataclass(frozen=True)
class Side:
    """What the user named (`what`: skeleton, item, step or root), its items by
    name (a root's latest step's), and the other items of its step."""

    text: str
    what: str
    items: dict[str, Any]
    others: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def where(self) -> str:
        if self.what != "root":
            return os.fspath(as_path(self.text))
        step, root = next(iter(self.items.values())).parent, as_path(self.text)
        return f"{step} (the latest step of the CheckpointManager root {root})"


@dataclasses.dataclass(frozen=True)
class Compared:
    """One item of each side compared: each side's metadata and directory
    (None for a skeleton), how they differ in structure, and in values (None
    without `--values`)."""

    name: str
    a: tuple[Metadata, Any]
    b: tuple[Metadata, Any]
    diffs: list[tuple]
    got: list[dict] | None

    @property
    def differ(self) -> bool:
        return bool(self.diffs) or any(v["mismatched"] for v in self.got or [])


def run(args) -> int:
    a, b = side(args.a, args.item), side(args.b, args.item)
    pairs, changes = _pairs(a, b)
    items = [_compare(args, *pair) for pair in pairs]
    differ = bool(changes) or any(c.differ for c in items)
    others = sorted(set(a.others) & set(b.others))
    if {"item", "skeleton"} & {a.what, b.what}:
        doc, text = _item_json(items[0], args), _item_text(items[0], args)
    else:
        doc = {"a": a.where(), "b": b.where()}
        doc["items"] = [{"name": c.name} | _item_json(c, args) for c in items]
        doc |= {"item_differences": _changes_json(changes), "not_compared": others}
        doc["differ"] = differ
        text = _steps_text(a, b, items, changes, others, args)
    print(json.dumps(doc, indent=2, ensure_ascii=False) if args.json else text)
    return 1 if differ else 0


def side(text: str, item: str | None) -> Side:
    """What `text` names; `item` picks that item of a step or root."""
    if _skeleton.looks_like_spec(text):
        return Side(text, "skeleton", {"": None})
    path = as_path(text)
    found = _items.items_under(path)  # raises if it names nothing
    if len(found) == 1 and found[0][1] == path:
        return Side(text, "item", {path.name: path})
    step = max((n for n, _ in found if n is not None), default=None)
    items = {p.name: p for n, p in found if n == step}
    if item is not None and item not in items:
        raise ItemNotFoundError(
            f"{path} holds no item named {item!r} (--item); it holds "
            f"{', '.join(sorted(items))}. Pass one of those."
        )
    if item is not None:
        return Side(text, "item", {item: items[item]})
    others = _items.others_in(next(iter(items.values())).parent)
    what = "step" if step is None else "root"
    return Side(text, what, items, {o.name: o.handler for o in others})


def _pairs(a: Side, b: Side):
    """`[(name, item of A, item of B)]` (None: a skeleton), and how the items
    the sides hold differ: `[(what, name, in A, in B)]`."""
    for one, other in ((a, b), (b, a)):
        if one.what in ("item", "skeleton") and len(other.items) > 1:
            raise ItemNotFoundError(
                f"{other.where()} holds several items ({', '.join(sorted(other.items))}"
                f"), and {one.text} is one item: pass --item NAME to compare that "
                "item of it, or give two steps to compare them item by item."
            )
    if {"item", "skeleton"} & {a.what, b.what}:
        name = next((n for n in [*b.items, *a.items] if n), "")
        return [(name, *(next(iter(s.items.values())) for s in (a, b)))], []
    held = [
        (n in a.items, n, f"{_items.kind_of((a.items | b.items)[n])} item")
        for n in sorted(a.items.keys() ^ b.items.keys())
    ]
    others = (a.others.keys() ^ b.others.keys()) - a.items.keys() - b.items.keys()
    held += [
        (n in a.others, n, handler_text((a.others | b.others)[n]))
        for n in sorted(others)
    ]
    changes = [
        ("item removed", n, text, "") if in_a else ("item added", n, "", text)
        for in_a, n, text in held
    ]
    both = sorted(a.items.keys() & b.items.keys())
    return [(n, a.items[n], b.items[n]) for n in both], changes


def _compare(args, name: str, item_a, item_b) -> Compared:
    sa, sb = _open(args.a, item_a), _open(args.b, item_b)
    got = _values(sa, sb, args.rtol, args.atol, args.buffer) if args.values else None
    both_saved = sa[1] is not None and sb[1] is not None
    return Compared(name, sa, sb, structure(sa[0], sb[0], both_saved), got)


def _open(text: str, item) -> tuple[Metadata, Any]:
    """The metadata of a checkpoint's item (with its directory), or what a
    checkpoint of the skeleton `text` would record (and None)."""
    if item is not None:
        return _items.read(item), item
    walked = walk(_skeleton.load(text))
    leaves = {}
    for leaf in walked.leaves:
        if leaf.kind != ARRAY:
            value = None if leaf.kind == SHARED else encode(leaf.value)
            leaves[leaf.name] = LeafMetadata(
                leaf.name, leaf.path_str, leaf.kind, value=value
            )
            continue
        x, size = leaf.value, leaf.value.dtype.itemsize
        if is_key_dtype(x.dtype):
            data = key_data_struct(x.dtype)
            size = data.dtype.itemsize * math.prod(data.shape)
        nbytes = math.prod(x.shape) * size
        leaves[leaf.name] = LeafMetadata(
            leaf.name,
            leaf.path_str,
            ARRAY,
            tuple(x.shape),
            dtype_str(x),
            container(x),
            STORED if nbytes else EMPTY,
            nbytes=nbytes,
        )
    return Metadata(f"skeleton {text}", 0, {}, leaves, dict(walked.modules)), None


def structure(a: Metadata, b: Metadata, both_saved: bool) -> list[tuple]:
    """Every difference in structure, `(what, name, as A has it, as B has
    it)`: in A's leaf order, then B's other leaves, then the modules'."""
    plain = _plain(a, b)
    la, lb = a.leaves, b.leaves
    if plain:  # what a plain Orbax checkpoint could hold, or the other side holds
        la = {n: r for n, r in la.items() if n in lb or _plain_holds(r)}
        lb = {n: r for n, r in lb.items() if n in la or _plain_holds(r)}
    diffs = [
        _leaf(ra, lb[n], both_saved, plain)
        if n in lb
        else ("removed", n, ra.describe(), "")
        for n, ra in la.items()
    ]
    diffs += [("added", n, "", r.describe()) for n, r in lb.items() if n not in la]
    return [d for d in diffs if d] + ([] if plain else _modules(a.modules, b.modules))


def _plain(a: Metadata, b: Metadata) -> bool:
    return isinstance(a, PlainMetadata) or isinstance(b, PlainMetadata)


def _modules(ma: dict, mb: dict) -> list[tuple]:
    diffs = []
    for name, m in ma.items():
        other = mb.get(name)
        if other is None:
            diffs.append(("module removed", name, m.cls, ""))
            continue
        if m.cls != other.cls:
            diffs.append(("class", name, m.cls, other.cls))
        for field in sorted(m.static.keys() | other.static.keys()):
            da, db = (
                describe(s[field]) if field in s else "absent"
                for s in (m.static, other.static)
            )
            diffs += [("static", f"{name}:{field}", da, db)] if da != db else []
    return diffs + [
        ("module added", n, "", m.cls) for n, m in mb.items() if n not in ma
    ]


def _plain_holds(record: LeafMetadata) -> bool:
    """An array, or a Python number (which Orbax stores as a 0-d array)."""
    if record.kind == ARRAY:
        return record.data != EMPTY
    return record.kind == SCALAR and scalar_type(record.value) in (
        "int",
        "float",
        "bool",
    )


def _as_array(record: LeafMetadata) -> LeafMetadata:
    """A Python number as the 0-d array Orbax stores it as, of a dtype Orbax
    picks: compared by shape only."""
    if record.kind == ARRAY:
        return dataclasses.replace(record, dtype=None) if record.shape == () else record
    return dataclasses.replace(record, kind=ARRAY, shape=(), dtype=None)


def _leaf(ra: LeafMetadata, rb: LeafMetadata, both_saved: bool, plain: bool):
    """How one leaf differs, or None. A skeleton's Python values are
    placeholders: only their types count."""
    if plain and ARRAY in (ra.kind, rb.kind) and ra.kind != rb.kind:
        ra, rb = _as_array(ra), _as_array(rb)
    if ra.kind != rb.kind:
        return ("kind", ra.name, ra.describe(), rb.describe())
    if ra.kind != ARRAY:
        return _value_diff(ra, rb, both_saved)
    return _array_diff(ra, rb, both_saved and not plain)


def _value_diff(ra: LeafMetadata, rb: LeafMetadata, both_saved: bool):
    same_type = scalar_type(ra.value) == scalar_type(rb.value)
    if ra.value == rb.value or not both_saved and ra.kind == SCALAR and same_type:
        return None
    return ("value", ra.name, ra.describe(), rb.describe())


def _array_diff(ra: LeafMetadata, rb: LeafMetadata, ties_count: bool):
    if ra.shape != rb.shape:
        return ("shape", ra.name, str(ra.shape), str(rb.shape))
    if ra.dtype != rb.dtype and None not in (ra.dtype, rb.dtype):
        return ("dtype", ra.name, str(ra.dtype), str(rb.dtype))
    ties = [
        f"tied to {r.alias_of}" if r.data == ALIAS else "its own array"
        for r in (ra, rb)
    ]
    tied = ties_count and ties[0] != ties[1]
    return ("tied", ra.name, *ties) if tied else None


# ---------------------------------------------------------------- values


def _values(a, b, rtol: float, atol: float, buffer: int) -> list[dict]:
    """How the values of each array leaf both hold with one shape differ, read
    about `buffer` bytes at a time (half from each side)."""
    for saved, directory in (a, b):
        if directory is None:
            raise _skeleton.SkeletonError(
                f"--values compares the data of two checkpoints, but "
                f"{saved.directory.removeprefix('skeleton ')} is a skeleton, which "
                "has none. Give two checkpoints, or leave out --values."
            )
    pairs = [
        (ra, rb)
        for name, ra in a[0].leaves.items()
        if (rb := b[0].leaves.get(name)) is not None
        and ra.kind == rb.kind == ARRAY
        and ra.shape == rb.shape
        and _keys(ra) == _keys(rb)
    ]
    total = sum(read_cost(ra) + read_cost(rb) for ra, rb in pairs)
    found = []
    with (
        _reader(*a) as ra_,
        _reader(*b) as rb_,
        Progress("diff --values", total) as bar,
    ):
        stream_b = rb_.stream((rb for _, rb in pairs), buffer // 2)
        for ra, xa in ra_.stream((ra for ra, _ in pairs), buffer // 2):
            rb, xb = next(stream_b)  # both streams follow `pairs`
            if _keys(ra):
                found.append(_compare_keys(ra.name, ra.dtype == rb.dtype, xa, xb))
            else:
                found.append(compare(ra.name, xa, xb, rtol, atol))
            bar.advance(read_cost(ra) + read_cost(rb))
    return found


def _reader(saved: Metadata, directory):
    if isinstance(saved, PlainMetadata):
        return StoreReader(directory, saved.ocdbt, saved.zarr3)
    return LeafReader(directory, saved)


def _keys(record: LeafMetadata) -> bool:
    return str(record.dtype).startswith("key<")


def _result(name, max_abs, max_rel, mismatched: int, size: int, keys: bool) -> dict:
    return {"name": name, "max_abs": max_abs, "max_rel": max_rel} | {
        "mismatched": mismatched,
        "size": size,
        "keys": keys,
    }


def _compare_keys(name: str, same_impl: bool, a: np.ndarray, b: np.ndarray) -> dict:
    """Typed PRNG keys (their key data: a trailing axis of words a key), each
    equal or not, and of one implementation: no magnitude."""
    size = int(np.prod(a.shape[:-1])) if a.ndim else 0
    mismatched = size
    if same_impl and a.shape == b.shape:
        same = np.all(a.reshape(size, -1) == b.reshape(size, -1), axis=1)
        mismatched = int(size - np.count_nonzero(same))
    return _result(name, None, None, mismatched, size, True)


def compare(name: str, a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> dict:
    """Two arrays of one shape, a chunk at a time: integers and booleans
    exactly, floats (and complex) as `numpy.isclose(a, b, rtol, atol,
    equal_nan=True)`. An element's relative difference is `|a - b| / max(|a|,
    |b|)`; a nan facing a number is mismatched, with no size."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    exact = _is_exact(a.dtype) and _is_exact(b.dtype)
    max_abs = max_rel = 0.0
    mismatched = 0
    for at in range(0, fa.size, _CHUNK):
        xa, xb = fa[at : at + _CHUNK], fb[at : at + _CHUNK]
        wa, wb = _wide(xa), _wide(xb)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if exact:  # exactly, even for int64 values float64 would round
                close = same = xa == xb
                hi, lo = np.maximum(xa, xb).astype(np.uint64), np.minimum(xa, xb)
                diff = np.where(same, 0.0, (hi - lo.astype(np.uint64)).astype(float))
            else:
                same = (wa == wb) | (np.isnan(wa) & np.isnan(wb))
                close = np.isclose(wa, wb, rtol=rtol, atol=atol, equal_nan=True)
                diff = np.where(same, 0.0, np.abs(wa - wb))
            diff = np.where(np.isnan(diff), 0.0, diff)
            scale = np.maximum(np.abs(wa), np.abs(wb))
            rel = np.where(np.isinf(diff), np.inf, diff / np.where(diff, scale, 1))
        mismatched += int(close.size - np.count_nonzero(close))
        max_abs = max(max_abs, float(np.max(diff)))
        max_rel = max(max_rel, float(np.max(rel)))
    return _result(name, max_abs, max_rel, mismatched, int(fa.size), False)


def _is_exact(dtype: np.dtype) -> bool:
    # ml_dtypes' floats (bfloat16, float8...) are kind "V", like int4: told
    # apart by whether they have a float info.
    if dtype.kind != "V":
        return dtype.kind in "biu"
    import ml_dtypes

    try:
        ml_dtypes.finfo(dtype)
        return False
    except ValueError:
        return True


def _wide(x: np.ndarray) -> np.ndarray:
    complex_ = np.issubdtype(x.dtype, np.complexfloating)
    return x.astype(np.complex128 if complex_ else np.float64)


# ---------------------------------------------------------------- output


def _differences(head: str, changes) -> str:
    """A table of `(what, name, in A, in B)`, every row aligned however long
    its name (optimizer state...)."""
    rows = []
    for what, name, x, y in changes:
        if what == "static":
            module, _, field = name.rpartition(":")
            name = f"{display_path(module) if module else '<root>'}.{field}"
        elif what not in ("item added", "item removed"):
            name = display_path(name)
        rows.append([what, name, f"{x or '(absent)'} -> {y or '(absent)'}"])
    return table(["difference", head, "A -> B"], rows, max_pad=None)


def _item_text(c: Compared, args) -> str:
    a, b = c.a[0], c.b[0]
    lines = [f"A: {a.directory}", f"B: {b.directory}", "", _structure_text(c)]
    if c.got is not None:
        lines += ["", *_values_lines(c.got, args)]
    return "\n".join([*lines, "", _item_verdict(c)])


def _structure_text(c: Compared) -> str:
    (a, _), (b, _), diffs = c.a, c.b, c.diffs
    if diffs:
        heading = f"Structure: {count(len(diffs), 'difference')}"
        return f"{heading}\n{_differences('name', diffs)}"
    if _plain(a, b):
        return (
            f"Structure: the same ({len(a.leaves)} leaves; a plain Orbax checkpoint "
            "records arrays only, so modules were not compared)."
        )
    return f"Structure: the same ({len(a.leaves)} leaves, {len(a.modules)} modules)."


def _values_lines(got: list[dict], args) -> list[str]:
    bad = sum(bool(v["mismatched"]) for v in got)
    head = f"Values (rtol={args.rtol:g}, atol={args.atol:g}): "
    head += (
        f"{bad} of {len(got)} arrays differ"
        if bad
        else (f"all {len(got)} arrays compared are within tolerance")
    )
    rows = [
        [number(v["max_abs"], 3), number(v["max_rel"], 3), _status(v)]
        + [display_path(v["name"])]
        for v in got
    ]
    # The name last: the numbers line up whatever its length.
    header = ["max abs", "max rel", "status", "name"]
    return [head, *[table(header, rows, right=(0, 1))] * bool(got)]


def _item_verdict(c: Compared) -> str:
    got = c.got
    bad = sum(bool(v["mismatched"]) for v in got or [])
    parts = [f"{len(c.diffs)} in structure"] * bool(c.diffs)
    parts += [f"{bad} in values"] * bool(bad)
    if parts:
        verdict = f"A and B differ: {', '.join(parts)}."
    else:
        verdict = "A and B do not differ" + (
            " (values within tolerance)." if got else " in structure."
        )
    return verdict + ("" if got is not None else _NOT_COMPARED + _why_not(c))


def _why_not(c: Compared) -> str:
    """Why values were not compared: "do not differ" must not read as "hold
    the same values"."""
    skeletons = [n for n, (_, d) in (("A", c.a), ("B", c.b)) if d is None]
    if not skeletons:
        return "pass --values to compare them."
    if len(skeletons) == 2:
        return "A and B are skeletons, which hold none."
    return f"{skeletons[0]} is a skeleton, which holds none."


def _status(v: dict) -> str:
    what = "keys" if v["keys"] else "elements"
    if v["mismatched"]:
        return f"DIFFERENT ({v['mismatched']} of {v['size']} {what})"
    return "equal keys" if v["keys"] else "equal" if v["max_abs"] == 0 else "close"


def _steps_text(a: Side, b: Side, items, changes, others, args) -> str:
    lines = [f"A: {a.where()}", f"B: {b.where()}", ""]
    if changes:
        lines += [
            f"Items: {count(len(changes), 'difference')}",
            _differences("item", changes),
            "",
        ]
    for c in items:
        # Each item's own lines, but its verdict: the last line's, for all.
        body = _item_text(c, args).rsplit("\n", 1)[0].rstrip("\n")
        lines += [f"Item {c.name}:", *("  " + x if x else "" for x in body.split("\n"))]
        lines.append("")
    if others:
        neither = "neither orbax_eqx nor plain Orbax items"
        lines.append(f"Not compared ({neither}, in both): {', '.join(others)}.")
    differing = [c.name for c in items if c.differ]
    parts = [f"{len(changes)} in which items they hold"] * bool(changes)
    parts += [f"item(s) {', '.join(differing)}"] * bool(differing)
    if parts:
        verdict = f"A and B differ: {'; '.join(parts)}."
    else:
        what = ", values within tolerance)." if args.values else " in structure)."
        verdict = f"A and B do not differ ({len(items)} item(s) compared{what}"
    if not args.values:
        verdict += _NOT_COMPARED + "pass --values to compare them."
    return "\n".join([*lines, verdict])


def _changes_json(changes) -> list[dict]:
    return [
        {"what": w, "name": n, "a": x or None, "b": y or None} for w, n, x, y in changes
    ]


def _item_json(c: Compared, args) -> dict:
    doc: dict[str, Any] = {"a": c.a[0].directory, "b": c.b[0].directory}
    doc |= {"differences": _changes_json(c.diffs), "values": None}
    if c.got is not None:
        leaves = [v | {k: _finite(v[k]) for k in ("max_abs", "max_rel")} for v in c.got]
        doc["values"] = {"rtol": args.rtol, "atol": args.atol, "leaves": leaves}
    return doc | {"differ": c.differ}


def _finite(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else repr(x)  # (strict JSON)

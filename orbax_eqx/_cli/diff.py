"""`diff`: how two checkpoints (or a checkpoint and a skeleton) differ.

The structure comes from the metadata alone: leaves added and removed, kinds,
shapes, dtypes, Python values (against a skeleton, by type only, as restore
compares them) and tied weights; modules' classes and static fields. With
`--values`, arrays both sides hold with one shape are read a batch at a time
and compared, floats as `numpy.isclose` with B as the reference. A plain
Orbax checkpoint is compared by its arrays. Two steps (or manager roots) are
compared item by item, paired by name.
"""

import argparse
import dataclasses
import json
import math
import os
from typing import Any

import numpy as np
from etils import epath

from .._errors import OrbaxEqxError
from .._format.locate import as_path
from .._format.sidecar import ALIAS, EMPTY, STORED, LeafMetadata, Metadata
from .._orbax import items as _items
from .._orbax.plain_items import PlainMetadata
from .._orbax.store_read import StoreReader
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
from .render import Progress, count, handler_text, table

_CHUNK = 1 << 20  # elements compared at once: bounds the float64 temporaries
_ARROW = " -> "


class ItemNotFoundError(OrbaxEqxError, FileNotFoundError):
    """`--item NAME` names no item of a step, or a step needs `--item`."""


@dataclasses.dataclass(frozen=True)
class Side:
    """A checkpoint's item (with its directory) or a skeleton (none)."""

    label: str
    saved: Metadata
    directory: Any = None


@dataclasses.dataclass(frozen=True)
class Named:
    """What the user named: a skeleton, one item, or a step's items (a root's
    latest step) by name, with the step's other items and their handlers."""

    text: str
    what: str  # "skeleton", "item", "step" or "root"
    items: dict[str, epath.Path]
    others: dict[str, str | None]


def run(args: argparse.Namespace) -> int:
    a, b = resolve(args.a, args.item), resolve(args.b, args.item)
    found, changes = _pairs(a, b)
    results = []
    for name, ia, ib in found:
        sa, sb = _open(args.a, ia), _open(args.b, ib)
        diffs = structure(sa, sb)
        got = values(sa, sb, args.rtol, args.atol, args.buffer) if args.values else None
        results.append((name, sa, sb, diffs, got))
    if "item" in (a.what, b.what) or "skeleton" in (a.what, b.what):
        ((_, sa, sb, diffs, got),) = results
        if args.json:
            print(
                json.dumps(
                    _json(sa, sb, diffs, got, args), indent=2, ensure_ascii=False
                )
            )
        else:
            print("\n".join(_text(sa, sb, diffs, got, args)))
        return 1 if _differ(diffs, got) else 0
    differ = bool(changes) or any(_differ(d, v) for *_, d, v in results)
    others = sorted(set(a.others) & set(b.others))
    if args.json:
        doc = {
            "a": _where(a),
            "b": _where(b),
            "items": [
                {"name": n} | _json(x, y, d, v, args) for n, x, y, d, v in results
            ],
            "item_differences": [
                {"what": w, "name": n, "a": x or None, "b": y or None}
                for w, n, x, y in changes
            ],
            "not_compared": others,
            "differ": differ,
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        print("\n".join(_steps_text(a, b, results, changes, others, args)))
    return 1 if differ else 0


def _differ(diffs, got) -> bool:
    return bool(diffs) or any(v["mismatched"] for v in got or [])


# ---------------------------------------------------------------- sides


def resolve(text: str, item: str | None = None) -> Named:
    """What `text` names: a skeleton spec, an item, a step or a root (its
    latest step); `item`, if given, picks that item of a step or root."""
    if _skeleton.looks_like_spec(text):
        return Named(text, "skeleton", {}, {})
    path = as_path(text)
    found = _items.items_under(path)  # raises if it names nothing
    numbers = sorted({n for n, _ in found if n is not None})
    if len(found) == 1 and found[0][1] == path:
        return Named(text, "item", {path.name: path}, {})
    what, step = ("root", numbers[-1]) if numbers else ("step", None)
    items = {p.name: p for n, p in found if n == step}
    step_dir = next(iter(items.values())).parent
    others = {o.name: o.handler for o in _items.others_in(step_dir)}
    if item is None:
        return Named(text, what, items, others)
    if item not in items:
        raise ItemNotFoundError(
            f"{path} holds no item named {item!r} (--item); it holds "
            f"{', '.join(sorted(items)) or 'no items'}. Pass one of those."
        )
    return Named(text, "item", {item: items[item]}, {})


def _where(side: Named) -> str:
    if side.what == "root":
        step = next(iter(side.items.values())).parent
        return f"{step} (the latest step of the CheckpointManager root {as_path(side.text)})"
    return os.fspath(as_path(side.text))


def _pairs(a: Named, b: Named):
    """`[(name, item of A, item of B)]` to compare (None for a skeleton), and
    how the items the two sides hold differ: `[(what, name, in A, in B)]`."""
    single = [s for s in (a, b) if s.what in ("item", "skeleton")]
    if single:
        other = b if single[0] is a else a
        if other.what not in ("item", "skeleton") and len(other.items) != 1:
            raise ItemNotFoundError(
                f"{_where(other)} holds several items ({', '.join(sorted(other.items))}), "
                f"and {single[0].text} is one item: pass --item NAME to compare that "
                "item of it, or give two steps to compare them item by item."
            )
        name = next(iter(b.items or a.items), "")
        one = lambda s: next(iter(s.items.values()), None)  # noqa: E731
        return [(name, one(a), one(b))], []
    found, changes = [], []
    for name in sorted(set(a.items) | set(b.items)):
        ia, ib = a.items.get(name), b.items.get(name)
        if ia is not None and ib is not None:
            found.append((name, ia, ib))
        else:
            text = f"{_items.kind_of(ia or ib)} item"
            changes.append(_change(name, ia is not None, text))
    for name in sorted(set(a.others) ^ set(b.others)):
        if name not in a.items and name not in b.items:
            changes.append(
                _change(
                    name, name in a.others, handler_text((a.others | b.others)[name])
                )
            )
    return found, changes


def _change(name: str, in_a: bool, text: str) -> tuple[str, str, str, str]:
    if in_a:
        return ("item removed", name, text, "")
    return ("item added", name, "", text)


def _open(text: str, item: epath.Path | None) -> Side:
    if item is None:
        return Side(text, skeleton_metadata(_skeleton.load(text), f"skeleton {text}"))
    return Side(text, _items.read(item), item)


def skeleton_metadata(tree: Any, where: str) -> Metadata:
    """What a checkpoint of `tree` would record, with nothing saved or read
    (a skeleton has no tied arrays)."""
    walked = walk(tree)
    leaves = {}
    for leaf in walked.leaves:
        if leaf.kind != ARRAY:
            value = None if leaf.kind == SHARED else encode(leaf.value)
            leaves[leaf.name] = LeafMetadata(
                leaf.name, leaf.path_str, leaf.kind, value=value
            )
            continue
        x = leaf.value
        item = x.dtype.itemsize
        if is_key_dtype(x.dtype):
            data = key_data_struct(x.dtype)
            item = data.dtype.itemsize * math.prod(data.shape)
        nbytes = math.prod(x.shape) * item
        leaves[leaf.name] = LeafMetadata(
            leaf.name,
            leaf.path_str,
            ARRAY,
            tuple(x.shape),
            dtype_str(x),
            container(x),
            STORED if nbytes else EMPTY,
            None,
            nbytes,
        )
    return Metadata(where, 0, {}, leaves, dict(walked.modules))


# ---------------------------------------------------------------- structure


def structure(a: Side, b: Side) -> list[tuple[str, str, str, str]]:
    """Every difference of `a` and `b` in structure: `(what, name, as A has
    it, as B has it)`, in A's leaf order, then B's, then the modules'."""
    la, lb = a.saved.leaves, b.saved.leaves
    both_saved = a.directory is not None and b.directory is not None
    plain = isinstance(a.saved, PlainMetadata) or isinstance(b.saved, PlainMetadata)
    if plain:  # Orbax holds arrays only, and Python numbers as 0-d arrays
        la = {n: r for n, r in la.items() if n in lb or _plain_holds(r)}
        lb = {n: r for n, r in lb.items() if n in la or _plain_holds(r)}
    diffs = []
    for name, ra in la.items():
        rb = lb.get(name)
        if rb is None:
            diffs.append(("removed", name, ra.describe(), ""))
            continue
        if plain and ARRAY in (ra.kind, rb.kind) and ra.kind != rb.kind:
            ra, rb = _as_array(ra), _as_array(rb)
        diff = _leaf(ra, rb, both_saved and not plain)
        # A skeleton's Python values are placeholders: their types must match.
        if diff and ra.kind == SCALAR and not both_saved:
            diff = diff if scalar_type(ra.value) != scalar_type(rb.value) else None
        diffs += [diff] if diff else []
    diffs += [("added", n, "", r.describe()) for n, r in lb.items() if n not in la]
    if plain:  # no modules recorded
        return diffs
    ma, mb = a.saved.modules, b.saved.modules
    for name, m in ma.items():
        other = mb.get(name)
        if other is None:
            diffs.append(("module removed", name, m.cls, ""))
            continue
        if m.cls != other.cls:
            diffs.append(("class", name, m.cls, other.cls))
        for field in sorted(set(m.static) | set(other.static)):
            da, db = (
                describe(s[field]) if field in s else "absent"
                for s in (m.static, other.static)
            )
            if da != db:
                diffs.append(("static", f"{name}:{field}", da, db))
    return diffs + [
        ("module added", n, "", m.cls) for n, m in mb.items() if n not in ma
    ]


def _plain_holds(record: LeafMetadata) -> bool:
    if record.kind == ARRAY:
        return record.data != EMPTY
    return record.kind == SCALAR and scalar_type(record.value) in (
        "int",
        "float",
        "bool",
    )


def _as_array(record: LeafMetadata) -> LeafMetadata:
    """A Python number as the 0-d array Orbax stores it as, of Orbax's dtype:
    compared by shape only."""
    if record.kind == ARRAY:
        return dataclasses.replace(record, dtype=None) if record.shape == () else record
    return dataclasses.replace(record, kind=ARRAY, shape=(), dtype=None)


def _leaf(ra: LeafMetadata, rb: LeafMetadata, both_saved: bool):
    name = ra.name
    if ra.kind != rb.kind:
        return ("kind", name, ra.describe(), rb.describe())
    if ra.kind != ARRAY:
        return (
            ("value", name, ra.describe(), rb.describe())
            if ra.value != rb.value
            else None
        )
    if ra.shape != rb.shape:
        return ("shape", name, str(ra.shape), str(rb.shape))
    if ra.dtype != rb.dtype and None not in (ra.dtype, rb.dtype):
        return ("dtype", name, str(ra.dtype), str(rb.dtype))
    tie = lambda r: f"tied to {r.alias_of}" if r.data == ALIAS else "its own array"  # noqa: E731
    if both_saved and tie(ra) != tie(rb):
        return ("tied", name, tie(ra), tie(rb))
    return None


# ---------------------------------------------------------------- values


def values(a: Side, b: Side, rtol: float, atol: float, buffer: int) -> list[dict]:
    """How the values of each array leaf both sides hold with one shape differ:
    `{"name", "max_abs", "max_rel", "mismatched", "size", "keys"}`, reading
    about `buffer` bytes at once (half from each side)."""
    for side in (a, b):
        if side.directory is None:
            raise _skeleton.SkeletonError(
                f"--values compares the data of two checkpoints, but {side.label} is "
                "a skeleton, which has none. Give two checkpoints, or leave out --values."
            )
    pairs = []
    for name, ra in a.saved.leaves.items():
        rb = b.saved.leaves.get(name)
        if (
            ra.kind == ARRAY
            and rb is not None
            and rb.kind == ARRAY
            and ra.shape == rb.shape
        ):
            if str(ra.dtype).startswith("key<") == str(rb.dtype).startswith("key<"):
                pairs.append((ra, rb))
    total = sum(read_cost(ra) + read_cost(rb) for ra, rb in pairs)
    found = []
    with (
        _reader(a) as reader_a,
        _reader(b) as reader_b,
        Progress("diff --values", total) as bar,
    ):
        stream_b = reader_b.stream((rb for _, rb in pairs), buffer // 2)
        for ra, xa in reader_a.stream((ra for ra, _ in pairs), buffer // 2):
            rb, xb = next(stream_b)  # both streams follow `pairs`
            if ra.dtype.startswith("key<"):
                found.append(_compare_keys(ra.name, ra.dtype == rb.dtype, xa, xb))
            else:
                found.append(compare(ra.name, xa, xb, rtol, atol))
            bar.advance(read_cost(ra) + read_cost(rb))
            del xa, xb
    return found


def _reader(side: Side):
    if isinstance(side.saved, PlainMetadata):
        return StoreReader(side.directory, side.saved.ocdbt, side.saved.zarr3)
    return LeafReader(side.directory, side.saved)


def _compare_keys(name: str, same_impl: bool, a: np.ndarray, b: np.ndarray) -> dict:
    """Typed PRNG keys (their key data, a trailing axis of words per key),
    each equal or not: no magnitude."""
    size = int(np.prod(a.shape[:-1])) if a.ndim else 0
    mismatched = size
    if same_impl and a.shape == b.shape:
        same = np.all(a.reshape(size, -1) == b.reshape(size, -1), axis=1)
        mismatched = int(size - np.count_nonzero(same))
    return {
        "name": name,
        "max_abs": None,
        "max_rel": None,
        "mismatched": mismatched,
        "size": size,
        "keys": True,
    }


def compare(name: str, a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> dict:
    """Two arrays of one shape, a chunk at a time: integers and booleans
    exactly, floats (and complex) as `numpy.isclose(a, b, rtol, atol,
    equal_nan=True)`; an element's relative difference is
    `|a - b| / max(|a|, |b|)`, and a nan facing a number is mismatched with
    no size."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    exact = _is_exact(a.dtype) and _is_exact(b.dtype)
    max_abs = max_rel = 0.0
    mismatched = 0
    for at in range(0, fa.size, _CHUNK):
        ra, rb = fa[at : at + _CHUNK], fb[at : at + _CHUNK]
        ca, cb = _wide(ra), _wide(rb)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if exact:  # exactly, even int64 values float64 would round
                close = same = ra == rb
                hi, lo = np.maximum(ra, rb), np.minimum(ra, rb)
                diff = np.where(
                    same,
                    0.0,
                    (hi.astype(np.uint64) - lo.astype(np.uint64)).astype(np.float64),
                )
            else:
                same = (ca == cb) | (np.isnan(ca) & np.isnan(cb))
                close = np.isclose(ca, cb, rtol=rtol, atol=atol, equal_nan=True)
                diff = np.where(same, 0.0, np.abs(ca - cb))
            diff = np.where(np.isnan(diff), 0.0, diff)
            scale = np.maximum(np.abs(ca), np.abs(cb))
            rel = np.where(np.isinf(diff), np.inf, diff / np.where(diff, scale, 1))
        mismatched += int(close.size - np.count_nonzero(close))
        max_abs = max(max_abs, float(np.max(diff, initial=0.0)))
        max_rel = max(max_rel, float(np.max(rel, initial=0.0)))
    return {
        "name": name,
        "max_abs": max_abs,
        "max_rel": max_rel,
        "mismatched": mismatched,
        "size": int(fa.size),
        "keys": False,
    }


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
    return x.astype(
        np.complex128 if np.issubdtype(x.dtype, np.complexfloating) else np.float64
    )


# ---------------------------------------------------------------- output


def _text(a: Side, b: Side, diffs, got, args) -> list[str]:
    lines = [f"A: {a.saved.directory}", f"B: {b.saved.directory}", ""]
    if diffs:
        rows = [
            [w, _name(w, n), f"{x or '(absent)'}{_ARROW}{y or '(absent)'}"]
            for w, n, x, y in diffs
        ]
        lines += [
            f"Structure: {count(len(diffs), 'difference')}",
            table(["difference", "name", "A -> B"], rows, max_pad=None),
        ]
    elif isinstance(a.saved, PlainMetadata) or isinstance(b.saved, PlainMetadata):
        lines.append(
            f"Structure: the same ({len(a.saved.leaves)} leaves; a plain Orbax "
            "checkpoint records arrays only, so modules were not compared)."
        )
    else:
        lines.append(
            f"Structure: the same ({len(a.saved.leaves)} leaves, {len(a.saved.modules)} modules)."
        )
    if got is not None:
        bad = sum(bool(v["mismatched"]) for v in got)
        lines += [
            "",
            f"Values (rtol={args.rtol:g}, atol={args.atol:g}): "
            + (
                f"{bad} of {len(got)} arrays differ"
                if bad
                else f"all {len(got)} arrays compared are within tolerance"
            ),
        ]
        rows = [
            [
                _num(v["max_abs"]),
                _num(v["max_rel"]),
                _status(v),
                display_path(v["name"]),
            ]
            for v in got
        ]
        # The name last: the numbers line up whatever its length.
        lines += (
            [table(["max abs", "max rel", "status", "name"], rows, right=(0, 1))]
            if got
            else []
        )
    return lines + ["", _verdict(a, b, diffs, got)]


def _name(what: str, name: str) -> str:
    if what != "static":
        return display_path(name)
    module, _, field = name.rpartition(":")
    return f"{display_path(module)}.{field}" if module else f"<root>.{field}"


def _num(x: float | None) -> str:
    if x is None:  # keys have no magnitude
        return "-"
    return "0" if x == 0 else f"{x:.3g}" if math.isfinite(x) else str(x)


def _status(v: dict) -> str:
    what = "keys" if v["keys"] else "elements"
    if v["mismatched"]:
        return f"DIFFERENT ({v['mismatched']} of {v['size']} {what})"
    return "equal keys" if v["keys"] else "equal" if v["max_abs"] == 0 else "close"


def _verdict(a: Side, b: Side, diffs, got) -> str:
    bad = sum(bool(v["mismatched"]) for v in got or [])
    if not diffs and not bad:
        verdict = "A and B do not differ" + (
            " (values within tolerance)." if got else " in structure."
        )
    else:
        parts = [f"{len(diffs)} in structure"] if diffs else []
        verdict = f"A and B differ: {', '.join(parts + ([f'{bad} in values'] if bad else []))}."
    if got is not None:
        return verdict
    # "Do not differ" must not read as "hold the same values".
    skeletons = [n for n, s in (("A", a), ("B", b)) if s.directory is None]
    if not skeletons:
        return (
            verdict + " Array values were not compared: pass --values to compare them."
        )
    if len(skeletons) == 2:
        return (
            verdict
            + " Array values were not compared: A and B are skeletons, which hold none."
        )
    return (
        verdict
        + f" Array values were not compared: {skeletons[0]} is a skeleton, which holds none."
    )


def _steps_text(a: Named, b: Named, results, changes, others, args) -> list[str]:
    lines = [f"A: {_where(a)}", f"B: {_where(b)}", ""]
    if changes:
        rows = [
            [w, display_path(n), f"{x or '(absent)'}{_ARROW}{y or '(absent)'}"]
            for w, n, x, y in changes
        ]
        lines += [
            f"Items: {count(len(changes), 'difference')}",
            table(["difference", "item", "A -> B"], rows, max_pad=None),
            "",
        ]
    for name, sa, sb, diffs, got in results:
        body = _text(sa, sb, diffs, got, args)[:-1]  # its verdict is the last line's
        while body and not body[-1]:
            body.pop()
        lines += [
            f"Item {name}:",
            *("  " + x if x else "" for x in "\n".join(body).splitlines()),
            "",
        ]
    if others:
        lines.append(
            f"Not compared (neither orbax_eqx nor plain Orbax items, in both): {', '.join(others)}."
        )
    differing = [n for n, *_, d, v in results if _differ(d, v)]
    parts = [f"{len(changes)} in which items they hold"] if changes else []
    parts += [f"item(s) {', '.join(differing)}"] if differing else []
    if parts:
        verdict = f"A and B differ: {'; '.join(parts)}."
    else:
        verdict = f"A and B do not differ ({len(results)} item(s) compared" + (
            ", values within tolerance)." if args.values else " in structure)."
        )
    if not args.values:
        verdict += " Array values were not compared: pass --values to compare them."
    return lines + [verdict]


def _json(a: Side, b: Side, diffs, got, args) -> dict:
    def number(x):
        return x if x is None or math.isfinite(x) else repr(x)

    doc: dict[str, Any] = {
        "a": a.saved.directory,
        "b": b.saved.directory,
        "differences": [
            {"what": w, "name": n, "a": x or None, "b": y or None}
            for w, n, x, y in diffs
        ],
        "values": None,
    }
    if got is not None:
        leaves = [
            v | {"max_abs": number(v["max_abs"]), "max_rel": number(v["max_rel"])}
            for v in got
        ]
        doc["values"] = {"rtol": args.rtol, "atol": args.atol, "leaves": leaves}
    return doc | {"differ": _differ(diffs, got)}

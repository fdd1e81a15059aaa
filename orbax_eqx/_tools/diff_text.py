"""`python -m orbax_eqx diff`: runs `diff` and shows what it found, as text or JSON."""

import argparse
import json
import math
from typing import Any

from .._tree.walk import display_path
from . import diff_items as _items
from .diff import Difference, ValueDiff, is_plain, open_side, structure, values
from .text import table

_ARROW = " -> "


def run(args: argparse.Namespace) -> int:
    """Runs `diff` for parsed arguments; returns the exit status (0 same, 1 not)."""
    item = getattr(args, "item", None)
    ra, rb = _items.resolve(args.a, item), _items.resolve(args.b, item)
    found_pairs, changes = _items.pairs(ra, rb)
    single = ra.what in ("item", "skeleton") or rb.what in ("item", "skeleton")
    results = []
    for name, ia, ib in found_pairs:
        a, b = open_side(args.a, _item(ia)), open_side(args.b, _item(ib))
        diffs = structure(a, b)
        found = (
            list(values(a, b, rtol=args.rtol, atol=args.atol, buffer=args.buffer))
            if args.values
            else None
        )
        results.append((name, a, b, diffs, found))
    if single:
        ((_, a, b, diffs, found),) = results
        if args.json:
            doc = _json(a, b, diffs, found, args)
            print(json.dumps(doc, indent=2, ensure_ascii=False))
        else:
            print(_text(a, b, diffs, found, args), end="")
        return 1 if _differ(diffs, found) else 0
    differ = bool(changes) or any(_differ(d, f) for _, _, _, d, f in results)
    others = _items.not_compared(ra, rb)
    if args.json:
        doc = {
            "a": _items.describe(ra),
            "b": _items.describe(rb),
            "items": [
                {"name": name} | _json(a, b, d, f, args) for name, a, b, d, f in results
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
        print(_steps_text(ra, rb, results, changes, others, args), end="")
    return 1 if differ else 0


def _item(target):
    return None if isinstance(target, str) else target


def _differ(diffs, found) -> bool:
    return bool(diffs) or any(not v.equal for v in found or [])


def _steps_text(ra, rb, results, changes, others, args) -> str:
    """Two steps (or roots), item by item, then one verdict."""
    lines = [f"A: {_items.describe(ra)}", f"B: {_items.describe(rb)}", ""]
    if changes:
        rows = [
            [w, display_path(n), f"{x or '(absent)'}{_ARROW}{y or '(absent)'}"]
            for w, n, x, y in changes
        ]
        lines += [
            f"Items: {len(changes)} difference{'s' if len(changes) != 1 else ''}",
            table(["difference", "item", "A -> B"], rows, max_pad=None),
            "",
        ]
    for name, a, b, diffs, found in results:
        # Each item's own A:/B: lines, then its structure and values (its
        # verdict is the last line's, for all items).
        body = _text(a, b, diffs, found, args).rstrip("\n").splitlines()[:-1]
        while body and not body[-1]:
            body.pop()
        lines += [f"Item {name}:", *("  " + x if x else "" for x in body), ""]
    if others:
        lines.append(
            f"Not compared (neither orbax_eqx nor plain Orbax items, in both): "
            f"{', '.join(others)}."
        )
    differing = [name for name, _, _, d, f in results if _differ(d, f)]
    parts = []
    if changes:
        parts.append(f"{len(changes)} in which items they hold")
    if differing:
        parts.append(f"item(s) {', '.join(differing)}")
    if parts:
        verdict = f"A and B differ: {'; '.join(parts)}."
    else:
        verdict = f"A and B do not differ ({len(results)} item(s) compared" + (
            ", values within tolerance)." if args.values else " in structure)."
        )
    if not args.values:
        verdict += " Array values were not compared: pass --values to compare them."
    lines.append(verdict)
    return "\n".join(lines) + "\n"


def _where(side) -> str:
    return side.saved.directory


def _text(a, b, diffs: list[Difference], found, args) -> str:
    lines = [f"A: {_where(a)}", f"B: {_where(b)}", ""]
    if diffs:
        rows = [[d.what, _name(d), _change(d)] for d in diffs]
        lines += [
            f"Structure: {len(diffs)} difference{'s' if len(diffs) != 1 else ''}",
            # Every row aligned, however long its name (optimizer state...).
            table(["difference", "name", "A -> B"], rows, max_pad=None),
        ]
    elif is_plain(a) or is_plain(b):
        lines.append(
            f"Structure: the same ({len(a.saved.leaves)} leaves; a plain Orbax "
            "checkpoint records arrays only, so modules were not compared)."
        )
    else:
        n = len(a.saved.leaves)
        lines.append(
            f"Structure: the same ({n} leaves, {len(a.saved.modules)} modules)."
        )
    if found is not None:
        bad = [v for v in found if not v.equal]
        lines += [
            "",
            f"Values (rtol={args.rtol:g}, atol={args.atol:g}): "
            + (
                f"{len(bad)} of {len(found)} arrays differ"
                if bad
                else f"all {len(found)} arrays compared are within tolerance"
            ),
        ]
        if found:
            lines.append(
                # The name last: the numbers line up whatever its length.
                table(
                    ["max abs", "max rel", "status", "name"],
                    [
                        [
                            _num(v.max_abs) if not v.keys else "-",
                            _num(v.max_rel) if not v.keys else "-",
                            _status(v),
                            display_path(v.name),
                        ]
                        for v in found
                    ],
                    right=(0, 1),
                )
            )
    lines += ["", _verdict(a, b, diffs, found)]
    return "\n".join(lines) + "\n"


def _name(d: Difference) -> str:
    if d.what == "static":
        module, _, field = d.name.rpartition(":")
        return f"{display_path(module)}.{field}" if module else f"<root>.{field}"
    return display_path(d.name)


def _change(d: Difference) -> str:
    if d.what in ("added", "module added"):
        return f"(absent){_ARROW}{d.b}"
    if d.what in ("removed", "module removed"):
        return f"{d.a}{_ARROW}(absent)"
    return f"{d.a}{_ARROW}{d.b}"


def _num(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _status(v: ValueDiff) -> str:
    if v.keys:  # typed PRNG keys: equal or not, key by key
        return (
            "equal keys" if v.equal else f"DIFFERENT ({v.mismatched} of {v.size} keys)"
        )
    if v.equal:
        return "equal" if v.max_abs == 0 else "close"
    return f"DIFFERENT ({v.mismatched} of {v.size} elements)"


def _verdict(a, b, diffs, found) -> str:
    bad = sum(not v.equal for v in found or [])
    if not diffs and not bad:
        verdict = "A and B do not differ" + (
            " (values within tolerance)." if found else " in structure."
        )
    else:
        parts = []
        if diffs:
            parts.append(f"{len(diffs)} in structure")
        if bad:
            parts.append(f"{bad} in values")
        verdict = f"A and B differ: {', '.join(parts)}."
    if found is None:
        # "Do not differ" must not read as "hold the same values".
        verdict += " " + _not_compared(a, b)
    return verdict


def _not_compared(a, b) -> str:
    skeletons = [name for name, side in (("A", a), ("B", b)) if side.directory is None]
    if not skeletons:
        return "Array values were not compared: pass --values to compare them."
    if len(skeletons) == 2:
        return "Array values were not compared: A and B are skeletons, which hold none."
    return (
        f"Array values were not compared: {skeletons[0]} is a skeleton, which "
        "holds none."
    )


def _json(a, b, diffs, found, args) -> dict:
    def number(x: float):
        return x if math.isfinite(x) else repr(x)

    doc: dict[str, Any] = {
        "a": _where(a),
        "b": _where(b),
        "differences": [
            {"what": d.what, "name": d.name, "a": d.a or None, "b": d.b or None}
            for d in diffs
        ],
        "values": None,
    }
    if found is not None:
        doc["values"] = {
            "rtol": args.rtol,
            "atol": args.atol,
            "leaves": [
                {
                    "name": v.name,
                    # Keys have no magnitude: null, and "keys": true.
                    "max_abs": None if v.keys else number(v.max_abs),
                    "max_rel": None if v.keys else number(v.max_rel),
                    "mismatched": v.mismatched,
                    "size": v.size,
                    "keys": v.keys,
                }
                for v in found
            ],
        }
    doc["differ"] = bool(diffs) or any(not v.equal for v in found or [])
    return doc

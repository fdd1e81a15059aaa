"""`python -m orbax_eqx diff`: runs `_diff` and shows what it found, as text or JSON."""

import argparse
import json
import math

from .._tree.walk import display_path
from .diff import Difference, ValueDiff, open_side, structure, values
from .text import table

_ARROW = " -> "


def run(args: argparse.Namespace) -> int:
    """Runs `diff` for parsed arguments; returns the exit status (0 same, 1 not)."""
    a, b = open_side(args.a), open_side(args.b)
    diffs = structure(a, b)
    found = (
        list(values(a, b, rtol=args.rtol, atol=args.atol, buffer=args.buffer))
        if args.values
        else None
    )
    differ = bool(diffs) or any(not v.equal for v in found or [])
    if args.json:
        print(json.dumps(_json(a, b, diffs, found, args), indent=2, ensure_ascii=False))
    else:
        print(_text(a, b, diffs, found, args), end="")
    return 1 if differ else 0


def _where(side) -> str:
    return side.saved.directory


def _text(a, b, diffs: list[Difference], found, args) -> str:
    lines = [f"A: {_where(a)}", f"B: {_where(b)}", ""]
    if diffs:
        rows = [[d.what, _name(d), _change(d)] for d in diffs]
        lines += [
            f"Structure: {len(diffs)} difference{'s' if len(diffs) != 1 else ''}",
            table(["difference", "name", "A -> B"], rows),
        ]
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
                table(
                    ["name", "max abs", "max rel", "status"],
                    [
                        [
                            display_path(v.name),
                            _num(v.max_abs),
                            _num(v.max_rel),
                            _status(v),
                        ]
                        for v in found
                    ],
                    right=(1, 2),
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

    doc = {
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
                    "max_abs": number(v.max_abs),
                    "max_rel": number(v.max_rel),
                    "mismatched": v.mismatched,
                    "size": v.size,
                }
                for v in found
            ],
        }
    doc["differ"] = bool(diffs) or any(not v.equal for v in found or [])
    return doc

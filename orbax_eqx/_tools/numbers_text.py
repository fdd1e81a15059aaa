"""`inspect --params` and `inspect --stats`: the output, as text or JSON.

`--params` (nothing read but metadata): parameters per module subtree, then
per dtype. `--stats` (every array read, a piece at a time): the numbers in
each array leaf, then the same tables. With `--json`, one object:

    {"path", "step", "items": [{"path", "kind",
      "params": {"total", "arrays", "nbytes",
                 "nodes": [{"name", "depth", "class", "params", "nbytes"}],
                 "dtypes": [{"dtype", "arrays", "params", "nbytes"}]},
      "stats": [{"name", "path", "dtype", "shape", "size", "nan", "inf",
                 "zeros", "min", "max", "mean", "std", "l2", "keys", "error"}]
               or null without --stats}]}

Numbers that do not exist (a leaf without finite elements, PRNG keys, a leaf
that could not be read) are null.
"""

import argparse
import dataclasses
import json
import math
import os

from etils import epath

from .._errors import some
from .._tree.walk import display_path
from .inspect import Report, gather
from .params import Counts, counts
from .plain_items import PlainMetadata
from .progress import Progress
from .stats import LeafStats, leaf_stats
from .step_items import ORBAX_EQX, PLAIN, TYPED
from .text import human_bytes, table
from .tree_view import left_out_line
from .typed_items import TypedMetadata


def run(args: argparse.Namespace) -> int:
    """Runs `inspect --params` / `--stats`; exit status 1 if a leaf could not
    be read, else 0."""
    report = gather(args.path, args.best, args.mode)
    depth = args.depth
    found = []
    for saved in report.items:
        item = epath.Path(saved.directory)
        stats = None
        if args.stats:
            total = sum(r.nbytes for r in saved.leaves.values())
            with Progress("inspect --stats", total) as bar:
                stats = list(leaf_stats(item, saved, progress=bar.advance))
        found.append((saved, counts(saved, depth), stats))
    if args.json:
        print(json.dumps(_json(report, found), indent=2, ensure_ascii=False))
    else:
        print(_text(report, found), end="")
    bad = any(s.error for _, _, stats in found for s in stats or [])
    return 1 if bad else 0


def _kind(saved) -> str:
    if isinstance(saved, PlainMetadata):
        return PLAIN
    return TYPED if isinstance(saved, TypedMetadata) else ORBAX_EQX


def _text(report: Report, found) -> str:
    parts = []
    if report.step is not None:
        parts.append(
            f"CheckpointManager root {report.path}: showing the latest step, "
            f"{report.step}.\n"
        )
    for saved, count, stats in found:
        lines = [f"Checkpoint {saved.directory} ({_kind(saved)} item)", ""]
        if stats is not None:
            lines += _stats_lines(stats) + [""]
        lines += _count_lines(count)
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.4g}"


def _stats_lines(stats: list[LeafStats]) -> list[str]:
    header = ["min", "max", "mean", "std", "L2", "zeros", "nan", "inf", "dtype"]
    rows = []
    for s in stats:
        counts_ = [str(s.zeros), str(s.nan), str(s.inf)]
        if s.keys or s.error:
            counts_ = ["-", "-", "-"]
        rows.append(
            [_num(s.min), _num(s.max), _num(s.mean), _num(s.std), _num(s.l2)]
            + counts_
            + [s.dtype, display_path(s.name)]
        )
    nonfinite = [s for s in stats if s.nan or s.inf]
    lines = [
        f"Values of {_count(len(stats), 'array')} (over their finite elements; "
        "read, not "
        "checked: `verify` checks them):",
        # The name last: the numbers line up whatever its length.
        table([*header, "name"], rows, right=tuple(range(8))),
    ]
    if nonfinite:
        lines.append(
            f"Not finite: {len(nonfinite)} array(s) hold NaN or Inf: "
            + some([display_path(s.name) for s in nonfinite], 10)
            + "."
        )
    keys = [s for s in stats if s.keys]
    if keys:
        lines.append(
            f"Typed PRNG keys ({len(keys)} array(s)) hold no numbers: counted only."
        )
    for s in stats:
        if s.error:
            lines.append(f"CANNOT READ {display_path(s.name)}: {s.error}")
    return lines


def _count_lines(count: Counts) -> list[str]:
    total = count.total or 1
    rows = [
        [
            ("  " * n.depth) + (display_path(n.name).rsplit(".", 1)[-1] or "<root>")
            if n.name
            else "<root>",
            n.cls,
            f"{n.params:,}",
            human_bytes(n.nbytes),
            f"{100 * n.params / total:.1f}%",
        ]
        for n in count.nodes
    ]
    dtypes = [
        [
            d.dtype,
            str(d.arrays),
            f"{d.params:,}",
            human_bytes(d.nbytes),
            f"{100 * d.nbytes / (count.nbytes or 1):.1f}%",
        ]
        for d in count.dtypes
    ]
    return [
        f"Parameters: {count.total:,} in {_count(count.arrays, 'array')} "
        f"({human_bytes(count.nbytes)}; tied weights once).",
        table(["subtree", "class", "params", "bytes", "share"], rows, right=(2, 3, 4)),
        *([left_out_line(count.left_out)] if count.left_out else []),
        "",
        "By dtype:",
        table(
            ["dtype", "arrays", "params", "bytes", "share"], dtypes, right=(1, 2, 3, 4)
        )
        if dtypes
        else "  (no arrays)",
    ]


def _finite(x: float | None):
    return x if x is None or math.isfinite(x) else None


def _json(report: Report, found) -> dict:
    items = []
    for saved, count, stats in found:
        items.append(
            {
                "path": saved.directory,
                "kind": _kind(saved),
                "params": {
                    "total": count.total,
                    "arrays": count.arrays,
                    "nbytes": count.nbytes,
                    "nodes": [
                        {
                            "name": n.name,
                            "depth": n.depth,
                            "class": n.cls or None,
                            "params": n.params,
                            "nbytes": n.nbytes,
                        }
                        for n in count.nodes
                    ],
                    "dtypes": [dataclasses.asdict(d) for d in count.dtypes],
                },
                "stats": None
                if stats is None
                else [
                    dataclasses.asdict(s)
                    | {
                        "shape": list(s.shape),
                        **{
                            k: _finite(getattr(s, k))
                            for k in ("min", "max", "mean", "std", "l2")
                        },
                    }
                    for s in stats
                ],
            }
        )
    return {"path": os.fspath(report.path), "step": report.step, "items": items}

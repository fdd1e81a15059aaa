"""`inspect`'s text output: steps of a manager root, then each item as a tree
(or, with `flat=True`, one row per leaf name and one per module)."""

import json
from typing import Any

from .._format.sidecar import ALIAS, Metadata
from .._tree.names import label
from .._tree.values import describe
from .._tree.walk import ARRAY, display_path
from . import plain_text
from .inspect import Report, rebuild_plan, totals
from .plain_items import PlainMetadata
from .text import cut, human_bytes, table
from .tree_view import build as build_tree
from .tree_view import left_out_line, rows_of, type_text, value_text
from .typed_items import TypedMetadata


def to_text(report: Report, flat: bool = False, every: bool = False) -> str:
    """The report as text for a person: a tree of modules and leaves, or with
    `flat=True` one row per leaf (by leaf name) and one per module. In the
    tree, runs of alike list items are folded unless `every`
    (`tree_view.FOLD`)."""
    parts = []
    if report.steps:
        best = report.best.step if report.best else None
        rows = [
            [str(s.step), _metrics_text(s.metrics), _marks(s.step, best, report.step)]
            for s in report.steps
        ]
        note = ""
        if report.best:
            word = "lowest" if report.best.mode == "min" else "highest"
            note = f" The best step has the {word} {report.best.metric}."
        parts.append(
            f"CheckpointManager root {report.path}: {len(report.steps)} step(s)\n"
            + table(["step", "metrics", ""], rows, right=(0,))
            + f"\nShowing the latest step, {report.step}.{note}\n"
        )
    for saved, shardings in zip(report.items, report.shardings, strict=True):
        if isinstance(saved, PlainMetadata):
            parts.append(plain_text.item_text(saved, shardings, flat, every))
        else:
            parts.append(
                _item_text(saved) if flat else _tree_text(saved, shardings, every)
            )
    if report.others:
        parts.append(plain_text.others_text(report.others, report.step))
    return "\n".join(parts)


def _marks(step: int, best: int | None, latest: int | None) -> str:
    return ", ".join(
        word
        for word, hit in (("best", step == best), ("latest", step == latest))
        if hit
    )


def _tree_text(saved: Metadata, shardings: dict[str, str], every: bool) -> str:
    header = [
        "name",
        "type",
        "shape",
        "bytes",
        "stored in",
        "sharding",
        "value / static fields",
    ]
    tree = build_tree(saved)
    rows = rows_of(tree, saved, shardings, every)
    # A column with nothing in it (no arrays; no sharding recorded) is left out.
    empty = [i for i in (4, 5) if not any(r[i] for r in rows)]
    header = [h for i, h in enumerate(header) if i not in empty]
    rows = [[c for i, c in enumerate(r) if i not in empty] for r in rows]
    lines = [
        f"Checkpoint {saved.directory}",
        "",
        table(header, rows, right=(3,)) if rows else "  (no leaves)",
        *([left_out_line(tree.left_out)] if tree.left_out else []),
        "",
        _total_line(saved),
        _writer_line(saved),
        _rebuild_line(saved),
    ]
    return "\n".join(lines) + "\n"


def _item_text(saved: Metadata) -> str:
    rows = []
    for name, leaf in saved.leaves.items():
        if leaf.kind == ARRAY:
            shape, size = str(tuple(leaf.shape or ())), human_bytes(leaf.nbytes)
        else:
            shape, size = "-", "-"
        rows.append(
            [display_path(name), shape, type_text(leaf), size, cut(value_text(leaf))]
        )
    modules = [
        [
            display_path(name),
            m.cls,
            ", ".join(f"{k}={describe(v)}" for k, v in m.static.items()),
        ]
        for name, m in saved.modules.items()
    ]
    lines = [
        f"Checkpoint {saved.directory}",
        "",
        f"Leaves ({len(saved.leaves)}):",
        table(["name", "shape", "type", "bytes", "value"], rows, right=(3,)),
        "",
        f"Modules ({len(saved.modules)}):",
        table(["name", "class", "static fields"], modules) if modules else "  (none)",
        "",
        _total_line(saved),
        _writer_line(saved),
        _rebuild_line(saved),
    ]
    return "\n".join(lines) + "\n"


def _total_line(saved: Metadata) -> str:
    arrays, nbytes = totals(saved)
    tied = sum(leaf.data == ALIAS for leaf in saved.leaves.values())
    return (
        f"Total: {len(saved.leaves)} leaves, {arrays} arrays"
        + (f" (plus {tied} tied to another leaf)" if tied else "")
        + f", {human_bytes(nbytes)}."
    )


def _writer_line(saved: Metadata) -> str:
    versions = dict(saved.versions)
    writer = versions.pop("orbax_eqx", "unknown")
    others = ", ".join(f"{k} {v}" for k, v in versions.items())
    if isinstance(saved, TypedMetadata):
        return (
            f"Written through `oeqx.type_handler_registry()` by orbax_eqx {writer} "
            f"(index format {saved.format_version})"
            + (f" with {others}." if others else ".")
            + "\nOnly its jax arrays are shown: Orbax's own handler stored the "
            "other leaves, and reads them back."
        )
    return f"Written by orbax_eqx {writer} (sidecar format {saved.format_version})" + (
        f" with {others}." if others else "."
    )


def _rebuild_line(saved: Metadata) -> str:
    """What `restore(path, allow=...)` needs to rebuild the item, if it can,
    and the callables a rebuild would install."""
    plan = rebuild_plan(saved)
    if not plan["recorded"]:
        if saved.nodes is None:
            return (
                "Without a skeleton: not rebuildable (this sidecar records no tree "
                "structure; re-save to get one)."
            )
        return f"Without a skeleton: not rebuildable: {plan['why']}"
    if plan["cannot"]:
        first = plan["cannot"][0]
        more = len(plan["cannot"]) - 1
        return (
            "Without a skeleton: not rebuildable: "
            f"{label(first['name'], first['path'])}: {first['why']}"
            + (f" (and {more} more)" if more else "")
            + "; restore it into a skeleton."
        )
    line = f"Without a skeleton: restore with `allow={plan['allow']!r}` to rebuild it."
    if plan["callables"]:
        line += "\nCallables a rebuild installs: " + ", ".join(
            f"`{name}`" for name in plan["callables"]
        )
        line += "."
    return line


def _metrics_text(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "-"

    def one(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        return json.dumps(value)

    return ", ".join(f"{k}={one(v)}" for k, v in metrics.items())

"""`inspect`: what a checkpoint holds, told from its sidecar alone.

Nothing here reads array data: a leaf's shape, dtype and size, its Python value
or description, and each module's class and static fields all come from the
sidecar, and a CheckpointManager's metrics from the small JSON files Orbax
writes in each step directory.
"""

import dataclasses
import json
import math
import os
from typing import Any

from etils import epath

from ._locate import as_path, find_item, is_item, items_in, steps_in
from ._sidecar import ALIAS, EMPTY, PACKED, LeafMetadata, Metadata, read
from ._values import describe, scalar_type
from ._walk import ARRAY, NUMPY, NUMPY_SCALAR, SCALAR, SHARED, display_path

# Where Orbax keeps a step's metrics: the step metadata (newer Orbax), or the
# `metrics` item that CheckpointManager writes with its JSON handler (0.12.x).
_STEP_METADATA = "_CHECKPOINT_METADATA"
_METRICS_FILE = ("metrics", "metrics")

_MAX_VALUE = 72  # longer descriptions are cut in the text output
_MAX_NAME_PAD = 56  # longer names push their row out rather than widen every row


@dataclasses.dataclass(frozen=True)
class Step:
    """One finished step of a CheckpointManager root."""

    step: int
    path: epath.Path
    metrics: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `inspect` shows about a path."""

    path: epath.Path
    steps: list[Step]  # a CheckpointManager root's steps; empty otherwise
    step: int | None  # the step inspected, for a CheckpointManager root
    items: list[Metadata]


def gather(directory: str | os.PathLike) -> Report:
    """Reads the sidecars (and step metrics) of the checkpoint at `directory`.

    **Arguments:**

    - `directory`: an item directory, a step directory (every orbax_eqx item in
        it is inspected), or a CheckpointManager root (its latest step is).

    **Returns:** a `Report`. Raises `CheckpointNotFoundError` if `directory`
    holds no orbax_eqx checkpoint, `SidecarError` if a sidecar is damaged.
    """
    path = as_path(directory)
    if path.is_dir() and not is_item(path):
        items = items_in(path)
        if items:
            return Report(path, [], None, [read(p) for p in items])
        found = steps_in(path)
        if found:
            steps = [Step(n, p, _metrics(p)) for n, p in found]
            latest, latest_path = found[-1]
            return Report(path, steps, latest, [read(p) for p in items_in(latest_path)])
    # An item, or nothing we know: `find_item` raises the error that says which.
    return Report(path, [], None, [read(find_item(path))])


def _metrics(step_dir: epath.Path) -> dict[str, Any] | None:
    # Plain JSON reads: metrics are a nicety, so a missing or odd file is
    # skipped rather than reported.
    sources = (
        (step_dir / _STEP_METADATA, "metrics"),
        (step_dir.joinpath(*_METRICS_FILE), None),
    )
    for file, key in sources:
        try:
            content = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if key is not None and isinstance(content, dict):
            content = content.get(key)
        if isinstance(content, dict) and content:
            return content
    return None


# ---------------------------------------------------------------- JSON output


def to_json(report: Report) -> dict[str, Any]:
    """The report as a JSON document (see `python -m orbax_eqx inspect --help`)."""
    return {
        "path": os.fspath(report.path),
        "steps": [
            {"step": s.step, "path": os.fspath(s.path), "metrics": _finite(s.metrics)}
            for s in report.steps
        ],
        "step": report.step,
        "items": [_item_json(m) for m in report.items],
    }


def _item_json(saved: Metadata) -> dict[str, Any]:
    leaves = {}
    for name, leaf in saved.leaves.items():
        record: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind}
        if leaf.kind == ARRAY:
            record.update(
                shape=list(leaf.shape or ()),
                dtype=leaf.dtype,
                nbytes=leaf.nbytes,
                container=leaf.container,
                data=leaf.data,
            )
            if leaf.data == ALIAS:
                record["alias_of"] = leaf.alias_of
            elif leaf.data == PACKED:
                record.update(pack=leaf.pack, offset=leaf.offset)
        else:
            record.update(type=_type(leaf), value=leaf.value, text=_value(leaf))
        leaves[name] = record
    modules = {
        name: {
            "path": m.path,
            "class": m.cls,
            "static": m.static,
            "static_text": {k: describe(v) for k, v in m.static.items()},
        }
        for name, m in saved.modules.items()
    }
    arrays, nbytes = _totals(saved)
    return {
        "path": saved.directory,
        "format_version": saved.format_version,
        "versions": saved.versions,
        "packs": [{"file": p.file, "nbytes": p.nbytes} for p in saved.packs],
        "leaves": leaves,
        "modules": modules,
        "totals": {"leaves": len(saved.leaves), "arrays": arrays, "nbytes": nbytes},
    }


def _finite(value: Any) -> Any:
    # Metrics may hold nan or inf, which strict JSON cannot; say them as text.
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------- text output


def to_text(report: Report) -> str:
    """The report as text for a person: one row per leaf and per module."""
    parts = []
    if report.steps:
        rows = [[str(s.step), _metrics_text(s.metrics)] for s in report.steps]
        parts.append(
            f"CheckpointManager root {report.path}: {len(report.steps)} step(s)\n"
            + _table(["step", "metrics"], rows, right=(0,))
            + f"\nShowing the latest step, {report.step}.\n"
        )
    parts += [_item_text(saved) for saved in report.items]
    return "\n".join(parts)


def _item_text(saved: Metadata) -> str:
    rows = []
    for name, leaf in saved.leaves.items():
        if leaf.kind == ARRAY:
            shape, size = str(tuple(leaf.shape or ())), human_bytes(leaf.nbytes)
        else:
            shape, size = "-", "-"
        rows.append([display_path(name), shape, _type(leaf), size, _cut(_value(leaf))])
    modules = [
        [
            display_path(name),
            m.cls,
            ", ".join(f"{k}={describe(v)}" for k, v in m.static.items()),
        ]
        for name, m in saved.modules.items()
    ]
    arrays, nbytes = _totals(saved)
    tied = sum(leaf.data == ALIAS for leaf in saved.leaves.values())
    versions = dict(saved.versions)
    writer = versions.pop("orbax_eqx", "unknown")
    others = ", ".join(f"{k} {v}" for k, v in versions.items())
    lines = [
        f"Checkpoint {saved.directory}",
        "",
        f"Leaves ({len(saved.leaves)}):",
        _table(["name", "shape", "type", "bytes", "value"], rows, right=(3,)),
        "",
        f"Modules ({len(saved.modules)}):",
        _table(["name", "class", "static fields"], modules) if modules else "  (none)",
        "",
        f"Total: {len(saved.leaves)} leaves, {arrays} arrays"
        + (f" (plus {tied} tied to another leaf)" if tied else "")
        + f", {human_bytes(nbytes)}.",
        f"Written by orbax_eqx {writer} (sidecar format {saved.format_version})"
        + (f" with {others}." if others else "."),
    ]
    return "\n".join(lines) + "\n"


def _totals(saved: Metadata) -> tuple[int, int]:
    """Arrays and their bytes, counting tied weights once, as they are stored."""
    stored = [
        leaf
        for leaf in saved.leaves.values()
        if leaf.kind == ARRAY and leaf.data != ALIAS
    ]
    return len(stored), sum(leaf.nbytes for leaf in stored)


def _type(leaf: LeafMetadata) -> str:
    if leaf.kind == ARRAY:
        return str(leaf.dtype)
    if leaf.kind == SCALAR:
        return scalar_type(leaf.value) or SCALAR
    return leaf.kind


def _value(leaf: LeafMetadata) -> str:
    if leaf.kind == ARRAY:
        notes = []
        if leaf.container == NUMPY:
            notes.append("numpy array")
        elif leaf.container == NUMPY_SCALAR:
            notes.append("numpy scalar")
        if leaf.data == EMPTY:
            notes.append("zero-size")
        elif leaf.data == ALIAS:
            notes.append(f"same array as {leaf.alias_of}")
        return ", ".join(notes)
    if leaf.kind == SHARED:
        return "placeholder for a node tied by eqx.nn.Shared"
    return describe(leaf.value)


def _metrics_text(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "-"

    def one(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        return json.dumps(value)

    return ", ".join(f"{k}={one(v)}" for k, v in metrics.items())


def human_bytes(n: int) -> str:
    """`n` bytes in binary units: `512 B`, `1.5 KiB`, `3.0 GiB`."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1023.95:
            break
    return f"{value:.1f} {unit}"


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def _table(
    header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()
) -> str:
    """Indented columns; the last column is never padded, so lines end cleanly."""
    widths = [
        min(max(len(r[i]) for r in [header, *rows]), _MAX_NAME_PAD)
        for i in range(len(header))
    ]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths))
        ]
        lines.append(("  " + "  ".join([*cells, row[-1]])).rstrip())
    return "\n".join(lines)

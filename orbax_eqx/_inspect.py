"""`inspect`: what a checkpoint holds, told from its sidecar alone.

Nothing here reads array data: a leaf's shape, dtype and size, its Python value
or description, and each module's class and static fields all come from the
sidecar; the sharding an array was saved with from Orbax's own metadata; and a
CheckpointManager's metrics from the small JSON files Orbax writes in each step
directory.
"""

import dataclasses
import json
import math
import os
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from ._format import cut, human_bytes, table
from ._locate import as_path, find_item, is_item, items_in, steps_in
from ._names import storage_key
from ._sidecar import ALIAS, EMPTY, STORED, LeafMetadata, Metadata, read
from ._tree_view import rows as tree_rows
from ._values import describe, scalar_type
from ._walk import ARRAY, NUMPY, NUMPY_SCALAR, SCALAR, SHARED, display_path

# Where Orbax keeps a step's metrics: the step metadata (newer Orbax), or the
# `metrics` item that CheckpointManager writes with its JSON handler (0.12.x).
_STEP_METADATA = "_CHECKPOINT_METADATA"
_METRICS_FILE = ("metrics", "metrics")


@dataclasses.dataclass(frozen=True)
class Step:
    """One finished step of a CheckpointManager root."""

    step: int
    path: epath.Path
    metrics: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Best:
    """The best step of a CheckpointManager root by one metric."""

    step: int
    metric: str
    mode: str  # "min" or "max"


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `inspect` shows about a path."""

    path: epath.Path
    steps: list[Step]  # a CheckpointManager root's steps; empty otherwise
    step: int | None  # the step inspected, for a CheckpointManager root
    items: list[Metadata]
    shardings: list[dict[str, str]]  # per item: leaf name -> saved sharding
    best: Best | None = None


def gather(
    directory: str | os.PathLike, best_metric: str = "loss", best_mode: str = "min"
) -> Report:
    """Reads the sidecars (and step metrics) of the checkpoint at `directory`.

    **Arguments:**

    - `directory`: an item directory, a step directory (every orbax_eqx item in
        it is inspected), or a CheckpointManager root (its latest step is).
    - `best_metric`, `best_mode`: on a CheckpointManager root, the best step is
        the one whose metric `best_metric` is lowest (`"min"`) or highest
        (`"max"`). Orbax does not record its `best_fn`, so this is asked.

    **Returns:** a `Report`. Raises `CheckpointNotFoundError` if `directory`
    holds no orbax_eqx checkpoint, `SidecarError` if a sidecar is damaged.
    """
    path = as_path(directory)
    steps: list[Step] = []
    step = best = None
    items = None
    if path.is_dir() and not is_item(path):
        items = items_in(path)
        found = [] if items else steps_in(path)
        if found:
            steps = [Step(n, p, _metrics(p)) for n, p in found]
            step, latest_path = found[-1]
            items = items_in(latest_path)
            best = _best(steps, best_metric, best_mode)
    # An item, or nothing we know: `find_item` raises the error that says which.
    items = items or [find_item(path)]
    saved = [read(p) for p in items]
    shardings = [saved_shardings(p, m) for p, m in zip(items, saved)]
    return Report(path, steps, step, saved, shardings, best)


def _best(steps: list[Step], metric: str, mode: str) -> Best | None:
    scored = [
        (s.metrics[metric], s.step)
        for s in steps
        if s.metrics
        and isinstance(s.metrics.get(metric), int | float)
        and not isinstance(s.metrics.get(metric), bool)
        and math.isfinite(s.metrics[metric])
    ]
    if not scored:
        return None
    # Ties go to the latest step, the one CheckpointManager would keep.
    if mode == "min":
        _, step = min(scored, key=lambda v: (v[0], -v[1]))
    else:
        _, step = max(scored)
    return Best(step, metric, mode)


def saved_shardings(directory: epath.Path, saved: Metadata) -> dict[str, str]:
    """The sharding each array was saved with, as Orbax recorded it, as text.

    A nicety: leaves Orbax recorded nothing for are left out, and a checkpoint
    whose Orbax metadata cannot be read gives `{}`.
    """
    if not any(leaf.data == STORED for leaf in saved.leaves.values()):
        return {}
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(directory).tree
    except Exception:  # any failure here only costs the sharding column
        return {}
    finally:
        handler.close()
    if not isinstance(tree, dict):
        return {}
    result = {}
    for name, leaf in saved.leaves.items():
        source = leaf.alias_of if leaf.data == ALIAS else name
        if leaf.data in (STORED, ALIAS):
            text = _sharding_text(
                getattr(tree.get(storage_key(source)), "sharding", None)
            )
            if text:
                result[name] = text
    return result


def _sharding_text(sharding) -> str:
    if sharding is None:
        return ""
    device = getattr(sharding, "device_str", None)
    if device is not None:
        return str(device)
    spec = getattr(sharding, "partition_spec", None)
    axes = getattr(sharding, "axis_names", None)
    shape = getattr(sharding, "shape", None)
    if spec is not None and axes is not None and shape is not None:
        parts = ", ".join(
            repr(p) if not isinstance(p, list) else repr(tuple(p)) for p in spec
        )
        mesh = ", ".join(f"{a}={int(n)}" for a, n in zip(axes, list(shape)))
        return f"P({parts}) over {mesh}"
    return type(sharding).__name__


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
        "latest": report.steps[-1].step if report.steps else None,
        "best": dataclasses.asdict(report.best) if report.best else None,
        "items": [_item_json(m, s) for m, s in zip(report.items, report.shardings)],
    }


def _item_json(saved: Metadata, shardings: dict[str, str]) -> dict[str, Any]:
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
            if name in shardings:
                record["sharding"] = shardings[name]
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


def to_text(report: Report, flat: bool = False) -> str:
    """The report as text for a person: a tree of modules and leaves, or with
    `flat=True` one row per leaf (by leaf name) and one per module."""
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
    for saved, shardings in zip(report.items, report.shardings):
        parts.append(_item_text(saved) if flat else _tree_text(saved, shardings))
    return "\n".join(parts)


def _marks(step: int, best: int | None, latest: int | None) -> str:
    return ", ".join(
        word
        for word, hit in (("best", step == best), ("latest", step == latest))
        if hit
    )


def _tree_text(saved: Metadata, shardings: dict[str, str]) -> str:
    header = [
        "name",
        "type",
        "shape",
        "bytes",
        "saved sharding",
        "value / static fields",
    ]
    rows = tree_rows(saved, shardings)
    if not shardings:  # nothing recorded: no empty column
        header.pop(4)
        rows = [r[:4] + r[5:] for r in rows]
    lines = [
        f"Checkpoint {saved.directory}",
        "",
        table(header, rows, right=(3,)) if rows else "  (no leaves)",
        "",
        _total_line(saved),
        _writer_line(saved),
    ]
    return "\n".join(lines) + "\n"


def _item_text(saved: Metadata) -> str:
    rows = []
    for name, leaf in saved.leaves.items():
        if leaf.kind == ARRAY:
            shape, size = str(tuple(leaf.shape or ())), human_bytes(leaf.nbytes)
        else:
            shape, size = "-", "-"
        rows.append([display_path(name), shape, _type(leaf), size, cut(_value(leaf))])
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
    ]
    return "\n".join(lines) + "\n"


def _total_line(saved: Metadata) -> str:
    arrays, nbytes = _totals(saved)
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
    return f"Written by orbax_eqx {writer} (sidecar format {saved.format_version})" + (
        f" with {others}." if others else "."
    )


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

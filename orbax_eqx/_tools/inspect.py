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

from .._bytes.route import read_bounded
from .._errors import OrbaxEqxError
from .._format.locate import as_path
from .._format.sidecar import ALIAS, PACKED, SHARDS, STORED, Metadata, arrays_dir
from .._orbax.type_restore import sharding_metadata
from .._rebuild import build as _rebuild
from .._storage.orbax_store.files import check as check_store_files
from .._tree.values import describe
from .._tree.walk import ARRAY, JAX
from . import plain_text
from . import step_items as _items
from . import typed_items as _typed
from .plain_items import PlainMetadata
from .sharding_text import sharding_text as _sharding_text
from .step_items import OtherItem
from .tree_view import type_text, value_text

# Where Orbax keeps a step's metrics: the step metadata (newer Orbax), or the
# `metrics` item that CheckpointManager writes with its JSON handler (0.12.x).
_STEP_METADATA = "_CHECKPOINT_METADATA"
_METRICS_FILE = ("metrics", "metrics")
_METRICS_MAX = 16 << 20  # bytes read of a metrics file, at most


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
    # The shown step's items that are none of ours or plain Orbax's (a JSON
    # item, a data loader's state): listed, not read.
    others: list[OtherItem] = dataclasses.field(default_factory=list)


def gather(
    directory: str | os.PathLike, best_metric: str = "loss", best_mode: str = "min"
) -> Report:
    """Reads the sidecars (and step metrics) of the checkpoint at `directory`.

    **Arguments:**

    - `directory`: an item directory, a step directory (every item in it is
        inspected: orbax_eqx items, and plain Orbax ones from Orbax's own
        metadata; the others are listed by name), or a CheckpointManager root
        (its latest step is).
    - `best_metric`, `best_mode`: on a CheckpointManager root, the best step is
        the one whose metric `best_metric` is lowest (`"min"`) or highest
        (`"max"`). Orbax does not record its `best_fn`, so this is asked.

    **Returns:** a `Report`. Raises `CheckpointNotFoundError` if `directory`
    holds no orbax_eqx checkpoint, `SidecarError` if a sidecar is damaged.
    """
    path = as_path(directory)
    steps: list[Step] = []
    step = best = None
    found = _items.items_under(path)
    numbers = sorted({n for n, _ in found if n is not None})
    shown = path  # the step whose other items are listed
    if numbers:
        where = {n: p.parent for n, p in found if n is not None}
        steps = [Step(n, where[n], _metrics(where[n])) for n in numbers]
        step = numbers[-1]
        best = _best(steps, best_metric, best_mode)
        shown = where[step]
    items = [p for n, p in found if n == step]
    saved = [_items.read(p) for p in items]
    shardings = [saved_shardings(p, m) for p, m in zip(items, saved, strict=True)]
    others = _items.others_in(shown) if _items.kind_of(shown) is None else []
    return Report(path, steps, step, saved, shardings, best, others)


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
    whose Orbax metadata cannot be read gives `{}`. Packed jax arrays were
    saved unsharded (on one device, or fully replicated: the sidecar does not
    say which): they say `unsharded`. Where the bytes are is the sidecar's
    `data`, not a sharding.
    """
    if isinstance(saved, _typed.TypedMetadata):
        return _typed_shardings(saved)
    if isinstance(saved, PlainMetadata):  # Orbax's own record, read already
        return {n: r.sharding for n, r in saved.leaves.items() if r.sharding}
    packed, sharded, stored = {}, {}, False
    leaves = saved.leaves
    for name, leaf in leaves.items():  # (one pass: `Metadata.source` written out)
        data = leaf.data
        source = leaf
        if data == ALIAS and leaf.alias_of is not None:
            source = leaves[leaf.alias_of]
        if leaf.container == JAX and source.data == PACKED:
            packed[name] = "unsharded"
        elif source.data == SHARDS and source.sharding:
            sharded[name] = source.sharding  # recorded by the save itself
        stored = stored or data == STORED
    packed.update(sharded)
    if not stored:
        return packed
    handler = ocp.PyTreeCheckpointHandler()
    try:
        store = arrays_dir(directory, saved.token)
        check_store_files(store)  # Orbax's read would block on a FIFO there
        tree = handler.metadata(store).tree
    except Exception:  # any failure here only costs the sharding column
        return packed
    finally:
        handler.close()
    if not isinstance(tree, dict):
        return packed
    result = packed
    for name, leaf in saved.leaves.items():
        source = saved.source(leaf)
        if leaf.data in (STORED, ALIAS) and source.key is not None:
            text = _sharding_text(getattr(tree.get(source.key), "sharding", None))
            if text:
                result[name] = text
    return result


def _typed_shardings(saved: "_typed.TypedMetadata") -> dict[str, str]:
    """Shardings as the type handler's indexes record them (Orbax's sharding
    metadata), as text; packed leaves were saved unsharded."""
    result = {}
    for group in saved.groups:
        for name, leaf in group.saved.leaves.items():
            if leaf.data == PACKED:
                result[name] = "unsharded"
                continue
            try:
                text = _sharding_text(sharding_metadata(group.shardings.get(name)))
            except Exception:  # a nicety: an odd entry only costs the column
                text = ""
            if text:
                result[name] = text
    return result


def _metrics(step_dir: epath.Path) -> dict[str, Any] | None:
    # Plain JSON reads: metrics are a nicety, so a missing or odd file is
    # skipped rather than reported.
    sources = (
        (step_dir / _STEP_METADATA, "metrics"),
        (step_dir.joinpath(*_METRICS_FILE), None),
    )
    for file, key in sources:
        try:
            # Bounded, and never from a FIFO or a device (which would block).
            content = json.loads(read_bounded(file, _METRICS_MAX))
        except (OSError, ValueError, RecursionError):
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
        "items": [
            _item_json(m, s)
            for m, s in zip(report.items, report.shardings, strict=True)
        ],
        "others": plain_text.others_json(report.others),
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
            elif leaf.data == PACKED:
                record.update(pack=leaf.pack, offset=leaf.offset)
            if name in shardings:
                record["sharding"] = shardings[name]
        else:
            record.update(type=type_text(leaf), value=leaf.value, text=value_text(leaf))
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
    arrays, nbytes = totals(saved)
    if isinstance(saved, PlainMetadata):
        return {
            "path": saved.directory,
            **plain_text.item_json(saved),
            "leaves": leaves,
            "totals": {"leaves": len(saved.leaves), "arrays": arrays, "nbytes": nbytes},
        }
    return {
        "path": saved.directory,
        "kind": _items.TYPED
        if isinstance(saved, _typed.TypedMetadata)
        else _items.ORBAX_EQX,
        "rebuild": rebuild_plan(saved),
        "format_version": saved.format_version,
        "versions": saved.versions,
        "packs": [{"file": p.file, "nbytes": p.nbytes} for p in saved.packs],
        "leaves": leaves,
        "modules": modules,
        "totals": {"leaves": len(saved.leaves), "arrays": arrays, "nbytes": nbytes},
    }


def rebuild_plan(saved: Metadata) -> dict[str, Any]:
    """Whether `restore(path, allow=...)` can rebuild the item without a
    skeleton, and what to allow: read from the sidecar, importing nothing.

    `{"recorded": bool, "allow": [modules], "callables": [names],
    "cannot": [{"name", "path", "why"}]}` (`name` the leaf name, `path` the
    leaf path; `callables` every function or class a rebuild would install
    as a callable, by qualified name: anything an allowed module holds can
    be); `recorded` is False for sidecars that do not record the tree
    (format < 5) or whose records of it cannot be rebuilt, with `why`.
    """
    try:
        found = _rebuild.needs(saved)
    except OrbaxEqxError as e:  # no structure recorded, or a damaged one
        return {
            "recorded": False,
            "allow": [],
            "callables": [],
            "cannot": [],
            "why": str(e),
        }
    return {
        "recorded": True,
        "allow": _rebuild.modules_to_allow(found.names),
        "callables": found.callables,
        "cannot": [{"name": n, "path": p, "why": why} for n, p, why in found.cannot],
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


def totals(saved: Metadata) -> tuple[int, int]:
    """Arrays and their bytes, counting tied weights once, as they are stored."""
    stored = [
        leaf
        for leaf in saved.leaves.values()
        if leaf.kind == ARRAY and leaf.data != ALIAS
    ]
    return len(stored), sum(leaf.nbytes for leaf in stored)

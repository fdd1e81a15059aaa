"""`inspect`: what a checkpoint holds, from its metadata alone (safetensors:
`safetensors_files`; `--params` and `--stats`: `stats`)."""

import argparse
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
from .._orbax import items as _items
from .._orbax.plain import PlainMetadata, sharding_text
from .._orbax.type_restore import sharding_metadata
from .._rebuild import build as _rebuild
from .._storage import shared as _shared
from .._storage.orbax_store.files import check as check_store_files
from .._storage.sharded.index_read import read_all
from .._tree.names import label
from .._tree.values import describe
from .._tree.walk import ARRAY, JAX, display_path
from . import stats
from .render import (
    Tree,
    count,
    cut,
    handler_text,
    human_bytes,
    table,
    type_text,
    value_text,
)

# Where Orbax keeps a step's metrics: the step metadata (newer Orbax), or the
# `metrics` item CheckpointManager writes with its JSON handler (0.12.x).
_METRICS = (("_CHECKPOINT_METADATA",), ("metrics", "metrics"))
_METRICS_MAX = 16 << 20  # bytes read of a metrics file, at most


@dataclasses.dataclass(frozen=True)
class Report:
    """What a path holds: a root's steps (`(step, path, metrics)`), the step
    shown (the latest of a root, else None), its items with the sharding of
    each array as text, the best step by one metric, and other items."""

    path: epath.Path
    steps: list[tuple[int, epath.Path, dict | None]]
    step: int | None
    items: list[Metadata]
    shardings: list[dict[str, str]]
    best: tuple[int, str, str] | None  # (step, metric, "min" or "max")
    others: list[_items.OtherItem]


def run(args: argparse.Namespace) -> int:
    if args.skeleton or args.mapping:
        raise OrbaxEqxError(
            f"--skeleton and --mapping line safetensors up with a skeleton, and "
            f"{as_path(args.path)} holds no safetensors file. Give a .safetensors "
            "file, a directory of them or an index; `diff` compares a checkpoint "
            "with a skeleton."
        )
    report = gather(args.path, args.best, args.mode)
    if args.params or args.stats:
        return stats.run(args, report)
    if args.json:
        print(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    else:
        print(to_text(report, args.flat, args.every), end="")
    return 0


def gather(directory: str, best_metric: str = "loss", mode: str = "min") -> Report:
    """The metadata of every item `directory` names (`items.items_under`); for
    a root, its steps with their metrics and the latest step's items."""
    path = as_path(directory)
    found = _items.items_under(path)
    numbers = sorted({n for n, _ in found if n is not None})
    where = {n: p.parent for n, p in found if n is not None}
    steps = [(n, where[n], _metrics(where[n])) for n in numbers]
    step = numbers[-1] if numbers else None
    items = [p for n, p in found if n == step]
    saved = [_items.read(p) for p in items]
    shown = where[step] if step is not None else path
    others = _items.others_in(shown) if _items.kind_of(shown) is None else []
    return Report(
        path,
        steps,
        step,
        saved,
        [saved_shardings(p, m) for p, m in zip(items, saved, strict=True)],
        _best(steps, best_metric, mode),
        others,
    )


def _best(steps, metric: str, mode: str) -> tuple[int, str, str] | None:
    scored = [
        (m[metric], n)
        for n, _, m in steps
        if m and type(m.get(metric)) in (int, float) and math.isfinite(m[metric])
    ]
    if not scored:
        return None
    # Ties go to the latest step, the one CheckpointManager would keep.
    best = min(scored, key=lambda v: (v[0], -v[1])) if mode == "min" else max(scored)
    return best[1], metric, mode


def _metrics(step_dir: epath.Path) -> dict[str, Any] | None:
    # A nicety: a missing or odd file is skipped. Bounded, and never read
    # from a FIFO or a device.
    for parts in _METRICS:
        try:
            content = json.loads(read_bounded(step_dir.joinpath(*parts), _METRICS_MAX))
        except (OSError, ValueError, RecursionError, OrbaxEqxError):
            continue
        if len(parts) == 1 and isinstance(content, dict):
            content = content.get("metrics")
        if isinstance(content, dict) and content:
            return content
    return None


def saved_shardings(directory: epath.Path, saved: Metadata) -> dict[str, str]:
    """The sharding each array was saved with, as text (a nicety: leaves with
    none recorded are left out). Packed jax arrays were saved on one device
    or fully replicated (the sidecar does not say which): `unsharded`."""
    if isinstance(saved, PlainMetadata):
        return {n: r.sharding for n, r in saved.leaves.items() if r.sharding}
    if isinstance(saved, _items.TypedMetadata):
        return _typed_shardings(saved)
    result: dict[str, str] = {}
    for name, leaf in saved.leaves.items():
        source = saved.source(leaf)
        if leaf.container == JAX and source.data == PACKED:
            result[name] = "unsharded"
        elif source.data == SHARDS and source.sharding:
            result[name] = source.sharding
    if any(r.data == STORED for r in saved.leaves.values()):
        result |= _stored_shardings(directory, saved)
    return result


def _stored_shardings(directory: epath.Path, saved: Metadata) -> dict[str, str]:
    """Orbax's record of the sharding of each array in its store."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        store = arrays_dir(directory, saved.token)
        check_store_files(store)  # Orbax's read would block on a FIFO there
        tree = handler.metadata(store).tree
    except Exception:  # any failure here only costs the sharding column
        return {}
    finally:
        handler.close()
    found = {}
    for name, leaf in saved.leaves.items() if isinstance(tree, dict) else ():
        key = saved.source(leaf).key
        if leaf.data in (STORED, ALIAS) and key is not None:
            found[name] = sharding_text(getattr(tree.get(key), "sharding", None))
    return {n: text for n, text in found.items() if text}


def _typed_shardings(saved: _items.TypedMetadata) -> dict[str, str]:
    result = {}
    for group in saved.groups:
        for name, leaf in group.saved.leaves.items():
            try:
                text = (
                    "unsharded"
                    if leaf.data == PACKED
                    else sharding_text(sharding_metadata(group.shardings.get(name)))
                )
            except Exception:  # a nicety: an odd entry only costs the column
                text = ""
            if text:
                result[name] = text
    return result


def totals(saved: Metadata) -> tuple[int, int]:
    """Arrays and their bytes, counting tied weights once, as they are stored."""
    stored = [r for r in saved.leaves.values() if r.kind == ARRAY and r.data != ALIAS]
    return len(stored), sum(r.nbytes for r in stored)


# ---------------------------------------------------------------- text


def to_text(report: Report, flat: bool = False, every: bool = False) -> str:
    parts = []
    if report.steps:
        best = report.best[0] if report.best else None
        rows = [
            [str(n), _metrics_text(m), ", ".join(_marks(n, best, report.step))]
            for n, _, m in report.steps
        ]
        note = ""
        if report.best:
            word = "lowest" if report.best[2] == "min" else "highest"
            note = f" The best step has the {word} {report.best[1]}."
        parts.append(
            f"CheckpointManager root {report.path}: {len(report.steps)} step(s)\n"
            + table(["step", "metrics", ""], rows, right=(0,))
            + f"\nShowing the latest step, {report.step}.{note}\n"
        )
    for saved, shardings in zip(report.items, report.shardings, strict=True):
        parts.append(_item_text(saved, shardings, flat, every))
    if report.others:
        listed = ", ".join(
            f"{o.name} ({handler_text(o.handler)})" for o in report.others
        )
        where = f"step {report.step}" if report.step is not None else "this step"
        parts.append(
            f"Other items of {where}, not read (neither orbax_eqx nor plain Orbax "
            f"PyTree items): {listed}.\n"
        )
    return "\n".join(parts)


def _marks(step: int, best: int | None, latest: int | None) -> list[str]:
    return [w for w, hit in (("best", step == best), ("latest", step == latest)) if hit]


def _metrics_text(metrics: dict[str, Any] | None) -> str:
    def one(v: Any) -> str:
        return f"{v:.6g}" if isinstance(v, float) else json.dumps(v)

    return ", ".join(f"{k}={one(v)}" for k, v in metrics.items()) if metrics else "-"


def _item_text(saved: Metadata, shardings: dict[str, str], flat: bool, every: bool):
    plain = isinstance(saved, PlainMetadata)
    lines = [f"Checkpoint {saved.directory}", ""]
    if isinstance(saved, PlainMetadata):
        layout = f"{'' if saved.ocdbt else 'no '}OCDBT, zarr v{3 if saved.zarr3 else 2}"
        lines[:1] = [
            f"Plain Orbax checkpoint {saved.directory}",
            f"Written by {handler_text(saved.handler)}; arrays stored with {layout}.",
        ]
    tree = Tree(saved)
    if not flat:
        last = "value" if plain else "value / static fields"
        header = ["name", "type", "shape", "bytes", "stored in", "sharding", last]
        shown = _table(
            header, tree.rows(shardings, every), {"stored in"} if plain else ()
        )
        lines += [shown or "  (no leaves)", *tree.left_out_line()]
    else:
        header = ["name", "shape", "type", "bytes", "sharding", "value"]
        rows = [_flat_row(n, r, shardings) for n, r in saved.leaves.items()]
        shown = _table(header, rows, () if plain else {"sharding"})
        lines += (
            [shown or "  (no arrays)"]
            if plain
            else [f"Leaves ({len(saved.leaves)}):", shown, "", *_modules(saved)]
        )
    return "\n".join([*lines, "", *_trailer(saved)]) + "\n"


def _table(header: list[str], rows: list[list[str]], hide) -> str:
    """The rows, without the columns in `hide` and those with nothing in them
    (no arrays stored; no sharding recorded); "" if there are no rows."""
    empty = {h for i, h in enumerate(header) if not any(r[i] for r in rows)}
    gone = set(hide) | (empty & {"stored in", "sharding"})
    keep = [i for i, h in enumerate(header) if h not in gone]
    shown = [[r[i] for i in keep] for r in rows]
    return table([header[i] for i in keep], shown, (keep.index(3),)) if rows else ""


def _flat_row(name: str, leaf, shardings: dict[str, str]) -> list[str]:
    array = leaf.kind == ARRAY
    return [
        display_path(name),
        str(tuple(leaf.shape or ())) if array else "-",
        type_text(leaf),
        human_bytes(leaf.nbytes) if array else "-",
        shardings.get(name, ""),
        cut(value_text(leaf)),
    ]


def _modules(saved: Metadata) -> list[str]:
    rows = [
        [
            display_path(n),
            m.cls,
            ", ".join(f"{k}={describe(v)}" for k, v in m.static.items()),
        ]
        for n, m in saved.modules.items()
    ]
    shown = table(["name", "class", "static fields"], rows) if rows else "  (none)"
    return [f"Modules ({len(rows)}):", shown]


def _trailer(saved: Metadata) -> list[str]:
    arrays, nbytes = totals(saved)
    if isinstance(saved, PlainMetadata):
        lines = [f"Total: {count(arrays, 'array')}, {human_bytes(nbytes)}."]
        if saved.unread:
            listed = [
                cut(f"{display_path(n)} ({why})") for n, why in saved.unread.items()
            ]
            more = f"; and {len(listed) - 5} more" if len(listed) > 5 else ""
            lines.append(f"Not shown ({len(listed)}): {'; '.join(listed[:5])}{more}.")
        return lines + [
            "Orbax recorded arrays only: no classes, static fields or Python values. "
            "`oeqx.restore(path, skeleton)` restores it into a skeleton."
        ]
    tied = sum(leaf.data == ALIAS for leaf in saved.leaves.values())
    versions = dict(saved.versions)
    writer = versions.pop("orbax_eqx", "unknown")
    others = ", ".join(f"{k} {v}" for k, v in versions.items())
    others = f" with {others}" if others else ""
    if isinstance(saved, _items.TypedMetadata):
        written = (
            f"Written through `oeqx.type_handler_registry()` by orbax_eqx {writer} "
            f"(index format {saved.format_version}){others}.\nOnly its jax arrays "
            "are shown: Orbax's own handler stored the other leaves, and reads "
            "them back."
        )
    else:
        version = saved.format_version
        written = f"Written by orbax_eqx {writer} (sidecar format {version}){others}."
    return [
        f"Total: {len(saved.leaves)} leaves, {arrays} arrays"
        + (f" (plus {tied} tied to another leaf)" if tied else "")
        + f", {human_bytes(nbytes)}.",
        *_shared_lines(saved),
        written,
        _rebuild_line(saved),
    ]


def _sharing(saved: Metadata) -> dict[str, Any] | None:
    """`shared.sharing` of an item saved with `dedup=True`, else None."""
    item = epath.Path(saved.directory)
    chunks: dict[str, int] = {}
    if saved.shard_files:
        for found in read_all(item, saved).values():
            for chunk in found:
                if chunk.shared:
                    chunks[chunk.file] = chunks.get(chunk.file, 0) + chunk.nbytes
    if not chunks and not any(p.shared for p in saved.packs):
        return None
    return _shared.sharing(item, saved, chunks)


def _shared_lines(saved: Metadata) -> list[str]:
    """For an item saved with `dedup=True`: its own bytes, those it shares,
    and with which steps."""
    found = _sharing(saved)
    if found is None:
        return []
    others = sorted({s for steps in found["steps"].values() for s in steps}, key=str)
    shown = ", ".join(others[:8]) + (
        f" and {len(others) - 8} more" if len(others) > 8 else ""
    )
    return [
        f"Stored once across steps (dedup): {human_bytes(found['own'])} written by "
        f"this save, {human_bytes(found['shared'])} by earlier ones, in "
        f"{count(len(found['packs']), 'shared pack')}"
        + (f", shared with step(s) {shown}." if others else ".")
    ]


def _rebuild_line(saved: Metadata) -> str:
    """What `restore(path, allow=...)` needs to rebuild the item, if it can,
    and the callables a rebuild would install."""
    plan = rebuild_plan(saved)
    if not plan["recorded"] and saved.nodes is None:
        return (
            "Without a skeleton: not rebuildable (this sidecar records no tree "
            "structure; re-save to get one)."
        )
    if not plan["recorded"]:
        return f"Without a skeleton: not rebuildable: {plan['why']}"
    if plan["cannot"]:
        first, more = plan["cannot"][0], len(plan["cannot"]) - 1
        return (
            "Without a skeleton: not rebuildable: "
            f"{label(first['name'], first['path'])}: {first['why']}"
            + (f" (and {more} more)" if more else "")
            + "; restore it into a skeleton."
        )
    line = f"Without a skeleton: restore with `allow={plan['allow']!r}` to rebuild it."
    if plan["callables"]:
        listed = ", ".join(f"`{name}`" for name in plan["callables"])
        line += f"\nCallables a rebuild installs: {listed}."
    return line


def rebuild_plan(saved: Metadata) -> dict[str, Any]:
    """Whether `restore(path, allow=...)` can rebuild the item without a
    skeleton, and what to allow, read from the sidecar, importing nothing."""
    plan: dict[str, Any] = {"recorded": True, "allow": [], "callables": []}
    try:
        found = _rebuild.needs(saved)
    except OrbaxEqxError as e:  # no structure recorded, or a damaged one
        return plan | {"recorded": False, "cannot": [], "why": str(e)}
    return plan | {
        "allow": _rebuild.modules_to_allow(found.names),
        "callables": found.callables,
        "cannot": [{"name": n, "path": p, "why": why} for n, p, why in found.cannot],
    }


# ---------------------------------------------------------------- JSON


def to_json(report: Report) -> dict[str, Any]:
    """The report as JSON (its shape: docs/guides/cli.md)."""
    best = report.best
    return {
        "path": os.fspath(report.path),
        "steps": [
            {"step": n, "path": os.fspath(p), "metrics": _finite(m)}
            for n, p, m in report.steps
        ],
        "step": report.step,
        "latest": report.steps[-1][0] if report.steps else None,
        "best": dict(zip(("step", "metric", "mode"), best, strict=True))
        if best
        else None,
        "items": [
            _item_json(m, s)
            for m, s in zip(report.items, report.shardings, strict=True)
        ],
        "others": [
            {"name": o.name, "path": str(o.path), "handler": o.handler}
            for o in report.others
        ],
    }


def _item_json(saved: Metadata, shardings: dict[str, str]) -> dict[str, Any]:
    leaves = {}
    for name, leaf in saved.leaves.items():
        record: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind}
        if leaf.kind != ARRAY:
            record.update(type=type_text(leaf), value=leaf.value, text=value_text(leaf))
        else:
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
        leaves[name] = record
    arrays, nbytes = totals(saved)
    doc: dict[str, Any] = {"path": saved.directory, "kind": _items.metadata_kind(saved)}
    if isinstance(saved, PlainMetadata):
        doc.update(handler=saved.handler, ocdbt=saved.ocdbt, zarr3=saved.zarr3)
        doc["unread"] = dict(saved.unread)
    else:
        doc.update(
            rebuild=rebuild_plan(saved),
            format_version=saved.format_version,
            versions=saved.versions,
            packs=[
                {"file": p.file, "nbytes": p.nbytes, "shared": p.shared}
                for p in saved.packs
            ],
        )
        if (found := _sharing(saved)) is not None:
            doc["shared"] = found
    doc["leaves"] = leaves
    if not isinstance(saved, PlainMetadata):
        doc["modules"] = {
            name: {
                "path": m.path,
                "class": m.cls,
                "static": m.static,
                "static_text": {k: describe(v) for k, v in m.static.items()},
            }
            for name, m in saved.modules.items()
        }
    doc["totals"] = {"leaves": len(saved.leaves), "arrays": arrays, "nbytes": nbytes}
    return doc


def _finite(value: Any) -> Any:
    # Metrics may hold nan or inf, which strict JSON cannot: said as text.
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value

"""`verify`: `oeqx.verify` on each item a path names; a step whose metadata
cannot be read counts as damaged, and the other steps are still checked."""

import dataclasses
import json

from .._errors import EARLIER_STEP, CheckpointPermissionError, OrbaxEqxError
from .._format.locate import as_path
from .._orbax import items as _items
from .._orbax.plain import PlainMetadata
from .._orbax.verify import verify
from .._tree.names import label
from .render import Progress, count, handler_text, human_bytes, printable


def run(args) -> int:
    items, steps = _selected(args.path, args.latest)
    one = len(items) == 1 and not steps
    saved = {item: _read(item, one) for _, item in items}
    root = as_path(args.path)
    if steps and not args.json:  # before the progress bar, which takes a while
        which = "the latest only" if args.latest else "every step"
        print(
            f"CheckpointManager root {root}: {len(steps)} step(s); checking {which}.",
            flush=True,
        )
    results = _check(items, saved)
    bad = [(s, i) for s, i, found in results if _failed(found) or not found.ok]
    if args.json:
        print(json.dumps(_doc(root, steps, results, saved, one, bad), indent=2))
    else:
        for _, item, found in results:
            print(_text(item, found, saved[item]))
        if not one:
            print(_verdict(root, results, bad, bool(steps), saved))
    return 1 if bad else 0


def _selected(path, latest: bool) -> tuple[list, list[int]]:
    """The `(step, item)` pairs to check, and the steps among them."""
    items = _items.items_under(path)
    steps = sorted({step for step, _ in items if step is not None})
    if latest and steps:
        items = [(s, i) for s, i in items if s == steps[-1]]
    return items, steps


def _check(items, saved: dict) -> list:
    """`(step, item, report or the error reading its metadata)` of each item."""
    total = sum(s.nbytes for s in saved.values() if not _failed(s))
    with Progress("verify", total) as bar:
        return [
            (s, i, saved[i] if _failed(saved[i]) else verify(i, progress=bar.advance))
            for s, i in items
        ]


def _doc(root, steps, results, saved, one: bool, bad) -> dict:
    entries = [_json(s, i, found, saved[i]) for s, i, found in results]
    if one:  # one checkpoint's report, as `oeqx.verify` gives it
        return {k: v for k, v in entries[0].items() if k != "step"}
    return dict(path=str(root), steps=steps, checkpoints=entries, ok=not bad)


def _failed(found) -> bool:
    return isinstance(found, Exception)


def _read(item, alone: bool):
    """The item's metadata; if it cannot be read, the error (one of several
    items counts as damaged; alone, or for want of permission, it ends the
    command)."""
    try:
        return _items.read(item)
    except OrbaxEqxError as e:
        if alone or isinstance(e, CheckpointPermissionError):
            raise
        return e


def _json(step, item, found, saved) -> dict:
    if _failed(found):
        return {"step": step, "directory": str(item), "ok": False, "error": str(found)}
    kind = _items.metadata_kind(saved)
    return {"step": step} | dataclasses.asdict(found) | {"ok": found.ok, "kind": kind}


def _text(item, report, saved) -> str:
    if _failed(report):
        return f"UNREADABLE {item}: {str(report).strip().splitlines()[0]}"
    lines = [
        f"DAMAGED {printable(label(leaf.name, leaf.path))}: {printable(leaf.problem)}"
        for leaf in report.damaged
    ]
    arrays = len(report.checked) + len(report.unchecked) + len(report.damaged)
    where, size = report.directory, human_bytes(report.nbytes)
    if isinstance(saved, PlainMetadata):  # no checksums: read back, no more
        who = handler_text(saved.handler)
        if not report.ok:
            lines.append(
                f"{len(report.damaged)} of {arrays} arrays in {where} cannot be "
                f"read (a plain Orbax checkpoint, {who}). {EARLIER_STEP}"
            )
        else:
            lines.append(
                f"{arrays} of {arrays} arrays ({size}) in {where} read back whole. "
                f"It is a plain Orbax checkpoint ({who}), which records no "
                "checksums: every array is there and decodes, but whether its "
                "values changed since the save cannot be told."
            )
        return "\n".join(lines)
    if report.unchecked:
        why = "saved with checksums=False"
        if saved.checksums:
            why = "Orbax-stored arrays that no process held whole at save"
        lines.append(
            f"{len(report.unchecked)} leaves record no checksum ({why}): read, not "
            "checked."
        )
    if report.ok:
        lines.append(
            f"{len(report.checked)} of {arrays} arrays ({size}) in {where} match "
            "their checksums."
        )
    else:
        lines.append(
            f"{len(report.damaged)} of {arrays} arrays in {where} are damaged. "
            + EARLIER_STEP
        )
    return "\n".join(lines)


def _verdict(root, results, bad, by_step: bool, saved: dict) -> str:
    plain = any(isinstance(s, PlainMetadata) for s in saved.values())
    sound = "every array matches" + (
        " (or, in plain Orbax items, reads back)." if plain else "."
    )
    if not by_step:
        if not bad:
            return f"{count(len(results), 'item')} of {root}: {sound}"
        names = ", ".join(item.name for _, item in bad)
        return (
            f"Damaged: {count(len(bad), 'item')} of {len(results)} ({names}). "
            + EARLIER_STEP
        )
    checked = sorted({step for step, _, _ in results})
    damaged = sorted({step for step, _ in bad})
    if not damaged:
        return f"{count(len(checked), 'step')} of {root}: {sound}"
    good = [s for s in checked if s not in damaged]
    newest = (
        f"The newest sound step is {good[-1]}" if good else "No step checked is sound"
    )
    return (
        f"Damaged: {count(len(damaged), 'step')} of {len(checked)} "
        f"({', '.join(map(str, damaged))}). {newest}; `oeqx.restore_latest` falls "
        "back past damaged steps."
    )

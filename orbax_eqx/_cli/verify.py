"""`verify`: `oeqx.verify` on what a path names, and what it found.

A path names what it names for `inspect`: an item, a step (each item) or a
CheckpointManager root (every finished step, or with `--latest` the latest),
or safetensors (`safetensors_files`). A step whose metadata cannot be read
counts as damaged there, and the other steps are still checked.
"""

import argparse
import dataclasses
import json

from .._errors import EARLIER_STEP, CheckpointPermissionError, OrbaxEqxError
from .._format.locate import as_path
from .._format.sidecar import PACKED, SHARDS, STORED
from .._orbax import items as _items
from .._orbax.plain_items import PlainMetadata
from .._orbax.verify import VerifyReport, check, verify
from .._tree.names import label
from . import safetensors_files
from .render import Progress, count, handler_text, human_bytes, printable


def run(args: argparse.Namespace) -> int:
    if safetensors_files.names_safetensors(args.path):
        return safetensors_files.verify(args)
    items = _items.items_under(args.path)
    steps = sorted({step for step, _ in items if step is not None})
    if args.latest and steps:
        items = [(step, item) for step, item in items if step == steps[-1]]
    saved = {}
    for _, item in items:
        try:
            saved[item] = _items.read(item)
        except CheckpointPermissionError:
            raise  # no damage: it ends the command
        except OrbaxEqxError as e:
            if len(items) == 1 and not steps:
                raise  # one checkpoint that cannot be read at all
            saved[item] = e
    root = as_path(args.path)
    if steps and not args.json:  # before the progress bar, which takes a while
        which = "the latest only" if args.latest else "every step"
        print(
            f"CheckpointManager root {root}: {len(steps)} step(s); checking {which}.",
            flush=True,
        )
    total = sum(_nbytes(s) for s in saved.values() if not isinstance(s, Exception))
    results = []
    with Progress("verify", total) as bar:
        for step, item in items:
            found = saved[item]
            if not isinstance(found, Exception):
                found = _verify(item, found, bar.advance)
            results.append((step, item, found))
    bad = [(s, i) for s, i, f in results if isinstance(f, Exception) or not f.ok]
    if args.json:
        entries = [
            _json(step, item, found, saved[item]) for step, item, found in results
        ]
        if len(items) == 1 and not steps:
            doc = entries[0]
            doc.pop("step")
        else:
            doc = {"path": str(root), "steps": steps, "checkpoints": entries}
            doc["ok"] = not bad
        print(json.dumps(doc, indent=2))
        return 1 if bad else 0
    for _, item, found in results:
        if isinstance(found, Exception):
            print(f"UNREADABLE {item}: {str(found).strip().splitlines()[0]}")
        else:
            print(_text(found, saved[item]), end="")
    if len(items) > 1 or steps:
        plain = any(isinstance(s, PlainMetadata) for s in saved.values())
        print(_verdict(root, results, bad, bool(steps), plain))
    return 1 if bad else 0


def _verify(item, saved, progress) -> VerifyReport:
    if isinstance(saved, PlainMetadata):  # its metadata is read already
        return check(item, saved, progress)
    return verify(item, progress=progress)


def _nbytes(saved) -> int:
    leaves = saved.leaves.values()
    return sum(r.nbytes for r in leaves if r.data in (PACKED, SHARDS, STORED))


def _json(step, item, found, saved) -> dict:
    if isinstance(found, Exception):
        return {"step": step, "directory": str(item), "ok": False, "error": str(found)}
    doc = dataclasses.asdict(found) | {
        "ok": found.ok,
        "kind": _items.metadata_kind(saved),
    }
    return {"step": step} | doc


def _text(report: VerifyReport, saved) -> str:
    lines = [
        f"DAMAGED {printable(label(leaf.name, leaf.path))}: {printable(leaf.problem)}"
        for leaf in report.damaged
    ]
    where = report.directory
    checked = report.checked + report.unchecked
    arrays = len(checked) + len(report.damaged)
    if isinstance(saved, PlainMetadata):
        who = handler_text(saved.handler)
        if report.ok:
            return (
                "\n".join(
                    lines
                    + [
                        f"{arrays} of {arrays} arrays ({human_bytes(report.nbytes)}) in {where} "
                        f"read back whole. It is a plain Orbax checkpoint ({who}), which "
                        "records no checksums: every array is there and decodes, but whether "
                        "its values changed since the save cannot be told."
                    ]
                )
                + "\n"
            )
        return (
            "\n".join(
                lines
                + [
                    f"{len(report.damaged)} of {arrays} arrays in {where} cannot be read (a "
                    f"plain Orbax checkpoint, {who}). {EARLIER_STEP}"
                ]
            )
            + "\n"
        )
    if report.unchecked:
        why = (
            "saved with checksums=False"
            if not saved.checksums
            else "Orbax-stored arrays that no process held whole at save"
        )
        lines.append(
            f"{len(report.unchecked)} leaves record no checksum ({why}): read, not "
            "checked."
        )
    if report.ok:
        lines.append(
            f"{len(report.checked)} of {arrays} arrays ({human_bytes(report.nbytes)}) "
            f"in {where} match their checksums."
        )
    else:
        lines.append(
            f"{len(report.damaged)} of {arrays} arrays in {where} are damaged. "
            + EARLIER_STEP
        )
    return "\n".join(lines) + "\n"


def _verdict(root, results, bad, by_step: bool, plain: bool) -> str:
    # Plain Orbax items have no checksums: their arrays read back, no more.
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

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
from .._orbax.plain import PlainMetadata
from .._orbax.verify import VerifyReport, check, verify
from .._tree.names import label
from . import safetensors_files
from .render import Progress, count, handler_text, human_bytes, printable


def run(args: argparse.Namespace) -> int:
    if safetensors_files.names_safetensors(args.path):
        return safetensors_files.verify(args)
    items, steps = _named(args.path, args.latest)
    one = len(items) == 1 and not steps
    saved = {item: _read(item, one) for _, item in items}
    root = as_path(args.path)
    if steps and not args.json:  # before the progress bar, which takes a while
        which = "the latest only" if args.latest else "every step"
        print(
            f"CheckpointManager root {root}: {len(steps)} step(s); checking {which}.",
            flush=True,
        )
    with Progress("verify", sum(map(_nbytes, saved.values()))) as bar:
        results = [(s, i, _verify(i, saved[i], bar.advance)) for s, i in items]
    bad = [(s, i) for s, i, found in results if not getattr(found, "ok", False)]
    if args.json:
        _print_json(root, steps, results, saved, bad, one)
    else:
        for _, item, found in results:
            print(_text(item, found, saved[item]), end="")
        if not one:
            print(_verdict(root, results, bad, bool(steps), saved))
    return 1 if bad else 0


def _named(path: str, latest: bool):
    """The items `path` names with their steps (a root's latest only, if
    `latest`), and the steps."""
    items = _items.items_under(path)
    steps = sorted({step for step, _ in items if step is not None})
    if latest and steps:
        return [(s, i) for s, i in items if s == steps[-1]], steps
    return items, steps


def _print_json(root, steps, results, saved, bad, one: bool) -> None:
    entries = [_json(s, i, found, saved[i]) for s, i, found in results]
    if one:  # one checkpoint's report, as `oeqx.verify` gives it
        doc = {k: v for k, v in entries[0].items() if k != "step"}
    else:
        doc = {"path": str(root), "steps": steps, "checkpoints": entries, "ok": not bad}
    print(json.dumps(doc, indent=2))


def _read(item, alone: bool):
    """The item's metadata; if it cannot be read, the error (one of several
    items counts as damaged; alone, it ends the command)."""
    try:
        return _items.read(item)
    except CheckpointPermissionError:
        raise  # no damage: it ends the command
    except OrbaxEqxError as e:
        if alone:
            raise
        return e


def _verify(item, saved, progress) -> VerifyReport | Exception:
    if isinstance(saved, Exception):
        return saved
    if isinstance(saved, PlainMetadata):  # its metadata is read already
        return check(item, saved, progress)
    return verify(item, progress=progress)


def _nbytes(saved) -> int:
    leaves = () if isinstance(saved, Exception) else saved.leaves.values()
    return sum(r.nbytes for r in leaves if r.data in (PACKED, SHARDS, STORED))


def _json(step, item, found, saved) -> dict:
    if isinstance(found, Exception):
        return {"step": step, "directory": str(item), "ok": False, "error": str(found)}
    doc = dataclasses.asdict(found) | {
        "ok": found.ok,
        "kind": _items.metadata_kind(saved),
    }
    return {"step": step} | doc


def _text(item, report: VerifyReport | Exception, saved) -> str:
    if isinstance(report, Exception):
        return f"UNREADABLE {item}: {str(report).strip().splitlines()[0]}\n"
    lines = [
        f"DAMAGED {printable(label(leaf.name, leaf.path))}: {printable(leaf.problem)}"
        for leaf in report.damaged
    ]
    arrays = len(report.checked) + len(report.unchecked) + len(report.damaged)
    if isinstance(saved, PlainMetadata):
        return "\n".join([*lines, _plain_line(report, saved, arrays)]) + "\n"
    if report.unchecked:
        why = "saved with checksums=False"
        if saved.checksums:
            why = "Orbax-stored arrays that no process held whole at save"
        lines.append(
            f"{len(report.unchecked)} leaves record no checksum ({why}): read, not "
            "checked."
        )
    where = report.directory
    if report.ok:
        size = human_bytes(report.nbytes)
        line = f"{len(report.checked)} of {arrays} arrays ({size}) in {where} match "
        lines.append(line + "their checksums.")
    else:
        line = f"{len(report.damaged)} of {arrays} arrays in {where} are damaged. "
        lines.append(line + EARLIER_STEP)
    return "\n".join(lines) + "\n"


def _plain_line(report: VerifyReport, saved: PlainMetadata, arrays: int) -> str:
    """A plain Orbax item: every array read back, none checked (Orbax records
    no checksums)."""
    who, where = handler_text(saved.handler), report.directory
    if not report.ok:
        return (
            f"{len(report.damaged)} of {arrays} arrays in {where} cannot be read (a "
            f"plain Orbax checkpoint, {who}). {EARLIER_STEP}"
        )
    return (
        f"{arrays} of {arrays} arrays ({human_bytes(report.nbytes)}) in {where} read "
        f"back whole. It is a plain Orbax checkpoint ({who}), which records no "
        "checksums: every array is there and decodes, but whether its values "
        "changed since the save cannot be told."
    )


def _verdict(root, results, bad, by_step: bool, saved: dict) -> str:
    # Plain Orbax items have no checksums: their arrays read back, no more.
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

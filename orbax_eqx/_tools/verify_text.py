"""`python -m orbax_eqx verify`: runs `verify` on what a path names, and shows
what it found.

A path names what it names for `inspect`: an item directory, a step directory
(each orbax_eqx item in it) or a CheckpointManager root (every finished step,
or with `--latest` the latest only).
"""

import argparse
import dataclasses
import json

from .._errors import EARLIER_STEP, CheckpointPermissionError, OrbaxEqxError
from .._format.locate import as_path
from .._format.sidecar import PACKED, SHARDS, STORED
from .._tree.names import label
from .plain_items import PlainMetadata, handler_text
from .progress import Progress
from .step_items import ORBAX_EQX, PLAIN, items_under, read
from .text import human_bytes, printable
from .verify import VerifyReport, verify, verify_plain


def run(args: argparse.Namespace) -> int:
    """Runs `verify` for parsed arguments; returns the exit status (0 sound, 1 not)."""
    items = items_under(args.path)
    steps = sorted({step for step, _ in items if step is not None})
    if args.latest and steps:
        items = [(step, item) for step, item in items if step == steps[-1]]
    if len(items) == 1 and not steps:
        return _one(args, items[0][1])
    return _several(args, items, steps)


def _one(args: argparse.Namespace, item) -> int:
    """One item: its damaged leaves, then one line (the format of old)."""
    saved = read(item)
    with Progress("verify", _nbytes(saved)) as bar:
        report = _verify(item, saved, bar.advance)
    if args.json:
        print(json.dumps(_json(report, saved), indent=2))
    else:
        print(_text(report, saved), end="")
    return 0 if report.ok else 1


def _several(args: argparse.Namespace, items, steps) -> int:
    """A root's steps, or a step's items: each as one item, then a verdict.

    A step whose sidecar cannot be read counts as damaged, and the others are
    still checked: which step is sound is what a root is verified for. A file
    this user may not read is no damage, and ends it (exit status 2).
    """
    sidecars = {}
    for _, item in items:
        try:
            sidecars[item] = read(item)
        except CheckpointPermissionError:
            raise
        except OrbaxEqxError as e:
            sidecars[item] = e
    total = sum(_nbytes(s) for s in sidecars.values() if not isinstance(s, Exception))
    root = as_path(args.path)
    if steps and not args.json:  # before the progress bar, which takes a while
        which = "the latest only" if args.latest else "every step"
        print(
            f"CheckpointManager root {root}: {len(steps)} step(s); checking {which}.",
            flush=True,
        )
    results = []
    with Progress("verify", total) as bar:
        for step, item in items:
            found = sidecars[item]
            if not isinstance(found, Exception):
                found = _verify(item, found, bar.advance)
            results.append((step, item, found))
    if args.json:
        doc = {"path": str(root), "steps": steps, "checkpoints": []}
        for step, item, found in results:
            entry = {"step": step}
            if isinstance(found, Exception):
                entry |= {"directory": str(item), "ok": False, "error": str(found)}
            else:
                entry |= _json(found, sidecars[item])
            doc["checkpoints"].append(entry)
        doc["ok"] = all(entry["ok"] for entry in doc["checkpoints"])
        print(json.dumps(doc, indent=2))
        return 0 if doc["ok"] else 1
    for _, item, found in results:
        if isinstance(found, Exception):
            print(f"UNREADABLE {item}: {str(found).strip().splitlines()[0]}")
        else:
            print(_text(found, sidecars[item]), end="")
    bad = [(step, item) for step, item, found in results if not _ok(found)]
    plain = any(isinstance(s, PlainMetadata) for s in sidecars.values())
    print(_verdict(root, results, bad, bool(steps), plain))
    return 1 if bad else 0


def _ok(found) -> bool:
    return not isinstance(found, Exception) and found.ok


def _verdict(root, results, bad, by_step: bool, plain: bool = False) -> str:
    # Plain Orbax items have no checksums: their arrays read back, no more.
    all_sound = (
        "every array matches (or, in plain Orbax items, reads back)."
        if plain
        else "every array matches."
    )
    if by_step:
        checked = sorted({step for step, _, _ in results})
        damaged = sorted({step for step, _ in bad})
        sound = [s for s in checked if s not in damaged]
        if not damaged:
            return f"{_count(checked, 'step')} of {root}: {all_sound}"
        newest = (
            f"The newest sound step is {sound[-1]}"
            if sound
            else "No step checked is sound"
        )
        return (
            f"Damaged: {_count(damaged, 'step')} of {len(checked)} "
            f"({', '.join(map(str, damaged))}). {newest}; `oeqx.restore_latest` "
            "falls back past damaged steps."
        )
    names = [item.name for _, item in bad]
    if not bad:
        return f"{_count(results, 'item')} of {root}: {all_sound}"
    return (
        f"Damaged: {_count(bad, 'item')} of {len(results)} ({', '.join(names)}). "
        + EARLIER_STEP
    )


def _count(things, word: str) -> str:
    return f"{len(things)} {word}{'s' if len(things) != 1 else ''}"


def _nbytes(saved) -> int:
    return sum(
        r.nbytes for r in saved.leaves.values() if r.data in (PACKED, SHARDS, STORED)
    )


def _verify(item, saved, progress) -> VerifyReport:
    if isinstance(saved, PlainMetadata):  # its metadata is read already
        return verify_plain(item, saved, progress)
    return verify(item, progress=progress)


def _json(report: VerifyReport, saved) -> dict:
    kind = PLAIN if isinstance(saved, PlainMetadata) else ORBAX_EQX
    return dataclasses.asdict(report) | {"ok": report.ok, "kind": kind}


def _plain_text(report: VerifyReport, saved: PlainMetadata) -> str:
    """A plain Orbax item: every array read back, none checked (Orbax records
    no checksums)."""
    lines = [
        f"DAMAGED {printable(label(leaf.name, leaf.path))}: {printable(leaf.problem)}"
        for leaf in report.damaged
    ]
    arrays = len(report.damaged) + len(report.unchecked)
    who = handler_text(saved.handler)
    if report.ok:
        lines.append(
            f"{arrays} of {arrays} arrays ({human_bytes(report.nbytes)}) in "
            f"{report.directory} read back whole. It is a plain Orbax checkpoint "
            f"({who}), which records no checksums: every array is there and "
            "decodes, but whether its values changed since the save cannot be told."
        )
    else:
        lines.append(
            f"{len(report.damaged)} of {arrays} arrays in {report.directory} "
            f"cannot be read (a plain Orbax checkpoint, {who}). " + EARLIER_STEP
        )
    return "\n".join(lines) + "\n"


def _text(report: VerifyReport, saved) -> str:
    if isinstance(saved, PlainMetadata):
        return _plain_text(report, saved)
    lines = [
        f"DAMAGED {printable(label(leaf.name, leaf.path))}: {printable(leaf.problem)}"
        for leaf in report.damaged
    ]
    arrays = len(report.checked) + len(report.damaged) + len(report.unchecked)
    if report.unchecked:
        if not saved.checksums:
            why = "saved with checksums=False"
        else:
            why = "Orbax-stored arrays that no process held whole at save"
        lines.append(
            f"{len(report.unchecked)} leaves record no checksum ({why}): read, not "
            "checked."
        )
    if report.ok:
        lines.append(
            f"{len(report.checked)} of {arrays} arrays ({human_bytes(report.nbytes)}) "
            f"in {report.directory} match their checksums."
        )
    else:
        lines.append(
            f"{len(report.damaged)} of {arrays} arrays in {report.directory} are "
            "damaged. " + EARLIER_STEP
        )
    return "\n".join(lines) + "\n"

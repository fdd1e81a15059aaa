"""`python -m orbax_eqx verify`: runs `_verify` and shows what it found."""

import argparse
import dataclasses
import json

from .._format.locate import find_item
from .._format.sidecar import PACKED, STORED
from .._format.sidecar_read import read
from .progress import Progress
from .text import human_bytes
from .verify import verify


def run(args: argparse.Namespace) -> int:
    """Runs `verify` for parsed arguments; returns the exit status (0 sound, 1 not)."""
    saved = read(find_item(args.path))
    total = sum(r.nbytes for r in saved.leaves.values() if r.data in (PACKED, STORED))
    with Progress("verify", total) as bar:
        report = verify(args.path, progress=bar.advance)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"ok": report.ok}, indent=2))
        return 0 if report.ok else 1
    for leaf in report.damaged:
        print(f"DAMAGED {leaf.path} ({leaf.name}): {leaf.problem}")
    arrays = len(report.checked) + len(report.damaged) + len(report.unchecked)
    if report.unchecked:
        why = (
            "saved with checksums=False"
            if not saved.checksums
            else "saved before orbax_eqx recorded them"
        )
        print(
            f"{len(report.unchecked)} leaves record no checksum ({why}): read, not "
            "checked."
        )
    if report.ok:
        print(
            f"{len(report.checked)} of {arrays} arrays ({human_bytes(report.nbytes)}) "
            f"in {report.directory} match their checksums."
        )
        return 0
    print(
        f"{len(report.damaged)} of {arrays} arrays in {report.directory} are "
        "damaged. Restore an earlier step, or re-save this one."
    )
    return 1

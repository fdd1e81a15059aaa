"""A step copied out of a manager's root with every byte it needs."""

import json
import os
import shutil

import msgspec
from etils import epath

from ..._bytes import route as _route
from ..._errors import SidecarError
from ..._format import sealed as _sealed
from ..._format import sidecar_read as _sidecar_read
from ..._format.sidecar import (
    FILE_NAME,
    SHARED_DIR,
    Metadata,
    pack_path,
    shard_index,
    shared_dir,
)
from .steps import ShardFiles


def copy_step(step: epath.Path, destination: epath.Path) -> list[str]:
    """Copies a step of a manager saved with `EqxHandler(dedup=True)` into a
    directory of its own that holds every byte it needs, for sharing it or
    keeping it after the shared bytes are gone."""
    step, destination = epath.Path(step), epath.Path(destination)
    for path, what in ((step, "step"), (destination, "destination")):
        if _route.is_remote(path):
            raise ValueError(
                f"Copying a step works on local directories; the {what} {path} is "
                "in an object store. Copy the step to a local disk first "
                "(`gcloud storage cp -r`, `aws s3 cp --recursive`), with the "
                f"`{SHARED_DIR}` directory beside it."
            )
    if not step.is_dir():
        raise FileNotFoundError(f"{step} is not a directory: pass a step directory.")
    if destination.exists():
        raise FileExistsError(
            f"{destination} exists already; pass the path of a new directory."
        )
    items = [p.parent for p in step.glob(f"*/{FILE_NAME}")]
    if (step / FILE_NAME).exists():
        items.append(step)  # an item directory given as the step
    temporary = destination.parent / f".{destination.name}.orbax_eqx-copy-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    copied: list[str] = []
    try:
        shutil.copytree(step, temporary, symlinks=True)
        for item in items:
            where = temporary / item.relative_to(step)
            copied += _hold_own_bytes(item, where)
        os.rename(temporary, destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return copied


def _hold_own_bytes(item: epath.Path, copy: epath.Path) -> list[str]:
    """Copies the shared packs and shard packs of the item `item` into its
    copy `copy`, and rewrites the copy's sidecar and shard indexes to find
    them there."""
    path = copy / FILE_NAME
    raw = path.read_bytes()

    def damaged(what: str) -> Exception:
        return SidecarError(
            f"The sidecar {item / FILE_NAME} {what}: the step is damaged and "
            "was not copied. Copy another step."
        )

    if not _sealed.check(raw, damaged):
        raise damaged("records no checksum")
    saved = _sidecar_read.read(item, nodes=False)  # every record checked
    copied = _hold_own_shards(item, copy, saved)
    shared = [p for p in saved.packs if p.shared]
    if not shared:
        return copied
    for pack in shared:
        _copy_in(item, pack_path(item, pack), copy, pack.nbytes, "pack")
    lines = raw.split(b"\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(b' "packs": '))
    packs = json.loads(lines[at][len(b' "packs": ') :].rstrip(b","))
    for record in packs:
        record.pop("shared", None)
    lines[at] = b' "packs": ' + json.dumps(packs).encode() + b","
    body = b"\n".join(lines[:-3]) + b"\n"  # up to the checksum line
    path.write_bytes(_sealed.seal(body))
    return [p.file for p in shared] + copied


def _copy_in(item, source: epath.Path, copy: epath.Path, nbytes: int, what: str):
    if not source.exists() or os.path.getsize(source) != nbytes:
        raise SidecarError(
            f"The shared {what} {source}, which the step {item} refers to, is "
            f"{'missing' if not source.exists() else 'not of its recorded size'}"
            ": the step cannot be copied whole. Copy another step."
        )
    shutil.copyfile(source, copy / source.name)


_SHARED_FILES = b', "shared": true, "files": '


def _hold_own_shards(item: epath.Path, copy: epath.Path, saved: Metadata) -> list:
    """Copies the shared shard packs the item's shard indexes list into the
    copy, and rewrites the copy's indexes (re-sealed) to find them there."""
    copied: list[str] = []
    for process in range(saved.shard_files):
        path = copy / shard_index(saved.token, process)
        raw = path.read_bytes()

        def damaged(what: str, path=path) -> Exception:
            return SidecarError(
                f"The shard index {item / path.name} {what}: the step is damaged "
                "and was not copied. Copy another step."
            )

        if not _sealed.check(raw, damaged):
            raise damaged("records no checksum")
        head, rest = raw.split(b"\n", 1)
        index = msgspec.json.decode(raw, type=ShardFiles)
        if not index.shared:
            continue
        for record in index.files:
            if not _sidecar_read.SHARD_NAME.fullmatch(record.file):
                raise damaged(f"lists {record.file[:80]!r}, not a shard pack")
            source = shared_dir(item) / record.file
            _copy_in(item, source, copy, record.nbytes, "shard pack")
            copied.append(record.file)
        if head.count(_SHARED_FILES) != 1:
            raise damaged("is not a shard index as orbax_eqx writes it")
        body = head.replace(_SHARED_FILES, b', "files": ') + b"\n" + rest
        body = b"\n".join(body.split(b"\n")[:-3]) + b"\n"  # up to the checksum
        path.write_bytes(_sealed.seal(body))
    return copied

"""`export`: the command line's face of `orbax_eqx.export_safetensors`.

A thin layer: the bridge (`_bridge/export.py`) does the work; this names the
fixes in its errors by the command line's flags (`--rename`, `--overwrite`)
and draws a progress bar on a terminal.
"""

import os
from typing import Any, TextIO

from .._bridge.export import CLI, DEFAULT_BUFFER, DEFAULT_MAX_SHARD_SIZE
from .._bridge.export import METADATA_ENTRY as METADATA_ENTRY
from .._bridge.export import Exported as Exported
from .._bridge.export import export as _export
from .._bridge.export_source import ExportError as ExportError
from .._restore.rename_map import RenameMap
from .progress import Progress


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    renames: RenameMap | None = None,
    mapping: Any = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    buffer: int = DEFAULT_BUFFER,
    overwrite: bool = False,
    progress: TextIO | None = None,
) -> Exported:
    """Writes the arrays of the checkpoint at `path` as safetensors at `out`.

    **Arguments:**

    - `path`: the checkpoint (an item directory, or a step holding one item).
    - `out`: a directory (Hugging Face layout, sharded past `max_shard_size`)
        or a file name ending in `.safetensors` (one file, whatever its size).
    - `renames`: a `RenameMap` from leaf names to tensor names (`--rename`).
    - `mapping`: a mapping (`--mapping`), instead of `renames`.
    - `max_shard_size`: the most bytes of tensor data per file.
    - `buffer`: about how many bytes of array data to hold at once.
    - `overwrite`: replace safetensors files already at `out`.
    - `progress`: where to draw a progress bar (only if it is a terminal).

    **Returns:** an `Exported` (see `orbax_eqx.export_safetensors`).
    """
    return _export(
        path,
        out,
        mapping=mapping,
        renames=renames,
        max_shard_size=max_shard_size,
        buffer=buffer,
        overwrite=overwrite,
        progress=lambda total: Progress("export", total, progress),
        words=CLI,
    )

"""`import`: safetensors (a file, or a Hugging Face directory) into a checkpoint.

The command line's face of `orbax_eqx.load_safetensors`: the skeleton is
filled from the files (every check made before any tensor is read, fixes
named by the command line's flags), then saved as an orbax_eqx checkpoint at
`out`, atomically, as `orbax_eqx.save` does.
"""

import dataclasses
import os
from typing import Any, TextIO

from .._bridge.load import load
from .._bridge.load_check import CLI
from .._bridge.safetensors.header import SafetensorsError
from .._format.locate import as_path
from .._orbax.api import save
from .._restore.rename_map import RenameMap
from .._save.leftovers import recover
from .._save.replace import check_target
from .progress import Progress

# Every error an import raises about its source or output (damaged files, an
# index, a skeleton that does not fit, an output in the way) is one of these.
ImportMismatchError = SafetensorsError


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `import_` wrote: the checkpoint, its leaves, tensors and bytes read."""

    path: str
    leaves: int
    tensors: int
    nbytes: int
    files: list[str]


def import_(
    source: str | os.PathLike,
    out: str | os.PathLike,
    skeleton: Any,
    *,
    renames: RenameMap | None = None,
    mapping: Any = None,
    cast: bool = False,
    allow_unused: bool = False,
    ignore_static: bool = False,
    overwrite: bool = False,
    progress: TextIO | None = None,
) -> Imported:
    """Saves an orbax_eqx checkpoint at `out` with the tensors found at `source`.

    **Arguments:**

    - `source`: a `.safetensors` file, or a directory holding them (with a
        `model.safetensors.index.json`, or without one: every file is read);
        local, `gs://` or `s3://`.
    - `out`: where to save the checkpoint; must not exist unless `overwrite`.
    - `skeleton`: the PyTree to fill, as for `orbax_eqx.restore`.
    - `renames`: a `RenameMap` from tensor names to leaf names (`--rename`).
    - `mapping`: a mapping (`--mapping`), instead of `renames`.
    - `cast`: cast tensors to the skeleton's dtypes where they differ.
    - `allow_unused`: let tensors that fill no leaf be left out.
    - `ignore_static`: keep the skeleton's static fields and classes where the
        files (from `export`) record others.
    - `overwrite`: replace a checkpoint at `out`, atomically (as
        `orbax_eqx.save` does); anything else there is refused.
    - `progress`: where to draw a progress bar (only if it is a terminal).

    **Returns:** an `Imported`.
    """
    out_path = as_path(out)
    recover(out_path)  # an earlier save killed mid-swap: its checkpoint counts
    if out_path.exists() and not overwrite:
        raise ImportMismatchError(
            f"{out_path} already exists. Pass --overwrite to replace it, or choose "
            "another output."
        )
    if overwrite:  # refuses a file or a directory of other files, before any read
        check_target(out_path, overwrite)
    loaded = load(
        source,
        skeleton,
        mapping=mapping,
        renames=renames,
        cast=cast,
        allow_unused=allow_unused,
        ignore_static=ignore_static,
        words=CLI,
        progress=lambda total: Progress("import", total, progress),
    )
    save(out_path, loaded.tree, overwrite=overwrite)
    return Imported(
        os.fspath(out_path), loaded.leaves, loaded.tensors, loaded.nbytes, loaded.files
    )

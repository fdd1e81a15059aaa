"""A restore without a skeleton that rebuilds the saved tree (`allow=`).

The skeleton comes from the sidecar (`_rebuild`), so where it and the
sidecar's leaves disagree, the sidecar disagrees with itself: damage, said
as such, never as a skeleton the caller did not pass. Before the skeleton is
made, each pack file is checked to hold the bytes its leaves claim, so that
no stand-in is allocated for sizes only the sidecar claims.
"""

import dataclasses
from typing import Any

from etils import epath

from .._errors import CheckpointMismatchError, RebuildError, SidecarError
from .._format.sidecar import PACKED, Metadata, pack_path
from .._mapping.errors import RenameError
from .._rebuild import build as _rebuild
from .._restore.restore import restore_tree
from .._storage import ranges as _ranges


def restore(inner, directory: epath.Path, saved: Metadata, args) -> Any:
    """Rebuilds the tree `saved` records under `args.allow`, and restores it."""
    _check_packs(epath.Path(directory), saved)
    skeleton = _rebuild.skeleton(saved, args.allow, args.prefix)
    args = dataclasses.replace(args, skeleton=skeleton, allow=None)
    try:
        return restore_tree(inner, directory, saved, args)
    except CheckpointMismatchError as e:
        if args.renames is None:
            raise _disagrees(saved, e) from None
        # The caller's renames: said of the rebuilt tree, as the next.
        raise CheckpointMismatchError(_of_the_tree(str(e))) from None
    except RenameError as e:
        raise RenameError(_of_the_tree(str(e))) from None
    except (RecursionError, SystemError) as e:
        # JAX flattens trees in C++, some hundreds of levels deep at most.
        if "recursion" not in str(e) and "exception set" not in str(e):
            raise
        raise RebuildError(
            f"The tree of the checkpoint at {saved.directory}, rebuilt, nests "
            "deeper than this JAX flattens (it was saved with another JAX, or "
            "by hand). Restore it flat (without `allow=`), or with a JAX that "
            "flattens it."
        ) from None


def _check_packs(directory: epath.Path, saved: Metadata) -> None:
    ends: dict[int, int] = {}
    for leaf in saved.leaves.values():
        if leaf.data == PACKED and leaf.pack is not None:
            end = (leaf.offset or 0) + leaf.nbytes
            ends[leaf.pack] = max(ends.get(leaf.pack, 0), end)
    for pack, end in ends.items():
        record = saved.packs[pack]
        _ranges.check_size(pack_path(directory, record), end, record.nbytes)


def _of_the_tree(text: str) -> str:
    """A mismatch message of a rebuilt skeleton, said of the rebuilt tree."""
    return (
        text.replace("The skeleton", "The tree rebuilt from the sidecar")
        .replace("the skeleton's", "the rebuilt tree's")
        .replace("the skeleton", "the rebuilt tree")
    )


def _disagrees(saved: Metadata, error: CheckpointMismatchError) -> SidecarError:
    """The mismatch of a rebuilt skeleton with the sidecar, said as what it is."""
    lines = [
        line.replace(" in the skeleton", " in the tree the sidecar's nodes record")
        .replace(" in the checkpoint", " in its leaf records")
        .replace("the skeleton", "the tree the sidecar's nodes record")
        for line in str(error).splitlines()
        if line.startswith(("  - ", "  ... and"))
    ]
    shown = "\n".join(lines) if lines else f"  - {str(error).splitlines()[0]}"
    return SidecarError(
        f"The sidecar in {saved.directory} is damaged: its records of the tree "
        f"disagree with its records of the leaves:\n{shown}\nRestore an earlier "
        "step, or restore this one flat (without `allow=`) or into a skeleton."
    )

"""`prune`: deletes the shared packs beside a manager's steps that no step
refers to, as each save with `dedup=True` does once its files are written."""

from .._bytes.route import is_remote
from .._errors import OrbaxEqxError
from .._format.locate import as_path
from .._storage import shared as _shared
from .render import count


def run(args) -> int:
    root = as_path(args.root)
    if not (is_remote(root) or root.is_dir()):
        raise OrbaxEqxError(
            f"{root} is not a directory: pass the root directory of a "
            "CheckpointManager, where its step directories are."
        )
    try:
        gone = _shared.collect(root, strict=True)
    except _shared.Busy as e:
        raise OrbaxEqxError(
            f"{root} has step directories a save is writing, or a killed save "
            f"left: {e}. Nothing was deleted. Run prune once no save is under "
            "way; delete the directory a killed save left, or save again (a save "
            "collects what killed ones left)."
        ) from None
    except _shared.Unreadable as e:
        raise OrbaxEqxError(
            f"The sidecar or a shard index of {e} cannot be read, so which shared "
            "packs its step refers to is unknown: nothing was deleted. Check that "
            "step with `python -m orbax_eqx verify`, and delete it if it is damaged."
        ) from None
    if gone:
        print(f"Deleted {count(len(gone), 'shared pack')} that no step refers to.")
    else:
        print("Nothing to delete: a step refers to every shared pack.")
    return 0

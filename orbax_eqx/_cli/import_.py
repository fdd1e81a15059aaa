"""`import`: safetensors into a skeleton (`_bridge.load`: every check before
any tensor is read), saved as a checkpoint atomically, as `oeqx.save` does."""

from .._bridge.load import load
from .._format.locate import as_path
from .._mapping.names import load as load_renames
from .._orbax import items as _items
from .._orbax.api import save
from .._save.replace import CheckpointExistsError, check_target, recover
from . import skeleton as _skeleton
from .render import Progress, human_bytes


def run(args) -> int:
    out = as_path(args.out)
    recover(out)  # an earlier save killed mid-swap: its checkpoint counts
    if out.exists() and not args.overwrite:
        raise CheckpointExistsError(
            f"{out} already exists. Pass `overwrite=True` to replace it, or choose "
            "another output."
        )
    if args.overwrite:  # refuses a file or a directory of other files, first
        check_target(out, args.overwrite)
    loaded = load(
        args.source,
        _skeleton.load(args.skeleton),
        mapping=_skeleton.load_mapping(args.mapping, None),
        renames=load_renames(args.rename),
        cast=args.cast,
        allow_unused=args.allow_unused,
        ignore_static=args.ignore_static,
        progress=lambda total: Progress("import", total),
    )
    save(out, loaded.tree, overwrite=args.overwrite)
    nbytes = _items.read(out).nbytes
    read = ""
    if nbytes != loaded.nbytes:
        read = f"; {human_bytes(loaded.nbytes)} of tensors read"
    print(
        f"Imported {loaded.tensors} tensors ({human_bytes(nbytes)}{read}) from "
        f"{len(loaded.files)} file(s) into {out} ({loaded.leaves} leaves)."
    )
    return 0

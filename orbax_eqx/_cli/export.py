"""`export`: a checkpoint's arrays as safetensors, through the bridge's
`export` (the work, every check and its words), with a progress bar."""

import os

import safetensors  # noqa: F401  (each file written is checked with its reader)

from .._bridge.export import export
from .._mapping.names import load as load_renames
from .render import Progress, human_bytes
from .skeleton import load_mapping


def run(args) -> int:
    path = args.path
    if args.item is not None:
        from .diff import side

        path = os.fspath(side(path, args.item).items[args.item])
    result = export(
        path,
        args.out,
        renames=load_renames(args.rename),
        mapping=load_mapping(args.mapping, args.skeleton),
        max_shard_size=args.max_shard_size,
        buffer=args.buffer,
        overwrite=args.overwrite,
        progress=lambda total: Progress("export", total),
    )
    files = result.files
    where = files[0] if len(files) == 1 else f"{len(files) - 1} files and {files[-1]}"
    print(
        f"Exported {result.tensors} tensors ({human_bytes(result.nbytes)}) to {where}."
    )
    if result.modules or result.in_metadata:
        print(
            f"The __metadata__ of each file holds the static fields of "
            f"{result.modules} modules and {result.in_metadata} non-array leaves."
        )
    if result.left_out:
        what = "mapping" if args.mapping else "rename map"
        print(f"The {what} left out {result.left_out} arrays.")
    return 0

"""The command line's `export` and `import`: thin layers over the bridge
(`orbax_eqx.export_safetensors`, `orbax_eqx.load_safetensors`), their
arguments and help."""

import argparse
import os

from .._errors import OrbaxEqxError
from .cli_commands import subcommand

_EXPORT_HELP = """\
Writes the arrays of a checkpoint as Hugging Face safetensors, reading and
writing a few arrays at a time, so memory stays near --buffer whatever the
size of the checkpoint.

Tensors are named by leaf name (layers.0.weight), or through --rename. Static
fields, Python leaves and class names go into the files' __metadata__ (under
"orbax_eqx", as JSON), with "format": "pt". Typed PRNG keys are written as
their key data (uint32). Tied weights are written once per leaf.

OUT is a directory: model.safetensors, or past --max-shard-size
model-00001-of-0000N.safetensors ... with model.safetensors.index.json, as
transformers' save_pretrained writes them. An OUT ending in .safetensors is
one file, whatever its size.

--rename names a JSON file: an object {"leaf name": "tensor name" or null}, or
a list of rules [["regex", "replacement" or null], ...] where the first rule
whose regex matches the whole leaf name applies (\\1 for groups). null leaves
the tensor out. An entry that matches nothing is an error.

--mapping names a JSON file of a state_dict mapping (what
orbax_eqx.StateDictMapping.to_json gives: renames, stacked layers, transposes,
split/fused tensors, dtypes, dropped leaves, ties), instead of --rename. A
mapping with field keys (field_keys) needs the model's classes: give
--skeleton module:function (see diff --help) to resolve them.

Needs the safetensors package: pip install 'orbax_eqx[safetensors]'.
"""

_IMPORT_HELP = """\
Saves an orbax_eqx checkpoint at OUT with the tensors of SOURCE, a .safetensors
file or a directory of them (with or without model.safetensors.index.json),
filling the skeleton given by --skeleton module:function (see diff --help).

Tensors are matched to leaves by name, through --rename (as for export, from
tensor names to leaf names), or through --mapping (a state_dict mapping's JSON,
as for export, read the other way: per-layer tensors stacked, transposes
undone, fused tensors split). Everything is checked before any tensor is
read: every array leaf needs a tensor of its shape and dtype (--cast casts to
the skeleton's dtypes), and every tensor must fill a leaf (--allow-unused
leaves the others out). Files written by export carry the saved static fields and
classes, checked against the skeleton's (--ignore-static keeps the skeleton's), and
Python leaves, which are restored from them; otherwise Python leaves, static
fields and callables are the skeleton's.
"""


def add_commands(commands, common, size) -> None:
    """Adds `export` and `import` to the subcommands `commands`; `common`: the
    parent parser of every command, `size`: the type of size arguments."""
    _add_export(commands, common, size)
    _add_import(commands, common)


def _add_names(parser) -> None:
    """Adds `--rename` and `--mapping`, either one, to `parser`."""
    names = parser.add_mutually_exclusive_group()
    names.add_argument("--rename", metavar="MAP", help="JSON rename map")
    names.add_argument("--mapping", metavar="FILE", help="JSON state_dict mapping")


def _add_export(commands, common, size) -> None:
    """Adds `export` to the subcommands `commands` (`common`: the shared options,
    `size`: the type of size arguments)."""
    export = subcommand(
        commands,
        common,
        "export",
        "write a checkpoint's arrays as safetensors",
        _EXPORT_HELP,
    )
    export.add_argument("path", metavar="PATH", help="checkpoint (item or step)")
    export.add_argument(
        "--to",
        default="safetensors",
        choices=("safetensors",),
        help="the format (default: safetensors, the only one so far)",
    )
    export.add_argument("out", metavar="OUT", help="directory, or file.safetensors")
    _add_names(export)
    export.add_argument(
        "--skeleton",
        metavar="MODULE:FUNCTION",
        help="the model's skeleton, to resolve a mapping's field keys",
    )
    export.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=size,
        default="5GB",
        help="most bytes per file, such as 2GB or 500MiB (default: 5GB)",
    )
    export.add_argument(
        "--buffer",
        metavar="SIZE",
        type=size,
        default="256MiB",
        help="array data held at once (default: 256MiB)",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace safetensors files in OUT"
    )
    export.add_argument(
        "--item", metavar="NAME", help="the item NAME of a step with several items"
    )
    export.set_defaults(run=_run_export)


def _add_import(commands, common) -> None:
    """Adds `import` to the subcommands `commands` (`common`: the shared options)."""
    import_ = subcommand(
        commands,
        common,
        "import",
        "save a checkpoint from safetensors, given a skeleton",
        _IMPORT_HELP,
    )
    import_.add_argument("source", metavar="SOURCE", help="file or directory")
    import_.add_argument("out", metavar="OUT", help="where to save the checkpoint")
    import_.add_argument(
        "--skeleton", required=True, metavar="MODULE:FUNCTION", help="the skeleton"
    )
    _add_names(import_)
    import_.add_argument(
        "--cast", action="store_true", help="cast tensors to the skeleton's dtypes"
    )
    import_.add_argument(
        "--allow-unused",
        action="store_true",
        help="leave out tensors that fill no leaf",
    )
    import_.add_argument(
        "--ignore-static",
        action="store_true",
        help="keep the skeleton's static fields and classes where the files "
        "record others",
    )
    import_.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint at OUT"
    )
    import_.set_defaults(run=_run_import)


def _run_export(args: argparse.Namespace) -> int:
    _need_safetensors("export")
    from .._restore.rename_map import load
    from .export import export
    from .text import human_bytes

    result = export(
        _item_path(args.path, args.item),
        args.out,
        renames=load(args.rename),
        mapping=_mapping(args.mapping, args.skeleton),
        max_shard_size=args.max_shard_size,
        buffer=args.buffer,
        overwrite=args.overwrite,
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


def _item_path(path: str, item: str | None) -> str:
    """PATH, or with `--item NAME` the directory of that item of it."""
    if item is None:
        return path
    from .diff_items import resolve

    return os.fspath(resolve(path, item).items[item])


def _mapping(path, skeleton):
    """The `--mapping` file, resolved against `--skeleton` if given."""
    if path is None:
        return None
    from .._mapping.mapping import StateDictMapping

    mapping = StateDictMapping.from_file(path)
    if skeleton is not None:
        from . import skeleton as _skeleton

        mapping = mapping.resolve(_skeleton.load(skeleton))
    return mapping


def _run_import(args: argparse.Namespace) -> int:
    # No safetensors package needed: the bridge reads the files itself.
    from .._restore.rename_map import load
    from . import skeleton as _skeleton
    from .importing import import_
    from .text import human_bytes

    renames = load(args.rename)
    skeleton = _skeleton.load(args.skeleton)
    result = import_(
        args.source,
        args.out,
        skeleton,
        renames=renames,
        mapping=_mapping(args.mapping, None),
        cast=args.cast,
        allow_unused=args.allow_unused,
        ignore_static=args.ignore_static,
        overwrite=args.overwrite,
    )
    print(
        f"Imported {result.tensors} tensors ({human_bytes(result.nbytes)}) from "
        f"{len(result.files)} file(s) into {result.path} ({result.leaves} leaves)."
    )
    return 0


def _need_safetensors(command: str) -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise _UsageError(
            f"{command} needs the safetensors package, which is not installed: "
            "pip install 'orbax_eqx[safetensors]' (or pip install safetensors)."
        ) from None


class _UsageError(OrbaxEqxError):
    """Something the command line cannot do as asked."""

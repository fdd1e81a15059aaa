"""The command line's `inspect`, `diff`, `verify` and `demo`: their arguments,
help and what each runs; and the types of their arguments."""

import argparse
import json
import math
import re
import sys

PROG = "orbax_eqx"

_INSPECT_HELP = """\
Shows what a checkpoint holds, from its sidecar alone (no array data is read):
every leaf with its shape, dtype and size, or its Python value; every module
with its class and static fields; totals; and the versions that wrote it.

The leaves are shown as a tree by module path: each module with its class,
static fields and the bytes stored under it; each array with its dtype, shape,
bytes, where its bytes are stored (the pack file, or Orbax's array store) and
the sharding it was saved with ("unsharded" for packed arrays: one device or
fully replicated; Orbax's record for arrays in its store); each Python leaf
with its value. List items alike all the way down (the layers of a model),
three or more in a row, show as the first and one row for the rest; --all
shows every one. --flat shows one row per leaf name instead.

PATH may be an item directory (it holds orbax_eqx.json), a step directory
(every orbax_eqx item in it is shown), or a CheckpointManager root (its steps
and their metrics are listed, the best and latest marked, then the latest step
is shown). Orbax does not record which metric made a step best: --best and
--mode say it (default: the lowest "loss").

--params counts the parameters (array elements) under every module and
container, and by dtype, from the metadata alone. --stats reads every array,
a piece at a time (memory stays near 64 MiB, or one chunk of Orbax's store
where larger), and shows per leaf its min, max, mean, std and L2 norm over its
finite elements, and its zero, NaN and Inf counts, then the --params tables;
exit status 1 if a leaf cannot be read. Their --json shape is described in
docs/guides/cli.md.

Plain Orbax checkpoints (saved by Orbax's PyTree or Standard handler, or
ocp.v1.save_pytree; no orbax_eqx sidecar) are shown from Orbax's own
metadata: every array with its shape, dtype, bytes and sharding, and the
handler that wrote it. A step's other items (JSON, a data loader's state)
are listed by name.

With --json, prints one JSON object: {"path", "steps": [{"step", "path",
"metrics"}], "step", "latest", "best": {"step", "metric", "mode"}, "items":
[{"path", "kind", "format_version", "versions", "leaves": {name: {...}},
"modules": {name: {...}}, "totals"}], "others": [{"name", "path",
"handler"}]}. Non-array values are given as the sidecar encodes them
("value") and as text ("text"); arrays have "sharding" where known. A plain
Orbax item has "kind": "plain Orbax", "handler", "ocdbt", "zarr3", "unread".
"""

_DIFF_HELP = """\
Compares two checkpoints, or a checkpoint and a skeleton, and lists every
difference: leaves only in A or only in B, and leaves whose kind, shape, dtype,
Python value or tying differs; modules whose class or static fields differ.
Against a skeleton, Python values are compared by type only, as restore does.

A and B are checkpoints, or skeletons given as `module:function` (or
`path/to/file.py:function`): a function of no arguments that returns the
skeleton, such as `eqx.filter_eval_shape(make_model, key)`. A checkpoint is an
item directory, a step directory or a CheckpointManager root (its latest
step). Two steps (or roots) are compared item by item, paired by name: items
only one side holds are differences, and other items both hold (JSON, a data
loader's state) are named, not compared. --item NAME compares that item of
each side that is a step or a root. Plain Orbax checkpoints (no orbax_eqx
sidecar: Orbax's PyTree or Standard handler, v0 or v1) are compared by their
arrays, against each other or an orbax_eqx checkpoint.
The module is imported from the current directory or PYTHONPATH; a file under
the name your code imports it by (path/to/tmodel.py as tmodel, from its
directory; a file in a package as package.tmodel), so that the classes of a
checkpoint made from it are recorded as tmodel.Net.

With --values, the arrays both checkpoints hold with the same shape are read,
a few at a time (--buffer), and compared: integers and booleans exactly,
floats as numpy.isclose(a, b, rtol, atol) with B as the reference. Each leaf's
largest absolute and relative (|a - b| / max(|a|, |b|)) difference is shown;
typed PRNG keys are compared as keys, each equal or not.

Exit status: 0 if A and B do not differ, 1 if they do, 2 on an error.
"""

_VERIFY_HELP = """\
Reads every array of a checkpoint and checks it against the checksum recorded
when it was saved (a CRC-32 for packed arrays, a 32-bit weighted sum for
arrays stored through Orbax). Each leaf whose data does not match, or cannot
be read, is listed with its leaf path. Arrays are read one at a time (packed
ones in 64 MiB pieces), so memory stays near the largest sharded array.

PATH may be an item directory, a step directory (every orbax_eqx item in it
is checked) or a CheckpointManager root: every finished step is checked, each
reported as it would be alone, then which steps are damaged and which is the
newest sound one (--latest checks the latest step only). A step whose sidecar
cannot be read counts as damaged there, and the other steps are still checked.

Exit status: 0 if every array matches, 1 if any leaf (or a root's step) is
damaged, 2 if the checkpoint cannot be read at all (no sidecar, or a damaged
one) or a file may not be read by this user.
"""

_DEMO_HELP = """\
Trains a small Equinox model (an MLP with BatchNorm and eqx.nn.State) for a
few steps with optax, saves every step asynchronously through an Orbax
CheckpointManager with orbax_eqx.EqxHandler, keeps the 3 best by loss, then
restores the best step into a skeleton from eqx.filter_eval_shape and checks
that the restored model has the same loss and parameters as the saved one.
Needs optax.
"""


def subcommand(commands, common, name: str, help: str, description: str):
    """Adds the subcommand `name` to `commands`, with the shared options
    `common`, a one-line `help` and a `description` shown as written."""
    return commands.add_parser(
        name,
        parents=[common],
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_inspect(commands, common) -> None:
    """Adds `inspect` to the subcommands `commands` (`common`: the shared options)."""
    inspect = subcommand(
        commands,
        common,
        "inspect",
        "show what a checkpoint holds, without reading array data",
        _INSPECT_HELP,
    )
    inspect.add_argument("path", metavar="PATH", help="item, step or manager root")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--flat", action="store_true", help="one row per leaf name, not a tree"
    )
    inspect.add_argument(
        "--all",
        action="store_true",
        dest="every",
        help="every list item in the tree (by default, 3 or more alike in a row "
        "show the first and one row for the rest)",
    )
    inspect.add_argument(
        "--best",
        metavar="METRIC",
        default="loss",
        help="the metric that picks the best step of a manager root (default: loss)",
    )
    inspect.add_argument(
        "--mode",
        choices=("min", "max"),
        default="min",
        help="whether the best step has the lowest or highest METRIC (default: min)",
    )
    inspect.add_argument(
        "--params",
        action="store_true",
        help="parameter counts per module subtree and per dtype",
    )
    inspect.add_argument(
        "--stats",
        action="store_true",
        help="read every array: min, max, mean, std, L2, NaN/Inf/zero counts",
    )
    inspect.add_argument(
        "--depth",
        type=positive_int,
        metavar="N",
        help="with --params/--stats: subtrees down to N levels (default: all)",
    )
    inspect.set_defaults(run=_run_inspect)


def add_diff(commands, common) -> None:
    """Adds `diff` to the subcommands `commands` (`common`: the shared options)."""
    diff = subcommand(
        commands,
        common,
        "diff",
        "compare two checkpoints, or a checkpoint and a skeleton",
        _DIFF_HELP,
    )
    diff.add_argument("a", metavar="A", help="checkpoint, or module:function")
    diff.add_argument("b", metavar="B", help="checkpoint, or module:function")
    diff.add_argument("--values", action="store_true", help="compare array data too")
    diff.add_argument(
        "--rtol", type=tolerance, default=1e-5, help="relative tolerance (1e-5)"
    )
    diff.add_argument(
        "--atol", type=tolerance, default=1e-8, help="absolute tolerance (1e-8)"
    )
    diff.add_argument(
        "--buffer",
        metavar="SIZE",
        type=size,
        default="256MiB",
        help="array data held at once, such as 512MiB (default: 256MiB)",
    )
    diff.add_argument(
        "--item",
        metavar="NAME",
        help="compare the item NAME of each side (steps with several items)",
    )
    diff.add_argument("--json", action="store_true", help="print JSON")
    diff.set_defaults(run=_run_diff)


def add_verify(commands, common) -> None:
    """Adds `verify` to the subcommands `commands` (`common`: the shared options)."""
    verify = subcommand(
        commands,
        common,
        "verify",
        "check every array of a checkpoint against its checksum",
        _VERIFY_HELP,
    )
    verify.add_argument("path", metavar="PATH", help="item, step or manager root")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.add_argument(
        "--latest",
        action="store_true",
        help="on a CheckpointManager root, check the latest step only",
    )
    verify.set_defaults(run=_run_verify)


def add_demo(commands, common) -> None:
    """Adds `demo` to the subcommands `commands` (`common`: the shared options)."""
    demo = subcommand(
        commands,
        common,
        "demo",
        "train, checkpoint and restore a small model",
        _DEMO_HELP,
    )
    demo.add_argument(
        "--dir",
        default="demo_checkpoints",
        help="where to save (default: ./demo_checkpoints); an earlier demo's "
        "checkpoints there are replaced, anything else is left alone",
    )
    demo.add_argument(
        "--steps", type=positive_int, default=10, help="training steps (default: 10)"
    )
    demo.set_defaults(run=_run_demo)


def _run_inspect(args: argparse.Namespace) -> int:
    if args.params or args.stats:
        from .numbers_text import run

        return run(args)
    from .inspect import gather, to_json
    from .inspect_text import to_text

    report = gather(args.path, args.best, args.mode)
    if args.json:
        print(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    else:
        print(to_text(report, flat=args.flat, every=args.every), end="")
    return 0


def _run_diff(args: argparse.Namespace) -> int:
    from .diff_text import run

    return run(args)


def _run_verify(args: argparse.Namespace) -> int:
    from .verify_text import run

    return run(args)


def _run_demo(args: argparse.Namespace) -> int:
    try:
        from . import demo as _demo
    except ModuleNotFoundError as e:
        if e.name != "optax":
            raise
        print(
            f"{PROG}: error: the demo trains with optax, which is not installed; "
            "`pip install optax` and run it again.",
            file=sys.stderr,
        )
        return 2
    return 0 if _demo.run(args.dir, args.steps) else 1


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(i?)B?\s*", re.I)


def size(text: str) -> int:
    """`5GB` (10**9 bytes), `256MiB` (2**20), `1000`: a size in bytes.

    Written here, not taken from a library: humanfriendly's `parse_size` (the
    one that does this) reads `256Mi` as 256 MB, not MiB.
    """
    match = _SIZE.fullmatch(text)
    if not match or (match.group(3) and not match.group(2)):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 5GB, 500MB, 256MiB or 1000000, got {text!r}"
        )
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    value = int(float(number) * (1024 if binary else 1000) ** power)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected a tolerance, a number >= 0, got {text!r}"
        )
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value

"""The command line: `python -m orbax_eqx {inspect,diff,verify,export,import,demo}`.

Also installed as the `orbax-eqx` script. Every failure is one line on stderr
and exit status 2, whatever raised it (a damaged checkpoint says what is wrong;
anything unforeseen is named with its command); `--debug` shows the traceback
instead. Long commands draw a progress bar on stderr when it is a terminal,
and nothing in a pipe.
"""

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence

from .._errors import OrbaxEqxError
from . import cli_safetensors as _safetensors
from .text import printable_lines

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
with its value. --flat shows one row per leaf name instead.

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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    **Arguments:**

    - `argv`: the arguments, without the program name; default `sys.argv[1:]`.

    **Returns:** the exit status: 0 on success, 1 if the demo's checks fail
    or `diff` finds differences, 2 on a bad path, a damaged checkpoint or bad
    usage.
    """
    args = _parser().parse_args(argv)
    _escape_unprintable(sys.stdout)
    _escape_unprintable(sys.stderr)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Inert(sys.stdout), _Inert(sys.stderr)
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = streams


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error worth a message.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (OrbaxEqxError, OSError) as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # The last line of defence: whatever else went wrong is still one line.
        if args.debug:
            raise
        print(
            f"{PROG}: error: {args.command} failed: {type(e).__name__}: "
            f"{_first_line(e)} (--debug shows the traceback)",
            file=sys.stderr,
        )
        return 2


class _Inert:
    """A text stream that escapes control characters other than newline and
    tab (ESC, CR, BEL...) in what is written: a checkpoint's names and values
    cannot drive the terminal. (Names are also printed one line each, see
    `text.printable`.) `write_raw` is for our own progress bar."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable_lines(text))

    def write_raw(self, text: str) -> int:
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _escape_unprintable(stream) -> None:
    """Prints text the terminal's encoding cannot hold as escapes, not an error.

    Leaf names from old checkpoints can hold lone surrogates (from
    `os.fsdecode`), which no encoding prints.
    """
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # already written to, or not a real stream
            pass


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, compare, export and import orbax_eqx checkpoints, "
        "or run a short demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error"
    )
    commands = parser.add_subparsers(title="commands", dest="command", required=True)

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="show what a checkpoint holds, without reading array data",
        description=_INSPECT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("path", metavar="PATH", help="item, step or manager root")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--flat", action="store_true", help="one row per leaf name, not a tree"
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
        type=_positive_int,
        metavar="N",
        help="with --params/--stats: subtrees down to N levels (default: all)",
    )
    inspect.set_defaults(run=_run_inspect)

    diff = commands.add_parser(
        "diff",
        parents=[common],
        help="compare two checkpoints, or a checkpoint and a skeleton",
        description=_DIFF_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("a", metavar="A", help="checkpoint, or module:function")
    diff.add_argument("b", metavar="B", help="checkpoint, or module:function")
    diff.add_argument("--values", action="store_true", help="compare array data too")
    diff.add_argument(
        "--rtol", type=_tolerance, default=1e-5, help="relative tolerance (1e-5)"
    )
    diff.add_argument(
        "--atol", type=_tolerance, default=1e-8, help="absolute tolerance (1e-8)"
    )
    diff.add_argument(
        "--buffer",
        metavar="SIZE",
        type=_size,
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

    _safetensors.add_commands(commands, common, _size)

    verify = commands.add_parser(
        "verify",
        parents=[common],
        help="check every array of a checkpoint against its checksum",
        description=_VERIFY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("path", metavar="PATH", help="item, step or manager root")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.add_argument(
        "--latest",
        action="store_true",
        help="on a CheckpointManager root, check the latest step only",
    )
    verify.set_defaults(run=_run_verify)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="train, checkpoint and restore a small model",
        description=_DEMO_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--dir",
        default="demo_checkpoints",
        help="where to save (default: ./demo_checkpoints); an earlier demo's "
        "checkpoints there are replaced, anything else is left alone",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=10, help="training steps (default: 10)"
    )
    demo.set_defaults(run=_run_demo)
    return parser


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
        print(to_text(report, flat=args.flat), end="")
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


def _size(text: str) -> int:
    """`5GB` (10**9 bytes), `256MiB` (2**20), `1000`: a size in bytes."""
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


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected a tolerance, a number >= 0, got {text!r}"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _one_line(error: BaseException) -> str:
    """An error's message on one line: the state_dict bridge's messages list
    their problems on lines of their own (`  - ...`), joined here with `; `."""
    from .._bridge.errors import BridgeError

    if not isinstance(error, BridgeError):
        return _first_line(error)
    lines = [line.strip() for line in str(error).strip().splitlines()]
    out = ""
    for line in lines:
        if line.startswith("- "):
            out += (" " if out.endswith(":") else "; ") + line[2:]
        elif line:
            out += ("" if not out else " ") + line
    return out or type(error).__name__


def _first_line(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # a message that cannot be made: an int too long, say
        text = ""
    lines = text.strip().splitlines()
    return lines[0] if lines else type(error).__name__

"""The command line: `python -m orbax_eqx {inspect,demo}` (also `orbax-eqx`)."""

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ._errors import OrbaxEqxError

PROG = "orbax_eqx"

_INSPECT_HELP = """\
Shows what a checkpoint holds, from its sidecar alone (no array data is read):
every leaf with its shape, dtype and size, or its Python value; every module
with its class and static fields; totals; and the versions that wrote it.

PATH may be an item directory (it holds orbax_eqx.json), a step directory
(every orbax_eqx item in it is shown), or a CheckpointManager root (its steps
and their metrics are listed, then the latest step is shown).

With --json, prints one JSON object: {"path", "steps": [{"step", "path",
"metrics"}], "step", "items": [{"path", "format_version", "versions",
"leaves": {name: {...}}, "modules": {name: {...}}, "totals"}]}. Non-array
values are given as the sidecar encodes them ("value") and as text ("text").
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

    **Returns:** the exit status: 0 on success, 1 if the demo's checks fail,
    2 on a bad path, a damaged checkpoint or bad usage.
    """
    args = _parser().parse_args(argv)
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
        print(f"{PROG}: error: {_first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect orbax_eqx checkpoints, or run a short demo.",
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
    inspect.set_defaults(run=_run_inspect)

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
    from ._inspect import gather, to_json, to_text

    report = gather(args.path)
    if args.json:
        print(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    else:
        print(to_text(report), end="")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    try:
        from . import _demo
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__

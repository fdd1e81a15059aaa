"""`python -m orbax_eqx` (also the `orbax-eqx` script): the arguments of every
command, and the one place errors become what a person reads.

Exit status: 0 on success; 1 when the command found what it looks for
(`diff`: differences; `verify`, `inspect --stats`: damage; `inspect` of
safetensors through a mapping: problems; `demo`: a failed check); 2 when it
cannot run (a bad path or argument, a checkpoint that cannot be read at
all). An error is its message on stderr, one problem a line, without a
traceback (`--debug` shows one); long commands draw a progress bar on stderr
when it is a terminal.
"""

import argparse
import importlib
import math
import os
import re
import sys
from collections.abc import Sequence

from .._errors import OrbaxEqxError
from .._gc import paused
from .render import PROG, error_lines, print_error, printable_lines, unforeseen


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    **Arguments:**

    - `argv`: the arguments, without the program name; default `sys.argv[1:]`.

    **Returns:** the exit status (see the module's doc).
    """
    args = _parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        try:  # names from old checkpoints may hold lone surrogates
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass
    streams, hook = (sys.stdout, sys.stderr), sys.unraisablehook
    sys.stdout, sys.stderr = _Inert(sys.stdout), _Inert(sys.stderr)
    if not args.debug:
        sys.unraisablehook = _quiet(hook)
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = streams
        sys.unraisablehook = hook


# The module of each command, and the packages some need, by their extras.
_MODULES = {"stats": "inspect", "import": "import_"}
_EXTRAS = {"safetensors": "safetensors", "optax": "demo"}


def _run(args: argparse.Namespace) -> int:
    try:
        name = _MODULES.get(args.command, args.command)
        module = importlib.import_module(f"{__package__}.{name}")
        with paused():  # objects per leaf, thousands of them: see `_gc`
            return module.run(args)
    except ModuleNotFoundError as e:
        if e.name not in _EXTRAS or args.debug:
            raise
        print_error(
            [
                f"{args.command} needs the {e.name} package, which is not installed: "
                f"pip install 'orbax_eqx[{_EXTRAS[e.name]}]' (or pip install {e.name})."
            ]
        )
        return 2
    except BrokenPipeError:  # the reader went away (`... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except (OrbaxEqxError, OSError) as e:
        if args.debug:
            raise
        print_error(error_lines(e))
        return 2
    except Exception as e:  # the last line of defence: still no traceback
        if args.debug:
            raise
        print_error([unforeseen(args.command, e)])
        return 2


def _quiet(hook):
    """`hook`, but for what Orbax and TensorStore leave behind after a read
    failed (reads finishing on a closed event loop, abandoned coroutines):
    the error reported says what went wrong."""

    def quiet(unraisable) -> None:
        text = str(unraisable.exc_value)
        if "Event loop is closed" in text or type(unraisable.object).__name__ in (
            "coroutine",
            "Task",
        ):
            return
        hook(unraisable)

    return quiet


class _Inert:
    """A text stream that escapes control characters (but newline and tab) in
    what is written; `write_raw` is for the progress bar."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable_lines(text))

    def write_raw(self, text: str) -> int:
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


# ---------------------------------------------------------------- arguments

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(i?)B?\s*", re.I)


def size(text: str) -> int:
    """`5GB` (10**9 bytes), `256MiB` (2**20), `1000`: a size in bytes."""
    match = _SIZE.fullmatch(text)
    if not match or (match[3] and not match[2]):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 5GB, 500MB, 256MiB or 1000000, got {text!r}"
        )
    power = "KMGT".find(match[2].upper()) + 1 if match[2] else 0
    value = int(float(match[1]) * (1024 if match[3] else 1000) ** power)
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
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_GUIDE = "Every command, its output and --json: docs/guides/cli.md."
_HELP = {
    "inspect": (
        "show what a checkpoint or safetensors holds, without reading array data",
        "PATH: an item, a step (each item), a CheckpointManager root (its steps, "
        "then the latest), a plain Orbax checkpoint, or safetensors (a file, a "
        "directory of them, an index). Runs of 3 or more alike list items fold "
        "into one row (--all shows each). With --skeleton (and --mapping), "
        "safetensors are lined up with the skeleton as `import` would, reading "
        "no tensor: exit status 1 if they do not fit. --stats reads every array "
        "(exit status 1 if one is damaged).",
    ),
    "diff": (
        "compare two checkpoints, or a checkpoint and a skeleton",
        "A and B: checkpoints (items, steps item by item, manager roots' latest "
        "steps), or skeletons as `module:function` or `path/to/file.py:function` "
        "(a function of no arguments returning the skeleton). Exit status: 0 if "
        "they do not differ, 1 if they do, 2 on an error.",
    ),
    "verify": (
        "check every array of a checkpoint against its checksum",
        "PATH: an item, a step, a manager root (every step, or --latest), a plain "
        "Orbax checkpoint (its arrays read back), or safetensors (the checksums "
        "export records, where a file has them). Exit status: 0 if sound, 1 if "
        "damaged, 2 if it cannot be read at all.",
    ),
    "export": (
        "write a checkpoint's arrays as safetensors",
        "OUT: a directory (model.safetensors, or sharded past --max-shard-size "
        "with an index), or a file ending in .safetensors. --rename: a JSON "
        '{"leaf": "tensor" or null} or [["regex", "replacement" or null], ...]; '
        "--mapping: a StateDictMapping's JSON. Needs the safetensors package.",
    ),
    "import": (
        "save a checkpoint from safetensors, given a skeleton",
        "SOURCE: a .safetensors file or a directory of them. Every problem is "
        "listed before any tensor is read.",
    ),
    "demo": (
        "train, checkpoint and restore a small model",
        "Trains a small MLP with BatchNorm with optax, saves every step through a "
        "CheckpointManager that keeps the 3 best, restores the best into a "
        "skeleton and checks it. Needs optax.",
    ),
}


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, compare, verify, export and import orbax_eqx "
        "checkpoints, or run a short demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="show the traceback of an error"
    )
    commands = parser.add_subparsers(title="commands", dest="command", required=True)

    def command(name: str, help_name: str | None = None):
        short, long = _HELP[help_name or name]
        return commands.add_parser(
            name, parents=[common], help=short, description=f"{long} {_GUIDE}"
        )

    for name in ("inspect", "stats"):
        _inspect(command(name, "inspect"), stats=name == "stats")
    _diff(command("diff"))
    verify = command("verify")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.add_argument(
        "--latest", action="store_true", help="a root's latest step only"
    )
    _export(command("export"))
    _import(command("import"))
    demo = command("demo")
    demo.add_argument(
        "--dir",
        default="demo_checkpoints",
        help="where to save (default: ./demo_checkpoints); an earlier demo's "
        "checkpoints there are replaced, anything else is left alone",
    )
    demo.add_argument("--steps", type=positive_int, default=10, help="default: 10")
    return parser


def _inspect(p: argparse.ArgumentParser, stats: bool) -> None:
    p.set_defaults(stats=stats)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--flat", action="store_true", help="one row per leaf or tensor")
    p.add_argument("--all", action="store_true", dest="every", help="fold nothing")
    p.add_argument("--best", metavar="METRIC", default="loss", help="default: loss")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="default: min")
    p.add_argument("--params", action="store_true", help="parameter counts")
    if not stats:
        p.add_argument("--stats", action="store_true", help="read every array")
    p.add_argument("--depth", type=positive_int, metavar="N", help="subtrees' depth")
    p.add_argument("--skeleton", metavar="MODULE:FUNCTION", help="line safetensors up")
    p.add_argument("--mapping", metavar="FILE", help="a StateDictMapping's JSON")
    _load_options(p)


def _load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cast", action="store_true", help="cast to the skeleton's dtypes")
    p.add_argument(
        "--allow-unused", action="store_true", help="leave out extra tensors"
    )
    p.add_argument(
        "--ignore-static", action="store_true", help="keep the skeleton's static fields"
    )


def _diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="checkpoint, or module:function")
    p.add_argument("b", metavar="B", help="checkpoint, or module:function")
    p.add_argument("--values", action="store_true", help="compare array data too")
    p.add_argument("--rtol", type=tolerance, default=1e-5, help="default: 1e-5")
    p.add_argument("--atol", type=tolerance, default=1e-8, help="default: 1e-8")
    p.add_argument(
        "--buffer", metavar="SIZE", type=size, default="256MiB", help="data held"
    )
    p.add_argument("--item", metavar="NAME", help="that item of each step")
    p.add_argument("--json", action="store_true", help="print JSON")


def _names(p: argparse.ArgumentParser) -> None:
    names = p.add_mutually_exclusive_group()
    names.add_argument("--rename", metavar="MAP", help="JSON rename map")
    names.add_argument("--mapping", metavar="FILE", help="JSON state_dict mapping")


def _export(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint (item or step)")
    p.add_argument(
        "--to",
        default="safetensors",
        choices=("safetensors",),
        help="default: safetensors",
    )
    p.add_argument("out", metavar="OUT", help="directory, or file.safetensors")
    _names(p)
    p.add_argument("--skeleton", metavar="MODULE:FUNCTION", help="for field keys")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=size,
        default="5GB",
        help="default: 5GB",
    )
    p.add_argument(
        "--buffer", metavar="SIZE", type=size, default="256MiB", help="default: 256MiB"
    )
    p.add_argument("--overwrite", action="store_true", help="replace files in OUT")
    p.add_argument("--item", metavar="NAME", help="that item of a step")


def _import(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="file or directory")
    p.add_argument("out", metavar="OUT", help="where to save the checkpoint")
    p.add_argument("--skeleton", required=True, metavar="MODULE:FUNCTION")
    _names(p)
    _load_options(p)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint")

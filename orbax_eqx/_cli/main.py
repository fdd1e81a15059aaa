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
        # Run as the program (no `argv`), the quiet hook stays until exit:
        # reads abandoned by a failed one may finish as the interpreter ends.
        if argv is not None:
            sys.unraisablehook = hook


# The module of each command, and the packages some need, by their extras.
_MODULES = {"stats": "inspect", "import": "import_", "copy": "copy_step"}
_EXTRAS = {"safetensors": "safetensors", "optax": "demo"}


def _run(args: argparse.Namespace) -> int:
    try:
        name = _MODULES.get(args.command, args.command)
        if name in ("inspect", "verify"):
            from .safetensors_files import names_safetensors

            name = "safetensors_files" if names_safetensors(args.path) else name
        module = importlib.import_module(f"{__package__}.{name}")
        with paused():  # objects per leaf, thousands of them: see `_gc`
            return module.run(args)
    except BrokenPipeError:  # the reader went away (`... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the one handler: whatever it is, no traceback
        if args.debug:
            raise
        if isinstance(e, ModuleNotFoundError) and e.name in _EXTRAS:
            lines = [
                f"{args.command} needs the {e.name} package, which is not installed: "
                f"pip install 'orbax_eqx[{_EXTRAS[e.name]}]' (or pip install {e.name})."
            ]
        elif isinstance(e, (OrbaxEqxError, OSError)):
            lines = error_lines(e)
        else:  # unforeseen: named with its command
            lines = [unforeseen(args.command, e)]
        print_error(lines)
        return 2


def _quiet(hook):
    """`hook`, but for what Orbax and TensorStore leave behind after a read
    failed (reads finishing on a closed event loop, abandoned coroutines):
    the error reported says what went wrong."""

    def quiet(unraisable) -> None:
        closed = "Event loop is closed" in str(unraisable.exc_value)
        if not closed and type(unraisable.object).__name__ not in ("coroutine", "Task"):
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


# Each command's one-line help, then what its page says in full.
_HELP = {
    "inspect": "show what a checkpoint or safetensors holds, reading no array",
    "stats": "the values of every array: inspect --stats",
    "diff": "compare two checkpoints, or a checkpoint and a skeleton",
    "verify": "check every array of a checkpoint against its checksum",
    "export": "write a checkpoint's arrays as safetensors",
    "import": "save a checkpoint from safetensors, given a skeleton",
    "copy": "copy a step saved with dedup=True with every byte it needs",
    "prune": "delete the shared bytes beside a manager's steps that no step needs",
    "demo": "train, checkpoint and restore a small model (needs optax)",
}
_GUIDE = "What each command shows, its --json and its exit status: docs/guides/cli.md"
_FLAGS = {  # store_true options, by the commands that take them
    "--json": ("print JSON", "inspect stats diff verify"),
    "--flat": ("one row per leaf or tensor", "inspect stats"),
    "--all": ("fold no alike rows", "inspect stats"),
    "--params": ("parameter counts per subtree and dtype", "inspect stats"),
    "--stats": ("read every array: min, max, mean, std, L2, NaN/Inf", "inspect"),
    "--latest": ("of a manager root, the latest step only", "verify"),
    "--values": ("compare array data too", "diff"),
    "--cast": ("cast tensors to the skeleton's dtypes", "inspect stats import"),
    "--allow-unused": ("leave out tensors that fill no leaf", "inspect stats import"),
    "--ignore-static": ("keep the skeleton's static fields", "inspect stats import"),
    "--overwrite": ("replace what is at OUT", "export import"),
}


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(prog=PROG, description=_GUIDE)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    for name, help in _HELP.items():
        text = f"{help[0].upper()}{help[1:]}. {_GUIDE}."
        p = commands.add_parser(name, parents=[common], help=help, description=text)
        p.set_defaults(stats=name == "stats")
        for flag, (text, where) in _FLAGS.items():
            if name in where.split():
                dest = "every" if flag == "--all" else flag[2:].replace("-", "_")
                p.add_argument(flag, action="store_true", help=text, dest=dest)
        _ARGUMENTS.get(name, lambda p: None)(p)
    return parser


def _inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH")
    p.add_argument("--best", metavar="METRIC", default="loss", help="default: loss")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="default: min")
    p.add_argument("--depth", type=positive_int, metavar="N", help="subtrees' depth")
    p.add_argument("--skeleton", metavar="MODULE:FUNCTION", help="line tensors up")
    p.add_argument("--mapping", metavar="FILE", help="JSON state_dict mapping")


def _diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="checkpoint, or module:function")
    p.add_argument("b", metavar="B", help="checkpoint, or module:function")
    p.add_argument("--rtol", type=tolerance, default=1e-5, help="default: 1e-5")
    p.add_argument("--atol", type=tolerance, default=1e-8, help="default: 1e-8")
    p.add_argument("--buffer", metavar="SIZE", type=size, default="256MiB")
    p.add_argument("--item", metavar="NAME", help="that item of each step")


def _names(p: argparse.ArgumentParser) -> None:
    names = p.add_mutually_exclusive_group()
    names.add_argument("--rename", metavar="MAP", help="JSON rename map")
    names.add_argument("--mapping", metavar="FILE", help="JSON state_dict mapping")


def _export(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint (item or step)")
    p.add_argument("out", metavar="OUT", help="directory, or file.safetensors")
    p.add_argument(
        "--to",
        default="safetensors",
        choices=("safetensors",),
        help="default: safetensors",
    )
    _names(p)
    p.add_argument("--skeleton", metavar="MODULE:FUNCTION", help="for field keys")
    p.add_argument("--max-shard-size", metavar="SIZE", type=size, default="5GB")
    p.add_argument("--buffer", metavar="SIZE", type=size, default="256MiB")
    p.add_argument("--item", metavar="NAME", help="that item of a step")


def _import(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="file or directory")
    p.add_argument("out", metavar="OUT", help="where to save the checkpoint")
    p.add_argument("--skeleton", required=True, metavar="MODULE:FUNCTION")
    _names(p)


def _demo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", default="demo_checkpoints", help="default: demo_checkpoints"
    )
    p.add_argument("--steps", type=positive_int, default=10, help="default: 10")


_ARGUMENTS = {
    "inspect": _inspect,
    "stats": _inspect,
    "diff": _diff,
    "verify": lambda p: p.add_argument("path", metavar="PATH"),
    "export": _export,
    "import": _import,
    "demo": _demo,
    "copy": lambda p: (
        p.add_argument("step", metavar="STEP", help="step directory"),
        p.add_argument("out", metavar="OUT", help="a new directory"),
    ),
    "prune": lambda p: p.add_argument("root", metavar="ROOT", help="manager root"),
}

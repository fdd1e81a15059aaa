"""The command line: `python -m orbax_eqx {inspect,diff,verify,export,import,demo}`.

Also installed as the `orbax-eqx` script. Every failure is one line on stderr
and exit status 2, whatever raised it (a damaged checkpoint says what is wrong;
anything unforeseen is named with its command); `--debug` shows the traceback
instead. Long commands draw a progress bar on stderr when it is a terminal,
and nothing in a pipe.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from .._errors import OrbaxEqxError, first_line
from .._gc import paused
from . import cli_commands as _commands
from . import cli_safetensors as _safetensors
from .cli_commands import PROG
from .text import printable_lines


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
        with paused():  # objects per leaf, thousands of them: see `_gc`
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
            f"{first_line(e)} (--debug shows the traceback)",
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
    _commands.add_inspect(commands, common)
    _commands.add_diff(commands, common)
    _safetensors.add_commands(commands, common, _commands.size)
    _commands.add_verify(commands, common)
    _commands.add_demo(commands, common)
    return parser


def _one_line(error: BaseException) -> str:
    """An error's message on one line: the state_dict bridge's messages list
    their problems on lines of their own (`  - ...`), joined here with `; `."""
    from .._mapping.errors import BridgeError

    if not isinstance(error, BridgeError):
        return first_line(error)
    lines = [line.strip() for line in str(error).strip().splitlines()]
    out = ""
    for line in lines:
        if line.startswith("- "):
            out += (" " if out.endswith(":") else "; ") + line[2:]
        elif line:
            out += ("" if not out else " ") + line
    return out or type(error).__name__

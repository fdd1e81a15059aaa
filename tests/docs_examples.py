"""Runs the code blocks of a Markdown page, in order, in the current directory.

The blocks of one page are one program: they share a namespace, and files one
block writes are there for the next. What each kind of fenced block does:

- ```` ```python ````: run. A block that starts with `>>>` is a doctest: its
    output (or traceback) must match, `...` matching anything.
- ```` ```console ````: each `$ command` runs in a shell (`python` is this
    interpreter) and what it prints, stdout and stderr together, must match the
    lines below it; `...` matches anything, and the current directory is shown
    as `/path/to`.
- ```` ```LANG title="NAME" ````: written to the file NAME, for later blocks.
- ```` ```bash ````: not run (setting up a virtual environment, serving the
    docs, hour-long benchmarks). Any other language is an error, so that no
    example escapes the tests by accident.

Run one page by hand: `python tests/docs_examples.py docs/guides/cli.md` (in
an empty directory, as the tests do).
"""

import atexit
import difflib
import doctest
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable

from sybil import Document, Example, Region
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

NOT_RUN = "bash"
SHOWN_AS = "/path/to"  # how console output shows the directory it ran in
_FLAGS = doctest.ELLIPSIS
_TITLE = re.compile(r'title="([^"/]+)"')
_INFO = re.compile(r"(?P<language>[\w-]*)(?P<attributes>[^\n]*)$\n", re.M)


def fenced_blocks(document: Document) -> Iterable[Region]:
    """Every fenced block of `document`, with its language and attributes."""
    return RawFencedCodeBlockLexer(info_pattern=_INFO)(document)


class _FileParser:
    """Blocks with `title="NAME"`: written to NAME in the current directory."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in fenced_blocks(document):
            title = _TITLE.search(region.lexemes["attributes"])
            if title:
                region.parsed = (title.group(1), region.lexemes["source"])
                region.evaluator = _write_file
                yield region


def _write_file(example: Example) -> None:
    name, text = example.parsed
    with open(name, "w", encoding="utf-8") as f:
        f.write(text)


class _ConsoleParser:
    """```` ```console ```` blocks: `$ command` lines and what they print."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in fenced_blocks(document):
            if region.lexemes["language"] == "console":
                region.parsed = _commands(region.lexemes["source"])
                region.evaluator = _run_console
                yield region


def _commands(text: str) -> list[tuple[str, str]]:
    commands: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif not commands:
            raise ValueError(f"console block does not start with `$ `: {line!r}")
        else:
            commands[-1][1].append(line)
    return [(command, "\n".join(lines)) for command, lines in commands]


def _run_console(example: Example) -> str | None:
    cwd = os.getcwd()
    # The package under test (this checkout), not whichever copy is installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "PATH": _python_dir() + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")])
        ),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",  # keeps stdout and stderr in order
    }
    for command, want in example.parsed:
        got = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        ).stdout
        for directory in {os.path.realpath(cwd), cwd}:
            got = got.replace(directory, SHOWN_AS)
        got, want = _trimmed(got), _trimmed(want)
        if not doctest.OutputChecker().check_output(want + "\n", got + "\n", _FLAGS):
            diff = "\n".join(
                difflib.unified_diff(
                    want.splitlines(), got.splitlines(), "expected", "got", lineterm=""
                )
            )
            return f"`$ {command}` printed something else:\n{diff}"
    return None


def _trimmed(text: str) -> str:
    """Without trailing whitespace, on each line and at the end."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


_PYTHON_DIR: list[str] = []


def _python_dir() -> str:
    """A directory whose `python` runs this interpreter, for console commands."""
    if not _PYTHON_DIR:
        directory = tempfile.mkdtemp(prefix="docs-python-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        script = os.path.join(directory, "python")
        with open(script, "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(script, 0o755)
        _PYTHON_DIR.append(directory)
    return _PYTHON_DIR[0]


def parse(path: str) -> Document:
    """The page at `path`, with an example for every block that runs."""
    return Document.parse(
        path,
        PythonCodeBlockParser(doctest_optionflags=_FLAGS),
        _FileParser(),
        _ConsoleParser(),
    )


def unknown_blocks(path: str) -> list[str]:
    """`line: language` of every block of the page that would neither run nor
    be written to a file, other than `bash` ones."""
    with open(path, encoding="utf-8") as f:
        document = Document(f.read(), path)
    known = ("python", "console", NOT_RUN)
    return [
        f"{document.line_column(region.start)}: {region.lexemes['language']!r}"
        for region in fenced_blocks(document)
        if region.lexemes["language"] not in known
        and not _TITLE.search(region.lexemes["attributes"])
    ]


def run(path: str) -> int:
    """Runs every example of the page at `path`; returns how many ran."""
    document = parse(path)
    count = 0
    for example in document:
        example.evaluate()
        count += 1
    return count


if __name__ == "__main__":
    (page,) = sys.argv[1:]
    print(f"{run(page)} examples of {page} passed")

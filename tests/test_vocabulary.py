"""No tracked file speaks of how the work was organised.

Words such as "stop 12", "session", "issue 30" or "this turn" name the steps
of the work that built the library, which no user can look up and none needs:
the code, the docs, the benchmarks and their logs say what the library does
and what was measured, and history lives in git and the CHANGELOG. The same
words in their ordinary technical senses (`boto3.Session`, pytest's
`scope="session"`, another project's `torchtitan PR #3188`) are allowed.
"""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# This file holds the patterns and a planted example of each, so it would
# report itself: it is left out of the scan (its self-test below runs the same
# check on planted text instead).
SELF = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()

FORBIDDEN = re.compile(
    r"\bstops? \d+\b"
    r"|\bsessions?\b|session\d+|-session"
    r"|\bissues? #?\d+\b"
    r"|\bthis turn\b"
    r"|\b(?:this|next|last|each) round\b"
    r"|\blent\b",
    re.IGNORECASE,
)
# Ordinary technical uses, removed from a line before it is checked.
ALLOWED = [
    re.compile(p, re.IGNORECASE)
    for p in [
        r"\bboto3\.Session\b",
        r"\bbotocore[. ]sessions?\b",
        r"\bget_session\b",
        r"\bAWS_SESSION_TOKEN\b",
        r"\bstart_new_session\b",
        r"\brequests\.Session\b",
        r"\b(?:aiohttp\.)?ClientSession\b",
        r"\bHTTP sessions?\b",
        r"""\bscope\s*=\s*["']session["']""",
        r"\b(?:pytest|test) sessions?\b",
        r"\bsession[- ]scoped\b",
        r"\bsession fixtures?\b",
        # Another project's issue or pull request: `google/orbax#123`, or a
        # project's name right before "PR #N" / "issue #N" (`torchtitan PR
        # #3188`, `orbax issue #123`); the `#` is required.
        r"\b[\w.-]+/[\w.-]+#\d+\b",
        r"\b(?!(?:a|an|the|this|that|our|its|same|each|next|last|see)\b)"
        r"[A-Za-z][\w.-]* (?:PR|issue|pull request) #\d+\b",
    ]
]


def vocabulary_hits(text: str, path: str = "<text>") -> list[str]:
    """`path:line: text` of every line of `text` with a forbidden word."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        rest = line
        for allowed in ALLOWED:
            rest = allowed.sub(" ", rest)
        if FORBIDDEN.search(rest):
            hits.append(f"{path}:{number}: {line.strip()}")
    return hits


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): no list of tracked files")
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path: pathlib.Path) -> str | None:
    """The file's text, or None for a binary (NUL bytes, not UTF-8) or a
    tracked file missing from the working tree."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_speaks_of_how_the_work_was_organised():
    hits = []
    for name in _tracked_files():
        if name == SELF:
            continue
        if vocabulary_hits(name):
            hits.append(f"{name}: (its path)")
        text = _text(ROOT / name)
        if text is not None:
            hits.extend(vocabulary_hits(text, name))
    assert not hits, "words of how the work was organised:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "text, reported",
    [
        ("resumed at stop 12", True),
        ("rerun in session 42 (gpu-h200-session38.log)", True),
        ("faster than before issue 30", True),
        ("not built this turn", True),
        ("measured again this round", True),
        ("no GPU was lent", True),
        ("boto3.Session()", False),
        ('@pytest.fixture(scope="session")', False),
        ("a server for the whole test session", False),
        ("as in torchtitan PR #3188 and google/orbax#123", False),
        ("see the issue #30", True),
        ("a Stop button, a turn of the key, a round trip", False),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v),
)
def test_the_check_reports_planted_words_and_allows_technical_ones(text, reported):
    assert bool(vocabulary_hits(text)) is reported

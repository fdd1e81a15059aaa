"""`.ci/run` finds the Python 3.13 it tests the newest releases with, or fails
saying where it looked; never silently skips the run.

The functions are run from the sourced script (sourcing runs nothing), with
PATH and HOME pointing into a temporary directory of fake interpreters: small
shell scripts that hand over to this Python or exit as a broken pyenv shim does.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parent.parent / ".ci" / "run"
# What the script runs besides interpreters; linked into a directory of their
# own, so that no python3.13 of this machine's PATH is found.
TOOLS = ("bash", "env", "sort", "mktemp", "dirname", "rm", "cat", "tee")


def _env(tmp_path) -> dict[str, str]:
    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        for name in TOOLS:
            (tools / name).symlink_to(shutil.which(name))
    (tmp_path / "bin").mkdir(exist_ok=True)
    return {"PATH": f"{tmp_path / 'bin'}:{tools}", "HOME": str(tmp_path / "home")}


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{shutil.which('bash')}\n{body}\n")
    path.chmod(0o755)
    return path


def _python(path: Path, version: str) -> Path:
    """A fake interpreter whose `sys.version_info[:2]` is `version`."""
    major, minor = version.split(".")
    check = f"import sys; sys.exit(({major}, {minor}) != (3, 13))"
    return _script(
        path,
        f'if [ "$1" = -c ]; then exec {sys.executable} -c "{check}"; fi\nexit 3',
    )


def _run(tmp_path, call: str, *, pyenv_root: Path | None = None):
    env = _env(tmp_path)
    if pyenv_root is not None:
        _script(tmp_path / "bin" / "pyenv", f'[ "$1" = root ] && echo {pyenv_root}')
    return subprocess.run(
        [shutil.which("bash"), "-c", f"source {CI_RUN} && {call}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_python313_on_path_comes_first(tmp_path):
    on_path = _python(tmp_path / "bin" / "python3.13", "3.13")
    _python(tmp_path / "home/.pyenv/versions/3.13.1/bin/python3.13", "3.13")
    result = _run(tmp_path, "find_python313")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(on_path)


def test_broken_pyenv_shim_falls_through_to_pyenv_newest(tmp_path):
    # pyenv's shim exits 127 when 3.13 is installed but not an active version.
    _script(
        tmp_path / "bin" / "python3.13", "echo 'pyenv: python3.13: not found'; exit 127"
    )
    root = tmp_path / "pyenv-root"
    for version in ("3.13.2", "3.13.10", "3.13.9"):
        _python(root / "versions" / version / "bin" / "python3.13", "3.13")
    result = _run(tmp_path, "find_python313", pyenv_root=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(root / "versions/3.13.10/bin/python3.13")


def test_home_pyenv_without_pyenv_on_path(tmp_path):
    found = _python(tmp_path / "home/.pyenv/versions/3.13.0/bin/python3.13", "3.13")
    result = _run(tmp_path, "find_python313")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(found)


def test_no_python313_fails_naming_where_it_looked(tmp_path):
    wrong = _python(tmp_path / "bin" / "python3.13", "3.12")  # misnamed
    result = _run(tmp_path, "find_python313")
    assert result.returncode == 1 and result.stdout == ""
    message = " ".join(result.stderr.split())
    assert "CI: no Python 3.13 found, so the newest end of the supported range" in (
        message
    )
    assert (
        "Looked for python3.13 on PATH, then $(pyenv root)/versions/3.13.*/bin/"
        "python3.13, then ~/.pyenv/versions/3.13*/bin/python3.13." in message
    )
    assert f"Found but did not run as 3.13: {wrong}." in message
    assert "Install it (`pyenv install 3.13`) or put a python3.13 on PATH." in message


@pytest.mark.skipif(not os.access(CI_RUN, os.X_OK), reason=".ci/run not executable")
def test_ci_fails_before_any_run_without_python313(tmp_path):
    # A python3 that would fail loudly if CI got as far as making a venv.
    env = _env(tmp_path)
    _script(tmp_path / "bin" / "python3", "echo 'python3 was run' >&2; exit 9")
    result = subprocess.run(
        [str(CI_RUN)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "CI: no Python 3.13 found" in result.stderr
    assert "python3 was run" not in result.stderr

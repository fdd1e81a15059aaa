"""Every code block of the README and the docs runs, so examples cannot rot.

Each page runs as one program in an empty temporary directory (see
`docs_examples.py` for what each kind of block does). Pages that need several
devices run in a subprocess with that many fake CPU devices; the rest run in
this process.
"""

import os
import pathlib
import re
import subprocess
import sys

import docs_examples
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted(
    str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
)
# Pages with a block that runs (the API reference is docstrings only, and the
# performance page shows only the benchmark commands, which take minutes).
WITH_EXAMPLES = [p for p in PAGES if any(docs_examples.parse(str(ROOT / p)))]
# Pages whose examples build meshes: they run with this many CPU devices.
DEVICES = {"docs/guides/sharding.md": 8}


def test_pages_are_found():
    assert "README.md" in WITH_EXAMPLES and "docs/guides/cli.md" in WITH_EXAMPLES
    assert set(DEVICES) <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("page", PAGES, ids=PAGES)
def test_every_block_runs_or_is_bash(page):
    """A block in a language the runner does not know would silently not run."""
    assert docs_examples.unknown_blocks(str(ROOT / page)) == []


@pytest.mark.parametrize("page", WITH_EXAMPLES, ids=WITH_EXAMPLES)
@pytest.mark.slow
def test_examples_run(page, tmp_path, monkeypatch):
    path = str(ROOT / page)
    if page in DEVICES:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES[page]}",
        }
        runner = pathlib.Path(docs_examples.__file__)
        result = subprocess.run(
            [sys.executable, str(runner), path],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert re.fullmatch(r"[1-9]\d* examples of .* passed\n", result.stdout)
        return
    monkeypatch.chdir(tmp_path)
    assert docs_examples.run(path) > 0


def test_api_reference_lists_every_public_name():
    import orbax_eqx as oeqx

    listed = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        listed |= set(re.findall(r"^::: orbax_eqx\.(\w+)$", page.read_text(), re.M))
    public = {
        name
        for name in vars(oeqx)
        if not name.startswith("_") and not isinstance(vars(oeqx)[name], type(re))
    }
    assert public - listed == set(), "not in docs/api/*.md"
    assert listed - public == set(), "in docs/api/*.md but not public"
    # The namespace is `__all__`: at most 30 names, and `__version__`.
    assert public == set(oeqx.__all__) - {"__version__"}
    assert len(public) <= 30

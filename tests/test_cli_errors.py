"""Every failure of the command line is its message on stderr (one problem a
line, alike ones grouped, at most 10, the fix in flags) and exit status 2,
even one nothing foresaw, with no traceback from any library; `--debug` shows
it instead. (Errors from damaged sidecars: tests/test_hostile_records.py.)"""

import re
import subprocess
import sys

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx

# The user's code: a skeleton JAX cannot flatten (dict keys of mixed types).
SKELETONS_PY = """
import jax, jax.numpy as jnp

def mixed_keys():
    return {1: jax.ShapeDtypeStruct((2,), jnp.float32), "a": 2}
"""


def test_anything_unforeseen_is_one_line_naming_the_command(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"a": jnp.ones(2)})
    (tmp_path / "skeletons.py").write_text(SKELETONS_PY)
    argv = ["diff", str(tmp_path / "ckpt"), f"{tmp_path / 'skeletons.py'}:mixed_keys"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        r"orbax_eqx: error: diff failed: ValueError: .+ \(--debug shows the "
        r"traceback\)\n",
        captured.err,
    ), captured.err
    with pytest.raises(ValueError):
        main([*argv, "--debug"])


class Box(eqx.Module):
    inner: object


@pytest.mark.slow
def test_inspect_of_a_module_nested_1000_deep(tmp_path, capsys):
    # The sidecar of `Box(Box(...Box(x)))`, 1,000 deep, as a save writes it
    # (building the model itself needs a raised recursion limit).
    path = tmp_path / "ckpt"
    oeqx.save(path, Box(jnp.ones(2)))
    content = sidecars.read(path)
    record = content["leaves"].pop("inner")
    depth = 1000
    content["leaves"][".".join(["inner"] * depth)] = {
        **record,
        "path": ".inner" * depth,
    }
    module = content["modules"][""]
    for i in range(1, depth):
        content["modules"][".".join(["inner"] * i)] = {**module, "path": ".inner" * i}
    root = content["nodes"][""]
    content["nodes"] = {
        ".".join(["inner"] * i): {
            **root,
            "path": ".inner" * i or "<root>",
            "children": [".".join(["inner"] * (i + 1))],
        }
        for i in range(depth)
    }
    sidecars.write(path, content)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith("inner")]
    assert len(rows) == depth
    leaf = rows[-1].lstrip()
    assert re.match(r"inner +float32 +\(2,\) +8 B", leaf), leaf
    assert len(rows[-1]) - len(leaf) >= 2 * depth  # indented by its depth
    assert "Total: 1 leaves, 1 arrays, 8 B." in out
    assert "Without a skeleton: restore with `allow=['test_cli_errors']`" in out


# ---------------------------------------------------------------- for people

MANY_PY = """
import jax, jax.numpy as jnp

def shapes():
    return {"w": [jax.ShapeDtypeStruct((i + 2,), jnp.float32) for i in range(15)]}

def half():
    return {"w": [jax.ShapeDtypeStruct((i + 1,), jnp.bfloat16) for i in range(15)]}

def alike():
    return {"w": [jax.ShapeDtypeStruct((3,), jnp.float32) for i in range(15)]}
"""


@pytest.fixture
def many(tmp_path, monkeypatch):
    """15 tensors `w.0` .. `w.14` of float32[i + 1], and skeletons of them."""
    from safetensors.numpy import save_file

    (tmp_path / "many.py").write_text(MANY_PY)
    tensors = {f"w.{i}": np.zeros(i + 1, np.float32) for i in range(15)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "many", raising=False)
    yield tmp_path
    sys.modules.pop("many", None)


def test_problems_one_a_line_capped(many, capsys):
    assert main(["import", "w.safetensors", "out", "--skeleton", "many:shapes"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"orbax_eqx: error: The skeleton does not fit the safetensors at \S+ \(15 "
        r"problems\):",
        lines[0],
    )
    items = [x for x in lines if x.startswith("  - ")]
    assert len(items) == 10 and "`w.0`" in items[0] and "`w.9`" in items[9]
    assert lines[11] == "  ... and 5 more"
    assert not (many / "out").exists()


def test_alike_problems_are_one_line(many, capsys):
    from safetensors.numpy import save_file

    save_file({f"w.{i}": np.zeros(2, np.float32) for i in range(15)}, "two.safetensors")
    assert main(["import", "two.safetensors", "out", "--skeleton", "many:alike"]) == 2
    lines = capsys.readouterr().err.splitlines()
    # Problems alike but for the name they start with: the first, then the names.
    (grouped,) = [x for x in lines if x.startswith("  - ")]
    assert re.fullmatch(
        r"  - .*`w\.0`.*\(2,\).*\(3,\).*; 14 more alike: `w\.1`, `w\.2`, `w\.3` "
        r"and 11 more\.?",
        grouped,
    ), grouped


def test_the_fix_is_a_flag_and_the_size_the_checkpoints(many, capsys):
    assert main(["import", "w.safetensors", "out", "--skeleton", "many:half"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("  - ")]
    assert "bfloat16" in line and "float32" in line
    assert "--cast" in err and "cast=True" not in err
    argv = ["import", "w.safetensors", "out", "--skeleton", "many:half", "--cast"]
    assert main(argv) == 0
    # The checkpoint's size (bfloat16: half the float32 tensors read).
    assert capsys.readouterr().out == (
        f"Imported 15 tensors (240 B; 480 B of tensors read) from 1 file(s) into "
        f"{many / 'out'} (15 leaves).\n"
    )


@pytest.mark.slow
def test_a_damaged_plain_orbax_checkpoint_prints_no_traceback(tmp_path):
    import orbax.checkpoint as ocp
    from test_cli import run_cli

    with ocp.PyTreeCheckpointer() as c:
        c.save(tmp_path / "ckpt", {"a": np.arange(100.0), "b": np.ones((9, 9))})
    for data in (tmp_path / "ckpt" / "d").iterdir():  # the metadata's records
        data.write_bytes(data.read_bytes()[:20])
    result = run_cli("verify", "ckpt", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert re.fullmatch(
        rf"orbax_eqx: error: {tmp_path / 'ckpt'} looks like a plain Orbax checkpoint "
        r"\(it has _METADATA\), but Orbax cannot read its metadata: [^\n]{20,240}\. "
        r"The checkpoint is damaged or incomplete; use another step\.\n",
        result.stderr,
    ), result.stderr
    assert "tensorstore_spec" not in result.stderr


def test_missing_package_of_the_demo(tmp_path):
    # A process where `import optax` fails, as where it is not installed.
    run = (
        "import runpy, sys; sys.modules['optax'] = None; "
        "sys.argv = ['orbax_eqx', 'demo', '--dir', sys.argv[1]]; "
        "runpy.run_module('orbax_eqx', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", run, str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "orbax_eqx: error: demo needs the optax package, which is not installed: "
        "pip install 'orbax_eqx[demo]' (or pip install optax).\n"
    )
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["diff", "a", "b", "--rtol", "-1"],
            r"orbax_eqx diff: error: argument --rtol: expected a tolerance, a number "
            r">= 0, got '-1'",
        ),
        (
            ["inspect", "a", "--depth", "0"],
            r"orbax_eqx inspect: error: argument --depth: expected a positive "
            r"integer, got '0'",
        ),
    ],
    ids=["tolerance", "positive-int"],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.fullmatch(message, capsys.readouterr().err.splitlines()[-1])

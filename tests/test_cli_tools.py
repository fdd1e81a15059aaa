"""`diff`, `export` and `import` run as a user runs them: `python -m orbax_eqx ...`
(or the `orbax-eqx` command's `main`, in this process)."""

import io
import json
import re
import sys

import equinox as eqx
import jax
import numpy as np
import pytest
from entry import main
from safetensors import safe_open
from test_cli import run_cli

import orbax_eqx as oeqx

# The user's code: `module:function` skeletons for diff and import.
MODELS_PY = """
import equinox as eqx, jax

def make(width=8, seed=0):
    return {"model": eqx.nn.MLP(3, 2, width, 1, key=jax.random.key(seed)), "step": 3}

def skeleton():
    return eqx.filter_eval_shape(make)

def wide():
    return eqx.filter_eval_shape(make, 16)

def broken():
    raise RuntimeError("no GPU here")
"""


def make(width=8, seed=0):
    return {"model": eqx.nn.MLP(3, 2, width, 1, key=jax.random.key(seed)), "step": 3}


@pytest.fixture(autouse=True)
def _own_imports(monkeypatch):
    """Forgets the skeleton files a test imports in this process (`m.py`,
    `skel.py`: each test writes its own under its own `tmp_path`); a file
    skeleton is imported under its module name, which one process keeps."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("m", "skel"):
        sys.modules.pop(name, None)


@pytest.fixture
def work(tmp_path):
    """`a`, and `b`: `a` with one bias nudged, `step` changed, a leaf added."""
    (tmp_path / "models.py").write_text(MODELS_PY)
    a = make()
    oeqx.save(tmp_path / "a", a)
    model = a["model"]
    bias = model.layers[0].bias
    b = {
        "model": eqx.tree_at(lambda m: m.layers[0].bias, model, bias.at[0].add(1e-3)),
        "step": 9,
        "extra": np.ones(2, np.float32),
    }
    oeqx.save(tmp_path / "b", b)
    return tmp_path


@pytest.mark.slow
def test_diff(work):
    result = run_cli("diff", "a", "b", cwd=work)
    assert result.returncode == 1, result.stderr
    assert result.stderr == ""  # no progress bar in a pipe
    out = result.stdout
    assert out.startswith(
        f"A: {work / 'a'}\nB: {work / 'b'}\n\nStructure: 2 differences\n"
    )
    assert re.search(r"^  value +step +int 3 -> int 9$", out, re.M)
    assert re.search(r"^  added +extra +\(absent\) -> array float32\[2\]$", out, re.M)
    # Without --values, the verdict says that values were not compared.
    assert out.endswith(
        "\nA and B differ: 2 in structure. Array values were not compared: pass "
        "--values to compare them.\n"
    )

    result = run_cli("diff", "a", "b", "--values", "--atol", "1e-4", cwd=work)
    assert result.returncode == 1 and result.stderr == ""
    out = result.stdout
    assert "Values (rtol=1e-05, atol=0.0001): 1 of 4 arrays differ" in out
    assert re.search(
        r"^ +0\.001 +\S+ +DIFFERENT \(1 of 8 elements\)  model\.layers\.0\.bias$",
        out,
        re.M,
    )
    assert re.search(r"^ +0 +0 +equal +model\.layers\.0\.weight$", out, re.M)
    assert out.endswith("A and B differ: 2 in structure, 1 in values.\n")

    result = run_cli("diff", "--json", "--values", "--atol", "0.01", "a", "b", cwd=work)
    doc = json.loads(result.stdout)
    assert result.returncode == 1 and doc["differ"] is True
    assert {d["what"] for d in doc["differences"]} == {"value", "added"}
    (bias,) = [v for v in doc["values"]["leaves"] if v["name"] == "model.layers.0.bias"]
    assert bias["mismatched"] == 0 and 9e-4 < bias["max_abs"] < 1.1e-3

    result = run_cli("diff", "a", "a", "--values", cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("A and B do not differ (values within tolerance).\n")

    # a and a copy of it with one value changed: the same structure, which is
    # all a diff without --values compares, and it says so.
    item = make()
    bias = item["model"].layers[0].bias
    model = eqx.tree_at(lambda m: m.layers[0].bias, item["model"], bias + 1)
    oeqx.save(work / "c", item | {"model": model})
    result = run_cli("diff", "a", "c", cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(
        "\nA and B do not differ in structure. Array values were not compared: "
        "pass --values to compare them.\n"
    )
    assert run_cli("diff", "a", "c", "--values", cwd=work).returncode == 1


@pytest.mark.slow
def test_diff_against_skeletons(work):
    result = run_cli("diff", "a", "models:skeleton", cwd=work)
    assert result.returncode == 0, result.stderr
    assert "B: skeleton models:skeleton\n" in result.stdout
    assert "Structure: the same (7 leaves, 3 modules)." in result.stdout

    result = run_cli("diff", "models.py:wide", "b", cwd=work)
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert re.search(
        r"^  shape +model\.layers\.0\.weight +\(16, 3\) -> \(8, 3\)$", out, re.M
    )
    assert re.search(r"^  static +model\.width_size +16 -> 8$", out, re.M)
    assert re.search(r"^  static +model\.layers\.1\.in_features +16 -> 8$", out, re.M)
    assert re.search(r"^  added +extra +\(absent\) -> array float32\[2\]$", out, re.M)
    # A skeleton's Python values are placeholders (its step is 3, b's is 9): only
    # their types are compared, as restore does.
    assert "step" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["a", "models:skeleton", "--values"],
            r"--values compares the data of two checkpoints, but models:skeleton is a "
            r"skeleton, which has none\. Give two checkpoints, or leave out --values\.",
        ),
        (
            ["a", "models:broken"],
            r"Calling `models:broken\(\)` for the skeleton failed: RuntimeError: "
            r"no GPU here \(--debug shows where\)\.",
        ),
        (
            ["a", "nomodule:make"],
            r"Cannot import module `nomodule` for the skeleton 'nomodule:make' "
            r"\(no module named 'nomodule'\)\. Run from the directory that holds it, "
            r"add that directory to PYTHONPATH, or give a file: "
            r"`path/to/file\.py:function`\.",
        ),
        (
            ["a", "models:nothing"],
            r"Module `models` \(\S+/models\.py\) has no `nothing`, asked for by the "
            r"skeleton 'models:nothing'\. Check the name after the colon\.",
        ),
        (["nope", "a"], r"\S+/nope does not exist\."),
    ],
    ids=["values-skeleton", "skeleton-raises", "no-module", "no-function", "missing"],
)
@pytest.mark.slow
def test_diff_errors(work, args, message):
    result = run_cli("diff", *args, cwd=work)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(r"orbax_eqx: error: " + message, line), line


@pytest.mark.slow
def test_export_sharded_then_import(work):
    result = run_cli(
        "export", "a", "--to", "safetensors", "hf", "--max-shard-size", "100B", cwd=work
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == (
        f"Exported 4 tensors (200 B) to 3 files and {work / 'hf'}/"
        "model.safetensors.index.json.\n"
        "The __metadata__ of each file holds the static fields of 3 modules and 3 "
        "non-array leaves.\n"
    )
    index = json.loads((work / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    for name, file in index["weight_map"].items():
        with safe_open(work / "hf" / file, framework="numpy") as f:
            assert name in f.keys()
            saved = json.loads(f.metadata()["orbax_eqx"])
    assert saved["modules"]["model"]["static"]["width_size"] == 8
    assert saved["leaves"]["step"]["value"] == 3

    result = run_cli("import", "hf", "back", "--skeleton", "models:skeleton", cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"Imported 4 tensors (200 B) from 3 file(s) into {work / 'back'} (7 leaves).\n"
    )
    result = run_cli(
        "diff", "a", "back", "--values", "--rtol", "0", "--atol", "0", cwd=work
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.slow
def test_export_renamed_for_pytorch_then_import(work):
    (work / "to_torch.json").write_text(
        json.dumps([[r"model\.layers\.(\d+)\.(.*)", r"net.\1.\2"]])
    )
    result = run_cli(
        "export",
        "a",
        "--to",
        "safetensors",
        "m.safetensors",
        "--rename",
        "to_torch.json",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    with safe_open(work / "m.safetensors", framework="numpy") as f:
        assert sorted(f.keys()) == [
            f"net.{i}.{p}" for i in range(2) for p in ("bias", "weight")
        ]
    (work / "from_torch.json").write_text(
        json.dumps(
            {
                f"net.{i}.{p}": f"model.layers.{i}.{p}"
                for i in range(2)
                for p in ("bias", "weight")
            }
        )
    )
    result = run_cli(
        "import",
        "m.safetensors",
        "back",
        "--skeleton",
        "models:skeleton",
        "--rename",
        "from_torch.json",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    restored = oeqx.restore(work / "back", eqx.filter_eval_shape(make, 8, 5))
    np.testing.assert_array_equal(
        restored["model"].layers[1].weight, make()["model"].layers[1].weight
    )


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (
            lambda w: (
                (w / "out").mkdir() or (w / "out" / "model.safetensors").write_text("")
            ),
            ["export", "a", "--to", "safetensors", "out"],
            r"\S+/out/model\.safetensors already exists\. Pass --overwrite to replace "
            r"it, or choose another output\.",
        ),
        (
            lambda w: (w / "m.json").write_text('{"model.layers.9.weight": "x"}'),
            ["export", "a", "--to", "safetensors", "out", "--rename", "m.json"],
            r"The rename map m\.json does not fit the names: The entry "
            r"'model\.layers\.9\.weight' of rule 0 `.*` matches no name \(the names "
            r"it sees look like `model\.layers\.0\.weight`, .*\)\. Fix or remove "
            r"those entries \(`inspect` shows the names\)\.",
        ),
        (
            lambda w: oeqx.save(w / "st", make()) or None,
            ["import", "nothing.safetensors", "c", "--skeleton", "models:skeleton"],
            r"\S+/nothing\.safetensors does not exist\.",
        ),
        (
            lambda w: (w / "t.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}"),
            ["import", "t.safetensors", "c", "--skeleton", "models:skeleton"],
            r"\S+/t\.safetensors is not a valid safetensors file: the header claims 16 "
            r"bytes, but the file has 10\. Re-download or re-export it\.",
        ),
    ],
    ids=["exists", "rename-unmatched", "import-missing", "import-damaged"],
)
@pytest.mark.slow
def test_export_import_errors(work, setup, args, message):
    setup(work)
    result = run_cli(*args, cwd=work)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(r"orbax_eqx: error: " + message, line), line


@pytest.mark.slow
def test_import_into_wrong_skeleton(work):
    assert run_cli("export", "a", "--to", "safetensors", "hf", cwd=work).returncode == 0
    result = run_cli("import", "hf", "c", "--skeleton", "models:wide", cwd=work)
    assert result.returncode == 2
    assert re.fullmatch(
        r"orbax_eqx: error: The skeleton does not fit the safetensors at \S+/hf \(6 "
        r"problems\):\n  - Tensor `model\.layers\.0\.weight` has shape \(8, 3\) in "
        r"the tensors, but the skeleton has \(16, 3\)[^\n]*\n(  - .*\n)*If the "
        r"model's hyperparameters differ .*\nPass --ignore-static to keep the "
        r"skeleton's\.\n",
        result.stderr,
    ), result.stderr
    assert not (work / "c").exists()


def test_import_unused_tensors(work, capsys):
    # In-process: the same command line, without a process per check.
    hf, out = str(work / "hf"), str(work / "c")
    skeleton = f"{work / 'models.py'}:skeleton"
    assert main(["export", str(work / "b"), "--to", "safetensors", hf]) == 0
    capsys.readouterr()
    assert main(["import", hf, out, "--skeleton", skeleton]) == 2
    assert capsys.readouterr().err == (
        f"orbax_eqx: error: The skeleton does not fit the safetensors at {hf} (1 "
        "problem):\n"
        "  - Tensor `extra` is in the tensors, but no leaf maps to it.\n"
        "To leave such tensors out, add an `ignore` rule for them (buffers such as "
        "`attn.bias` or `rotary_emb.inv_freq`), or pass --allow-unused to leave them "
        "out.\n"
    )
    assert main(["import", hf, out, "--skeleton", skeleton, "--allow-unused"]) == 0
    restored = oeqx.restore(out, eqx.filter_eval_shape(make))
    assert restored["step"] == 9  # from the files' metadata, not the skeleton's 3


def test_missing_safetensors_is_one_line_and_only_export_needs_it(
    work, capsys, monkeypatch
):
    hf = str(work / "hf")
    assert main(["export", str(work / "a"), "--to", "safetensors", hf]) == 0
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import` of it fails
    assert main(["export", str(work / "a"), "--to", "safetensors", "x"]) == 2
    assert capsys.readouterr().err == (
        "orbax_eqx: error: export needs the safetensors package, which is not "
        "installed: pip install 'orbax_eqx[safetensors]' (or pip install "
        "safetensors).\n"
    )
    # `import` reads the files itself.
    skeleton = f"{work / 'models.py'}:skeleton"
    assert main(["import", hf, str(work / "back"), "--skeleton", skeleton]) == 0


# ---------------------------------------------------------------- pieces


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(work, capsys, monkeypatch):
    argv = ["export", str(work / "a"), "--to", "safetensors"]
    assert main([*argv, str(work / "piped")]) == 0
    assert capsys.readouterr().err == ""  # a pipe: nothing drawn
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*argv, str(work / "drawn")]) == 0
    drawn = terminal.getvalue().split("\r")
    assert "export [##############################] 100% 200 B / 200 B" in drawn
    assert drawn[-2].strip() == drawn[-1] == ""  # the bar is erased at the end


@pytest.mark.parametrize(
    "a, b, rtol, atol, expected",
    [
        ([1.0, np.nan, np.inf], [1.0, np.nan, np.inf], 0, 0, (0, 0, 0)),
        ([1.0, 2.0], [1.0, 2.2], 0.2, 0, (0.2, 0.2 / 2.2, 0)),
        ([1.0, 2.0], [1.0, 2.2], 0.01, 0, (0.2, 0.2 / 2.2, 1)),
        ([1.0, np.nan], [1.0, 1.0], 1, 1, (0, 0, 1)),
        ([0.0, 1.0], [np.inf, 1.0], 0, 0, (np.inf, np.inf, 1)),
        (
            np.array([2**62 + 1], np.int64),
            np.array([2**62], np.int64),
            1,
            1,
            (1, None, 1),
        ),
        (np.array([True]), np.array([False]), 1, 1, (1, 1, 1)),
        ([1 + 1j], [1 - 1j], 0, 0, (2, 2**0.5, 1)),
    ],
    ids=[
        "nan-inf-equal",
        "within-rtol",
        "past-rtol",
        "nan-vs-number",
        "inf",
        "int64",
        "bool",
        "complex",
    ],
)
def test_compare(tmp_path, capsys, a, b, rtol, atol, expected):
    oeqx.save(tmp_path / "a", {"x": np.asarray(a)})
    oeqx.save(tmp_path / "b", {"x": np.asarray(b)})
    argv = ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--values", "--json"]
    code = main([*argv, "--rtol", str(rtol), "--atol", str(atol)])
    (result,) = json.loads(capsys.readouterr().out)["values"]["leaves"]
    max_abs, max_rel, mismatched = expected
    assert (code, result["mismatched"]) == (int(bool(mismatched)), mismatched)
    for got, want in ((result["max_abs"], max_abs), (result["max_rel"], max_rel)):
        if want is not None:
            got = float(got)  # "inf" as text: JSON has no infinity
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "source, spec, message",
    [
        (
            "x = 3\n",
            "m.py:x",
            r"`m\.py:x` names a value of type int, not a function; the skeleton "
            r"must be given by a function of no arguments that returns it\.",
        ),
        (
            "import no_such_dependency\n",
            "m.py:f",
            r"Importing \S+/m\.py for the skeleton failed: ModuleNotFoundError: No "
            r"module named 'no_such_dependency' \(--debug shows where\)\.",
        ),
        (
            "def f(): pass\n",
            "gone.py:f",
            r"\S+/gone\.py, named by the skeleton "
            r"'gone\.py:f', does not exist\.",
        ),
        (
            "def f(): pass\n",
            "m.py:",
            r"'m\.py:' is not a skeleton: expected `module:function`, such as "
            r"`my_model:skeleton`, naming a function of no arguments\.",
        ),
    ],
    ids=["not-callable", "import-fails", "no-file", "no-function-name"],
)
def test_skeleton_errors(tmp_path, capsys, monkeypatch, source, spec, message):
    (tmp_path / "m.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    # (`import` builds the skeleton before it looks for the tensors.)
    assert main(["import", "none.safetensors", "out", "--skeleton", spec]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", capsys.readouterr().err)


def test_skeleton_from_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "m.py").write_text("def f():\n    return {'a': 1}\n")
    oeqx.save(tmp_path / "ckpt", {"a": 2})
    monkeypatch.chdir(tmp_path)
    # `m.py:f` is a skeleton, `m.py` a path (and no checkpoint).
    assert main(["diff", "ckpt", "m.py:f"]) == 0
    assert "B: skeleton m.py:f\n" in capsys.readouterr().out
    assert main(["diff", "ckpt", "m.py"]) == 2
    assert (
        "m.py is a file; pass the directory of a checkpoint" in capsys.readouterr().err
    )


@pytest.mark.parametrize("name", ["prng_keys", "batchnorm_state", "shared_tied"])
@pytest.mark.slow
def test_diff_checkpoint_against_its_own_skeleton(tmp_path, capsys, name):
    # In-process: every leaf kind of the zoo, through `module:function`.
    (tmp_path / "skel.py").write_text(
        "import jax, zoo\n"
        f"def skeleton():\n    return zoo.skeleton(zoo.{name}, jax.random.key(2))\n"
    )
    import zoo

    oeqx.save(tmp_path / "ckpt", zoo.ZOO[name](jax.random.key(1)))
    code = main(["diff", str(tmp_path / "ckpt"), f"{tmp_path / 'skel.py'}:skeleton"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.endswith(
        "\nA and B do not differ in structure. Array values were not compared: B "
        "is a skeleton, which holds none.\n"
    )


def test_rename_maps_match_in_bounded_time(tmp_path, capsys):
    # Patterns that backtrack for ever in a backtracking engine, on names of
    # the longest length a name may have: RE2 matches them in linear time.
    import time

    names = {
        "a" * 2048: np.ones(1, np.float32),
        "a" * 2047 + "d": np.ones(1, np.float32),
    }
    oeqx.save(tmp_path / "ck", names)
    rules = [["(a+)+b", "x"], ["(.*)(.*)(.*)(.*)b", "y"], ["(a|aa)+c", "z"]]
    (tmp_path / "r.json").write_text(json.dumps(rules))
    started = time.perf_counter()
    args = ["export", str(tmp_path / "ck"), str(tmp_path / "out")]
    assert main([*args, "--rename", str(tmp_path / "r.json")]) == 2
    assert time.perf_counter() - started < 10
    assert "The pattern '(a+)+b' of rule 0" in capsys.readouterr().err

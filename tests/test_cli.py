"""The command line, run as a user runs it: `python -m orbax_eqx ...` in a shell."""

import json
import os
import re
import site
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest
from entry import main

import orbax_eqx as oeqx

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))


def run_cli(*args, cwd):
    # CPU only: the subprocess must not compete with this one for an accelerator.
    # The package under test, not whichever copy is installed.
    path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "orbax_eqx", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def make_item():
    model = eqx.nn.MLP(2, 1, 4, depth=1, key=jax.random.key(0))
    return {
        "model": model,
        "step": 7,
        "lr": 0.5,
        "note": "hi",
        "table": np.arange(3, dtype=np.int32),
    }


@pytest.fixture
def step_dir(tmp_path):
    """A step directory `run/7` holding one item, `default`, as a manager makes."""
    oeqx.save(tmp_path / "run" / "7" / "default", make_item())
    return tmp_path / "run" / "7"


def _venv_in(directory):
    """`directory/.venv`, a venv that sees this one's packages, as the README's
    set-up makes (`python3 -m venv .venv`, then `.venv/bin/pip install ...`)."""
    venv = directory / ".venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "this_venv.pth").write_text(
        "".join(
            f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()
        )
    )
    return venv / "bin" / "python"


@pytest.mark.slow
def test_demo_then_inspect_root(tmp_path):
    # The README's set-up: the demo run by the venv's python, never activated.
    python = _venv_in(tmp_path)
    result = subprocess.run(
        [str(python), "-m", "orbax_eqx", "demo", "--steps", "5"],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    best = re.search(r"^Best step: (\d+), loss ([0-9.]+)\.$", result.stdout, re.M)
    assert best, result.stdout
    kept = re.search(r"kept steps ([0-9, ]+) \(", result.stdout).group(1).split(", ")
    assert best.group(1) in kept
    assert re.search(
        rf"^Restored step {best.group(1)} .* \d+ leaves", result.stdout, re.M
    )
    assert "Checked: same loss as recorded" in result.stdout
    root = tmp_path / "demo_checkpoints"
    assert sorted(p.name for p in root.iterdir()) == sorted(kept)

    # The last line is a command that works as printed, in a shell whose PATH
    # knows nothing of the venv (a bare `python` there has no orbax_eqx).
    last = result.stdout.splitlines()[-1]
    assert last == "Next: .venv/bin/python -m orbax_eqx inspect demo_checkpoints"
    result = subprocess.run(
        last.removeprefix("Next: "),
        shell=True,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PATH": os.defpath},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"CheckpointManager root {root}: {len(kept)} step(s)\n")
    # Each kept step with the loss the demo recorded for it.
    assert re.search(rf"^ +{best.group(1)}  loss={best.group(2)[:6]}", out, re.M)
    latest = max(kept, key=int)
    assert f"Showing the latest step, {latest}." in out
    assert "The best step has the lowest loss." in out
    marks = dict(re.findall(r"^ +(\d+)  loss=\S+(?:  (.+))?$", out, re.M))
    assert marks[best.group(1)].startswith("best")
    assert marks[latest].endswith("latest")
    assert f"Checkpoint {root / latest / 'default'}\n" in out
    # The tree: modules with class and static fields, arrays with the sharding
    # they were saved with, Python leaves with their values.
    assert re.search(
        r"^  model +Sequential +1\.5 KiB$\n^    layers +1\.5 KiB$\n"
        r"^      0 +Linear +1\.1 KiB +in_features=8, out_features=32, use_bias=True$\n"
        r"^        weight +float32 +\(32, 8\) +1\.0 KiB +pack +unsharded$",
        out,
        re.M,
    )
    assert re.search(
        r"^      1 +BatchNorm +256 B +input_size=32, .*mode='batch'", out, re.M
    )
    assert re.search(r"^  step +int +" + latest + "$", out, re.M)

    result = run_cli("inspect", "--flat", "demo_checkpoints", cwd=tmp_path)
    assert re.search(
        r"^  model\.layers\.0\.weight +\(32, 8\) +float32 +1\.0 KiB$",
        result.stdout,
        re.M,
    )
    assert "equinox.nn._batch_norm.BatchNorm" in result.stdout


RELU = f"{jax.nn.relu.__module__}.{jax.nn.relu.__qualname__}"


@pytest.mark.slow
def test_inspect_item_dir_flat(step_dir, tmp_path):
    result = run_cli("inspect", "--flat", step_dir / "default", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"Checkpoint {step_dir / 'default'}\n")
    rows = [
        r"model\.layers\.0\.weight +\(4, 2\) +float32 +32 B",
        # Where JAX defines `relu` is JAX's business: ask it, don't pin it.
        r"model\.activation +- +callable +- +" + re.escape(RELU),
        r"lr +- +float +- +0\.5",
        r"note +- +str +- +'hi'",
        r"table +\(3,\) +int32 +12 B +numpy array",
        r"model +equinox\.nn\._mlp\.MLP +.*width_size=4, depth=1(, .*)?",
    ]
    for row in rows:
        assert re.search(rf"^  {row}$", out, re.M), row
    assert re.search(r"^Total: 10 leaves, 5 arrays, 80 B\.$", out, re.M)
    saved_format = oeqx.metadata(step_dir / "default").format_version
    assert re.search(
        rf"^Written by orbax_eqx \S+ \(sidecar format {saved_format}\) with .*jax ",
        out,
        re.M,
    )


@pytest.mark.slow
def test_inspect_step_dir_json(step_dir, tmp_path):
    result = run_cli("inspect", "--json", "run/7", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["steps"] == [] and doc["step"] is None
    (item,) = doc["items"]
    assert item["path"] == str(step_dir / "default")
    shapes = {k: v.get("shape") for k, v in item["leaves"].items()}
    assert shapes == {
        "lr": None,
        "model.layers.0.weight": [4, 2],
        "model.layers.0.bias": [4],
        "model.layers.1.weight": [1, 4],
        "model.layers.1.bias": [1],
        "model.activation": None,
        "model.final_activation": None,
        "note": None,
        "step": None,
        "table": [3],
    }
    assert item["leaves"]["step"] == {
        "path": "['step']",
        "kind": "scalar",
        "type": "int",
        "value": 7,
        "text": "7",
    }
    assert item["leaves"]["table"]["container"] == "numpy"
    weight = item["leaves"]["model.layers.0.weight"]
    assert (weight["data"], weight["pack"], weight["offset"]) == ("packed", 0, 0)
    (pack,) = item["packs"]
    assert re.fullmatch(r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin", pack["file"])
    assert pack["nbytes"] == 268
    assert item["modules"]["model"]["static"]["width_size"] == 4
    assert item["totals"] == {"leaves": 10, "arrays": 5, "nbytes": 80}
    assert item["versions"]["orbax_eqx"] == oeqx.__version__


def test_inspect_json_in_process(tmp_path, capsys):
    # Manager roots, tied weights, zero-size arrays and odd metrics, without
    # paying for a subprocess each.
    weight = np.ones((2, 2), np.float32)
    item = {"a": weight, "b": weight, "empty": np.zeros((0, 3), np.float32)}
    for step in (3, 10):
        oeqx.save(tmp_path / "root" / str(step) / "default", item)
    (tmp_path / "root" / "10" / "metrics").mkdir()
    (tmp_path / "root" / "10" / "metrics" / "metrics").write_text('{"loss": NaN}')
    (tmp_path / "root" / "3" / "_CHECKPOINT_METADATA").write_text("{damaged")

    assert main(["inspect", "--json", str(tmp_path / "root")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["metrics"]) for s in doc["steps"]] == [
        (3, None),
        (10, {"loss": "nan"}),
    ]
    assert doc["step"] == 10
    leaves = doc["items"][0]["leaves"]
    assert leaves["b"]["data"] == "alias" and leaves["b"]["alias_of"] == "a"
    assert leaves["empty"]["data"] == "none"
    assert doc["items"][0]["totals"] == {"leaves": 3, "arrays": 2, "nbytes": 16}

    assert main(["inspect", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +3  -$", out, re.M)
    assert re.search(r"^ +10  loss=nan +latest$", out, re.M)  # nan is never best
    assert re.search(
        r"^  b +float32 +\(2, 2\) +16 B +pack +numpy array, same array as a$",
        out,
        re.M,
    )
    assert "Total: 3 leaves, 2 arrays (plus 1 tied to another leaf), 16 B." in out


def _missing(tmp_path):
    return "nope"


def _not_a_checkpoint(tmp_path):
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    (tmp_path / "plain" / "file.txt").write_text("hello")
    return "plain"


def _corrupt_sidecar(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "orbax_eqx.json").write_text('{"format": "orbax_eqx", ')
    return "broken"


@pytest.mark.parametrize(
    "make_path, message",
    [
        (_missing, r"\S+/nope does not exist\."),
        (
            _not_a_checkpoint,
            r"\S+/plain holds no orbax_eqx checkpoint \(no orbax_eqx\.json in it "
            r"or in its subdirectories\)\.",
        ),
        (
            _corrupt_sidecar,
            r"The sidecar \S+/broken/orbax_eqx\.json is not JSON as orbax_eqx writes "
            r"it \(.+\); the checkpoint is damaged \(or something else was put in its "
            r"place\)\. Restore an earlier step, or re-save it\.",
        ),
    ],
    ids=["missing", "not-a-checkpoint", "corrupt-sidecar"],
)
@pytest.mark.slow
def test_inspect_bad_path(tmp_path, make_path, message):
    result = run_cli("inspect", make_path(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(r"orbax_eqx: error: " + message, line), line
    assert "Traceback" not in result.stderr


def test_debug_shows_traceback(tmp_path, capsys):
    with pytest.raises(oeqx.CheckpointNotFoundError, match="does not exist"):
        main(["inspect", "--debug", str(tmp_path / "nope")])


def test_demo_refuses_foreign_directory(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["demo", "--dir", str(tmp_path / "mine")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"orbax_eqx: error: \S+/mine exists and does not look like the demo's "
        r"checkpoints \(.*\), so the demo will not delete it\. Pass --dir to choose "
        r"another directory\.",
        line,
    )
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


SAVE_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, orbax_eqx as oeqx
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 2), ("data", "model"))
w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
b = jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))
oeqx.save("sharded", {"w": w, "b": b, "n": np.ones(2), "t": w})
oeqx.save("unpacked", {"r": b, "s": jnp.ones(2)}, pack=False)
"""


@pytest.mark.slow
def test_inspect_shows_saved_sharding(tmp_path):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    subprocess.run(
        [sys.executable, "-c", SAVE_SHARDED], cwd=tmp_path, env=env, check=True
    )
    result = run_cli("inspect", "sharded", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Where the bytes are stored (a layout) and the sharding are two columns.
    assert re.search(
        r"^  name +type +shape +bytes +stored in +sharding +value / static fields$",
        out,
        re.M,
    )
    sharded = r"P\('data', 'model'\) over data=2, model=2"
    # Sharded arrays are in shard packs, which record the saving sharding.
    assert re.search(
        rf"^  t +float32 +\(8, 4\) +128 B +shard packs +{sharded}$", out, re.M
    )
    # Replicated arrays are packed, and the sidecar does not say over how many
    # devices; numpy arrays have no sharding; a tied leaf has its twin's.
    assert re.search(r"^  b +float32 +\(4,\) +16 B +pack +unsharded$", out, re.M)
    assert re.search(r"^  n +float64 +\(2,\) +16 B +pack +numpy array$", out, re.M)
    assert re.search(
        rf"^  w +float32 +\(8, 4\) +128 B +shard packs +{sharded} +same array as t$",
        out,
        re.M,
    )
    assert "packed" not in out

    result = run_cli("inspect", "--json", "sharded", cwd=tmp_path)
    leaves = json.loads(result.stdout)["items"][0]["leaves"]
    assert leaves["w"]["sharding"] == "P('data', 'model') over data=2, model=2"
    assert (leaves["b"]["sharding"], leaves["b"]["data"]) == ("unsharded", "packed")
    assert "sharding" not in leaves["n"]

    # In Orbax's store, Orbax's record says what the sharding was.
    result = run_cli("inspect", "unpacked", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"^  r +float32 +\(4,\) +16 B +Orbax +replicated over data=2, model=2$",
        result.stdout,
        re.M,
    )
    assert re.search(
        r"^  s +float32 +\(2,\) +8 B +Orbax +single device \(\S+\)$",
        result.stdout,
        re.M,
    )


def test_inspect_best_step_by_metric(tmp_path, capsys):
    for step, metrics in [
        (1, '{"loss": 3.0, "acc": 0.5}'),
        (2, '{"loss": 1.0, "acc": 0.9}'),
        (3, '{"loss": 2.0, "acc": 0.9}'),
    ]:
        oeqx.save(tmp_path / "root" / str(step) / "default", {"x": np.ones(1)})
        (tmp_path / "root" / str(step) / "metrics").mkdir()
        (tmp_path / "root" / str(step) / "metrics" / "metrics").write_text(metrics)
    root = str(tmp_path / "root")
    assert main(["inspect", "--json", root]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest"] == 3 and doc["best"] == {
        "step": 2,
        "metric": "loss",
        "mode": "min",
    }
    # The highest accuracy: steps 2 and 3 tie, and the later one wins.
    assert main(["inspect", root, "--best", "acc", "--mode", "max"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +3  loss=2, acc=0\.9  best, latest$", out, re.M)
    assert re.search(r"^ +2  loss=1, acc=0\.9$", out, re.M)
    assert "Showing the latest step, 3. The best step has the highest acc." in out
    assert main(["inspect", "--json", root, "--best", "nope"]) == 0
    assert json.loads(capsys.readouterr().out)["best"] is None


@pytest.mark.slow
def test_inspect_tree_of_odd_names(tmp_path, capsys):
    import zoo

    oeqx.save(tmp_path / "odd", zoo.odd_dict_keys(jax.random.key(0)))
    oeqx.save(tmp_path / "tied", zoo.shared_tied(jax.random.key(0)))
    assert main(["inspect", str(tmp_path / "odd")]) == 0
    out = capsys.readouterr().out
    # Escaped parts stay escaped (as in leaf names); `a.b` is one part, `a` a node.
    assert re.search(r"^  a\\\.b +float32 +\(2,\)", out, re.M)
    assert re.search(r"^  a +8 B$\n^    b +float32 +\(2,\) +8 B", out, re.M)
    assert re.search(r"^  ints +8 B$\n^    0 +float32", out, re.M)
    assert re.search(r"^      0 +int +1$", out, re.M)
    assert main(["inspect", str(tmp_path / "tied")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  <root> +TiedLM +160 B$", out, re.M)
    assert re.search(
        r"^          weight +shared +placeholder for a node tied", out, re.M
    )
    assert "placeholder for a node tied by eqx.nn.Shared" in out

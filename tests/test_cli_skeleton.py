"""`--skeleton path/to/file.py:function`: the file is imported under the name
the user's code imports it by, so a checkpoint made from it restores into the
same skeleton imported normally."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_cli import PACKAGE_ROOT, run_cli

TMODEL_PY = """
import equinox as eqx, jax

class Net(eqx.Module):
    linear: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 2, key=key)
        self.scale = 2.0

def skeleton():
    return eqx.filter_eval_shape(Net, jax.random.key(0))
"""


def _tensors(directory):
    save_file(
        {
            "linear.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
            "linear.bias": np.array([1.0, -1.0], np.float32),
        },
        str(directory / "net.safetensors"),
    )
    return directory / "net.safetensors"


def _restore_normally(ckpt, path_entry: str, module: str):
    """Restores `ckpt` into `module.skeleton()` in a fresh Python that imports
    `module` as a user's script would."""
    script = (
        "import importlib, numpy as np, orbax_eqx as oeqx\n"
        f"m = importlib.import_module({module!r})\n"
        f"net = oeqx.restore({str(ckpt)!r}, m.skeleton())\n"
        "print(type(net).__module__, type(net).__qualname__, net.scale)\n"
        "print(np.asarray(net.linear.weight).tolist())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([path_entry, PACKAGE_ROOT])
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=path_entry,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_file_skeleton_records_import_names(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tmodel.py").write_text(TMODEL_PY)
    source = _tensors(tmp_path)
    # Run from elsewhere: the file is named by a path, not found on sys.path.
    result = run_cli(
        "import",
        source,
        "ckpt",
        "--skeleton",
        "models/tmodel.py:skeleton",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    sidecar = (tmp_path / "ckpt" / "orbax_eqx.json").read_text()
    assert '"tmodel.Net"' in sidecar and "_orbax_eqx_skeleton" not in sidecar
    restored = _restore_normally(tmp_path / "ckpt", str(models), "tmodel")
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.splitlines() == [
        "tmodel Net 2.0",
        "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]",
    ]


@pytest.mark.slow
def test_file_skeleton_in_a_package(tmp_path):
    package = tmp_path / "src" / "proj" / "nets"
    package.mkdir(parents=True)
    (tmp_path / "src" / "proj" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "tmodel.py").write_text(TMODEL_PY)
    source = _tensors(tmp_path)
    result = run_cli(
        "import",
        source,
        "ckpt",
        "--skeleton",
        "src/proj/nets/tmodel.py:skeleton",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert '"proj.nets.tmodel.Net"' in (tmp_path / "ckpt/orbax_eqx.json").read_text()
    restored = _restore_normally(
        tmp_path / "ckpt", str(tmp_path / "src"), "proj.nets.tmodel"
    )
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.splitlines()[0] == "proj.nets.tmodel Net 2.0"


@pytest.mark.parametrize(
    "file, message",
    [
        (
            "my-model.py",
            r"\S+/my-model\.py, named by the skeleton 'sub/my-model\.py:skeleton', "
            r"cannot be imported by name: 'my-model' is not a Python module name, "
            r"and the classes in it would be recorded under a name that no `import` "
            r"finds, so the checkpoint would not restore into the same skeleton "
            r"imported normally\. Rename the file to a valid module name "
            r"\(such as my_model\.py\)\.",
        ),
        (
            "json.py",
            r"\S+/json\.py, named by the skeleton 'sub/json\.py:skeleton', would be "
            r"imported as `json`, but `json` is already imported from \S+: its "
            r"classes would be recorded under another module's name\. Rename the "
            r"file, or give the skeleton as `module:function` with its directory "
            r"on PYTHONPATH\.",
        ),
    ],
    ids=["not-a-module-name", "name-taken"],
)
@pytest.mark.slow
def test_file_skeleton_refused(tmp_path, file, message):
    # In a folder of its own: `python -m` puts the working directory first on
    # sys.path, where a json.py would shadow the standard library's at start.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / file).write_text(TMODEL_PY)
    result = run_cli(
        "import",
        _tensors(tmp_path),
        "ckpt",
        "--skeleton",
        f"sub/{file}:skeleton",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", result.stderr), result.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_two_skeleton_files_of_one_name(tmp_path):
    # Each file is imported as `tmodel` in turn: the second replaces the first
    # (both were loaded by the command line itself, not by the user's code).
    for width in (2, 3):
        folder = tmp_path / f"v{width}"
        folder.mkdir()
        (folder / "tmodel.py").write_text(
            TMODEL_PY.replace("Linear(3, 2,", f"Linear(3, {width},")
        )
    result = run_cli(
        "diff", "v2/tmodel.py:skeleton", "v3/tmodel.py:skeleton", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr
    assert "  shape       linear.weight        (2, 3) -> (3, 3)\n" in result.stdout

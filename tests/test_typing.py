"""Type checkers see orbax_eqx's annotations (`py.typed`), and `oeqx.save`,
`oeqx.restore` and `EqxRestore` take their options as typed keyword
parameters: `mypy --strict` passes a user script that uses them and catches a
misspelt one."""

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import orbax_eqx as oeqx

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
LIMIT_S = 300  # mypy reads jax, equinox and orbax the first time

_SCRIPT = textwrap.dedent(
    """
    import equinox as eqx
    import jax
    import orbax.checkpoint as ocp  # type: ignore[import-untyped]  # (no py.typed)

    import orbax_eqx as oeqx


    def main(path: str) -> None:
        model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
        oeqx.save(path, model, overwrite=True, use_compression=True, checksums=False)
        skeleton = eqx.filter_eval_shape(eqx.nn.Linear, 2, 2, key=jax.random.key(1))
        restored = oeqx.restore(path, skeleton, cast=True, missing="keep")
        args = oeqx.EqxRestore(skeleton, strict=False, prefix="model", report=True)
        mngr = ocp.CheckpointManager(path, item_handlers=oeqx.EqxHandler(pack=True))
        print(restored, mngr.restore(0, args=args))
    """
)


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mypy_cache")

    def run(source: str) -> subprocess.CompletedProcess:
        script = tmp_path_factory.mktemp("script") / "user_script.py"
        script.write_text(source)
        argv = ["--strict", "--follow-imports=silent", "--cache-dir", str(cache)]
        try:
            return subprocess.run(
                [sys.executable, "-m", "mypy", *argv, str(script)],
                capture_output=True,
                text=True,
                # The package under test, not an installed copy.
                env={**os.environ, "MYPYPATH": PACKAGE_ROOT},
                timeout=LIMIT_S,  # then SIGKILL
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"mypy ran past {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")

    return run


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PACKAGE_ROOT, "orbax_eqx", "py.typed"))


def test_mypy_strict_passes_options(mypy):
    proc = mypy(_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


def test_mypy_strict_catches_misspelt_options(mypy):
    source = (
        _SCRIPT.replace("use_compression=True", "use_compresion=True")
        .replace('missing="keep"', 'missng="keep"')
        .replace("strict=False", "strickt=False")
    )
    proc = mypy(source)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for name, function in [
        ("use_compresion", "save"),
        ("missng", "restore"),
        ("strickt", "EqxRestore"),
    ]:
        assert f'Unexpected keyword argument "{name}" for "{function}"' in proc.stdout
    # A wrong value is caught too.
    proc = mypy(_SCRIPT.replace('missing="keep"', 'missing="kept"'))
    assert proc.returncode == 1
    assert 'Argument "missing" to "restore" has incompatible type' in proc.stdout


def _typed_init(cls) -> list[str]:
    """The parameters of the `__init__` written out for type checkers in
    `cls`'s body (under `if TYPE_CHECKING:`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            return [a.arg for a in args.args[1:] + args.kwonlyargs]
    raise AssertionError(f"{cls.__name__} has no typed __init__")


@pytest.mark.parametrize(
    "cls", [oeqx.EqxSave, oeqx.EqxRestore], ids=lambda c: c.__name__
)
def test_typed_init_matches_the_dataclass(cls):
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    assert _typed_init(cls) == fields
    real = inspect.signature(cls.__init__).parameters
    assert _typed_init(cls) == [name for name in real if name != "self"]


def test_save_and_restore_mirror_the_handler_and_restore_args():
    restore = inspect.signature(oeqx.restore).parameters
    assert list(restore)[1:] == _typed_init(oeqx.EqxRestore)
    for name, parameter in inspect.signature(oeqx.EqxRestore).parameters.items():
        assert restore[name].default == parameter.default, name
        assert restore[name].annotation == parameter.annotation, name
    save = inspect.signature(oeqx.save).parameters
    handler = inspect.signature(oeqx.EqxHandler).parameters
    # A save does not restore, so the cap on restored bytes is no option of it.
    expected = [name for name in handler if name != "restore_concurrent_gb"]
    assert list(save) == ["directory", "item", "overwrite", *expected]
    for name in expected:
        assert save[name].default == handler[name].default, name
        assert save[name].annotation == handler[name].annotation, name

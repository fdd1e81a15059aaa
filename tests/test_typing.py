"""Type checkers see orbax_eqx's annotations (`py.typed`), and `oeqx.save`,
`oeqx.restore` and `EqxRestore` take their options as typed keyword
parameters: `mypy --strict` passes a user script that uses them and catches a
misspelt one."""

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
                # A user's project: not ours, whose [tool.mypy] is the package's.
                cwd=script.parent,
                timeout=LIMIT_S,  # then SIGKILL
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"mypy ran past {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")

    return run


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PACKAGE_ROOT, "orbax_eqx", "py.typed"))


@pytest.mark.slow
def test_mypy_strict_passes_options(mypy):
    proc = mypy(_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


@pytest.mark.slow
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


@pytest.mark.slow
def test_typed_script_sees_the_args_classes_fields(mypy):
    """`EqxSave` and `EqxRestore` are checked as the dataclasses they are,
    though Orbax's base class is `Any` to type checkers."""
    source = _SCRIPT.replace(
        "print(restored,", "print(oeqx.EqxSave(model, 3), oeqx.EqxRestore(x=1),"
    )
    proc = mypy(source)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'Too many positional arguments for "EqxSave"' in proc.stdout
    assert 'Unexpected keyword argument "x" for "EqxRestore"' in proc.stdout


def test_restore_takes_the_parameters_of_restore_args(tmp_path):
    restore = inspect.signature(oeqx.restore).parameters
    args = inspect.signature(oeqx.EqxRestore).parameters
    assert list(restore) == ["directory", *args]
    assert list(args)[:2] == ["skeleton", "allow"]
    for name, parameter in args.items():
        assert restore[name] == parameter, name
    # As a call checks them: a misspelt option is a TypeError before any I/O,
    # and `directory` may be named.
    with pytest.raises(TypeError, match="missng"):
        oeqx.restore(tmp_path / "nothing", None, missng="keep")
    with pytest.raises(oeqx.CheckpointNotFoundError, match="nothing"):
        oeqx.restore(directory=tmp_path / "nothing")


def test_save_mirrors_the_handler():
    save = inspect.signature(oeqx.save).parameters
    handler = inspect.signature(oeqx.EqxHandler).parameters
    # A save does not restore, so the cap on restored bytes is no option of
    # it; it waits for its writes, so it copies no numpy leaf and keeps no
    # copies' buffers between saves; it saves no step of a manager, so it has
    # no earlier steps to share bytes with (`dedup`).
    skipped = ("restore_concurrent_gb", "kept_copy_bytes", "dedup")
    expected = [name for name in handler if name not in skipped]
    assert list(save) == ["directory", "item", "overwrite", *expected]
    for name in expected:
        assert save[name].default == handler[name].default, name
        assert save[name].annotation == handler[name].annotation, name

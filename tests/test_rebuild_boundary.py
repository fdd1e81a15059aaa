"""`allow=` as a security boundary: what a sidecar may make a rebuild import,
select and allocate.

- The import rule: a rebuild imports exactly the modules `allow` names (and
  whatever they import themselves), never a `__main__` module, never a
  submodule nothing imported; a module that exits while imported is a clear
  error. Checked in fresh processes, with planted modules that would leave a
  mark if imported.
- `eqx.nn.Shared`'s recorded selectors step through recorded nodes only.
- Recorded numpy scalars are checked before anything is made.

Sidecars are edited as an attacker would, checksum recomputed
(`tests/sidecars.py`): what is probed is the rebuild's rules.
"""

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import sidecars
import zoo
from entry import main as cli_main

import orbax_eqx as oeqx

KEY = jax.random.key(0)
TIMEOUT_S = 120
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))


def _damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=KEY))
    return path


# ------------------------------------------------------------- the import rule

_CHILD = """
import json, sys
sys.argv = ["train.py", "--lr", "0.1"]  # what a script module would parse
import orbax_eqx as oeqx
try:
    oeqx.restore(sys.argv_path, allow=json.loads(sys.argv_allow))
    outcome = "restored"
except oeqx.RebuildError as e:
    outcome = str(e)
except BaseException as e:
    outcome = f"RAW {type(e).__name__}: {e}"
print(json.dumps({"outcome": outcome, "imported": sorted(
    n for n in sys.modules if n.startswith(("planted", "numpy.f2py"))
)}))
"""


def _restore_in_fresh_process(path, allow, site=None):
    paths = [str(site)] if site is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, PACKAGE_ROOT])}
    code = _CHILD.replace("sys.argv_path", repr(str(path))).replace(
        "sys.argv_allow", repr(json.dumps(allow))
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,  # the child is killed (SIGKILL) past it
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_script_module_is_never_imported(mlp):
    # numpy's f2py command line parses the caller's `sys.argv` when imported,
    # and exits: it must not run, whatever `allow` holds.
    sidecars.edit(
        mlp,
        lambda c: c["leaves"]["activation"].update(
            value={"callable": "numpy.f2py.__main__.main"}
        ),
    )
    found = _restore_in_fresh_process(mlp, ["equinox", "jax", "numpy"])
    assert found["imported"] == []
    assert (
        "`activation`: callable `numpy.f2py.__main__.main` is in a `__main__` "
        "module (a script, or a package's command line), which a rebuild never "
        "imports: define it in a module" in found["outcome"]
    )


@pytest.mark.parametrize("name", ["__main__", "numpy.f2py.__main__"])
def test_allow_refuses_main_modules(name):
    with pytest.raises(
        ValueError,
        match=rf"allow: '{name}' is a `__main__` module \(a script, or a package's "
        r"command line\), which a rebuild never imports",
    ):
        oeqx.EqxRestore(allow=["equinox", name])


@pytest.fixture
def planted(tmp_path):
    """A package `planted` whose submodule `cli` leaves a mark when imported;
    its `__init__` imports nothing of it, and imports any name asked of it
    lazily (a module `__getattr__`, as some packages have)."""
    site = tmp_path / "site"
    (site / "planted").mkdir(parents=True)
    mark = tmp_path / "cli-ran"
    (site / "planted" / "__init__.py").write_text(
        textwrap.dedent("""
        import importlib

        def __getattr__(name):
            return importlib.import_module("planted." + name)
        """)
    )
    (site / "planted" / "cli.py").write_text(
        textwrap.dedent(f"""
        open({str(mark)!r}, "w").write("imported")

        def relu(x):
            return x
        """)
    )
    return site, mark


@pytest.mark.slow
def test_a_submodule_nothing_imported_is_not_imported(mlp, planted):
    site, mark = planted
    sidecars.edit(
        mlp,
        lambda c: c["leaves"]["activation"].update(
            value={"callable": "planted.cli.relu"}
        ),
    )
    found = _restore_in_fresh_process(mlp, ["equinox", "jax", "planted"], site)
    assert not mark.exists()
    assert found["imported"] == ["planted"]  # the allowed package, alone
    assert (
        "`activation`: callable `planted.cli.relu` is in module `planted.cli`, which "
        "no allowed module imports (a rebuild imports only what `allow` names; to "
        "allow it: `planted.cli`)" in found["outcome"]
    )
    # Named in `allow`, it is imported because it is named.
    found = _restore_in_fresh_process(mlp, ["equinox", "jax", "planted.cli"], site)
    assert found == {"outcome": "restored", "imported": ["planted", "planted.cli"]}
    assert mark.exists()


@pytest.mark.slow
def test_the_allow_list_inspect_prints_works_in_a_fresh_process(mlp, planted, capsys):
    site, _ = planted
    sidecars.edit(
        mlp,
        lambda c: c["leaves"]["activation"].update(
            value={"callable": "planted.cli.relu"}
        ),
    )
    assert cli_main(["inspect", "--json", str(mlp)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["rebuild"]["allow"] == ["equinox.nn", "planted.cli"]
    found = _restore_in_fresh_process(mlp, item["rebuild"]["allow"], site)
    assert found["outcome"] == "restored"


@pytest.mark.parametrize(
    "name", ["lazy.sub.relu", "lazy.missing", "lazy.relu.__globals__"]
)
def test_a_module_getattr_is_never_called(tmp_path, monkeypatch, mlp, name):
    # A module's `__getattr__` may import anything (lazy submodules): a
    # rebuild reads module namespaces as they are.
    mark = tmp_path / "getattr-ran"
    (tmp_path / "lazy.py").write_text(
        textwrap.dedent(f"""
        def __getattr__(name):
            open({str(mark)!r}, "w").write(name)
            raise AttributeError(name)

        def relu(x):
            return x
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy", raising=False)
    sidecars.edit(
        mlp, lambda c: c["leaves"]["activation"].update(value={"callable": name})
    )
    with pytest.raises(oeqx.RebuildError, match=rf"`activation`: callable `{name}`"):
        oeqx.restore(mlp, allow=["equinox", "jax", "lazy"])
    assert not mark.exists()
    sys.modules.pop("lazy", None)


@pytest.mark.parametrize(
    "body, what",
    [
        ("raise SystemExit(2)", r"exited \(SystemExit\(2\)\)"),
        ("raise KeyboardInterrupt", r"was interrupted \(KeyboardInterrupt\)"),
    ],
    ids=["exit", "interrupt"],
)
def test_an_allowed_module_that_stops_when_imported_is_a_clear_error(
    tmp_path, monkeypatch, mlp, body, what
):
    (tmp_path / "stopper.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        oeqx.RebuildError,
        match=rf"Importing `stopper`, which `allow` names, {what}: it runs a "
        r"program when imported instead of only defining names \(a script, or a "
        r"package's command line\)\. Remove it from `allow`",
    ):
        oeqx.restore(mlp, allow=["equinox", "jax", "stopper"])
    assert "stopper" not in sys.modules


def test_narrow_allow_lists_work(mlp):
    # `jax.nn` holds `jax.nn.gelu`, recorded by its defining module's name.
    model = oeqx.restore(mlp, allow=["equinox.nn", "jax.nn"])
    assert model.activation is jax.nn.gelu
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`activation`: callable `jax\._src\.nn\.functions\.gelu` is outside "
        r"`allow` \(to allow it: `jax`\)",
    ):
        oeqx.restore(mlp, allow=["equinox.nn"])
    # A module that only imports `gelu` is no way to reach it.
    with pytest.raises(oeqx.RebuildError, match=r"is outside `allow`"):
        oeqx.restore(mlp, allow=["equinox.nn", "jax.numpy"])


def test_anything_an_allowed_module_holds_can_be_wired_in(mlp, capsys):
    # What `allow` trusts (the rebuild guide says so): `numpy.save` as an
    # activation, with `numpy` allowed; `inspect` lists what a rebuild installs.
    sidecars.edit(
        mlp,
        lambda c: c["leaves"]["activation"].update(value={"callable": "numpy.save"}),
    )
    model = oeqx.restore(mlp, allow=["equinox", "numpy"])
    assert model.activation is np.save
    assert cli_main(["inspect", "--json", str(mlp)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["rebuild"]["callables"] == ["numpy.save", "equinox.nn._mlp.<lambda>"]


def test_names_held_only_by_a_module_outside_allow_are_refused(mlp):
    # `os.system` is `posix.system`: `posix` is imported by everything.
    sidecars.edit(
        mlp,
        lambda c: c["leaves"]["activation"].update(value={"callable": "posix.system"}),
    )
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`activation`: callable `posix\.system` is outside `allow` \(to "
        r"allow it: `posix`\)",
    ):
        oeqx.restore(mlp, allow=["equinox", "jax"])
    # `os` holds it as `os.system`: allowing `os` trusts that too.
    assert oeqx.restore(mlp, allow=["equinox", "os"]).activation is os.system


# ----------------------------------------------------------- `Shared` selectors


@pytest.fixture
def tied(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, zoo.shared_tied(KEY))
    return path


def _wire(path, field, steps):
    def change(c):
        c["nodes"]["shared"]["wiring"][field]["paths"] = [steps]

    sidecars.edit(path, change)


_ESCAPES = {
    "eval": [
        ["index", 0],
        ["attr", "__class__"],
        ["attr", "__call__"],
        ["attr", "__globals__"],
        ["key", "__builtins__"],
        ["key", "eval"],
    ],
    "dunder": [["index", 0], ["attr", "__dict__"]],
    "static-field": [["index", 1], ["attr", "in_features"]],
    "past-the-end": [["index", 2]],
    "into-a-leaf": [["index", 0], ["attr", "weight"], ["attr", "T"]],
    "key-of-a-tuple": [["key", 0]],
}


@pytest.mark.parametrize("steps", _ESCAPES.values(), ids=_ESCAPES.keys())
@pytest.mark.parametrize("field", ["where", "get"])
def test_shared_selectors_step_through_recorded_nodes_only(tied, field, steps):
    _wire(tied, field, steps)
    shown = "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in steps)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(
            r"`eqx\.nn\.Shared` node `shared` records that "
            rf"`{field}` selects `{_escape(shown)}`, which is no node of the saved "
            r"tree \(at step .*\)"
        ),
    ):
        oeqx.restore(tied, allow=["equinox", "zoo"])


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_shared_selectors_of_recorded_nodes_still_tie(tied):
    # The recorded wiring, resealed: what the checks above refuse is only
    # what no save records.
    _wire(tied, "where", [["index", 1], ["attr", "weight"]])
    model = oeqx.restore(tied, allow=["equinox", "zoo"])
    embed, head = model.shared()
    assert embed.weight is head.weight


# ------------------------------------------------------ values that allocate


class Holder(eqx.Module):
    w: jax.Array
    value: object = eqx.field(static=True)


def _holder(value) -> Holder:
    with warnings.catch_warnings():  # Equinox warns of numpy scalars as static
        warnings.simplefilter("ignore", UserWarning)
        return Holder(jnp.ones(2), value)


@pytest.fixture
def holder(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _holder(np.int8(3)))
    return path


def _static(path, encoded):
    sidecars.edit(path, lambda c: c["modules"][""]["static"].update(value=encoded))


_SCALARS = {
    "bytes-from-an-int": (["|S1", 10**9], r"a \|S1 scalar recorded with an int value"),
    "as-the-issue-spells-it": (
        ["S1", 10**9],
        r"dtype 'S1' is spelled '\|S1' where a save writes it",
    ),
    "void-from-a-float": (["|V8", {"float": "2e10"}], r"a \|V8 scalar recorded"),
    "void-as-the-issue": (["V8", {"float": "2e10"}], r"dtype 'V8' is spelled"),
    "int8-out-of-range": (
        ["int8", 1000],
        r"1000 is out of range for int8 \(-128 to 127\)",
    ),
    "uint8-negative": (["uint8", -1], r"-1 is out of range for uint8 \(0 to 255\)"),
    "int4-out-of-range": (["int4", 8], r"8 is out of range for int4 \(-8 to 7\)"),
    "huge-int": (
        ["int64", {"int": "0x" + "f" * 600}],
        r"<a huge int> is out of range for int64 \(-9223372036854775808 to ",
    ),
    "float16-overflow": (
        ["float16", {"float": "1e10"}],
        r"10000000000\.0 is out of range for float16\.",
    ),
    "text-too-long": (["<U2", "abc"], r"a string of 3 characters is no <U2"),
    "bytes-too-long": (["|S2", {"bytes": "YWJj"}], r"3 bytes are no \|S2"),
    "not-what-it-reads-back": (
        ["float16", {"float": "0.1"}],
        r"the float16 scalar 0\.1 does not read back as recorded",
    ),
    "object": (["object", 1], r"dtype 'object' is one a save refuses"),
    "structured-spelling": (["i8,i8", 1], r"dtype 'i8,i8' is spelled"),
    "unknown": (["float99", 1], r"unknown dtype 'float99'"),
}


@pytest.mark.parametrize(
    "body, what", list(_SCALARS.values()), ids=list(_SCALARS.keys())
)
def test_numpy_scalars_are_checked_before_anything_is_made(holder, capsys, body, what):
    _static(holder, {"numpy": body})
    tracemalloc.start()
    try:
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=r"The sidecar in \S+ is damaged: the numpy scalar at `value` is "
            rf"none a save writes: {what}",
        ):
            oeqx.restore(holder, allow=["equinox", "test_rebuild_boundary"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # `["|S1", 10**9]` made a gigabyte, once
    assert cli_main(["inspect", str(holder)]) == 0
    out = capsys.readouterr().out
    assert "Without a skeleton: not rebuildable: The sidecar in" in out
    assert "the numpy scalar at `value` is none a save writes" in out


_SAVED = {
    "int8": np.int8(-5),
    "uint64": np.uint64(2**64 - 1),
    "float16": np.float16(0.1),
    "bfloat16": ml_dtypes.bfloat16(1.5),
    "int4": np.array(-3, ml_dtypes.int4)[()],
    "complex64": np.complex64(1 - 2j),
    "bool": np.bool_(True),
    "bytes": np.bytes_(b"abc"),
    "str": np.str_("ab"),
    "void": np.void(b"\x00\x01\x02\x03"),
    "nan": np.float32("nan"),
}


@pytest.mark.parametrize("value", list(_SAVED.values()), ids=list(_SAVED.keys()))
def test_numpy_scalars_a_save_writes_rebuild_as_saved(tmp_path, value):
    saved = {"static": _holder(value), "leaf": value}
    oeqx.save(tmp_path / "ckpt", saved)
    restored = oeqx.restore(
        tmp_path / "ckpt", allow=["equinox", "jax", "test_rebuild_boundary"]
    )
    for got in (restored["static"].value, restored["leaf"]):
        assert type(got) is type(value) and got.dtype == value.dtype
        assert got.tobytes() == value.tobytes()


def test_a_longdouble_saves_as_text_and_restores_into_a_skeleton(tmp_path):
    # Its `.item()` is itself: recorded by its text (it once recursed forever).
    value = np.longdouble("0.1")
    oeqx.save(tmp_path / "ckpt", _holder(value))
    static = oeqx.metadata(tmp_path / "ckpt").modules[""].static["value"]
    assert static["object"] == "numpy.longdouble"
    restored = oeqx.restore(tmp_path / "ckpt", _holder(value))
    assert restored.value is not None and restored.value == value
    with pytest.raises(oeqx.RebuildError, match=r"`value`: an object recorded only"):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "test_rebuild_boundary"])


def test_a_datetime_scalar_cannot_be_rebuilt_and_is_no_damage(tmp_path):
    oeqx.save(tmp_path / "ckpt", _holder(np.datetime64("2020-01-01")))
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`value`: a numpy datetime64\[D\] scalar, recorded as text, cannot "
        r"be rebuilt",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "test_rebuild_boundary"])


_ARRAY_DTYPES = {
    "structured": ("i8,i8", r"leaf 'x' has unknown dtype 'i8,i8'"),
    "void": (
        "V16",
        r"leaf 'x' has dtype 'V16', which no save writes \(it writes '\|V16'\)",
    ),
    "text": (
        "U2",
        r"leaf 'x' has dtype 'U2', which no save writes \(it writes '<U2'\)",
    ),
    "datetime": (
        "M8[s]",
        r"leaf 'x' has dtype 'M8\[s\]', which no save writes \(it writes "
        r"'datetime64\[s\]'\)",
    ),
    "object": (
        "O",
        r"leaf 'x' has dtype 'O', which no save writes \(it refuses arrays of "
        r"objects\)",
    ),
}


@pytest.mark.parametrize(
    "dtype, what", list(_ARRAY_DTYPES.values()), ids=list(_ARRAY_DTYPES.keys())
)
def test_array_dtypes_only_as_a_save_writes_them(tmp_path, capsys, dtype, what):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"x": np.zeros(2, np.float64)})
    sidecars.edit(path, lambda c: c["leaves"]["x"].update(dtype=dtype))
    for restore in (
        lambda: oeqx.restore(path),
        lambda: oeqx.restore(path, allow=["equinox"]),
        lambda: oeqx.metadata(path),
        lambda: oeqx.verify(path),
    ):
        with pytest.raises(oeqx.CheckpointDamagedError, match=_damaged(what)):
            restore()
    assert cli_main(["inspect", str(path)]) == 2
    assert "is damaged: leaf 'x' has" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value",
    [
        np.array(["ab", "c"]),
        np.array(["x" * 100]),
        np.zeros(3, "V16"),
        np.array(["2020-01-01"], "M8[s]"),
    ],
    ids=["text", "long-text", "void", "datetime"],
)
def test_arrays_of_flexible_dtypes_rebuild(tmp_path, value):
    oeqx.save(tmp_path / "ckpt", {"x": value})
    restored = oeqx.restore(tmp_path / "ckpt", allow=[])
    assert restored["x"].dtype == value.dtype
    np.testing.assert_array_equal(restored["x"], value)


def test_a_packed_leaf_claiming_gigabytes_is_refused_before_its_stand_in(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"x": np.bytes_(b"ab")})

    def claim(c):
        c["leaves"]["x"].update(dtype="|S1000000000", nbytes=10**9)
        c["packs"][0]["nbytes"] = 10**9 + 64

    sidecars.edit(path, claim)
    tracemalloc.start()
    try:
        with pytest.raises(oeqx.CheckpointDamagedError, match=r"orbax_eqx~packed"):
            oeqx.restore(path, allow=[])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20

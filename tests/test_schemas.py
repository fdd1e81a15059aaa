"""The shard index's schema (`_format/schema.py`): what a
record may hold is said as types and bounds, and anything else written into
an index is damage, named by index file and leaf.

The checkpoint is saved by a subprocess with 4 CPU devices (one row-sharded
array); each test edits a copy of its index and restores it here.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import sidecars

import orbax_eqx as oeqx

pytestmark = pytest.mark.slow  # a subprocess with 4 devices saves once

SAVE = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx
    mesh = jax.make_mesh((4,), ("a",))
    x = np.arange(32 * 4, dtype=np.int32).reshape(32, 4)
    s = NamedSharding(mesh, P("a"))
    rows = jax.make_array_from_callback(x.shape, s, lambda i: x[i])
    oeqx.save(sys.argv[1], {"rows": rows})
    """
)
SKELETON = {"rows": np.zeros((32, 4), np.int32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "ckpt"
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return path


def _edited(saved, tmp_path, change):
    """The index edited and resealed, as an attacker would (a JSON object's
    text: anything else has no seal to write)."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    (index,) = path.glob("orbax_eqx~shards.*.json")
    content = json.loads(index.read_text())
    content.pop("checksum")
    text = change(content)
    if text.startswith("{") and text.endswith("}"):
        index.write_bytes(sidecars.seal_text(text))
    else:
        index.write_text(text)
    return path, index


def _row(content, k=0):
    return content["chunks"]["rows"][k]


def _set(content, k, value):
    _row(content)[k] = value
    return json.dumps(content)


def _malformed(what):
    return rf"it is not a shard index as orbax_eqx writes it \({what}\)"


_UNSEALED = r"it records no checksum on its last line: it was edited"


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: _set(c, 2, True), _malformed(r"Expected `int`, got `bool`.*")),
        (lambda c: _set(c, 2, 1.0), _malformed(r"Expected `int`, got `float`.*")),
        (lambda c: _set(c, 3, -4), _malformed(r"Expected `int` >= 0.*")),
        (lambda c: _set(c, 4, 0), _malformed(r"Expected `int` >= 1.*")),
        (lambda c: _set(c, 5, ["0" * 17]), _malformed(r"Expected `str` matching.*")),
        (lambda c: _set(c, 0, [0]), r"a chunk of `rows` has a box of two ranks"),
        (lambda c: _set(c, 0, "0"), _malformed(r"Expected `array`, got `str`.*")),
        (
            # (two optional trailing fields: a file index and an XXH3-128)
            lambda c: json.dumps(
                {**c, "chunks": {"rows": [_row(c) + [0, "0" * 32, 7]]}}
            ),
            _malformed(r"Expected `array` of at most length 8.*"),
        ),
        (
            lambda c: json.dumps({**c, "chunks": {"rows": [_row(c)[:5]]}}),
            _malformed(r"Expected `array` of at (most|least) length 6.*"),
        ),
        (
            lambda c: json.dumps({**c, "chunks": {"rows": {"0": _row(c)}}}),
            _malformed(r"Expected `array`, got `object` - at `\$\.chunks\[\.\.\.\]`"),
        ),
        (
            lambda c: json.dumps({**c, "chunks": [_row(c)]}),
            _malformed(r"Expected `object`, got `array` - at `\$\.chunks`"),
        ),
        (
            lambda c: json.dumps({**c, "nbytes": -1}),
            _malformed(r"Expected `int` >= 0 - at `\$\.nbytes`"),
        ),
        (lambda c: json.dumps([c]), _UNSEALED),
        (
            lambda c: json.dumps({**c, "chunks": {"rows": "@"}}).replace(
                '"@"', "[" * 100_000 + "]" * 100_000
            ),
            _malformed(r"maximum recursion depth exceeded.*"),
        ),
        (lambda c: "[" * 100_000 + "]" * 100_000, _UNSEALED),
        (lambda c: '{"format": NaN}', _malformed(r"JSON is malformed.*")),
    ],
    ids=[
        "bool-offset",
        "float-offset",
        "negative-size",
        "zero-block",
        "sum-past-64-bits",
        "ranks-differ",
        "start-a-string",
        "row-too-long",
        "row-too-short",
        "rows-not-a-list",
        "chunks-not-an-object",
        "negative-nbytes",
        "not-an-object",
        "deep-rows",
        "deep-document",
        "nan",
    ],
)
def test_what_the_schema_does_not_allow_is_damage(saved, tmp_path, change, problem):
    path, index = _edited(saved, tmp_path, change)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {index.name} of the checkpoint in .* is damaged: "
        rf"{problem}",
    ):
        oeqx.restore(path, SKELETON)


def test_fields_the_schema_does_not_name_are_ignored(saved, tmp_path):
    # An index may carry more than this version reads (a later writer's notes):
    # only the fields the schema names are read.
    path, _ = _edited(saved, tmp_path, lambda c: json.dumps({**c, "note": [1, 2]}))
    restored = oeqx.restore(path, SKELETON)
    np.testing.assert_array_equal(
        restored["rows"], np.arange(32 * 4, dtype=np.int32).reshape(32, 4)
    )


# --- the sidecar's schemas (`_format/schema.py`) ------------------------------

import jax.numpy as jnp  # noqa: E402
from entry import main  # noqa: E402


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "ckpt"
    item = {"w": jnp.ones(2), "n": 3, "f": jnp.tanh}
    oeqx.save(path, item)
    return path


def _leaf(name, **fields):
    return lambda c: c["leaves"][name].update(**fields)


def _damaged(what):
    return rf"The sidecar in .* is damaged: {what}.*\. Restore an earlier step"


def _bad_leaf(what):
    return rf"leaf 'w' is malformed \({what}\)"


def _bad_field(field, what):
    return rf'its "{field}" is malformed \({what}\)'


@pytest.mark.parametrize(
    "edit, what",
    [
        (
            _leaf("w", kind="tensor"),
            _bad_leaf(r"Invalid value 'tensor' - at `\$\.kind`"),
        ),
        (_leaf("w", kind=None), _bad_leaf(r"Expected `str` - at `\$\.kind`")),
        (_leaf("w", path=7), _bad_leaf(r"Expected `str`, got `int` - at `\$\.path`")),
        (_leaf("w", shape=[True]), _bad_leaf(r"Expected `int`, got `bool` - .*")),
        (_leaf("w", shape=[2.0]), _bad_leaf(r"Expected `int`, got `float` - .*")),
        (_leaf("w", shape=[2**63]), _bad_leaf(r"Expected `int` <= \d+ - .*")),
        (_leaf("w", container="torch"), _bad_leaf(r"Invalid enum value 'torch' - .*")),
        (_leaf("w", dtype=4), _bad_leaf(r"Expected `str`, got `int` - at `\$\.dtype`")),
        (_leaf("w", data="disk"), _bad_leaf(r"Invalid enum value 'disk' - .*")),
        (_leaf("w", sum32=-1), _bad_leaf(r"Expected `int` >= 0 - at `\$\.sum32`")),
        (_leaf("w", xxh3="XYZ"), _bad_leaf(r"Expected `str` matching regex .*")),
        (
            lambda c: c["leaves"].update(w=[1, 2]),  # no row (`compact`)
            _bad_leaf(r"Expected `str`, got `int` - at `\$\[0\]`"),
        ),
        (
            lambda c: c["modules"].update(x={"static": {}}),
            r"module 'x' has no class, path or static fields",
        ),
        (
            lambda c: c["nodes"][""].update(type="set"),
            r"node '' is malformed \(Invalid enum value 'set' - at `\$\.type`\)",
        ),
        (
            lambda c: c["nodes"][""].update(keys={"a": 1}),
            r"node '' is malformed \(Expected `array`, got `object` - at `\$\.keys`\)",
        ),
        (
            lambda c: c.update(checksums="yes"),
            _bad_field("checksums", r"Expected `bool`, got `str` - .*"),
        ),
        (
            lambda c: c.update(shard_files=-2),
            _bad_field("shard_files", r"Expected `int` >= 0 - .*"),
        ),
        (
            lambda c: c.update(packs={}),
            _bad_field("packs", r"Expected `array`, got `object` - .*"),
        ),
        (
            lambda c: c["packs"][0].update(nbytes="8"),
            _bad_field(
                "packs", r"Expected `int`, got `str` - at `\$\.packs\[0\]\.nbytes`"
            ),
        ),
        (
            lambda c: c.update(versions={"jax": 1}),
            _bad_field("versions", r"Expected `str`, got `int` - .*"),
        ),
        (
            lambda c: c.update(modules=[]),
            _bad_field("modules", r"Expected `object`, got `array` - .*"),
        ),
    ],
    ids=[
        "kind-unknown",
        "kind-null",
        "path-int",
        "shape-bool",
        "shape-float",
        "shape-past-numpy",
        "container",
        "dtype-int",
        "data",
        "sum32",
        "xxh3-not-hex",
        "leaf-a-list",
        "module-no-class",
        "node-type",
        "node-keys",
        "checksums",
        "shard-files",
        "packs",
        "pack-size",
        "versions",
        "modules",
    ],
)
def test_what_the_sidecar_schema_does_not_allow_is_damage(small, edit, what):
    sidecars.edit(small, edit)
    with pytest.raises(oeqx.CheckpointDamagedError, match=_damaged(what)):
        oeqx.metadata(small)


def test_fields_the_sidecar_schema_does_not_name_are_read_past(small):
    # A later writer's notes, on the document and on each kind of record.
    def notes(c):
        c["note"] = {"by": "a later writer"}
        for rec in c["leaves"].values():
            rec["note"] = [1, 2, 3]
        for rec in c["modules"].values():
            rec["note"] = None

    sidecars.edit(small, notes)
    restored = oeqx.restore(small, {"w": jnp.zeros(2), "n": 0, "f": jnp.tanh})
    np.testing.assert_array_equal(restored["w"], np.ones(2))
    assert restored["n"] == 3


def test_only_a_rebuild_reads_the_records_of_inner_nodes(small, capsys):
    # A restore into a skeleton, or a flat one, builds no node from them and
    # reads past them (their time and memory are a tenth of a large tree's);
    # a rebuild, `metadata` and `verify` read and check them.
    sidecars.edit(small, lambda c: c["nodes"][""].update(type="set"))
    skeleton = {"w": jnp.zeros(2), "n": 0, "f": jnp.tanh}
    np.testing.assert_array_equal(oeqx.restore(small, skeleton)["w"], np.ones(2))
    assert oeqx.restore(small)["n"] == 3
    damaged = _damaged(r"node '' is malformed \(Invalid enum value 'set'")
    with pytest.raises(oeqx.CheckpointDamagedError, match=damaged):
        oeqx.restore(small, allow=["jax"])
    with pytest.raises(oeqx.CheckpointDamagedError, match=damaged):
        oeqx.metadata(small)
    capsys.readouterr()
    assert main(["verify", str(small)]) != 0
    assert "node '' is malformed (Invalid enum value 'set'" in capsys.readouterr().err

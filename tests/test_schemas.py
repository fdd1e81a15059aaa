"""The shard index's schema (`_storage/sharded/index_schema.py`): what a
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
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    (index,) = path.glob("orbax_eqx~shards.*.json")
    text = index.read_text()
    index.write_text(change(json.loads(text)) if callable(change) else change)
    return path, index


def _row(content, k=0):
    return content["chunks"]["rows"][k]


def _set(content, k, value):
    _row(content)[k] = value
    return json.dumps(content)


FORM = r"a chunk of `rows` is not \[start, stop, offset, nbytes, block, xxh3s\]"


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: _set(c, 2, True), FORM),  # a boolean is no size
        (lambda c: _set(c, 2, 1.0), FORM),  # nor is a float
        (lambda c: _set(c, 3, -4), FORM),
        (lambda c: _set(c, 4, 0), FORM),  # a block of 0 bytes
        (lambda c: _set(c, 5, ["0" * 17]), FORM),  # past an XXH3-64
        (lambda c: _set(c, 0, [0]), FORM),  # start and stop of other ranks
        (lambda c: _set(c, 0, "0"), FORM),
        (lambda c: json.dumps({**c, "chunks": {"rows": [_row(c) + [7]]}}), FORM),
        (lambda c: json.dumps({**c, "chunks": {"rows": [_row(c)[:5]]}}), FORM),
        (
            lambda c: json.dumps({**c, "chunks": {"rows": {"0": _row(c)}}}),
            r"the chunks of `rows` are not a list",
        ),
        (
            lambda c: json.dumps({**c, "chunks": [_row(c)]}),
            r'"chunks" must be a JSON object',
        ),
        (lambda c: json.dumps({**c, "nbytes": -1}), r'"nbytes" must be a size'),
        (lambda c: json.dumps([c]), r'expected a JSON object with "format"'),
        (
            lambda c: json.dumps({**c, "chunks": {"rows": "@"}}).replace(
                '"@"', "[" * 100_000 + "]" * 100_000
            ),
            r"it is not valid JSON \(maximum recursion depth exceeded",
        ),
        (lambda c: "[" * 100_000 + "]" * 100_000, r"expected a JSON object"),
        (lambda c: '{"format": NaN}', r"it is not valid JSON"),
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
import sidecars  # noqa: E402
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


@pytest.mark.parametrize(
    "edit, what",
    [
        (_leaf("w", kind="tensor"), r"leaf 'w' has unknown kind 'tensor'"),
        (_leaf("w", kind=None), r"leaf 'w' has unknown kind None"),
        (_leaf("w", path=7), r"leaf 'w' has a path that is not a string"),
        (_leaf("w", shape=[True]), r"leaf 'w' has shape \[True\], not a list of sizes"),
        (_leaf("w", shape=[2.0]), r"leaf 'w' has shape \[2\.0\], not a list of sizes"),
        (_leaf("w", shape=[2**63]), r"leaf 'w' has shape \[\d+\], not a list of sizes"),
        (_leaf("w", container="torch"), r"leaf 'w' has no valid dtype or container"),
        (_leaf("w", dtype=4), r"leaf 'w' has no valid dtype or container"),
        (_leaf("w", data="disk"), r"leaf 'w' has unknown data location 'disk'"),
        (_leaf("w", sum32=-1), r"leaf 'w' has sum32 -1, not a 32-bit checksum"),
        (_leaf("w", crc32=5), r"leaf 'w' records a CRC-32 \(\"crc32\"\), which a"),
        (_leaf("w", xxh3="XYZ"), r"leaf 'w' has data checksum 'XYZ', not XXH3-64"),
        (
            lambda c: c["leaves"].update(w=[1, 2]),  # no row (`compact`)
            r"leaf 'w' is a row, `\[dtype, shape, offset, xxh3\]` \(a packed jax "
            r"array\), but it has 2 values",
        ),
        (
            lambda c: c["modules"].update(x={"static": {}}),
            r"module 'x' has no class, path or static fields",
        ),
        (
            lambda c: c["nodes"][""].update(type="set"),
            r"node '' has no valid type, path or children",
        ),
        (
            lambda c: c["nodes"][""].update(keys={"a": 1}),
            r"the keys of node '' are malformed",
        ),
        (lambda c: c.update(checksums="yes"), r'"checksums" must be true or false'),
        (lambda c: c.update(shard_files=-2), r'"shard_files" is -2, not a count'),
        (lambda c: c.update(packs={}), r'"packs" must be a JSON list'),
        (lambda c: c["packs"][0].update(nbytes="8"), r"pack 0 has no size"),
        (lambda c: c.update(versions={"jax": 1}), r'"versions" must map package'),
        (lambda c: c.update(modules=[]), r'"modules" must be a JSON object'),
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
        "crc32-in-format-6",
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
    with pytest.raises(oeqx.SidecarError, match=_damaged(what)):
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
    damaged = _damaged(r"node '' has no valid type, path or children")
    with pytest.raises(oeqx.SidecarError, match=damaged):
        oeqx.restore(small, allow=["jax"])
    with pytest.raises(oeqx.SidecarError, match=damaged):
        oeqx.metadata(small)
    capsys.readouterr()
    assert main(["verify", str(small)]) != 0
    assert "node '' has no valid type, path or children" in capsys.readouterr().err

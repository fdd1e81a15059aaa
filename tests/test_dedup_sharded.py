"""Sharded arrays stored once (`EqxHandler(dedup=True)`): each chunk a process
writes (a distinct box of a sharded array) that the newest step holds, byte
for byte, is recorded as a reference to that step's shard pack in the shared
directory instead of being written again.

A subprocess with 8 CPU devices saves a frozen sharded base beside a trained
sharded head, step after step, and restores every kept step onto another
mesh; this process (one device: another mesh again) checks the files, copies
a step out, deletes shared bytes by hand and edits shard indexes as an
attacker would. Files are named as docs/guides/format.md names them.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pytest
import sidecars

import orbax_eqx as oeqx

# Its module-scoped steps take seconds to make: the whole module is slow.
pytestmark = pytest.mark.slow

SHARED = "orbax_eqx~shared"
STEPS = 6

_SAVE = textwrap.dedent(
    """
    import json, os, sys
    import jax, numpy as np
    import orbax.checkpoint as ocp
    import orbax_eqx as oeqx
    sys.path.insert(0, sys.argv[2])
    from test_dedup_sharded import STEPS, SHARED, item, skeleton

    root, where = sys.argv[1], os.path.join(sys.argv[1], SHARED)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sizes = []
    with ocp.CheckpointManager(
        root,
        item_handlers=oeqx.EqxHandler(dedup=True),
        options=ocp.CheckpointManagerOptions(max_to_keep=3),
    ) as mngr:
        for step in range(STEPS):
            before = set(os.listdir(where)) if step else set()
            mngr.save(step, args=oeqx.EqxSave(item(step, mesh)))
            mngr.wait_until_finished()
            sizes.append({
                n: os.path.getsize(os.path.join(where, n))
                for n in os.listdir(where) if n not in before
            })
        other = jax.make_mesh((2, 4), ("a", "b"))
        for step in mngr.all_steps():
            got = mngr.restore(step, args=oeqx.EqxRestore(skeleton(other)))
            want = item(step, other)
            assert got["head"].sharding == want["head"].sharding
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b)), step
    print(json.dumps(sizes))
    """
)


def _place(mesh, x, spec):
    from jax.sharding import NamedSharding

    if mesh is None:
        return x
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])


def item(step: int, mesh=None):
    """A frozen base (`w` over both mesh axes, `emb` split along its rows)
    and a head and bias trained at each step (numpy arrays without `mesh`)."""
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    emb = rng.standard_normal((256, 64)).astype(np.float32)
    head = np.full((8, 64), step, np.float32) + np.arange(64, dtype=np.float32)
    return {
        "base": {"w": _place(mesh, w, P("a", "b")), "emb": _place(mesh, emb, P("a"))},
        "head": _place(mesh, head, P("a")),
        "bias": np.full(4, step, np.float32),
        "step": step,
    }


def skeleton(mesh=None):
    """`item`'s skeleton, of shape-dtype structs (placed over `mesh`, if given)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def struct(shape, spec):
        sharding = None if mesh is None else NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)

    return {
        "base": {
            "w": struct((64, 1024), P("a", "b")),
            "emb": struct((256, 64), P("a")),
        },
        "head": struct((8, 64), P("a")),
        "bias": np.zeros(4, np.float32),
        "step": 0,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`(root, [{file: size} new in the shared directory after each save]`)."""
    root = tmp_path_factory.mktemp("dedup-sharded") / "run"
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).parent.parent),
    }
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE, str(root), here],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def copied(run, tmp_path):
    """A copy of the run's root, to damage."""
    shutil.copytree(run[0], tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _assert_step(got, step: int) -> None:
    want = item(step)
    assert got["step"] == step
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _kept(root) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def _index(root, step: int) -> tuple[Path, dict]:
    item_dir = root / str(step) / "default"
    token = oeqx.metadata(item_dir).token
    path = item_dir / f"orbax_eqx~shards.{token}.0.json"
    return path, json.loads(path.read_text())


def test_only_the_changed_chunks_are_written(run):
    root, sizes = run
    shards = [{n: s for n, s in new.items() if "~shards." in n} for new in sizes]
    # The first save: the whole base (256 KiB and 64 KiB) and the head.
    ((first,),) = (list(s.values()) for s in shards[:1])
    assert first == 64 * 1024 * 4 + 256 * 64 * 4 + 8 * 64 * 4
    # Then the head alone: 4 distinct row blocks of 2 x 64 float32 each.
    for new in shards[1:]:
        assert list(new.values()) == [4 * 2 * 64 * 4]
    assert _kept(root) == [3, 4, 5]
    # Every kept step's index lists the first save's shard pack and its own.
    first_file = next(iter(shards[0]))
    for step in _kept(root):
        _, index = _index(root, step)
        assert index["shared"] is True
        files = [f["file"] for f in index["files"]]
        assert sorted(files) == sorted([first_file, *shards[step]])
        assert all(len(row) == 8 for rows in index["chunks"].values() for row in rows)
    # Left in the shared directory: what the kept steps refer to (closing
    # the manager collected step 2's own, which Orbax deleted last).
    left = {n for n in os.listdir(root / SHARED) if "~shards." in n}
    assert left == {first_file, *shards[3], *shards[4], *shards[5]}


def test_inspect_says_what_a_step_shares_with_which_steps(run):
    root, _ = run
    found = subprocess.run(
        [sys.executable, "-m", "orbax_eqx", "inspect", str(root / "5" / "default")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    own = 4 * 2 * 64 * 4  # the head's chunks
    assert (
        f"Stored once across steps (dedup): {own / 1024:.1f} KiB written by this "
        "save, 320.0 KiB by earlier ones, in 3 shared packs, shared with step(s) 3, 4."
    ) in found


def test_the_published_schema_validates_a_dedup_shard_index(run):
    schema = json.loads(
        (Path(__file__).parent.parent / "docs" / "format.schema.json").read_text()
    )
    _, index = _index(run[0], 5)
    jsonschema.validate(index, schema)


def test_every_kept_step_restores_bitwise_onto_one_device(run):
    root, _ = run
    for step in _kept(root):
        _assert_step(oeqx.restore(root / str(step) / "default", skeleton()), step)
    assert oeqx.verify(root / "5" / "default").ok


def test_a_step_copied_out_restores_without_the_shared_dir(copied, tmp_path):
    release = tmp_path / "release" / "4"
    files = oeqx.copy_step(copied / "4", release)
    assert sum("~shards." in f for f in files) == 2  # the first save's and its own
    shutil.rmtree(copied / SHARED)
    _assert_step(oeqx.restore(release / "default", skeleton()), 4)
    _, index = _index(tmp_path / "release", 4)
    assert "shared" not in index and len(index["files"]) == 2
    assert oeqx.verify(release / "default").ok


def test_a_shared_shard_pack_deleted_by_hand_names_its_leaves(copied):
    _, index = _index(copied, 5)
    # The first save's (the base and head 0), not step 5's own (the head).
    (first,) = (f["file"] for f in index["files"] if f["nbytes"] > 2048)
    os.remove(copied / SHARED / first)
    with pytest.raises(oeqx.CheckpointDamagedError) as e:
        oeqx.restore(copied / "5" / "default", skeleton())
    message = str(e.value)
    assert "in files that are gone" in message
    assert f"{SHARED}/{first}, which held leaves " in message
    assert "`['base']['w']`" in message and "`['base']['emb']`" in message
    assert "python -m orbax_eqx copy" in message


def _edit(root, step: int, change) -> None:
    path, index = _index(root, step)
    change(index)
    sidecars.write_json(path, index)


def _point_head_at_the_base(index) -> None:
    """Step 5's first head chunk, pointed at the first save's shard pack, at
    the offset of its own bytes there: other bytes, of the same size."""
    own = next(i for i, f in enumerate(index["files"]) if f["nbytes"] == 2048)
    row = index["chunks"]["head"][0]
    assert row[6] == own
    row[6] = 1 - own


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda c: c["files"][0].update(file="../../outside.bin"),
            r"file 0 is '../../outside.bin', not a shard pack",
        ),
        (
            lambda c: c["files"][1].update(file="orbax_eqx.json"),
            r"file 1 is 'orbax_eqx.json', not a shard pack",
        ),
        (
            lambda c: c["chunks"]["head"][0].__setitem__(6, 7),
            r"a chunk of `head` names file 7 where the index lists 2",
        ),
        (
            _point_head_at_the_base,
            r"changed after it was saved[\s\S]*Leaf `\['head'\]` \(head\), chunk "
            r"\[\d+:\d+, 0:64\] in orbax_eqx~shards\.",
        ),
    ],
    ids=["outside-the-root", "not-a-shard-pack", "no-such-file", "unrelated-bytes"],
)
def test_a_hostile_shard_index_is_refused(copied, change, match):
    (copied.parent / "outside.bin").write_bytes(b"\0" * (1 << 20))
    _edit(copied, 5, change)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(copied / "5" / "default", skeleton())


def test_shared_shard_packs_of_a_checkpoint_saved_alone_are_refused(copied):
    """Shared bytes are found beside the steps of a manager only: a sidecar
    without a manager's step (its own packs moved in) whose shard index lists
    shared shard packs is damage."""
    item_dir = copied / "5" / "default"

    def alone(content):
        content.pop("saved_as")
        for pack in content["packs"]:
            assert pack.pop("shared") is True
            shutil.copyfile(copied / SHARED / pack["file"], item_dir / pack["file"])

    sidecars.edit(item_dir, alone)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"orbax_eqx~shards\.[0-9a-f]{16}\.0\.json of the checkpoint in .* is "
        r"damaged: it lists shared shard packs, which only the steps of a manager "
        r"have, but the sidecar records no manager's step",
    ):
        oeqx.restore(item_dir, skeleton())

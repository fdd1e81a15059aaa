"""Steps that store each unchanged leaf once (`EqxHandler(dedup=True)`).

A frozen base beside a trained head, saved step after step through one
manager: the base's bytes are written once, in the shared directory beside
the steps, and every kept step restores bitwise whatever Orbax's retention, a
user's `rm -r` or a `kill -9` deleted. Files are named as docs/guides/format.md
names them.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import xxhash

import orbax_eqx as oeqx

SHARED = "orbax_eqx~shared"
BASE = np.arange(1 << 16, dtype=np.float32)  # 256 KiB, frozen


def _item(step: int):
    return {
        "base": {"w": jnp.asarray(BASE), "table": BASE[:1000].copy()},
        "head": eqx.nn.Linear(4, 3, key=jax.random.key(step)),
        "step": step,
    }


SKELETON = _item(0)


def _manager(root, **options):
    return ocp.CheckpointManager(
        root,
        item_handlers=oeqx.EqxHandler(dedup=True),
        options=ocp.CheckpointManagerOptions(**options),
    )


def _assert_step(got, step: int) -> None:
    want = _item(step)
    assert got["step"] == step
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _shared(root) -> dict[str, int]:
    where = os.path.join(root, SHARED)
    return {n: os.path.getsize(os.path.join(where, n)) for n in os.listdir(where)}


def _packs(root, step: int) -> set[str]:
    """The shared packs step `step` refers to (none if its sidecar is gone)."""
    path = root / str(step) / "default" / "orbax_eqx.json"
    if not path.exists():
        return set()
    return {p["file"] for p in json.loads(path.read_text())["packs"] if p.get("shared")}


def test_a_frozen_base_is_written_once_and_every_kept_step_restores(tmp_path):
    with _manager(tmp_path, max_to_keep=3) as mngr:
        mngr.save(0, args=oeqx.EqxSave(_item(0)))
        mngr.wait_until_finished()
        (first,) = _shared(tmp_path).values()
        for step in range(1, 8):
            before = set(_shared(tmp_path))
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
            mngr.wait_until_finished()
            new = {n: s for n, s in _shared(tmp_path).items() if n not in before}
            # Only the head (weight 48 + bias 12 bytes, each at a 64-byte offset).
            assert list(new.values()) == [64 + 12]
        assert mngr.all_steps() == [5, 6, 7]
        for step in mngr.all_steps():
            _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)
        # The base's pack and the heads of kept steps, and of step 4, which
        # Orbax deleted after the last save's clean-up.
        assert len(_shared(tmp_path)) == 5
    assert first > BASE.nbytes
    # Closing the manager collected step 4's.
    live = set().union(*(_packs(tmp_path, s) for s in (5, 6, 7)))
    assert len(live) == 4 and set(_shared(tmp_path)) == live


def test_retention_and_steps_deleted_by_hand_break_no_kept_step(tmp_path):
    options = dict(
        max_to_keep=2,
        best_fn=lambda metrics: metrics["score"],
        best_mode="max",
        keep_checkpoints_without_metrics=False,
    )
    scores = [5, 1, 9, 2, 7, 3, 8]
    with _manager(tmp_path, **options) as mngr:
        for step, score in enumerate(scores):
            mngr.save(step, args=oeqx.EqxSave(_item(step)), metrics={"score": score})
            mngr.wait_until_finished()
        kept = mngr.all_steps()
        assert kept == [2, 6]  # the best two: step 0's base is in neither's own pack
        for step in kept:
            _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)
    with _manager(tmp_path, max_to_keep=5) as mngr:
        for step in (10, 11, 12):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
            mngr.wait_until_finished()
        shutil.rmtree(tmp_path / "11")  # by hand, in the middle
        mngr.reload()
        mngr.save(13, args=oeqx.EqxSave(_item(13)))
        mngr.wait_until_finished()
        for step in mngr.all_steps():
            _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)
        steps = mngr.all_steps()
    # Nothing but what the kept steps refer to is left.
    live = set().union(*(_packs(tmp_path, s) for s in steps))
    assert set(_shared(tmp_path)) == live


def test_a_changed_leaf_is_written_again(tmp_path):
    table = np.zeros(1000, np.float32)
    with _manager(tmp_path) as mngr:
        for step in range(3):
            table[step] = step + 1  # changed in place: the bytes say so
            mngr.save(step, args=oeqx.EqxSave({"table": table}))
            mngr.wait_until_finished()
            got = mngr.restore(step, args=oeqx.EqxRestore({"table": table}))
            np.testing.assert_array_equal(got["table"], table)
        assert len(_shared(tmp_path)) == 3


def test_two_items_of_one_step_share_one_directory(tmp_path):
    handlers = {
        "model": oeqx.EqxHandler(dedup=True),
        "opt": oeqx.EqxHandler(dedup=True),
    }
    with ocp.CheckpointManager(
        tmp_path,
        item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(max_to_keep=2),
    ) as mngr:
        for step in range(4):
            args = ocp.args.Composite(
                model=oeqx.EqxSave(_item(step)),
                opt=oeqx.EqxSave({"mu": jnp.full((8,), step, jnp.float32)}),
            )
            mngr.save(step, args=args)
            mngr.wait_until_finished()
        for step in mngr.all_steps():
            got = mngr.restore(
                step,
                args=ocp.args.Composite(
                    model=oeqx.EqxRestore(SKELETON),
                    opt=oeqx.EqxRestore({"mu": jnp.zeros((8,), jnp.float32)}),
                ),
            )
            _assert_step(got.model, step)
            np.testing.assert_array_equal(got.opt["mu"], np.full((8,), step))


def test_a_step_copied_out_restores_without_the_shared_bytes(tmp_path):
    root = tmp_path / "run"
    with _manager(root) as mngr:
        for step in range(3):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    copied = oeqx.copy_step(root / "2", tmp_path / "release" / "2")
    assert len(copied) == 2  # the base's pack and step 2's own
    shutil.rmtree(root / SHARED)
    got = oeqx.restore(tmp_path / "release" / "2" / "default", SKELETON)
    _assert_step(got, 2)
    with pytest.raises(oeqx.CheckpointDamagedError) as e:
        oeqx.restore(root / "2" / "default", SKELETON)
    message = str(e.value)
    assert "in files that are gone" in message
    assert "which held leaves `['base']['table']`, `['base']['w']`" in message
    assert "which held leaves `['head'].weight`, `['head'].bias`" in message
    assert f"{SHARED}/orbax_eqx~packed." in message
    assert "python -m orbax_eqx copy" in message
    with pytest.raises(FileExistsError, match="exists already; pass the path of a new"):
        oeqx.copy_step(root / "2", tmp_path / "release" / "2")


def test_dedup_needs_packs_and_a_manager(tmp_path):
    with pytest.raises(ValueError, match=r"dedup=True, pack=False\): only packed"):
        oeqx.EqxHandler(dedup=True, pack=False)
    with ocp.Checkpointer(oeqx.EqxHandler(dedup=True)) as checkpointer:
        with pytest.raises(ValueError, match="is a checkpoint of its own. Save it"):
            checkpointer.save(tmp_path / "alone", args=oeqx.EqxSave(_item(0)))


def _reseal(path) -> None:
    """Seals an edited sidecar again, as the format page says a save does."""
    lines = path.read_bytes().split(b"\n")
    body = b"\n".join(lines[:-3]) + b"\n"
    digest = f"xxh3:{xxhash.xxh3_64_intdigest(body):016x}"
    path.write_bytes(body + f' "checksum": "{digest}"\n}}\n'.encode())


def _edit_packs(path, edit) -> None:
    lines = path.read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(b' "packs": '))
    packs = json.loads(lines[at][len(b' "packs": ') :].rstrip(b","))
    edit(packs)
    lines[at] = b' "packs": ' + json.dumps(packs).encode() + b","
    path.write_bytes(b"\n".join(lines))
    _reseal(path)


def test_shared_packs_are_read_only_beside_the_steps_of_a_manager(tmp_path):
    root = tmp_path / "run"
    with _manager(root) as mngr:
        mngr.save(0, args=oeqx.EqxSave(_item(0)))
        mngr.wait_until_finished()
    path = root / "0" / "default" / "orbax_eqx.json"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(x for x in lines if not x.startswith(b' "saved_as"')))
    _reseal(path)
    with pytest.raises(oeqx.CheckpointDamagedError, match="lists shared packs but was"):
        oeqx.restore(root / "0" / "default", SKELETON)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda p: p[0].update(file="../../outside.bin"), "not a pack file"),
        (lambda p: p[0].update(file="orbax_eqx~packed.0123456789abcdef.0.bin"), "gone"),
        # (the base's pack, written with step 0's head after the base)
        (lambda p: p[1].update(nbytes=p[1]["nbytes"] - 64), "bytes where"),
        (lambda p: p.reverse(), "changed after it was saved|ends at byte"),
    ],
    ids=["outside-the-root", "another-file", "another-size", "unrelated-bytes"],
)
def test_hostile_references_are_refused(tmp_path, edit, match):
    (tmp_path / "outside.bin").write_bytes(b"\0" * (1 << 20))
    root = tmp_path / "run"
    with _manager(root) as mngr:
        for step in range(2):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    _edit_packs(root / "1" / "default" / "orbax_eqx.json", edit)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(root / "1" / "default", SKELETON)


def test_an_unreadable_step_keeps_every_shared_pack(tmp_path):
    with _manager(tmp_path) as mngr:
        for step in range(2):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
            mngr.wait_until_finished()
        (tmp_path / "0" / "default" / "orbax_eqx.json").write_text("{")  # damaged
        before = set(_shared(tmp_path))
        shutil.rmtree(tmp_path / "1")
        mngr.reload()
        mngr.save(2, args=oeqx.EqxSave(_item(2)))
        mngr.wait_until_finished()
    # Step 1's own pack is referred to by no step, but step 0 cannot be read.
    assert before <= set(_shared(tmp_path))


_SAVER = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp, numpy as np, equinox as eqx
    import orbax.checkpoint as ocp, orbax_eqx as oeqx
    sys.path.insert(0, sys.argv[2])
    from test_dedup import _item
    mngr = ocp.CheckpointManager(
        sys.argv[1],
        item_handlers=oeqx.EqxHandler(dedup=True),
        options=ocp.CheckpointManagerOptions(max_to_keep=3),
    )
    start = max(mngr.all_steps(), default=-1) + 1
    for step in range(start, start + 1000):
        mngr.save(step, args=oeqx.EqxSave(_item(step)))
        print(step, flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_anywhere_leaves_every_committed_step_restorable(tmp_path, seed):
    rng = np.random.default_rng(seed)
    here = os.path.dirname(__file__)
    for _ in range(4):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path), here],
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        child.stdout.readline()  # saving has begun
        time.sleep(rng.uniform(0.0, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        with _manager(tmp_path, max_to_keep=3) as mngr:
            # (Older steps may be half deleted: Orbax's own retention, killed.)
            for step in mngr.all_steps()[-3:]:
                _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)
    # The next save collects what the killed ones left.
    with _manager(tmp_path, max_to_keep=3) as mngr:
        before = {s: _packs(tmp_path, s) for s in mngr.all_steps()}
        step = max(before, default=-1) + 1
        mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
        steps = mngr.all_steps()
        for step in steps:
            _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)
    live = set().union(*(_packs(tmp_path, s) for s in steps))
    # Left: only what the steps Orbax deleted after that save refer to.
    deleted = set().union(*(p for s, p in before.items() if s not in steps))
    assert set(_shared(tmp_path)) - live <= deleted


def test_the_command_line_inspects_copies_and_prunes(tmp_path, capsys):
    from entry import main

    root = tmp_path / "run"
    with _manager(root, max_to_keep=2) as mngr:
        for step in range(4):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    capsys.readouterr()
    assert main(["inspect", str(root / "3" / "default")]) == 0
    assert (
        "Stored once across steps (dedup): 60 B written by this save, 259.9 KiB by "
        "earlier ones, in 2 shared packs, shared with step(s) 2."
    ) in capsys.readouterr().out
    assert main(["copy", str(root / "3"), str(tmp_path / "out" / "3")]) == 0
    assert "with 2 shared packs copied in" in capsys.readouterr().out
    assert main(["copy", str(root / "3"), str(tmp_path / "out" / "3")]) == 2
    assert "exists already; pass the path of a new directory" in capsys.readouterr().err
    # (Closing the manager collected step 1's own pack.)
    assert main(["prune", str(root)]) == 0
    assert "Nothing to delete" in capsys.readouterr().out
    shutil.rmtree(root / "2")  # by hand: its own pack is no step's now
    assert main(["prune", str(root)]) == 0
    assert capsys.readouterr().out == "Deleted 1 shared pack that no step refers to.\n"
    (root / "4.orbax-checkpoint-tmp-1").mkdir()  # a save under way
    assert main(["prune", str(root)]) == 2
    err = capsys.readouterr().err
    assert "a save is writing, or a killed save left: 4.orbax-checkpoint-tmp-1" in err
    assert "Nothing was deleted" in err and "Traceback" not in err
    (root / "4.orbax-checkpoint-tmp-1").rmdir()
    (root / "3" / "default" / "orbax_eqx.json").write_text("{")
    assert main(["prune", str(root)]) == 2
    assert "cannot be read, so which shared packs" in capsys.readouterr().err
    assert main(["prune", str(tmp_path / "nothing")]) == 2
    assert "is not a directory: pass the root directory" in capsys.readouterr().err
    _assert_step(oeqx.restore(tmp_path / "out" / "3" / "default", SKELETON), 3)


def test_orbax_v1_checkpointer_saves_with_dedup(tmp_path):
    from orbax.checkpoint import v1 as ocp1

    policy = ocp1.training.preservation_policies.LatestN(2)
    with ocp1.training.Checkpointer(tmp_path, preservation_policy=policy) as ckptr:
        for step in range(5):
            before = set(_shared(tmp_path)) if (tmp_path / SHARED).exists() else set()
            item = oeqx.EqxSave(_item(step), dedup=True)
            assert ckptr.save_checkpointables(step, {"model": item})
            new = [s for n, s in _shared(tmp_path).items() if n not in before]
            assert new == ([64 + 12] if step else new)  # after the first, the head
        assert [c.step for c in ckptr.checkpoints] == [3, 4]
        for step in (3, 4):
            loaded = ckptr.load_checkpointables(step, {"model": SKELETON})
            _assert_step(loaded["model"], step)
    assert len(_shared(tmp_path)) <= 4  # the base, the kept heads, one to collect


def test_verify_checks_the_shared_bytes_a_step_refers_to(tmp_path):
    with _manager(tmp_path) as mngr:
        for step in range(3):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    assert oeqx.verify(tmp_path / "2" / "default").ok
    (base,) = _packs(tmp_path, 0)  # written by step 0: the base, and its head
    with open(tmp_path / SHARED / base, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")  # in `['base']['table']`
    for step in (1, 2):
        report = oeqx.verify(tmp_path / str(step) / "default")
        assert not report.ok
        assert "['base']['table']" in str(report.damaged)
    # A fallback goes past every step that refers to it: here, all of them.
    with _manager(tmp_path) as mngr:
        with pytest.raises(oeqx.CheckpointNotFoundError) as e:
            oeqx.restore_latest(mngr, oeqx.EqxRestore(SKELETON))
    for step in (0, 1, 2):
        assert f"step {step}: CheckpointDamagedError" in str(e.value)


def test_a_step_saved_again_by_another_manager_is_read_as_it_is(tmp_path):
    other = {**_item(1), "base": {"w": jnp.asarray(BASE + 1), "table": BASE[:1000] + 1}}
    with _manager(tmp_path) as mngr:
        for step in range(2):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
            mngr.wait_until_finished()
        shutil.rmtree(tmp_path / "1")
        with _manager(tmp_path) as again:  # step 1 anew, with another base
            again.save(1, args=oeqx.EqxSave(other))
            again.wait_until_finished()
        mngr.reload()
        mngr.save(2, args=oeqx.EqxSave(_item(2)))  # its base: the new step 1
        mngr.wait_until_finished()
        _assert_step(mngr.restore(2, args=oeqx.EqxRestore(SKELETON)), 2)
        got = mngr.restore(1, args=oeqx.EqxRestore(SKELETON))
        np.testing.assert_array_equal(got["base"]["w"], BASE + 1)


def test_a_step_that_shares_bytes_restores_as_any_step_does(tmp_path):
    with _manager(tmp_path) as mngr:
        for step in range(3):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    item = tmp_path / "2" / "default"
    want = _item(2)
    # A part of it, under a prefix.
    base = oeqx.restore(item, SKELETON["base"], prefix="base")
    np.testing.assert_array_equal(base["w"], BASE)
    # Under other names.
    renamed = oeqx.restore(
        item,
        {**SKELETON, "head": {"kernel": want["head"].weight, "b": want["head"].bias}},
        renames={"head.weight": "head.kernel", "head.bias": "head.b"},
    )
    np.testing.assert_array_equal(renamed["head"]["kernel"], want["head"].weight)
    # Rebuilt without a skeleton, and flat.
    rebuilt = oeqx.restore(item, allow=["equinox"])
    assert eqx.tree_equal(rebuilt, want)
    flat = oeqx.restore(item)
    np.testing.assert_array_equal(flat["base.table"], BASE[:1000])


def test_a_handler_registry_and_preservation_policies_store_once_too(tmp_path):
    handler = oeqx.EqxHandler(dedup=True)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("model", oeqx.EqxSave, handler)
    registry.add("model", oeqx.EqxRestore, handler)
    policy = ocp.checkpoint_managers.LatestN(n=2)
    options = ocp.CheckpointManagerOptions(preservation_policy=policy)
    with ocp.CheckpointManager(
        tmp_path, options=options, handler_registry=registry
    ) as mngr:
        for step in range(5):
            before = set(_shared(tmp_path)) if (tmp_path / SHARED).exists() else set()
            mngr.save(step, args=ocp.args.Composite(model=oeqx.EqxSave(_item(step))))
            mngr.wait_until_finished()
            new = [s for n, s in _shared(tmp_path).items() if n not in before]
            assert new == ([64 + 12] if step else new)
        assert mngr.all_steps() == [3, 4]
        for step in (3, 4):
            got = mngr.restore(
                step, args=ocp.args.Composite(model=oeqx.EqxRestore(SKELETON))
            )
            _assert_step(got.model, step)


def test_a_dedup_sidecar_is_short_and_the_published_schema_validates_it(tmp_path):
    import jsonschema

    schema = json.loads(
        (Path(__file__).parent.parent / "docs" / "format.schema.json").read_text()
    )
    with _manager(tmp_path) as mngr:
        for step in range(2):
            mngr.save(step, args=oeqx.EqxSave(_item(step)))
        mngr.wait_until_finished()
    sidecar = json.loads((tmp_path / "1" / "default" / "orbax_eqx.json").read_text())
    jsonschema.validate(sidecar, schema)
    # A jax array of pack 0 and one of an earlier save's pack, each a row.
    weight, w = sidecar["leaves"]["head.weight"], sidecar["leaves"]["base.w"]
    assert weight[:3] == ["float32", [3, 4], 0] and weight[3][2] == 0
    assert w[:2] == ["float32", [BASE.size]] and w[3][2] == 1
    assert len(w[3][1]) == 32  # its XXH3-128

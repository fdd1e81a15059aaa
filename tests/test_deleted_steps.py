"""A step that a manager deletes while it is restored: said so, and skipped by
`restore_latest`.

The deletion is real (a second `CheckpointManager` with `max_to_keep` saving
new steps, as a training job does beside an evaluator) and staged at a fixed
point: the `shardings=` function, which a restore calls after reading the
sidecar and before reading any array.

Internal modules imported here (`_restore`) are the units these tests pin, or
the only way to cause or observe the condition under test; everything else goes
through `orbax_eqx` and the `orbax-eqx` command.
"""

import shutil

import jax
import orbax.checkpoint as ocp
import pytest
import zoo

import orbax_eqx as oeqx

DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _model(step):
    return zoo.mlp(jax.random.key(step))


@pytest.fixture
def run(tmp_path):
    """A training run's manager (`max_to_keep=2`, steps 1 and 2 saved) and an
    evaluator's manager of the same directory, which lists steps 1 and 2."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2)

    def manager(pack=True, options=None):
        handler = oeqx.EqxHandler(pack=pack)
        return ocp.CheckpointManager(
            tmp_path / "run", item_handlers=handler, options=options
        )

    def make(pack=True):
        writer = manager(pack, options)
        for step in (1, 2):
            writer.save(step, args=oeqx.EqxSave(_model(step)))
        writer.wait_until_finished()
        reader = manager()
        assert reader.all_steps() == [1, 2]
        return writer, reader

    made = []
    yield lambda pack=True: made.append(make(pack)) or made[-1]
    for writer, reader in made:
        writer.close()
        reader.close()


def _saving_meanwhile(writer, steps, times=1):
    """A `shardings=` function that, in each of the first `times` restores that
    call it, has the writer save the next two of `steps` (deleting older ones)
    before anything is read."""
    steps = iter(steps)
    seen = {"first": None, "restores": 0}

    def shardings(name, leaf):
        if seen["first"] is None:
            seen["first"] = name
        if name == seen["first"]:  # called once per leaf, in order: a new restore
            seen["restores"] += 1
            if seen["restores"] <= times:
                for step in [next(steps), next(steps)]:
                    writer.save(step, args=oeqx.EqxSave(_model(step)))
                writer.wait_until_finished()
        return DEVICE

    return shardings


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_step_deleted_during_restore_is_said_so(run, pack):
    writer, reader = run(pack)
    shardings = _saving_meanwhile(writer, [3, 4])
    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    with pytest.raises(
        oeqx.CheckpointNotFoundError,  # a CheckpointNotFoundError, FileNotFoundError
        match=r"The checkpoint at .*run/2/default was deleted while it was being "
        r"restored, as a CheckpointManager with `max_to_keep` \(perhaps in another "
        r"process\) deletes old steps when it saves new ones\. Restore a step that "
        r"is kept \(call `mngr\.reload\(\)`, then `mngr\.latest_step\(\)`\), or use "
        r"`oeqx\.restore_latest\(mngr, args\)`, which moves on to the newest step "
        r"left\.$",
    ):
        reader.restore(2, args=oeqx.EqxRestore(skeleton, shardings=shardings))
    # The advice, followed.
    reader.reload()
    restored = reader.restore(
        reader.latest_step(), args=oeqx.EqxRestore(skeleton, shardings=shardings)
    )
    zoo.assert_same(restored, _model(4))


def test_restore_latest_moves_on_to_the_newest_step_left(run, recwarn):
    writer, reader = run()
    shardings = _saving_meanwhile(writer, [3, 4])
    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    args = oeqx.EqxRestore(skeleton, shardings=shardings)
    step, restored = oeqx.restore_latest(reader, args)
    assert step == 4  # not 1, which was deleted too, nor a fallback
    zoo.assert_same(restored, _model(4))
    assert not recwarn.list  # no FallbackWarning: nothing was damaged


def test_restore_latest_when_the_listed_steps_are_gone_before_it_starts(run):
    writer, reader = run()
    for step in (3, 4):  # the evaluator's list still says 1, 2
        writer.save(step, args=oeqx.EqxSave(_model(step)))
    writer.wait_until_finished()
    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    step, restored = oeqx.restore_latest(reader, oeqx.EqxRestore(skeleton))
    assert step == 4
    zoo.assert_same(restored, _model(4))


def test_restore_latest_skips_a_step_caught_half_deleted(run, recwarn):
    # Caught while the deletion is under way: the manager still lists the step
    # (its directory is there), but its item is gone.
    _, reader = run()
    item = reader.directory / "2" / "default"

    def shardings(name, leaf):
        if item.exists():
            shutil.rmtree(item)
        return DEVICE

    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    args = oeqx.EqxRestore(skeleton, shardings=shardings)
    step, restored = oeqx.restore_latest(reader, args)
    assert step == 1
    zoo.assert_same(restored, _model(1))
    assert not recwarn.list  # deleted, not damaged: no FallbackWarning


def test_restore_latest_gives_up_on_a_manager_deleting_faster_than_it_reads(run):
    writer, reader = run()
    # Every restore sees the writer save two more steps, deleting the one read.
    shardings = _saving_meanwhile(writer, range(3, 100), times=100)
    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        # Ten steps deleted under it, the most it moves on from.
        match=r"No step of .*run could be restored:\n  - step 22: "
        r"CheckpointDeletedError: The checkpoint at .*run/22/default was deleted "
        r"while it was being restored, .*\n  - step 21: FileNotFoundError: "
        r"Checkpoint at .*run/21 not found\.\nSteps were deleted as fast as they "
        r"were read \(steps 2, 4, 6, 8, 10, 12, 14, 16, 18, 20 first\): restore "
        r"while the manager that saves is "
        r"idle, or have it keep more steps \(`max_to_keep`\)\.$",
    ):
        oeqx.restore_latest(reader, oeqx.EqxRestore(skeleton, shardings=shardings))


def test_damaged_step_is_still_a_fallback(run):
    writer, reader = run()
    item = reader.directory / "2" / "default"
    (pack,) = [p for p in item.iterdir() if p.name.startswith("orbax_eqx~packed")]
    pack.write_bytes(b"")  # cut short: damage, not a deletion
    skeleton = zoo.skeleton(zoo.mlp, jax.random.key(9))
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"Restored step 1 of .*run, because newer steps could not be "
        r"restored:\n  - step 2: CheckpointDamagedError",
    ):
        step, restored = oeqx.restore_latest(reader, oeqx.EqxRestore(skeleton))
    assert step == 1
    zoo.assert_same(restored, _model(1))


def test_all_steps_deleted_says_so(run):
    _, reader = run()
    for step in (1, 2):
        shutil.rmtree(reader.directory / str(step))
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"run holds no finished step to restore \(step 2 was deleted "
        r"meanwhile\)\.$",
    ):
        oeqx.restore_latest(
            reader, oeqx.EqxRestore(zoo.skeleton(zoo.mlp, jax.random.key(9)))
        )

"""Steps that store each unchanged leaf once (`EqxHandler(dedup=True)`) on gs:// and s3://.

The local tests (tests/test_dedup.py) again on real protocol servers on
127.0.0.1 (moto_server, fake-gcs-server), under a `CheckpointManager` with
Orbax's commit files, and through the faults of a network or a store that
refuses: a clean-up whose deletion or listing fails, a shared pack whose
write is cut, a commit that never comes, a shared pack deleted from the
bucket. The bucket is listed with TensorStore straight from the server,
not through orbax_eqx.
"""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath

import orbax_eqx as oeqx
from integration_tests import _object_servers
from integration_tests._faults import Fault, FaultProxy

SHARED = "orbax_eqx~shared"
BASE = np.arange(1 << 14, dtype=np.float32)  # 64 KiB, frozen
HEAD = (3, 4)  # float32: a head's pack is 48 bytes
CLEAN_UP = "orbax_eqx could not delete the shared bytes no step refers to"
_NAMES = {  # what points orbax_eqx, s3fs and gcsfs at a server
    "s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"),
    "gs": ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"),
}


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    """`(server, bucket URL)`, with the server's variables set."""
    bucket = request.getfixturevalue(f"{request.param}_bucket")
    return request.getfixturevalue(f"{request.param}_server"), bucket


def _item(step: int):
    return {
        "base": {"w": jnp.asarray(BASE), "table": BASE[:1000].copy()},
        "head": jnp.full(HEAD, float(step)),
        "step": step,
    }


SKELETON = _item(0)


def _manager(root: str, **options) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath, **options
    )
    handler = oeqx.EqxHandler(dedup=True)
    return ocp.CheckpointManager(root, item_handlers=handler, options=options)


def _assert_step(got, step: int) -> None:
    want = _item(step)
    assert got["step"] == step
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


def _restores(mngr: ocp.CheckpointManager) -> None:
    for step in mngr.all_steps():
        _assert_step(mngr.restore(step, args=oeqx.EqxRestore(SKELETON)), step)


def _shared(server, root: str) -> dict[str, int]:
    """`{name: size}` of the objects under `<root>/orbax_eqx~shared/`."""
    bucket, _, key = root.split("://")[1].partition("/")
    prefix = f"{key}/{SHARED}/" if key else f"{SHARED}/"
    kv = ts.KvStore.open(server.tensorstore_spec(bucket)).result()
    keys = kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
    return {k.decode()[len(prefix) :]: len(kv.read(k).result().value) for k in keys}


def _save(mngr, step: int, server, root: str) -> str:
    """Saves step `step`; the name of the one shared pack its save wrote."""
    before = _shared(server, root)
    mngr.save(step, args=oeqx.EqxSave(_item(step)))
    mngr.wait_until_finished()
    (new,) = set(_shared(server, root)) - set(before)
    return new


@contextlib.contextmanager
def _proxied(bucket: str, *faults: Fault):
    """A `FaultProxy` in front of `bucket`'s server, which orbax_eqx, s3fs and
    gcsfs reach meanwhile."""
    names = _NAMES[bucket.split("://")[0]]
    with FaultProxy(os.environ[names[-1]], faults) as proxy:
        with _object_servers.environ({name: proxy.url for name in names}):
            _object_servers.clear_fsspec_caches()
            try:
                yield proxy
            finally:
                _object_servers.clear_fsspec_caches()


# -- written once, deleted when no step refers to it --------------------------


@pytest.mark.parametrize("under", ["run", ""], ids=["under-a-prefix", "bucket-root"])
def test_a_frozen_base_is_written_once_and_every_kept_step_restores(store, under):
    """At a bucket's root, every save deleted the shared packs of all the
    other steps: the listing of the root asked for keys under "/"."""
    server, bucket = store
    root = f"{bucket}/{under}" if under else bucket
    own: dict[int, str] = {}  # step: the pack its save wrote
    with _manager(root, max_to_keep=3) as mngr:
        for step in range(6):
            own[step] = _save(mngr, step, server, root)
            sizes = _shared(server, root)
            if step == 0:
                assert sizes[own[0]] > BASE.nbytes  # the base and the head
            else:  # only the head
                assert sizes[own[step]] == np.prod(HEAD) * 4
            # Gone: the packs of the steps Orbax deleted before this save.
            alive = range(max(1, step - 3), step + 1)
            assert set(sizes) == {own[0], *(own[s] for s in alive)}
        assert mngr.all_steps() == [3, 4, 5]
        _restores(mngr)
        epath.Path(f"{root}/4").rmtree()  # by hand, in the middle
        mngr.reload()
        own[6] = _save(mngr, 6, server, root)
        assert mngr.all_steps() == [3, 5, 6]
        _restores(mngr)
    assert set(_shared(server, root)) == {own[s] for s in (0, 3, 5, 6)}
    with _manager(root) as mngr:  # a new manager finds them all
        assert mngr.all_steps() == [3, 5, 6]
        _restores(mngr)


# -- faults --------------------------------------------------------------------


def _listing(bucket: str, under: str) -> str:
    """A regex for orbax_eqx's listing of every object under `run/<under>`
    (Orbax lists one level at a time, with a delimiter)."""
    if bucket.startswith("s3://"):  # TensorStore's
        return rf"list-type=2&prefix=run/{under}$"
    return rf"delimiter=&prefix=run/{under}&"  # gcsfs's


_CLEAN_UP_FAULTS = {
    # (method, path regex, which of the matching requests of the save)
    "delete": lambda bucket: ("DELETE", rf"{SHARED}/orbax_eqx~packed\.", [1]),
    "shared-listing": lambda bucket: ("GET", _listing(bucket, f"{SHARED}/"), [1]),
    # (The first listing of the steps is the save's, for the newest step.)
    "steps-listing": lambda bucket: ("GET", _listing(bucket, ""), [2]),
}


@pytest.mark.parametrize("request_", list(_CLEAN_UP_FAULTS))
@pytest.mark.parametrize("status", [503, 403], ids=["retried", "refused"])
def test_a_clean_up_that_fails_deletes_nothing_in_use_and_fails_no_save(
    store, request_, status
):
    server, bucket = store
    root = f"{bucket}/run"
    with _manager(root, max_to_keep=2) as mngr:
        own = {step: _save(mngr, step, server, root) for step in range(4)}
    # Step 1 is deleted, and its head collected once the manager closed.
    assert set(_shared(server, root)) == {own[s] for s in (0, 2, 3)}
    epath.Path(f"{root}/2").rmtree()  # by hand: its head is for the next save
    method, path, nth = _CLEAN_UP_FAULTS[request_](bucket)
    fault = Fault("status", method=method, path=path, nth=nth, status=status)
    with _proxied(bucket, fault), _manager(root, max_to_keep=2) as mngr:
        if status == 503:  # TensorStore asks again
            own[4] = _save(mngr, 4, server, root)
        else:
            with pytest.warns(oeqx.OrbaxEqxWarning, match=CLEAN_UP) as caught:
                own[4] = _save(mngr, 4, server, root)
            assert len(caught) == 1
            assert "Nothing in use was deleted; the next save tries again" in str(
                caught[0].message
            )
        assert fault.hits == 1
        assert mngr.all_steps() == [3, 4]
        _restores(mngr)
    # Step 2's head: deleted by the save, or when a refused clean-up left it,
    # by the manager's close.
    assert set(_shared(server, root)) == {own[s] for s in (0, 3, 4)}
    with _manager(root, max_to_keep=2) as mngr:
        own[5] = _save(mngr, 5, server, root)
        _restores(mngr)
    assert set(_shared(server, root)) == {own[s] for s in (0, 4, 5)}


def test_a_shared_pack_whose_write_is_cut_fails_that_save_only(store):
    server, bucket = store
    root = f"{bucket}/run"
    with _manager(root, max_to_keep=3) as mngr:
        own = {step: _save(mngr, step, server, root) for step in range(3)}
    # Every try of the write: the connection reset before the server has it.
    cut = Fault("reset", path=rf"{SHARED}/orbax_eqx~packed\.")
    with _proxied(bucket, cut), _manager(root, max_to_keep=3) as mngr:
        with pytest.raises(oeqx.ObjectStoreError, match=rf"Writing {root}/{SHARED}/"):
            mngr.save(3, args=oeqx.EqxSave(_item(3)))
            mngr.wait_until_finished()
    assert cut.hits >= 6  # TensorStore's tries
    assert set(_shared(server, root)) == set(own.values())
    with _manager(root, max_to_keep=3) as mngr:
        assert mngr.all_steps() == [0, 1, 2]
        _restores(mngr)
        own[4] = _save(mngr, 4, server, root)
        assert mngr.all_steps() == [1, 2, 4]
        _restores(mngr)


def test_a_step_that_was_never_committed_keeps_no_shared_pack(store):
    """On s3:// a step with a sidecar but no commit file counted as committed:
    its shared pack was kept for good, and its sidecar could be the base."""
    server, bucket = store
    root = f"{bucket}/run"
    with _manager(root) as mngr:
        own = {step: _save(mngr, step, server, root) for step in range(2)}
    write = "PUT" if bucket.startswith("s3://") else "POST"
    commit = Fault(
        "status", method=write, path=r"run/2/commit_success\.txt", status=403
    )
    before = set(_shared(server, root))
    with _proxied(bucket, commit), _manager(root) as mngr:
        with pytest.raises(Exception):  # Orbax's (s3fs's, gcsfs's) error
            mngr.save(2, args=oeqx.EqxSave(_item(2)))
            mngr.wait_until_finished()
    assert commit.hits >= 1
    # Written, never committed: what the next save collects.
    assert len(set(_shared(server, root)) - before) == 1
    assert epath.Path(f"{root}/2/default/orbax_eqx.json").exists()
    with _manager(root) as mngr:
        assert mngr.all_steps() == [0, 1]
        own[3] = _save(mngr, 3, server, root)
        assert mngr.all_steps() == [0, 1, 3]
        _restores(mngr)
    assert set(_shared(server, root)) == {own[s] for s in (0, 1, 3)}


def test_a_restore_whose_shared_pack_was_deleted_names_the_leaves_and_file(store):
    server, bucket = store
    root = f"{bucket}/run"
    with _manager(root) as mngr:
        own = {step: _save(mngr, step, server, root) for step in range(3)}
    epath.Path(f"{root}/{SHARED}/{own[0]}").unlink()  # the base's, by hand
    _object_servers.clear_fsspec_caches()
    with _manager(root) as mngr:
        with pytest.raises(oeqx.CheckpointDamagedError) as e:
            mngr.restore(2, args=oeqx.EqxRestore(SKELETON))
    message = str(e.value)
    assert message.startswith(
        f"The checkpoint in {root}/2/default keeps bytes it shares with other "
        "steps (saved with `dedup=True`) in files that are gone:\n"
    ), message
    assert (
        f"  - {root}/{SHARED}/{own[0]}, which held leaves `['base']['table']`, "
        "`['base']['w']`\n"
    ) in message
    assert own[2] not in message  # the head's pack is there
    assert "They were deleted by hand" in message

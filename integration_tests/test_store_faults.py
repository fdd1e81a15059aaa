"""Object stores that fail in transit: read again, never called damage.

Each test puts a fault-injecting proxy of its own (`_faults.py`) between
orbax_eqx and a real server (moto_server for S3, fake-gcs-server for GCS),
and makes chosen requests fail the way networks, stores and caching proxies
do: a body cut short, a byte flipped, `Range:` ignored, 5xx storms, resets,
stalls, objects deleted behind a restore. Checkpoints are written straight
to the server; only the restores go through the proxy. Real damage (bytes
changed in the bucket itself) is still damage, and still falls back.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_eqx as oeqx
from integration_tests import _object_servers, _procs
from integration_tests._faults import Fault, FaultProxy

COMMIT_FILE = ocp.path.atomicity.CommitFileTemporaryPath
STALL_S = 2  # ORBAX_EQX_STALL_SECONDS for the tests with stalls
DATA = r"^bytes=0-"  # the Range of a read of a pack's data (not a length probe)


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    return request.getfixturevalue(f"{request.param}_bucket")


def _tree(step: int) -> dict:
    return {"a": jnp.full((1000,), float(step)), "b": jnp.arange(1000.0) + step}


def _same(got, step: int) -> None:
    want = _tree(step)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def _manager(root: str) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(temporary_path_class=COMMIT_FILE)
    return ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler(), options=options)


def _saved(bucket: str, steps=(2, 10)) -> str:
    """A run with `steps`, written straight to the server; its root."""
    root = f"{bucket}/run"
    with _manager(root) as mngr:
        for step in steps:
            mngr.save(step, args=oeqx.EqxSave(_tree(step)))
        mngr.wait_until_finished()
    return root


def _pack(step: int) -> str:
    """A regex for the path of step `step`'s pack file."""
    return rf"/{step}/default/orbax_eqx~packed\."


_NAMES = {
    "s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"),
    "gs": ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"),  # gcsfs, ours
}


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


def _data_reads(proxy: FaultProxy, step: int) -> int:
    return sum(
        1
        for r in proxy.requests
        if r.method == "GET"
        and f"/{step}/default/orbax_eqx~packed." in r.target
        and (r.range or "").startswith("bytes=0-")
    )


# -- read again, not damage ------------------------------------------------


def test_a_body_cut_short_once_is_read_again(bucket):
    """On s3:// the cut body (IncompleteReadError) made `restore_latest` fall
    back from healthy step 10 to step 2."""
    root = _saved(bucket)
    cut = Fault("cut", method="GET", path=_pack(10), range=DATA, nth=[1], at=100)
    with _proxied(bucket, cut) as proxy, _manager(root) as mngr:
        step, got = oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
    assert step == 10 and cut.hits == 1
    _same(got, 10)
    assert _data_reads(proxy, 10) == 2


def test_a_byte_flipped_in_transit_once_is_read_again(bucket):
    """One flipped byte made `restore_latest` fall back (S3: 10 -> 2, GCS too):
    the checksum failed, and it was called damage without a second read."""
    root = _saved(bucket)
    flip = Fault("flip", method="GET", path=_pack(10), range=DATA, nth=[1], at=77)
    with _proxied(bucket, flip) as proxy, _manager(root) as mngr:
        step, got = oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
    assert step == 10 and flip.hits == 1
    _same(got, 10)
    assert _data_reads(proxy, 10) == 2


def test_bytes_changed_differently_on_every_read_are_the_stores_failure(bucket):
    root = _saved(bucket)
    flip = Fault("flip", method="GET", path=_pack(10), range=DATA, at=(5, 50, 500))
    with _proxied(bucket, flip), _manager(root) as mngr:
        with pytest.raises(oeqx.ObjectStoreError) as e:
            oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
    text = str(e.value)
    assert text.startswith(f"Reading {root}/10/default from bucket '"), text
    assert "gave different bytes on each of 3 reads" in text
    assert "the checkpoint itself may be intact" in text
    assert text.count("  - Leaf `['a']` (a): XXH3-64 recorded at save") == 3, text
    assert flip.hits == 3


def test_bytes_damaged_in_the_bucket_are_still_damage_and_fall_back(bucket):
    """The same wrong bytes on every read: damage, after one more read."""
    root = _saved(bucket)
    item = f"{root}/10/default"
    pack = f"{item}/{oeqx.metadata(item).packs[0].file}"
    data = bytearray(epath.Path(pack).read_bytes())
    data[40] ^= 0xFF
    epath.Path(pack).write_bytes(bytes(data))
    _object_servers.clear_fsspec_caches()
    with _proxied(bucket) as proxy, _manager(root) as mngr:
        with pytest.raises(oeqx.CheckpointDamagedError, match="changed after it"):
            mngr.restore(10, args=oeqx.EqxRestore(_tree(0)))
        assert _data_reads(proxy, 10) == 2  # read again once, then believed
        with pytest.warns(oeqx.OrbaxEqxWarning, match=r"step 10: CheckpointDamaged"):
            step, got = oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
    assert step == 2
    _same(got, 2)


def test_verify_reads_again_before_it_reports_damage(bucket):
    """A byte flipped in transit made `verify` report a damaged leaf; bytes
    changed in the bucket are still reported."""
    root = _saved(bucket, steps=(10,))
    item = f"{root}/10/default"
    flip = Fault("flip", method="GET", path=_pack(10), range=DATA, nth=[1], at=9)
    with _proxied(bucket, flip):
        report = oeqx.verify(item)
    assert report.ok and sorted(report.checked) == ["a", "b"] and flip.hits == 1
    pack = f"{item}/{oeqx.metadata(item).packs[0].file}"
    data = bytearray(epath.Path(pack).read_bytes())
    data[4040] ^= 0xFF  # in leaf b
    epath.Path(pack).write_bytes(bytes(data))
    _object_servers.clear_fsspec_caches()
    with _proxied(bucket):
        report = oeqx.verify(item)
    assert [d.name for d in report.damaged] == ["b"] and report.checked == ("a",)
    assert report.damaged[0].problem.startswith("data does not match its XXH3-64")


# -- ranges ------------------------------------------------------------------


@pytest.mark.parametrize("verify", [False, True], ids=["unchecked", "checked"])
def test_an_endpoint_that_ignores_range_never_gives_other_bytes(
    bucket, verify, monkeypatch
):
    """Answered 200 with the whole object, `restore(prefix="b", verify=False)`
    returned leaf `a`'s bytes as `b` on s3://, and with checks on a healthy
    checkpoint was called damaged. Packs in parts, too."""
    from orbax_eqx._bytes import store

    # Internal: the part size is no option (real parts: tens of MiB).
    monkeypatch.setattr(store, "PART_BYTES", 4096)  # the pack in parts
    root = _saved(bucket, steps=(10,))
    ignore = Fault("ignore_range", method="GET", ranged=True)
    with _proxied(bucket, ignore):
        got = oeqx.restore(
            f"{root}/10/default", _tree(0)["b"], prefix="b", verify=verify
        )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_tree(10)["b"]))
    assert ignore.hits >= 3


def _whole_reads(proxy: FaultProxy, step: int) -> int:
    return sum(
        1
        for r in proxy.requests
        if r.method == "GET"
        and f"/{step}/default/orbax_eqx~packed." in r.target
        and r.range is None
    )


@pytest.mark.parametrize("nth", [[1], None], ids=["once", "always"])
def test_an_answer_with_other_bytes_than_asked_is_never_taken(bucket, nth):
    """A 206 whose `Content-Range` is not the range asked (here leaf `b`'s
    bytes for leaf `a`): on s3:// its bytes were taken, unchecked, as `a`; on
    gs:// the healthy checkpoint was called damaged. Now the piece is read
    again as the whole object and sliced, once or on every answer."""
    root = _saved(bucket, steps=(10,))
    other = Fault("shift_range", method="GET", path=_pack(10), range=DATA, nth=nth)
    other.at = 4032  # where leaf `b` starts
    with _proxied(bucket, other) as proxy:
        got = oeqx.restore(
            f"{root}/10/default", _tree(0)["a"], prefix="a", verify=False
        )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_tree(10)["a"]))
    assert other.hits == 1 and _data_reads(proxy, 10) == 1
    assert _whole_reads(proxy, 10) == 1


# -- a store that fails ------------------------------------------------------


@pytest.mark.parametrize(
    "store,status", [("s3", 503), ("gcs", 500)], ids=["s3-503", "gcs-500"]
)
def test_a_storm_of_errors_is_the_stores_failure_not_damage(request, store, status):
    """It ended in "No step could be restored ... The checkpoints are damaged
    ... start afresh"; it is the store's failure, with status and endpoint,
    and no step is passed over."""
    bucket = request.getfixturevalue(f"{store}_bucket")
    root = _saved(bucket, steps=(2, 6, 10))
    with _proxied(bucket) as proxy, _manager(root) as mngr:
        proxy.add(Fault("status", status=status))
        with pytest.raises(oeqx.ObjectStoreError) as e:
            oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
        proxy.clear()
        packs = [r for r in proxy.requests if "packed" in r.target]
    text = str(e.value)
    assert f"at {proxy.url}" in text and str(status) in text, text
    assert "The store failed, not the checkpoint" in text
    assert "damaged" not in text and "credentials" not in text
    assert not any(f"/{step}/" in r.target for r in packs for step in (2, 6))


def test_a_store_that_is_down_is_said_so(bucket):
    root = _saved(bucket, steps=(2, 10))
    with _proxied(bucket) as proxy, _manager(root) as mngr:
        proxy.close()  # nothing listens there any more
        began = time.monotonic()
        with pytest.raises(oeqx.ObjectStoreError) as e:
            oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
        took = time.monotonic() - began
    text = str(e.value)
    assert f"at {proxy.url}" in text, text
    assert "Check the store is up and reachable from here" in text
    assert "damaged" not in text and "credentials" not in text
    assert took < 90


def test_a_connection_reset_does_not_blame_credentials(bucket):
    """Every ObjectStoreError said "Check the bucket exists and your
    credentials reach it", even for a connection reset."""
    root = _saved(bucket, steps=(10,))
    reset = Fault("reset", method="GET", path=_pack(10), range=DATA)
    with _proxied(bucket, reset):
        with pytest.raises(oeqx.ObjectStoreError) as e:
            oeqx.restore(f"{root}/10/default", _tree(0))
    text = str(e.value)
    assert text.startswith(f"Reading {root}/10/default/orbax_eqx~packed."), text
    assert "The store failed, not the checkpoint: this is no sign of damage." in text
    assert "credentials" not in text and "bucket exists" not in text
    assert reset.hits >= 6  # TensorStore's tries (`objects._RETRIES`)


# -- deleted meanwhile ---------------------------------------------------------


def test_objects_deleted_during_a_restore_are_a_deletion(bucket):
    """On s3:// (and gs://) this was `CheckpointDamagedError`; on a disk,
    `CheckpointDeletedError`."""
    root = _saved(bucket, steps=(2, 6, 10))

    def delete(step):
        return lambda: epath.Path(f"{root}/{step}").rmtree()

    first = Fault("call", method="GET", path=_pack(10), nth=[1], action=delete(10))
    with _proxied(bucket, first) as proxy, _manager(root) as mngr:
        with pytest.raises(oeqx.CheckpointNotFoundError, match="was deleted while"):
            mngr.restore(10, args=oeqx.EqxRestore(_tree(0)))
        proxy.add(Fault("call", method="GET", path=_pack(6), nth=[1], action=delete(6)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no FallbackWarning: no damage
            step, got = oeqx.restore_latest(mngr, oeqx.EqxRestore(_tree(0)))
    assert step == 2
    _same(got, 2)


# -- stalls --------------------------------------------------------------------


@pytest.fixture(params=["s3", "gcs"], scope="module")
def stalls(request, tmp_path_factory):
    """The `_stall_worker.py` cases on one store: `{case: result}`."""
    server = request.getfixturevalue(f"{request.param}_server")
    url = server.create_bucket(f"stalls-{request.param}-{os.getpid()}")
    with _object_servers.environ(
        {**server.env(), "ORBAX_EQX_STALL_SECONDS": str(STALL_S)}
    ):
        (log,) = _procs.run(
            "_stall_worker.py",
            request.param,
            url,
            devices=1,
            log_dir=tmp_path_factory.mktemp("stalls"),
            timeout=400,
        )
    return {
        result["case"]: {**result, "store": request.param}
        for line in log.splitlines()
        if line.startswith("RESULT ")
        for result in [json.loads(line[len("RESULT ") :])]
    }


# Two stalls, then the backoff of every try, and TensorStore's own margin
# (`objects._wait_s`), and this shared machine's slowness.
_STALL_BOUND_S = 2 * STALL_S + 10.2 + 5 + 15


@pytest.mark.parametrize("case", ["get", "body", "put"])
def test_a_stalled_request_is_an_error_in_bounded_time(stalls, case):
    """A stalled GET failed after 304 s, a PUT after 306 s, a body stalled
    halfway after 67 s (with `endpoint URL: "None"`); here the stall timeout
    is `STALL_S` (ORBAX_EQX_STALL_SECONDS): each request is waited on for two
    stalls and the backoff of its tries, then cancelled."""
    result = stalls[case]
    assert "ObjectStoreError" in result["mro"], result
    assert result["seconds"] < _STALL_BOUND_S, result
    text = result["message"]
    assert "at http://127.0.0.1:" in text and "None" not in text, text
    assert ": no answer within 19 s, its tries included." in text, text
    assert "The store failed, not the checkpoint" in text
    assert "credentials" not in text and "damaged" not in text
    assert result["stalled"], result


def test_restore_latest_pays_a_stall_once(stalls):
    """It paid each stall again for every kept step."""
    result = stalls["latest"]
    assert result["type"] == "ObjectStoreError", result
    assert result["seconds"] < _STALL_BOUND_S, result
    assert result["stalled"] and all("/3/default/" in t for t in result["stalled"])


# -- a manager that cannot save on S3 exits ----------------------------------


def test_a_refused_manager_save_on_s3_lets_the_process_exit(s3_bucket, tmp_path):
    """Without `temporary_path_class`, the documented `ObjectStoreSaveError`
    came, then the interpreter hung at exit (`threading._shutdown`; absl:
    "cannot schedule new futures after shutdown")."""
    env = _procs.worker_env(1)
    script = (
        "import jax, orbax.checkpoint as ocp, orbax_eqx as oeqx\n"
        f"mngr = ocp.CheckpointManager('{s3_bucket}/run', "
        "item_handlers=oeqx.EqxHandler())\n"
        "mngr.save(1, args=oeqx.EqxSave({'w': jax.numpy.ones(3)}))\n"
    )
    began = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit; stderr:\n{e.stderr}")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "cannot schedule new futures" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("orbax_eqx._errors.ObjectStoreSaveError: Saving to"), last
    assert time.monotonic() - began < 90

"""orbax_eqx on object stores, end to end, against real loopback servers.

moto_server speaks S3 and fake-gcs-server speaks GCS (see
`_object_servers.py`); each test gets a fresh bucket and the environment a
user would set (`AWS_ENDPOINT_URL` and keys, `STORAGE_EMULATOR_HOST`).
Standalone saves and restores, the CLI, `CheckpointManager` with retention
and a best metric, sharded saves from 2 processes restored onto another mesh
and process count, the v1 API, and the faults: a server that dies mid-save,
an endpoint with nothing behind it, missing credentials, a manager set up
for rename commits on S3.
"""

import os
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx
from integration_tests import _object_servers, _procs

COMMIT_FILE = ocp.path.atomicity.CommitFileTemporaryPath


class Block(eqx.Module):
    """Attention, an MLP, static fields and a callable: a model's parts."""

    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm
    heads: int = eqx.field(static=True)

    def __init__(self, key, heads=2, dim=16):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 2, activation=jax.nn.gelu, key=k2)
        self.norm = eqx.nn.LayerNorm(dim)
        self.heads = heads


def _same(a, b):
    assert bool(eqx.tree_equal(a, b))


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    return request.getfixturevalue(f"{request.param}_bucket")


def _model(seed):
    return Block(jax.random.key(seed))


def _skeleton():
    return eqx.filter_eval_shape(Block, jax.random.key(1))


def test_standalone_save_restore_metadata_verify(bucket):
    model = {"model": _model(0), "step": 7, "lr": float("nan")}
    path = f"{bucket}/runs/a/model"
    oeqx.save(path, model)
    skeleton = {"model": _skeleton(), "step": 0, "lr": 0.0}
    restored = oeqx.restore(path, skeleton)  # from a differently made model
    _same(restored["model"], model["model"])
    assert restored["step"] == 7 and np.isnan(restored["lr"])
    assert oeqx.metadata(path).leaves["step"].value == 7
    assert oeqx.verify(path).ok
    flat = oeqx.restore(path)
    np.testing.assert_array_equal(
        flat["model.attn.query_proj.weight"], model["model"].attn.query_proj.weight
    )
    with pytest.raises(FileExistsError, match="overwrite=True"):
        oeqx.save(path, model)
    oeqx.save(path, {"model": _model(2), "step": 8, "lr": 1.0}, overwrite=True)
    assert oeqx.restore(path, skeleton)["step"] == 8


def test_the_cli_reads_object_stores(bucket):
    path = f"{bucket}/cli/model"
    oeqx.save(path, _model(0))
    expected = {"inspect": "query_proj", "verify": "match their checksums"}
    for command in (["inspect", path], ["verify", path]):
        result = subprocess.run(
            [sys.executable, "-m", "orbax_eqx", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env=_procs.worker_env(1),
        )
        assert result.returncode == 0, result.stderr
        assert expected[command[0]] in result.stdout, result.stdout


def test_large_packs_go_in_parts_and_read_back(bucket, monkeypatch):
    from orbax_eqx._bytes import store

    # Internal: the part size is no option (real parts: tens of MiB).
    monkeypatch.setattr(store, "PART_BYTES", 4096)  # the block's pack: ~5 parts
    model = _model(0)
    path = f"{bucket}/parts/model"
    oeqx.save(path, model)
    _same(oeqx.restore(path, _skeleton()), model)
    assert oeqx.verify(path).ok


@pytest.mark.parametrize("spelling", ["item_handlers", "handler_registry"])
def test_manager_with_retention_and_best_metric(bucket, spelling):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2,
        best_fn=lambda m: m["loss"],
        best_mode="min",
        temporary_path_class=COMMIT_FILE,
    )
    if spelling == "item_handlers":
        kwargs = {"item_handlers": oeqx.EqxHandler()}
    else:
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("default", oeqx.EqxSave, oeqx.EqxHandler())
        registry.add("default", oeqx.EqxRestore, oeqx.EqxHandler())
        kwargs = {"handler_registry": registry}
    models = {step: _model(step) for step in range(3)}
    root = f"{bucket}/run"
    with ocp.CheckpointManager(root, options=options, **kwargs) as mngr:
        for step, loss in zip(range(3), [0.9, 0.4, 0.7], strict=True):
            mngr.save(step, args=oeqx.EqxSave(models[step]), metrics={"loss": loss})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2] and mngr.best_step() == 1
        restored = mngr.restore(1, args=oeqx.EqxRestore(_skeleton()))
    _same(restored, models[1])
    with ocp.CheckpointManager(root, options=options, **kwargs) as mngr:
        assert mngr.latest_step() == 2  # a new manager finds the committed steps
        _same(mngr.restore(2, args=oeqx.EqxRestore(_skeleton())), models[2])


def test_a_manager_that_would_rename_on_s3_is_refused_before_it_writes(s3_bucket):
    root = f"{s3_bucket}/run"
    with ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler()) as mngr:
        with pytest.raises(Exception) as e:
            mngr.save(0, args=oeqx.EqxSave(_model(0)))
            mngr.wait_until_finished()
    text = str(e.value) + "".join(str(n) for n in getattr(e.value, "__notes__", []))
    chain = e.value
    while chain is not None and not isinstance(chain, oeqx.ObjectStoreError):
        chain = chain.__cause__ or chain.__context__
    assert chain is not None, text
    message = str(chain)
    assert "S3 cannot rename a directory" in message
    assert "temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath" in message
    assert "oeqx.save" in message
    assert (
        not oeqx.metadata_or_none(root) if hasattr(oeqx, "metadata_or_none") else True
    )


def test_pack_false_on_s3_is_refused_with_what_works(s3_bucket):
    with pytest.raises(
        oeqx.ObjectStoreError,
        match=r"pack=False.*cannot write to s3://.*Leave `pack=True`",
    ):
        oeqx.save(f"{s3_bucket}/m", _model(0), pack=False)


def test_pack_false_works_on_gcs(gcs_bucket):
    model = _model(0)
    oeqx.save(f"{gcs_bucket}/m", model, pack=False)
    _same(oeqx.restore(f"{gcs_bucket}/m", _skeleton()), model)


def test_v1_api(bucket):
    model = _model(0)
    path = f"{bucket}/v1"
    commit_file = ocp.v1.options.AtomicityOptions(
        mode=ocp.v1.options.AtomicityMode.COMMIT_FILE
    )
    with ocp.v1.Context(atomicity_options=commit_file):
        ocp.v1.save_checkpointables(path, {"model": model})
        got = ocp.v1.load_checkpointables(path, {"model": _skeleton()})
    _same(got["model"], model)


def test_sharded_saves_from_two_processes_restore_elsewhere(bucket, tmp_path):
    url = f"{bucket}/sharded"
    logs = _procs.run(
        "_object_store_worker.py",
        "save",
        url,
        devices=4,
        processes=2,
        log_dir=tmp_path,
        timeout=240,
    )
    assert all(log.rstrip().endswith("ok") for log in logs)
    for devices, processes in [(2, 1), (1, 1)]:
        logs = _procs.run(
            "_object_store_worker.py",
            "restore",
            url,
            devices=devices,
            processes=processes,
            log_dir=tmp_path,
            timeout=240,
        )
        assert all(log.rstrip().endswith("ok") for log in logs)


def test_a_dead_endpoint_is_an_error_in_seconds_naming_what_to_set(monkeypatch):
    port = _object_servers.free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    start = time.monotonic()
    for call in (
        lambda: oeqx.save("s3://bucket/m", _model(0)),
        lambda: oeqx.restore("s3://bucket/m", _skeleton()),
        lambda: oeqx.metadata("s3://bucket/m"),
    ):
        with pytest.raises(oeqx.OrbaxEqxError) as e:
            call()
        text = str(e.value)
        assert f"bucket 'bucket' at http://127.0.0.1:{port}" in text
        assert "Could not connect" in text and "AWS_ENDPOINT_URL" in text
    assert time.monotonic() - start < 120


def test_missing_credentials_name_the_variables(s3_server, tmp_path):
    # In a fresh process: botocore and s3fs keep credentials they found once.
    url = s3_server.create_bucket("nocredentials")
    env = _procs.worker_env(1)
    env.update({k: v for k, v in s3_server.env().items() if v is not None})
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    script = (
        "import jax, equinox as eqx, orbax_eqx as oeqx\n"
        f"oeqx.save('{url}/m', eqx.nn.Linear(2, 2, key=jax.random.key(0)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("orbax_eqx.ObjectStoreError: Saving to"), last
    assert "NoCredentialsError" in last
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE" in last


def test_a_server_that_dies_mid_save_is_an_error_and_spares_earlier_steps(tmp_path):
    """fake-gcs-server on files: killed while step 2 uploads, started again on
    the same files and port; step 1 restores, step 2 was never committed."""
    data = tmp_path / "objects"
    data.mkdir()
    port = _object_servers.free_port()

    def start():
        argv = [str(_object_servers.gcs_binary()), "-scheme", "http"]
        argv += ["-host", "127.0.0.1", "-port", str(port)]
        argv += ["-external-url", f"http://127.0.0.1:{port}", "-log-level", "warn"]
        argv += ["-backend", "filesystem", "-filesystem-root", str(data)]
        server = _object_servers.GCSServer(argv, tmp_path / "log", port, None)
        server._wait_ready("/storage/v1/b", 30)
        return server

    server = start()
    try:
        url = server.create_bucket("dies")
        options = ocp.CheckpointManagerOptions(temporary_path_class=COMMIT_FILE)
        big = {"w": jax.numpy.ones((64, 1 << 20), "float32")}  # 256 MiB
        small = {"w": jax.numpy.arange(10.0)}
        with _object_servers.environ(server.env()):
            _object_servers.clear_fsspec_caches()
            with ocp.CheckpointManager(
                f"{url}/run", item_handlers=oeqx.EqxHandler(), options=options
            ) as mngr:
                mngr.save(1, args=oeqx.EqxSave(small))
                mngr.wait_until_finished()
                mngr.save(2, args=oeqx.EqxSave(big))
                time.sleep(0.5)
                os.killpg(server.proc.pid, signal.SIGKILL)
                start_wait = time.monotonic()
                with pytest.raises(Exception) as e:
                    mngr.wait_until_finished()
                assert time.monotonic() - start_wait < 120  # bounded, not a hang
            del e
            server.stop()
            server = start()
            _object_servers.clear_fsspec_caches()
            with ocp.CheckpointManager(
                f"{url}/run", item_handlers=oeqx.EqxHandler(), options=options
            ) as mngr:
                assert mngr.all_steps() == [1]  # step 2 was never committed
                got = mngr.restore(1, args=oeqx.EqxRestore({"w": small["w"]}))
            np.testing.assert_array_equal(got["w"], small["w"])
            _object_servers.clear_fsspec_caches()
    finally:
        server.stop()


def test_throttling_is_retried_with_backoff(s3_server):
    """Every third request answered 503 SlowDown: the save and the restore
    succeed, through retries (TensorStore's for our files, botocore's for
    Orbax's directories)."""
    from integration_tests._faults import Fault, FaultProxy

    url = s3_server.create_bucket("throttled")
    model = _model(0)
    slow_down = Fault("status", status=503, every=3)  # S3's SlowDown
    with FaultProxy(s3_server.url, [slow_down]) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.url}
        env["AWS_ENDPOINT_URL_S3"] = proxy.url
        with _object_servers.environ(env):
            _object_servers.clear_fsspec_caches()
            try:
                oeqx.save(f"{url}/m", model)
                _same(oeqx.restore(f"{url}/m", _skeleton()), model)
            finally:
                _object_servers.clear_fsspec_caches()
        assert slow_down.hits >= 3


def test_a_store_that_always_throttles_is_an_error_in_bounded_time(s3_server):
    from integration_tests._faults import Fault, FaultProxy

    url = s3_server.create_bucket("throttledforgood")
    with FaultProxy(s3_server.url, [Fault("status", status=503)]) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.url}
        env["AWS_ENDPOINT_URL_S3"] = proxy.url
        with _object_servers.environ(env):
            _object_servers.clear_fsspec_caches()
            start = time.monotonic()
            try:
                with pytest.raises(oeqx.ObjectStoreError) as e:
                    oeqx.save(f"{url}/m", _model(0))
            finally:
                _object_servers.clear_fsspec_caches()
            assert time.monotonic() - start < 120
    text = str(e.value)
    assert f"bucket 'throttledforgood' at {proxy.url}" in text
    assert "503" in text or "SlowDown" in text or "UNAVAILABLE" in text, text


def test_two_jobs_saving_one_step_never_commit_a_mix(s3_bucket, tmp_path):
    """Two jobs (processes) save step 5 of one run at once (commit-file mode
    writes straight into the step's directory, and Orbax deletes an incomplete
    one it finds). Each losing save says so (or, where the other job deleted
    the step between our check and Orbax's step-metadata write, Orbax does);
    a committed step is one job's whole checkpoint, never a mix or a step
    with files missing; step 1 is intact."""
    import json

    options = ocp.CheckpointManagerOptions(temporary_path_class=COMMIT_FILE)
    first = {"w": jax.numpy.full((1 << 18,), 0.0)}
    for trial in range(3):
        root = f"{s3_bucket}/run{trial}"
        with ocp.CheckpointManager(
            root, item_handlers=oeqx.EqxHandler(), options=options
        ) as mngr:
            mngr.save(1, args=oeqx.EqxSave(first))
        base = tmp_path / f"trial{trial}"
        base.mkdir()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(_procs.HERE / "_object_two_writers_worker.py"),
                    root,
                    str(who),
                ],
                env=_procs.worker_env(1),
                cwd=base,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for who in (0, 1)
        ]
        try:
            deadline = time.monotonic() + 120
            while not all((base / f"ready-{w}").exists() for w in (0, 1)):
                assert time.monotonic() < deadline and not any(
                    p.poll() for p in procs
                ), "a writer did not get ready"
                time.sleep(0.01)
            (base / "go.tmp").write_text(repr(time.time() + 0.05))
            (base / "go.tmp").rename(base / "go")
            files = [base / f"outcome-{w}.json" for w in (0, 1)]
            deadline = time.monotonic() + 180
            while not all(f.exists() for f in files):
                assert time.monotonic() < deadline, "a save hung"
                time.sleep(0.05)
            outcomes = [json.loads(f.read_text()) for f in files]
        finally:
            for p in procs:
                _procs._kill(p)
        # Ours, or Orbax's own when the other job deleted the step after our
        # last check and before Orbax's step-metadata write (it runs before
        # any handler hook; storage guide, "What is atomic where").
        orbax_race = f"Path is not a directory: {root}/5"
        for outcome in outcomes:
            if not outcome["ok"] and not (
                "Another save of the same step" in outcome["message"]
                or (
                    outcome["type"] == "NotADirectoryError"
                    and outcome["message"] == orbax_race
                )
            ):
                pytest.fail(f"a losing save said:\n{outcome['traceback']}")
        with ocp.CheckpointManager(
            root, item_handlers=oeqx.EqxHandler(), options=options
        ) as mngr:
            steps = mngr.all_steps()
            assert 1 in steps
            got = mngr.restore(1, args=oeqx.EqxRestore(first))
            np.testing.assert_array_equal(got["w"], first["w"])
            if 5 in steps:
                # One job's (both "won" only if one saved after the other's
                # commit, and the manager then kept the step it found).
                winners = [w for w, o in enumerate(outcomes) if o["ok"]]
                assert winners, outcomes
                got = mngr.restore(5, args=oeqx.EqxRestore(first))
                assert float(got["w"][0]) in [float(w) for w in winners]
                np.testing.assert_array_equal(got["w"], got["w"][0])
                assert oeqx.verify(f"{root}/5/default").ok


def test_a_save_that_lost_its_step_removes_its_objects(bucket, monkeypatch):
    """A save held just before its commit finds another save's sidecar in
    its place (what a second job saving the same step leaves): it stops with
    the message, deletes the objects it wrote (its pack, in parts) and leaves
    the other's sidecar and the earlier step alone."""
    import threading

    from etils import epath

    from orbax_eqx._bytes import store
    from orbax_eqx._save import claim as _claim

    # Internal: the part size is no option (real parts: tens of MiB).
    monkeypatch.setattr(store, "PART_BYTES", 4096)  # the pack in several parts
    reached, release = threading.Event(), threading.Event()
    before_commit = _claim.before_commit

    def held(started):
        if not str(started.directory).endswith("/5/default"):
            return before_commit(started)
        reached.set()
        assert release.wait(60), "the test never released the commit"
        return before_commit(started)

    # Internal: no public hook pauses a save just before its commit.
    monkeypatch.setattr(_claim, "before_commit", held)
    root = f"{bucket}/lost"
    options = ocp.CheckpointManagerOptions(temporary_path_class=COMMIT_FILE)
    mngr = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler(), options=options)
    try:
        mngr.save(4, args=oeqx.EqxSave(_model(4)))
        mngr.wait_until_finished()
        mngr.save(5, args=oeqx.EqxSave(_model(5)))
        assert reached.wait(120)
        step = epath.Path(f"{root}/5/default")
        _object_servers.clear_fsspec_caches()
        ours = sorted(p.name for p in step.iterdir() if "packed" in p.name)
        assert len(ours) > 2 and all(".part-" in name for name in ours), ours
        sidecar = step / "orbax_eqx.json"
        text = sidecar.read_text()
        token = text.split('"token": "')[1][:16]
        other = text.replace(token, "0123456789abcdef")
        sidecar.write_text(other)  # another job's save claimed the step
        release.set()
        with pytest.raises(RuntimeError, match="removed its files"):
            mngr.wait_until_finished()
    finally:
        release.set()
        mngr.close()
    _object_servers.clear_fsspec_caches()
    left = sorted(p.name for p in step.iterdir())
    assert not [name for name in left if token in name], left
    assert sidecar.read_text() == other  # the other's is left alone
    _same(oeqx.restore(f"{root}/4/default", _skeleton()), _model(4))


def test_a_missing_bucket_is_named_and_not_made(bucket):
    """A save or restore to a bucket that is not there says so, naming the
    bucket, its endpoint and how to make it; the save makes no bucket (s3fs
    would, for Orbax's directories)."""
    from etils import epath

    scheme, name = bucket.split("://")
    missing = f"{scheme}://{name}-gone"
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get(
        "STORAGE_EMULATOR_HOST"
    )
    make = (
        f"`aws s3 mb s3://{name}-gone`"
        if scheme == "s3"
        else f"`gcloud storage buckets create gs://{name}-gone`"
    )
    expected = (
        f"The bucket '{name}-gone' at {endpoint} does not exist (reaching "
        f"{missing}/m). Correct the bucket's name, or create the bucket ({make}) "
        "before saving to it."
    )
    for attempt in (
        lambda: oeqx.save(f"{missing}/m", _model(0)),
        lambda: oeqx.restore(f"{missing}/m", _skeleton()),
        lambda: oeqx.metadata(f"{missing}/m"),
    ):
        with pytest.raises(oeqx.ObjectStoreError) as e:
            attempt()
        assert str(e.value) == expected
    _object_servers.clear_fsspec_caches()
    assert not epath.Path(missing).exists()

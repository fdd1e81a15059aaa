"""Setting up a `CheckpointManager` on gs:// and s3://, as a new user does:
which variables keep gs:// quiet, and what the manager's own directory calls
raise before orbax_eqx is asked anything (docs/guides/storage.md, "Setting up
a CheckpointManager on an object store").

Each case runs in a fresh process with only the variables a user sets: gcsfs,
s3fs and botocore keep what they found once per process.
"""

import re
import subprocess
import sys

from integration_tests import _object_servers, _procs

_MANAGER = """
import logging, sys
import equinox as eqx, jax, orbax.checkpoint as ocp
import orbax_eqx as oeqx

logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
options = ocp.CheckpointManagerOptions(
    max_to_keep=2, temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
)
handler = oeqx.EqxHandler()
with ocp.CheckpointManager({root!r}, item_handlers=handler, options=options) as m:
    for step in range(3):
        m.save(step, args=oeqx.EqxSave(model))
        m.wait_until_finished()  # else Orbax may warn that a save waited
    restored = m.restore(2, args=oeqx.EqxRestore(eqx.filter_eval_shape(lambda: model)))
    assert eqx.tree_equal(restored, model), "restored wrong values"
    print("steps", m.all_steps())
"""

# TensorStore's one info line for its test token: no warning.
_TENSORSTORE_INFO = re.compile(
    r"I\d{4} [\d:.]+ +\d+ google_auth_provider\.cc:\d+\] Using "
    r"GOOGLE_AUTH_TOKEN_FOR_TESTING"
)


def _run(script: str, env: dict[str, str], timeout: float = 180):
    full = _procs.worker_env(1)
    for name in list(full):  # only what the case sets: no test-server extras
        if name.startswith(("GOOGLE", "GCE", "CLOUDSDK", "NO_GCE", "STORAGE", "AWS")):
            del full[name]
        if name.startswith(("TENSORSTORE", "GCSFS")):
            del full[name]
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _emulator(server) -> dict[str, str]:
    """The documented variables for an emulator: gcsfs's (Orbax's
    directories) and TensorStore's (orbax_eqx's files), which reads no other."""
    return {
        "STORAGE_EMULATOR_HOST": server.url,
        "TENSORSTORE_GCS_HTTP_URL": server.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "owner",
    }


def test_gcs_manager_is_quiet_with_the_documented_variables(gcs_server):
    root = gcs_server.create_bucket("quiet-run") + "/run"
    env = {**_emulator(gcs_server), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    result = _run(_MANAGER.format(root=root), env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "steps [1, 2]\n"
    noise = [
        line
        for line in result.stderr.splitlines()
        if not _TENSORSTORE_INFO.fullmatch(line)
        and not _deleted_step_metadata(line, root)
    ]
    assert noise == []


def _deleted_step_metadata(line: str, root: str) -> bool:
    """Orbax's own warning when it reads the step metadata of step 0 while
    its retention (`max_to_keep=2`) is deleting that step: on an object
    store the step's prefix still lists while its objects go. Seen once in
    CI on Python 3.13 (orbax-checkpoint 0.12.8); no variable of ours affects
    it, and step 0 is the only step deleted here."""
    return (
        line
        == f"WARNING:absl:Metadata file does not exist: {root}/0/_CHECKPOINT_METADATA"
    )


def test_gcs_without_the_hns_variable_warns_from_gcsfs(gcs_server):
    # What the storage guide explains: gcsfs asks Google's storage-control
    # API for each bucket's type on every file call Orbax makes, and logs a
    # warning each time it cannot (an emulator serves no such API).
    root = gcs_server.create_bucket("noisy-run") + "/run"
    result = _run(_MANAGER.format(root=root), _emulator(gcs_server))
    assert result.returncode == 0, result.stderr
    warnings = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("WARNING:gcsfs:Could not determine bucket type")
    ]
    assert len(warnings) > 20


def test_gcs_missing_bucket_under_a_manager_is_named_at_the_first_save(gcs_server):
    # gcsfs (with the documented variables) makes the manager's root without
    # asking whether the bucket exists; the first save asks, and says so.
    script = """
import equinox as eqx, jax, orbax.checkpoint as ocp
import orbax_eqx as oeqx

model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
mngr = ocp.CheckpointManager("gs://no-such-bucket/run", item_handlers=oeqx.EqxHandler())
try:
    mngr.save(0, args=oeqx.EqxSave(model))
except oeqx.ObjectStoreError as e:
    print(e)
"""
    env = {**_emulator(gcs_server), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    result = _run(script, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"The bucket 'no-such-bucket' at http://{gcs_server.url.split('://')[-1]} "
        "does not exist (reaching gs://no-such-bucket/run/0/default). Correct the "
        "bucket's name, or create the bucket (`gcloud storage buckets create "
        "gs://no-such-bucket`) before saving to it.\n"
    )


def test_gcs_with_only_the_emulator_variable_names_tensorstores(gcs_server):
    # orbax_eqx sets no variable for the caller: it says which one to set.
    root = gcs_server.create_bucket("half-set") + "/run"
    script = (
        _MANAGER.format(root=root)
        .replace("with ocp", "try:\n  with ocp")
        .replace("\n    ", "\n      ")
        + "except oeqx.ObjectStoreError as e:\n  print(e)\n"
    )
    result = _run(script, {"STORAGE_EMULATOR_HOST": gcs_server.url})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"STORAGE_EMULATOR_HOST is {gcs_server.url!r}, but TensorStore, which "
        "orbax_eqx reads and writes gs:// through, takes its endpoint only from "
        f"TENSORSTORE_GCS_HTTP_URL: set TENSORSTORE_GCS_HTTP_URL={gcs_server.url} "
    ), result.stdout


def test_gcs_missing_bucket_with_gcsfs_defaults_is_orbaxs_raw_error(gcs_server):
    # With gcsfs's default file system, the manager's own directory creation
    # raises before orbax_eqx runs: the guide shows this message and the fix.
    script = """
import orbax.checkpoint as ocp
import orbax_eqx as oeqx
try:
    ocp.CheckpointManager("gs://no-such-bucket/run", item_handlers=oeqx.EqxHandler())
except FileNotFoundError as e:
    print(type(e).__name__, e)
"""
    result = _run(script, {"STORAGE_EMULATOR_HOST": gcs_server.url})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "FileNotFoundError Bucket does not exist: no-such-bucket\n"


def test_s3_wrong_endpoint_is_botocores_raw_error_from_the_manager():
    port = _object_servers.free_port()  # nothing listens there
    script = """
import orbax.checkpoint as ocp
import orbax_eqx as oeqx
options = ocp.CheckpointManagerOptions(
    temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
)
try:
    handler = oeqx.EqxHandler()
    ocp.CheckpointManager("s3://bucket/run", item_handlers=handler, options=options)
except Exception as e:
    print(type(e).__module__, type(e).__name__, e)
"""
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    result = _run(script, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "botocore.exceptions EndpointConnectionError Could not connect to the "
        f'endpoint URL: "http://127.0.0.1:{port}/bucket/run"\n'
    )

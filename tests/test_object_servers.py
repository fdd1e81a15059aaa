"""The loopback object-store fixtures work: TensorStore's kvstore and epath
both reach moto_server (s3://) and fake-gcs-server (gs://) through them.

These pin what the byte layer relies on (see
benchmarks/object_store_probes/FACTS.md): the kvstore specs that reach each
server, ranged reads, prefix listing and deletion, and that epath sees the
same objects.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorstore as ts
from etils import epath

from integration_tests import _object_servers

DATA = bytes(range(256)) * 64  # 16 KiB, every byte value


def kvstore(root: str) -> ts.KvStore:
    """The kvstore of bucket `root`, as the byte layer opens it.

    TensorStore's s3 driver ignores AWS_ENDPOINT_URL (without `endpoint` it
    goes to AWS and retries for minutes), so the endpoint is in the spec; the
    gcs driver follows TENSORSTORE_GCS_HTTP_URL from the environment.
    """
    scheme, bucket = root.split("://")
    if scheme == "s3":
        spec = {
            "driver": "s3",
            "bucket": bucket,
            "endpoint": os.environ["AWS_ENDPOINT_URL"],
            "aws_region": os.environ["AWS_REGION"],
        }
    else:
        spec = {"driver": "gcs", "bucket": bucket}
    # A few quick retries: a test must fail, not wait 15 minutes, if a server dies.
    retries = _object_servers.QUICK_RETRIES
    spec["context"] = {f"{spec['driver']}_request_retries": retries}
    return ts.KvStore.open(spec).result()


@pytest.fixture(params=["s3", "gcs"], ids=["s3", "gcs"])
def bucket(request):
    """Each test runs on both servers."""
    return request.getfixturevalue(f"{request.param}_bucket")


def test_kvstore_write_ranged_read_list_delete(bucket):
    kv = kvstore(bucket)
    for key in ["run/a.bin", "run/sub/b.bin", "run/sub/c.bin", "runner.txt"]:
        kv.write(key, DATA).result()

    got = kv.read("run/a.bin", byte_range=slice(1000, 5000)).result()
    assert got.state == "value" and bytes(got.value) == DATA[1000:5000]
    tail = kv.read("run/a.bin", byte_range=slice(len(DATA) - 7, None)).result()
    assert bytes(tail.value) == DATA[-7:]
    assert kv.read("run/none.bin").result().state == "missing"

    # A prefix is a key range, "run/" up to "run0" ("/" + 1); "runner.txt"
    # shares the characters but not the directory.
    run = ts.KvStore.KeyRange("run/", "run0")
    assert sorted(kv.list(run).result()) == [
        b"run/a.bin",
        b"run/sub/b.bin",
        b"run/sub/c.bin",
    ]
    kv.delete_range(ts.KvStore.KeyRange("run/sub/", "run/sub0")).result()
    assert sorted(kv.list().result()) == [b"run/a.bin", b"runner.txt"]
    kv.write("run/a.bin", None).result()
    assert kv.list().result() == [b"runner.txt"]


@pytest.mark.slow
def test_epath_sees_kvstore_objects(bucket):
    kv = kvstore(bucket)
    kv.write("ckpt/0/data.bin", DATA).result()

    root = epath.Path(bucket)
    assert (root / "ckpt" / "0" / "data.bin").read_bytes() == DATA
    assert [p.name for p in (root / "ckpt").iterdir()] == ["0"]
    assert (root / "ckpt" / "0").is_dir()

    (root / "ckpt" / "meta.json").write_text('{"step": 0}')
    assert bytes(kv.read("ckpt/meta.json").result().value) == b'{"step": 0}'
    with (root / "ckpt" / "0" / "data.bin").open("rb") as f:
        f.seek(4096)
        assert f.read(100) == DATA[4096:4196]

    (root / "ckpt").rmtree()
    assert kv.list().result() == []
    assert not (root / "ckpt" / "meta.json").exists()


def test_buckets_are_fresh_and_env_is_restored(s3_server, gcs_server):
    """Each bucket fixture use gets an empty bucket; its env leaves with it."""
    before = os.environ.get("AWS_ENDPOINT_URL")
    for server in (s3_server, gcs_server):
        url = server.create_bucket("fresh-" + server.kind)
        with _object_servers.environ(server.env()):
            assert kvstore(url).list().result() == []
            for key, value in server.env().items():
                assert os.environ.get(key) == value
    assert os.environ.get("AWS_ENDPOINT_URL") == before


def test_a_server_that_cannot_start_says_why(tmp_path):
    """A server that exits at once fails with its own log, not a timeout."""
    server = _object_servers.GCSServer(
        [str(_object_servers.gcs_binary()), "-scheme", "nonsense"],
        tmp_path / "bad.log",
        _object_servers.free_port(),
        None,
    )
    with pytest.raises(_object_servers.ServerError, match=r"exited with .*log"):
        server._wait_ready("/storage/v1/b", timeout=10)


def test_filesystem_backend_keeps_objects_in_a_directory_removed_at_stop(tmp_path):
    with _object_servers.start_gcs(tmp_path, backend="filesystem") as server:
        root = server.create_bucket("on-disk")
        data_dir = server._data
        with _object_servers.environ(_object_servers.env(server)):
            kvstore(root).write("k", DATA).result()
        assert any(p.is_file() for p in data_dir.rglob("*"))
    assert server.proc.returncode is not None
    assert not data_dir.exists()
    server.stop()  # again: a fixture and a `finally` may both stop it


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_server_tensorstore_spec_with_a_path(kind, request):
    server = request.getfixturevalue(f"{kind}_server")
    root = request.getfixturevalue(f"{kind}_bucket")
    bucket = root.split("://")[1]
    sub = ts.KvStore.open(server.tensorstore_spec(bucket, "run/")).result()
    sub.write("x", b"1").result()
    assert kvstore(root).list().result() == [b"run/x"]


def test_servers_die_with_the_process_that_started_them(tmp_path):
    """A test run killed with SIGKILL leaves no server behind (Linux)."""
    code = (
        "import sys, time\n"
        "from integration_tests import _object_servers as o\n"
        "s3, gcs = o.start_s3(sys.argv[1]), o.start_gcs(sys.argv[1])\n"
        "print(s3.proc.pid, gcs.proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    repo = str(Path(__file__).resolve().parents[1])
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": repo},
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, "the servers did not start"
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_server_says_so_when_asked_for_a_bucket(tmp_path):
    server = _object_servers.start_gcs(tmp_path)
    server.stop()
    with pytest.raises(_object_servers.ServerError, match=r"exited with .*log"):
        server.create_bucket("after-stop")

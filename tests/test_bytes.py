"""The byte layer (`orbax_eqx/_bytes`): the same behaviour from every store.

Each test runs on a local directory, on moto_server (s3://) and on
fake-gcs-server (gs://), all real, on loopback. Large files are cut into
parts on object stores; `PART_BYTES` is made small here so that parts,
ranges across parts and short last parts are exercised with little data.

Internal modules imported here (`_bytes`, `_storage`) are the units these tests
pin, or the only way to cause or observe the condition under test; everything
else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import os

import numpy as np
import pytest
from etils import epath

import orbax_eqx as oeqx
from orbax_eqx._bytes import route, store
from orbax_eqx._storage import ranges as _ranges

DATA = np.random.default_rng(0).integers(0, 256, 10_000, np.uint8)


@pytest.fixture(params=["local", "s3", "gcs"])
def root(request, tmp_path):
    """A directory (local) or a bucket's root URL, to write files under."""
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue(f"{request.param}_bucket")


@pytest.fixture
def small_parts(monkeypatch):
    # Internal: the part size is no option; parts of its real size would take
    # tens of MiB per test to reach several of them.
    monkeypatch.setattr(store, "PART_BYTES", 1024)


def _views(data: np.ndarray, size: int):
    return [memoryview(data[i : i + size]) for i in range(0, data.nbytes, size)]


def test_whole_files_round_trip_and_reads_are_bounded(root):
    path = f"{root}/index.json"
    route.write_whole(path, b'{"a": 1}')
    assert route.read_bounded(path, 100) == b'{"a": 1}'
    route.write_whole(path, b"[]")  # replaced whole
    assert route.read_bounded(path, 2) == b"[]"

    def error(what):
        return ValueError(f"index {what}")

    with pytest.raises(ValueError, match=r"index has .*more than the 1 allowed"):
        route.read_bounded(path, 1, error)
    with pytest.raises(FileNotFoundError):
        route.read_bounded(f"{root}/none.json", 100)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_write_new_never_replaces_another_writers_file(where, request, tmp_path):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket")
    path = f"{root}/sidecar.json"
    route.write_new(path, b"first")
    with pytest.raises(FileExistsError):
        route.write_new(path, b"second")
    assert route.read_bounded(path, 100) == b"first"


@pytest.mark.parametrize("nbytes", [0, 1000, 1024, 1025, 10_000])
@pytest.mark.slow
def test_streamed_files_read_back_in_any_ranges(root, small_parts, nbytes):
    data = DATA[:nbytes]
    path = f"{root}/pack.bin"
    route.for_path(path).write_stream(path, _views(data, 300), nbytes)
    stored_in_parts = nbytes > store.PART_BYTES
    assert route.for_path(path).exists(path)
    if root.startswith(("s3://", "gs://")):
        # One object, or parts of PART_BYTES and a shorter last one.
        whole = route.for_path(path).exists(f"{root}/pack.bin.part-00000")
        assert whole == stored_in_parts
    ranges = [(0, nbytes), (nbytes // 3, nbytes - 1), (1023, min(1030, nbytes))]
    ranges = [(a, b) for a, b in ranges if a <= b]
    buffers = _ranges.read(epath.Path(path), ranges, nbytes=nbytes)
    for (a, b), got in zip(ranges, buffers, strict=True):
        np.testing.assert_array_equal(got, data[a:b])
        assert got.size == 0 or got.ctypes.data % 64 == 0  # for zero-copy device_put


def test_delete_takes_the_file_and_its_parts_only(root, small_parts):
    one = route.for_path(root)
    for name in ("pack.bin", "pack.bin2", "other.bin"):
        one.write_stream(f"{root}/{name}", _views(DATA, 4096), DATA.nbytes)
    one.write_whole(f"{root}/pack", b"a neighbour whose name starts the same")
    one.delete(f"{root}/pack.bin")
    assert not one.exists(f"{root}/pack.bin")
    assert not one.exists(f"{root}/pack.bin.part-00003")
    for name in ("pack.bin2", "other.bin", "pack"):
        assert one.exists(f"{root}/{name}"), name
    one.delete(f"{root}/pack.bin")  # not there: no error
    got = _ranges.read(epath.Path(f"{root}/pack.bin2"), [(0, 10_000)], nbytes=10_000)
    np.testing.assert_array_equal(got[0], DATA)


def test_bytes_can_be_checked_as_they_arrive(root, small_parts):
    path = f"{root}/pack.bin"
    route.for_path(path).write_stream(path, _views(DATA, 4096), DATA.nbytes)
    seen = []

    def meanwhile(buffers, ready):
        for upto in (1, 1500, 7000, 9000):
            ready(0, upto)
            seen.append(bytes(buffers[0][:upto]) == DATA[1000 : 1000 + upto].tobytes())

    # Without the recorded length too, as shard packs are read.
    _ranges.read(epath.Path(path), [(1000, 10_000)], meanwhile=meanwhile)
    _ranges.read(epath.Path(path), [(1000, 10_000)], meanwhile=meanwhile, nbytes=10_000)
    assert seen == [True] * 8


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "is missing"),
        ("longer", "has .*bytes"),
        ("shorter", "ends before byte 10000|has 9000 bytes where 10000"),
    ],
)
def test_damaged_files_are_damage_not_a_hang_nor_a_raw_error(root, damage, message):
    path = f"{root}/pack.bin"
    data = {"missing": None, "longer": DATA.tobytes() + b"x", "shorter": DATA[:9000]}
    if data[damage] is not None:
        route.write_whole(path, bytes(data[damage]))
    with pytest.raises(oeqx.CheckpointDamagedError, match=f"pack file .*({message})"):
        _ranges.read(epath.Path(path), [(0, 10_000)], nbytes=10_000)


@pytest.mark.parametrize("where", ["s3", "gcs"])
@pytest.mark.parametrize(
    "damage, message",
    [("gone", "is missing"), ("cut", "ends before byte 3072")],
)
def test_parts_damaged_after_open_are_damage(
    where, damage, message, request, small_parts
):
    """A part deleted or cut short between the length checks of `open` and
    the reads: the reads say so (on S3 they are streamed by botocore)."""
    root = request.getfixturevalue(f"{where}_bucket")
    path = f"{root}/pack.bin"
    one = route.for_path(path)
    one.write_stream(path, _views(DATA, 4096), DATA.nbytes)
    part = f"{path}.part-00002"  # bytes 2048-3071
    with one.open(path, DATA.nbytes, DATA.nbytes) as reader:
        if damage == "gone":
            one.delete(part)
        else:
            one.write_whole(part, DATA[2048:2900].tobytes())
        buffers = [np.empty(DATA.nbytes, np.uint8)]
        reads = reader.start([(0, DATA.nbytes)], buffers)
        with pytest.raises(store.BadFile, match=message):
            reads.wait()
        reads.ready(0, 2048)  # the bytes before it were read whole
    np.testing.assert_array_equal(buffers[0][:2048], DATA[:2048])


@pytest.mark.parametrize("where", ["s3", "gcs"])
def test_a_missing_part_is_damage(where, request, small_parts):
    root = request.getfixturevalue(f"{where}_bucket")
    path = f"{root}/pack.bin"
    route.for_path(path).write_stream(path, _views(DATA, 4096), DATA.nbytes)
    epath.Path(f"{path}.part-00003").unlink()
    with pytest.raises(oeqx.CheckpointDamagedError, match="is missing its part 3"):
        _ranges.read(epath.Path(path), [(0, 100)], nbytes=DATA.nbytes)


@pytest.mark.parametrize("where", ["s3", "gcs"])
def test_parts_copied_to_a_disk_read_as_the_file(where, request, small_parts, tmp_path):
    root = request.getfixturevalue(f"{where}_bucket")
    path = f"{root}/pack.bin"
    route.for_path(path).write_stream(path, _views(DATA, 4096), DATA.nbytes)
    for k in range(store.count(DATA.nbytes)):  # as `gsutil cp -r` brings them
        name = store.part_name("pack.bin", k)
        (tmp_path / name).write_bytes(epath.Path(f"{root}/{name}").read_bytes())
    (got,) = _ranges.read(
        epath.Path(tmp_path / "pack.bin"), [(500, 9500)], nbytes=DATA.nbytes
    )
    np.testing.assert_array_equal(got, DATA[500:9500])


@pytest.mark.slow
def test_a_server_that_is_not_there_is_an_error_in_seconds(monkeypatch):
    from integration_tests._object_servers import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(oeqx.ObjectStoreError) as e:
        route.read_bounded("s3://nowhere/ckpt/orbax_eqx.json", 100)
    text = str(e.value)
    assert "bucket 'nowhere' at http://127.0.0.1:" in text
    assert "Could not connect" in text or "connect" in text.lower()
    assert "AWS_ENDPOINT_URL" in text


def test_paths_on_other_stores_are_refused():
    with pytest.raises(ValueError, match="knows local paths, gs:// and s3://"):
        route.for_path("hdfs://cluster/ckpt")
    with pytest.raises(ValueError, match="names no bucket"):
        route.for_path("s3:///ckpt")


def test_environment_sets_endpoint_region_and_credentials(monkeypatch):
    # Internal: the spec handed to TensorStore is where region and credentials show.
    from orbax_eqx._bytes import objects

    for name in ["AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ACCESS_KEY_ID"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    before = dict(os.environ)
    where, key = objects.split("s3://b/run/7")
    spec = where.spec()
    assert key == "run/7" and spec["endpoint"] == "http://127.0.0.1:9000"
    assert spec["aws_region"] == "eu-west-3" and "aws_credentials" not in spec
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9001")  # wins
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    spec = objects.split("s3://b/x")[0].spec()
    assert spec["endpoint"] == "http://127.0.0.1:9001"
    assert spec["aws_credentials"] == {"type": "environment"}
    del before["AWS_ENDPOINT_URL"], before["AWS_DEFAULT_REGION"]
    assert {k: v for k, v in os.environ.items() if k in before} == before


def test_an_emulator_tensorstore_cannot_see_is_refused_naming_the_variable(
    monkeypatch,
):
    """TensorStore's gcs driver takes its endpoint only from its own variable,
    which orbax_eqx does not set for the caller (no writes to os.environ)."""
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    before = dict(os.environ)
    with pytest.raises(oeqx.ObjectStoreError) as e:
        oeqx.metadata("gs://bucket/m")
    assert str(e.value) == (
        "STORAGE_EMULATOR_HOST is '127.0.0.1:4443', but TensorStore, which "
        "orbax_eqx reads and writes gs:// through, takes its endpoint only from "
        "TENSORSTORE_GCS_HTTP_URL: set TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:4443 "
        "(and GOOGLE_AUTH_TOKEN_FOR_TESTING=owner, so that it looks for no Google "
        "credentials), or unset STORAGE_EMULATOR_HOST to reach Google Cloud Storage."
    )
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    "value",
    ["soon", "0", "-5", "inf", "1e9"],
    ids=["word", "zero", "<0", "inf", "huge"],
)
def test_a_stall_timeout_that_is_no_time_is_refused_naming_the_variable(
    value, monkeypatch
):
    monkeypatch.setenv("ORBAX_EQX_STALL_SECONDS", value)
    with pytest.raises(oeqx.OrbaxEqxError) as e:
        oeqx.metadata("s3://bucket/m")
    assert isinstance(e.value, ValueError)
    assert str(e.value) == (
        f"ORBAX_EQX_STALL_SECONDS is {value!r}: expected the seconds a request "
        "to an object store may go without progress, a number above 0 and at "
        "most 86400 (default 60). Set it to, say, `ORBAX_EQX_STALL_SECONDS=60`, "
        "or unset it."
    )


def test_version_tells_a_file_written_anew(root):
    """What a restore compares to tell a checkpoint replaced or deleted under it
    (`_restore/vanished.py`): the same on every store."""
    path = f"{root}/sidecar.json"
    found = route.for_path(path)
    assert found.version(path) is None
    found.write_whole(path, b"one")
    first = found.version(path)
    assert first is not None and found.version(path) == first
    found.write_whole(path, b"two")
    assert found.version(path) not in (None, first)
    found.delete(path)
    assert found.version(path) is None


def test_a_reader_never_mixes_two_versions_of_a_local_file(tmp_path):
    """A file replaced (same size, `os.replace`) between two reads of one
    reader: the second read says so, never reads the new bytes as the old."""
    path = tmp_path / "pack.bin"
    path.write_bytes(DATA.tobytes())
    # Internal: a `Reader` is opened by the restore and the safetensors loader.
    with route.for_path(path).open(path, DATA.nbytes, DATA.nbytes) as reader:
        first = [np.empty(100, np.uint8)]
        reader.start([(0, 100)], first).wait()
        np.testing.assert_array_equal(first[0], DATA[:100])
        (tmp_path / "new").write_bytes(DATA[::-1].tobytes())
        os.replace(tmp_path / "new", path)
        with pytest.raises(store.BadFile, match="was replaced or changed while it"):
            reader.start([(100, 200)], [np.empty(100, np.uint8)]).wait()
        with pytest.raises(store.BadFile, match="was replaced or changed while it"):
            reader.check_unchanged()


@pytest.mark.parametrize("where", ["s3", "gcs"])
@pytest.mark.parametrize("stored", ["whole", "in parts"])
def test_a_reader_never_mixes_two_versions_of_an_object(where, stored, request):
    """An object overwritten between two reads of one reader: the second read
    fails (its generation, or ETag, changed), never mixes the two."""
    root = request.getfixturevalue(f"{where}_bucket")
    if stored == "in parts":
        request.getfixturevalue("small_parts")
    path = f"{root}/pack.bin"
    one = route.for_path(path)
    one.write_stream(path, _views(DATA, 4096), DATA.nbytes)
    # Internal: a `Reader` is opened by the restore and the safetensors loader.
    with one.open(path, DATA.nbytes, DATA.nbytes) as reader:
        first = [np.empty(100, np.uint8)]
        reader.start([(0, 100)], first).wait()
        np.testing.assert_array_equal(first[0], DATA[:100])
        other = DATA[::-1].copy()  # the same size
        one.write_stream(path, _views(other, 4096), DATA.nbytes)
        with pytest.raises(store.BadFile, match="was replaced during the read"):
            reader.start([(0, 100)], [np.empty(100, np.uint8)]).wait()
        with pytest.raises(store.BadFile, match="was replaced during the read"):
            reader.check_unchanged()

"""`_bytes/files`: reading only regular files, never blocking, bounded; creating
new files never through a planted link. Real files, FIFOs, sockets, devices.

Whatever end-to-end test a FIFO would hang (restore, verify, export) runs in a
subprocess with a time limit: tests/test_hostile_files.py. Here a FIFO is only
opened by code that must not block on it; a regression would hang this test,
so these run under a time limit too (`_within`).
"""

import os
import socket
import stat
import threading

import numpy as np
import pytest
from etils import epath

from orbax_eqx._bytes import files
from orbax_eqx._storage import ranges as _ranges


def _within(seconds, fn, *args, **kwargs):
    """Runs `fn` in a thread; fails the test if it takes longer than `seconds`."""
    result = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked for {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _fifo(p):
    os.mkfifo(p)


def _directory(p):
    os.mkdir(p)


def _device(p):
    os.symlink("/dev/zero", p)  # followed: the device itself is checked


def _socket(p):
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.fspath(p))
    s.close()


@pytest.mark.parametrize(
    "make, what",
    [
        (_fifo, "a FIFO \\(named pipe\\)"),
        (_directory, "a directory"),
        (_device, "a character device"),
        (_socket, "a socket"),
    ],
    ids=["fifo", "directory", "device", "socket"],
)
def test_only_regular_files_are_read(tmp_path, make, what):
    path = tmp_path / "data.bin"
    make(path)
    with pytest.raises(
        files.FileCheckError,
        match=rf"^{path} is {what}, not a regular file\. Replace it with the file "
        "that belongs there\\.$",
    ):
        _within(10, files.read_bounded, path, 1 << 20)
    with pytest.raises(files.FileCheckError, match=f"is {what}"):
        _within(10, files.open_regular, path)


def test_the_callers_error_is_raised(tmp_path):
    os.mkfifo(tmp_path / "pack")

    def error(what):
        return ValueError(f"The pack {what}: damaged.")

    with pytest.raises(ValueError, match=r"^The pack is a FIFO \(named pipe\), not"):
        _within(10, files.open_regular, tmp_path / "pack", error)


def test_symlinks_are_followed_unless_asked_not_to(tmp_path):
    (tmp_path / "real").write_bytes(b"abc")
    os.symlink("real", tmp_path / "link")
    assert files.read_bounded(tmp_path / "link", 3) == b"abc"
    with pytest.raises(files.FileCheckError, match="is a symbolic link, not a regular"):
        files.open_regular(tmp_path / "link", follow=False)
    fd = files.open_regular(tmp_path / "real", follow=False)
    try:  # blocking again, as a plain open gives it
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


def test_missing_and_unreadable_files_raise_as_open_does(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.read_bounded(tmp_path / "nope", 10)


def test_reads_are_bounded(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * 100)
    assert files.read_bounded(path, 100) == b"x" * 100
    with pytest.raises(
        files.FileCheckError, match=r"big has 100 bytes, more than the 99 allowed"
    ):
        files.read_bounded(path, 99)


def test_huge_sparse_file_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "huge"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte of nothing: sparse, no disk used
    with pytest.raises(files.FileCheckError, match=r"has 1099511627776 bytes, more"):
        _within(10, files.read_bounded, path, 1 << 20)


def test_check_size(tmp_path):
    path = tmp_path / "pack"
    path.write_bytes(b"x" * 10)
    fd = files.open_regular(path)
    try:
        files.check_size(fd, 10, ValueError)
        for expected in (9, 11):
            with pytest.raises(
                ValueError, match=rf"^has 10 bytes where {expected} were written$"
            ):
                files.check_size(fd, expected, ValueError)
    finally:
        os.close(fd)


def test_new_files_never_write_through_a_planted_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    final = tmp_path / "out" / "model.safetensors"
    final.parent.mkdir()
    # The name the old scheme used (`{final}.tmp-{pid}`) is not the one drawn.
    os.symlink(outside, f"{final}.tmp-{os.getpid()}")
    fd, tmp = files.create_new(final)
    try:
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert outside.read_bytes() == b"precious"
    assert os.path.dirname(tmp) == os.fspath(final.parent)
    assert not os.path.islink(tmp)
    with open(tmp, "rb") as f:
        assert f.read() == b"new"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o666 & ~umask


def test_a_taken_name_is_never_written_through(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    final = tmp_path / "index.json"
    os.symlink(outside, f"{final}.tmp-planted")  # a link...
    os.symlink(tmp_path / "nowhere", f"{final}.tmp-dangling")  # ...a dangling one
    names = iter(["planted", "dangling", "fresh"])
    # The random draw, made to hit the planted names first (internal: no real
    # way makes 64 random bits collide).
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    fd, tmp = files.create_new(final)
    os.close(fd)
    assert tmp == f"{final}.tmp-fresh"
    assert outside.read_bytes() == b"precious"
    assert not os.path.exists(tmp_path / "nowhere")


def _planted(tmp_path, final):
    """Links to a file outside, at `final` and at the temporary name the old
    writers used (`{final}.tmp-{pid}`); returns the file they point to."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    os.symlink(outside, final)
    os.symlink(outside, f"{final}.tmp-{os.getpid()}")
    return outside


def _written(final, data, planted):
    """`final` holds `data` in a regular file of its own; the link at the old
    temporary name is left alone; the file linked to is untouched."""
    assert not os.path.islink(final)
    with open(final, "rb") as f:
        assert f.read() == data
    assert os.path.islink(f"{final}.tmp-{os.getpid()}")
    assert planted.read_bytes() == b"precious"
    left = sorted(os.listdir(os.path.dirname(final)))
    assert left == sorted([os.path.basename(final), f"{final.name}.tmp-{os.getpid()}"])


def test_replace_whole_never_writes_through_a_planted_link(tmp_path):
    (tmp_path / "d").mkdir()
    final = tmp_path / "d" / "index.json"
    planted = _planted(tmp_path, final)
    files.replace_whole(final, b'{"new": 1}')
    _written(final, b'{"new": 1}', planted)


def test_a_pack_file_is_never_written_through_a_planted_link(tmp_path):
    (tmp_path / "d").mkdir()
    final = tmp_path / "d" / "orbax_eqx~packed.0123456789abcdef.0.bin"
    planted = _planted(tmp_path, final)
    x = np.arange(16, dtype=np.float32)
    _ranges.write(epath.Path(final), [(0, x), (128, x)], 192)
    expected = x.tobytes() + bytes(64) + x.tobytes()
    _written(final, expected, planted)
    # A hard link at the name: its file (another name of it) is not written in
    # place, as an `O_TRUNC` open of the name once did.
    os.unlink(final)
    os.link(planted, final)
    _ranges.write(epath.Path(final), [(0, x)], 64)
    with open(final, "rb") as f:
        assert f.read() == x.tobytes()
    assert planted.read_bytes() == b"precious"

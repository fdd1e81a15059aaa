"""Files that are not regular files, or cannot be read, wherever a checkpoint
or an input should have one: a FIFO, a directory, a device or a link to
`/dev/zero` where the pack, the sidecar, a shard index or an entry of Orbax's
array store should be; a sidecar larger than any sidecar; more entries than
any store holds; files this user cannot read; and the same in the other
files read (a rename map, an import's safetensors file and index). Each is
refused before anything blocks or reads without end, in one clear error.

Whatever could block (a FIFO) or read without end (`/dev/zero`) runs in a
fresh interpreter with a time and a memory limit (`tests/children.py`), or
in a thread with a time limit (`tests/unblock.py`), so that a regression
fails the test instead of hanging it or filling the machine's memory.
"""

import os
import re
import shutil
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from children import restore_in_child, run_child
from entry import main
from unblock import raised_by
from untouched import snapshot

import orbax_eqx as oeqx

# --- in a checkpoint's directory and the files read ----------------------------
# (The check a save makes of a sidecar after a failure, which no public call
# reaches with a FIFO there: `tests/test_staged_faults.py`.)


SIDECAR = "orbax_eqx.json"
MAX_BYTES = 256 << 20  # the most a sidecar may have (docs/guides/format.md)


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"model": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "n": 3})
    return path


def _pack(path):
    return path / oeqx.metadata(path).packs[0].file


def _damaged_pack(what):
    return (
        rf"The pack file \S+/orbax_eqx~packed\.[0-9a-f]{{16}}\.0\.bin {what}: the "
        r"checkpoint is damaged \(a copy cut short, or a file deleted\)\. Restore an "
        r"earlier step, or re-save it\."
    )


def _damaged_sidecar(what):
    return (
        rf"The sidecar \S+/orbax_eqx\.json {what}; the checkpoint is damaged \(or "
        r"something else was put in its place\)\. Restore an earlier step, or "
        r"re-save it\."
    )


def _on_checkpoint(path, out) -> dict:
    """Restore, verify and export of `path`, by the API and the command line."""
    return run_child(
        path=str(path),
        out=str(out / "api"),
        cli={
            "cli verify": ["verify", str(path)],
            "cli export": [
                "export",
                str(path),
                "--to",
                "safetensors",
                str(out / "cli"),
            ],
        },
    )


@pytest.mark.slow
def test_fifo_in_place_of_the_pack_fails_fast(tmp_path):
    path = _checkpoint(tmp_path)
    pack = _pack(path)
    pack.unlink()
    os.mkfifo(pack)
    runs = _on_checkpoint(path, tmp_path / "out")
    damaged = _damaged_pack(r"is a FIFO \(named pipe\), not a regular file")
    for name in ("restore", "export"):
        assert runs[name]["type"] == "CheckpointDamagedError", runs[name]
        assert re.fullmatch(damaged, runs[name]["message"]), runs[name]["message"]
    # verify: every packed leaf is damaged, and says why.
    problems = runs["verify"]["value"]
    assert len(problems) == 4 and all(re.fullmatch(damaged, p) for p in problems)
    assert runs["cli verify"]["code"] == 1
    assert runs["cli verify"]["stdout"].count("DAMAGED") == 4
    cli = runs["cli export"]
    assert cli["code"] == 2 and cli["stdout"] == ""
    assert re.fullmatch(f"orbax_eqx: error: {damaged}\n", cli["stderr"]), cli
    # Export left nothing behind: its temporary files are gone.
    assert os.listdir(tmp_path / "out" / "api") == []
    assert os.listdir(tmp_path / "out" / "cli") == []


@pytest.mark.parametrize(
    "plant, what",
    [
        (os.mkfifo, r"is a FIFO \(named pipe\), not a regular file"),
        # A link to an endless stream: refused as the device it is, unread.
        (
            lambda p: os.symlink("/dev/zero", p),
            "is a character device, not a regular file",
        ),
    ],
    ids=["fifo", "dev_zero"],
)
@pytest.mark.slow
def test_sidecar_that_would_never_end_fails_fast(tmp_path, plant, what):
    path = _checkpoint(tmp_path)
    (path / SIDECAR).unlink()
    plant(path / SIDECAR)
    runs = _on_checkpoint(path, tmp_path / "out")
    message = _damaged_sidecar(what)
    for name in ("restore", "verify", "export"):
        assert runs[name]["type"] == "SidecarError", runs[name]
        assert re.fullmatch(message, runs[name]["message"]), runs[name]["message"]
    for name in ("cli verify", "cli export"):
        assert runs[name]["code"] == 2 and runs[name]["stdout"] == ""
        assert re.fullmatch(f"orbax_eqx: error: {message}\n", runs[name]["stderr"])
    assert not (tmp_path / "out").exists()


def test_directory_in_place_of_the_pack(tmp_path):
    path = _checkpoint(tmp_path)
    pack = _pack(path)
    pack.unlink()
    pack.mkdir()
    message = _damaged_pack("is a directory, not a regular file")
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(path)
    report = oeqx.verify(path)
    assert len(report.damaged) == 4
    assert all(re.fullmatch(message, d.problem) for d in report.damaged)


def test_directory_in_place_of_the_sidecar(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    (path / SIDECAR).unlink()
    (path / SIDECAR).mkdir()
    message = _damaged_sidecar("is a directory, not a regular file")
    for run in (oeqx.restore, oeqx.verify, oeqx.metadata):
        with pytest.raises(oeqx.CheckpointDamagedError, match=message):
            run(path)
    assert main(["inspect", str(path)]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", capsys.readouterr().err)


def test_sidecar_larger_than_any_sidecar_is_refused_unread(tmp_path):
    path = _checkpoint(tmp_path)
    with open(path / SIDECAR, "r+b") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no disk, and never read
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged_sidecar(
            f"has {MAX_BYTES + 1} bytes, more than the {MAX_BYTES} allowed"
        ),
    ):
        oeqx.restore(path)


WINDOW = 8 << 20  # `max_staged_bytes`: CPU devices copy through it


def _staged_pack(tmp_path):
    """A checkpoint, restored whole through a staging window (`WINDOW`: as on
    an accelerator), and its pack file."""
    path = _checkpoint(tmp_path)
    oeqx.restore(path, max_staged_bytes=WINDOW)
    return path, _pack(path)


def test_staged_restore_of_a_fifo_pack_fails_fast(tmp_path):
    path, pack = _staged_pack(tmp_path)
    pack.unlink()
    os.mkfifo(pack)
    raised = raised_by(lambda: oeqx.restore(path, max_staged_bytes=WINDOW), pack)
    assert isinstance(raised, oeqx.CheckpointDamagedError), raised
    message = _damaged_pack(r"is a FIFO \(named pipe\), not a regular file")
    assert re.fullmatch(message, str(raised)), raised


# --- the other files read: import's safetensors, rename map, a failed save's sidecar


SKELETON_PY = """
import jax, jax.numpy as jnp

def skeleton():
    return {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
"""


@pytest.mark.slow
def test_import_from_a_fifo_fails_fast(tmp_path):
    (tmp_path / "skeletons.py").write_text(SKELETON_PY)
    skeleton = f"{tmp_path / 'skeletons.py'}:skeleton"
    single = tmp_path / "one.safetensors"
    os.mkfifo(single)
    (tmp_path / "hf").mkdir()
    listed = tmp_path / "hf" / "model.safetensors"  # found by listing `hf`
    os.mkfifo(listed)
    (tmp_path / "indexed").mkdir()
    index = tmp_path / "indexed" / "model.safetensors.index.json"
    os.mkfifo(index)
    runs = run_child(
        cli={
            "file": [
                "import",
                str(single),
                str(tmp_path / "a"),
                "--skeleton",
                skeleton,
            ],
            "directory": [
                *("import", str(tmp_path / "hf"), str(tmp_path / "b")),
                *("--skeleton", skeleton),
            ],
            "index": [
                *("import", str(tmp_path / "indexed"), str(tmp_path / "c")),
                *("--skeleton", skeleton),
            ],
        }
    )
    for name, fifo in (("file", single), ("directory", listed)):
        assert runs[name]["code"] == 2 and runs[name]["stdout"] == ""
        assert runs[name]["stderr"] == (
            f"orbax_eqx: error: {fifo} is not a valid safetensors file: it is a FIFO "
            "(named pipe), not a regular file. Re-download or re-export it.\n"
        )
    # A directory whose index is a FIFO: refused, not waited on.
    assert runs["index"]["code"] == 2 and runs["index"]["stdout"] == ""
    assert runs["index"]["stderr"] == (
        f"orbax_eqx: error: {index} is not a safetensors index: it is a FIFO "
        "(named pipe), not a regular file. Re-download or re-export the directory.\n"
    )
    for out in ("a", "b", "c"):
        assert not (tmp_path / out).exists()


def test_rename_map_that_would_never_end_is_refused_unread(tmp_path, capsys):
    # The command line's `--rename` file, read before the checkpoint.
    def export(renames):
        codes = []
        argv = ["export", str(tmp_path / "none"), str(tmp_path / "out")]
        run = lambda: codes.append(main([*argv, "--rename", str(renames)]))  # noqa: E731
        assert raised_by(run, renames) is None
        assert codes == [2] and not (tmp_path / "out").exists()
        return capsys.readouterr().err

    fifo = tmp_path / "renames.json"
    os.mkfifo(fifo)
    assert export(fifo) == (
        f"orbax_eqx: error: The mapping {fifo} is a FIFO (named pipe), not a "
        "regular file. Pass the path of a JSON file.\n"
    )
    endless = tmp_path / "zero.json"
    os.symlink("/dev/zero", endless)
    assert re.match(
        rf"orbax_eqx: error: The mapping {endless} is a character device, not a "
        r"regular file\.",
        export(endless),
    )
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: no disk, and never read
    assert export(huge) == (
        f"orbax_eqx: error: The mapping {huge} has {(16 << 20) + 1} bytes, more "
        f"than the {16 << 20} allowed. Pass the path of a JSON file.\n"
    )
    assert export(tmp_path / "nope.json") == (
        f"orbax_eqx: error: The mapping {tmp_path}/nope.json does not exist. Pass "
        "the path of a JSON file.\n"
    )


# --- export through a planted symlink ---------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
def test_export_never_writes_through_a_planted_symlink(tmp_path, sharded):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(1000.0), "b": jnp.ones(300)})
    out = tmp_path / "hf"
    out.mkdir()
    names = (
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        if sharded
        else ["model.safetensors"]
    )
    if sharded:
        names.append("model.safetensors.index.json")
    # What export used to write through: `{final}.tmp-{pid}`, here a link to a
    # file outside the output directory, which must stay as it is.
    victims = []
    for i, name in enumerate(names):
        victim = tmp_path / f"victim-{i}"
        victim.write_bytes(b"precious")
        os.symlink(victim, out / f"{name}.tmp-{os.getpid()}")
        victims.append(victim)
    result = oeqx.export_safetensors(
        path, out, max_shard_size=2000 if sharded else 10**9
    )
    assert [os.path.basename(f) for f in result.files] == names
    for victim in victims:
        assert victim.read_bytes() == b"precious"
    for name in names:  # the planted links are left alone, not written or removed
        assert os.path.islink(out / f"{name}.tmp-{os.getpid()}")
        assert not os.path.islink(out / name)
    assert sorted(os.listdir(out)) == sorted(
        names + [f"{name}.tmp-{os.getpid()}" for name in names]
    )


# --- in Orbax's array store (`pack=False`) ------------------------------------
# `verify` says "cannot be read" rather than call a good checkpoint damaged.
# (The check a save makes of the store just before its commit, and the cap on
# its entries, lowered: `tests/test_storage_units.py`.)


def _unpacked(tmp_path, **options):
    path = tmp_path / "ckpt"
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    oeqx.save(path, {"model": model, "n": 3}, pack=False, **options)
    return path


def _store(path):
    return path / f"orbax_eqx~arrays.{oeqx.metadata(path).token}"


def _damaged_store(path, planted, what):
    return (
        f"Orbax's array store of the checkpoint at {re.escape(str(path))} holds "
        f"{re.escape(str(planted))}, which is {what} where Orbax writes only regular "
        r"files and directories\. Reading it could block forever or without end, so "
        r"nothing was read: the checkpoint is damaged \(or something else was put in "
        r"its place\)\. Restore an earlier step, or re-save the checkpoint\."
    )


def _replace_with(planted, plant):
    planted.unlink()
    plant(planted)


@pytest.mark.parametrize(
    "where, plant, what",
    [
        # A chunk file of the OCDBT data: the reads of the arrays open it.
        (
            lambda store: sorted((store / "ocdbt.process_0" / "d").iterdir())[0],
            os.mkfifo,
            r"a FIFO \(named pipe\)",
        ),
        # Orbax's own metadata, read before any array.
        (
            lambda store: store / "_METADATA",
            lambda p: os.symlink("/dev/zero", p),
            "a symbolic link to a character device",
        ),
    ],
    ids=["fifo_chunk", "dev_zero_metadata"],
)
@pytest.mark.slow
def test_array_store_entry_that_would_never_end_fails_fast(
    tmp_path, where, plant, what
):
    path = _unpacked(tmp_path)
    planted = where(_store(path))
    _replace_with(planted, plant)
    runs = run_child(
        path=str(path),
        out=str(tmp_path / "out" / "api"),
        cli={
            "cli verify": ["verify", str(path)],
            "cli inspect": ["inspect", str(path)],
        },
    )
    message = _damaged_store(path, planted, what)
    for name in ("restore", "export"):
        assert runs[name]["type"] == "CheckpointDamagedError", runs[name]
        assert re.fullmatch(message, runs[name]["message"]), runs[name]["message"]
    # verify: every Orbax-stored array is damaged, and says why.
    problems = runs["verify"]["value"]
    assert len(problems) == 4
    assert all(re.fullmatch(f"cannot be read: {message}", p) for p in problems)
    verified = runs["cli verify"]
    assert verified["code"] == 1 and verified["stdout"].count("DAMAGED") == 4
    assert re.search(message, verified["stdout"])
    # inspect reads the sidecar only: the tree is shown whole, nothing blocks.
    inspected = runs["cli inspect"]
    assert inspected["code"] == 0 and inspected["stderr"] == "", inspected
    assert inspected["stdout"].count("  Orbax") == 4
    assert "Total: 7 leaves, 4 arrays, 200 B." in inspected["stdout"]


def test_array_store_fifo_of_an_array_not_read_is_not_walked(tmp_path):
    # Without OCDBT each array has its directory; a partial restore walks, and
    # reads, only those of the arrays it asks for.
    path = tmp_path / "ckpt"
    oeqx.save(
        path, {"a": jnp.arange(3.0), "b": jnp.ones(4)}, pack=False, use_ocdbt=False
    )
    store = _store(path)
    fifo = store / "b" / "0"
    _replace_with(fifo, os.mkfifo)
    skeleton = jax.ShapeDtypeStruct((3,), jnp.float32)
    got = []

    def partial():
        got.append(oeqx.restore(path, skeleton, prefix="a"))

    assert raised_by(partial, fifo) is None
    assert got[0].tolist() == [0.0, 1.0, 2.0]
    # Asked for, the array's FIFO is refused.
    raised = raised_by(lambda: oeqx.restore(path), fifo)
    assert isinstance(raised, oeqx.CheckpointDamagedError)
    assert re.fullmatch(
        _damaged_store(path, fifo, r"a FIFO \(named pipe\)"), str(raised)
    )


# --- permissions ---------------------------------------------------------------


@pytest.mark.parametrize("run", ["restore", "verify"])
@pytest.mark.parametrize("what", ["directory", "sidecar", "pack", "store", "data"])
@pytest.mark.slow
def test_unreadable_checkpoint(tmp_path, what, run):
    # Unreadable is not damaged: `verify` raises too, rather than report a leaf
    # as damaged (which could get a good checkpoint deleted).
    if os.geteuid() == 0:
        # Root reads anything: restore as nobody, in a directory nobody can reach.
        base = tempfile.mkdtemp(prefix="oeqx-perm-")
        os.chmod(base, 0o755)
    else:
        base = str(tmp_path)
    try:
        path = os.path.join(base, "ckpt")
        # "store", "data": Orbax's array store, or a data file in it.
        stored = what in ("store", "data")
        oeqx.save(
            path, {"w": jnp.arange(8.0 if not stored else 100_000)}, pack=not stored
        )
        shutil.copytree(path, os.path.join(base, "warm"))
        for dirpath, dirnames, filenames in os.walk(base):
            for n in dirnames:
                os.chmod(os.path.join(dirpath, n), 0o755)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o644)
        targets = {"directory": path, "sidecar": os.path.join(path, SIDECAR)}
        if stored:
            targets["store"] = os.fspath(_store(Path(path)))
            data = Path(targets["store"]).glob("ocdbt.process_0/d/*")
            targets["data"] = os.fspath(max(data, key=os.path.getsize))
        target = targets.get(what) or os.fspath(_pack(Path(path)))
        os.chmod(target, 0o000)
        before = snapshot(base) if os.geteuid() != 0 else None
        if os.geteuid() == 0:
            warm = os.path.join(base, "warm")
            result = restore_in_child(path, warm, 65534, run)
            kind, message = result["type"], result["message"]
        else:
            with pytest.raises(PermissionError) as info:
                getattr(oeqx, run)(path)
            kind, message = type(info.value).__name__, str(info.value)
            assert isinstance(info.value, PermissionError)
        os.chmod(target, 0o755 if what in ("directory", "store") else 0o644)
        if before is not None:
            assert snapshot(base) == before
        assert kind == "CheckpointPermissionError", message
        # The file that could not be read: in an unreadable store, the first
        # one TensorStore tried.
        named = message.removeprefix("Permission denied: ").split(" cannot be ")[0]
        assert named == target or (
            what == "store" and named.startswith(target + os.sep)
        ), message
        assert message == (
            f"Permission denied: {named} cannot be read by this user. Check the "
            "permissions of the checkpoint's directory and files (`ls -l`), or run "
            "as the user that saved it."
        )
    finally:
        if base != str(tmp_path):
            shutil.rmtree(base)

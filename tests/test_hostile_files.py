"""Files that are not files: a FIFO, a directory or a device where a checkpoint
file should be (in Orbax's array store too), a sidecar without end, a pack
longer than written, and a symlink planted where export writes.

Whatever could block (a FIFO) or read without end (`/dev/zero`) runs in a
fresh interpreter with a time limit and a memory limit, so that a regression
fails the test (with the stack of the hang, from `faulthandler`) instead of
hanging it or filling the machine's memory.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from console import main
from unblock import raised_by

import orbax_eqx as oeqx
from orbax_eqx._format.sidecar import MAX_BYTES, arrays_dir
from orbax_eqx._restore.rename_map import RenameError, load
from orbax_eqx._save.claim import _is_sidecar_of
from orbax_eqx._storage.orbax_store import files as store_files
from orbax_eqx._storage.transfer import staging
from orbax_eqx._tools.export import export
from orbax_eqx._tools.importing import ImportMismatchError, import_

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
SIDECAR = "orbax_eqx.json"
LIMIT_S = 120  # for a child that imports JAX and runs a few commands
MEMORY = 3 << 30  # a child's address space: reading /dev/zero ends here


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


# Runs restore, verify and export through the API on `spec["path"]` (if
# given), then each command line of `spec["cli"]`; prints one JSON line per
# run as it ends.
_CHILD = textwrap.dedent(
    """
    import contextlib, faulthandler, io, json, resource, sys
    # A hang prints every thread's stack and ends the child: the test shows it.
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
    # An endless read ends in MemoryError here, not with the machine's memory.
    memory = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    from importlib.metadata import entry_points
    import orbax_eqx as oeqx
    from orbax_eqx._tools.export import export
    (script,) = entry_points(group="console_scripts", name="orbax-eqx")
    main = script.load()  # the installed command

    spec = json.loads(sys.argv[3])

    def report(name, **result):
        print(json.dumps({"run": name, **result}), flush=True)

    def attempt(name, fn):
        try:
            value = fn()
        except Exception as e:
            report(name, type=type(e).__name__, message=str(e))
        else:
            report(name, type=None, value=value)

    if "path" in spec:
        path, out = spec["path"], spec["out"]
        attempt("restore", lambda: sorted(oeqx.restore(path)))
        attempt("verify", lambda: [d.problem for d in oeqx.verify(path).damaged])
        attempt("export", lambda: export(path, out).files)
    for name, argv in spec["cli"].items():
        err, printed = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
            code = main(argv)
        report(name, code=code, stderr=err.getvalue(), stdout=printed.getvalue())
    """
)


def _run_child(**spec) -> dict:
    """Runs `_CHILD` with `spec`; returns {run: result}. Fails on a hang or crash."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PACKAGE_ROOT}
    argv = [str(LIMIT_S - 20), str(MEMORY), json.dumps(spec)]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=LIMIT_S,  # then SIGKILL: a stuck read ignores anything else
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"blocked past {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"the child failed:\n{proc.stdout}\n{proc.stderr}"
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line]
    return {r.pop("run"): r for r in runs}


def _on_checkpoint(path, out) -> dict:
    """Restore, verify and export of `path`, by the API and the command line."""
    return _run_child(
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
        with pytest.raises(oeqx.SidecarError, match=message):
            run(path)
    assert main(["inspect", str(path)]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", capsys.readouterr().err)


def test_sidecar_larger_than_any_sidecar_is_refused_unread(tmp_path):
    path = _checkpoint(tmp_path)
    with open(path / SIDECAR, "r+b") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no disk, and never read
    with pytest.raises(
        oeqx.SidecarError,
        match=_damaged_sidecar(
            f"has {MAX_BYTES + 1} bytes, more than the {MAX_BYTES} allowed"
        ),
    ):
        oeqx.restore(path)


def test_pack_longer_than_written_is_damaged(tmp_path):
    path = _checkpoint(tmp_path)
    written = oeqx.metadata(path).packs[0].nbytes
    with open(_pack(path), "ab") as f:
        f.write(b"\0" * 100)
    message = _damaged_pack(f"has {written + 100} bytes where {written} were written")
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(path)
    assert all(re.fullmatch(message, d.problem) for d in oeqx.verify(path).damaged)


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
    runs = _run_child(
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
        }
    )
    for name, fifo in (("file", single), ("directory", listed)):
        assert runs[name]["code"] == 2 and runs[name]["stdout"] == ""
        assert runs[name]["stderr"] == (
            f"orbax_eqx: error: {fifo} is not a valid safetensors file: it is a FIFO "
            "(named pipe), not a regular file. Re-download or re-export it.\n"
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


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
    result = export(path, out, max_shard_size=2000 if sharded else 10**9)
    assert [os.path.basename(f) for f in result.files] == names
    for victim in victims:
        assert victim.read_bytes() == b"precious"
    for name in names:  # the planted links are left alone, not written or removed
        assert os.path.islink(out / f"{name}.tmp-{os.getpid()}")
        assert not os.path.islink(out / name)
    assert sorted(os.listdir(out)) == sorted(
        names + [f"{name}.tmp-{os.getpid()}" for name in names]
    )


# --- what is no file inside Orbax's array store (`pack=False`) ---------------------


def _unpacked(tmp_path, **options):
    path = tmp_path / "ckpt"
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    oeqx.save(path, {"model": model, "n": 3}, pack=False, **options)
    return path


def _store(path):
    return arrays_dir(path, oeqx.metadata(path).token)


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
    runs = _run_child(
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
    assert all(re.fullmatch(f'cannot be read: "{message}"', p) for p in problems)
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


def test_array_store_checked_before_a_commit_names_the_save(tmp_path):
    # The check a save makes before its commit, on a store something else
    # wrote into: the message is about the save, not a damaged checkpoint.
    path = _unpacked(tmp_path)
    store = _store(path)
    fifo = store / "ocdbt.process_0" / "intruder"
    os.mkfifo(fifo)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=(
            f"Orbax's array store of the save under way in {re.escape(str(path))} "
            f"holds {re.escape(str(fifo))}, which is a FIFO \\(named pipe\\) where "
            r"Orbax writes only regular files and directories: something other than "
            r"this save wrote into its directory while it ran\. Reading it could "
            r"block forever or without end, so the save stopped before its commit "
            r"and no checkpoint was changed\. Find what writes into the checkpoint "
            r"directory, then save again\.$"
        ),
    ):
        store_files.check(store, saving=True)


def test_array_store_with_more_entries_than_any_store_is_refused(tmp_path, monkeypatch):
    path = _unpacked(tmp_path)
    # A store of a few files stands for one of millions: the cap, lowered.
    monkeypatch.setattr(store_files, "MAX_ENTRIES", 3)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=(
            f"Orbax's array store of the checkpoint at {re.escape(str(path))} holds "
            r"more than 3 files and directories, far more than Orbax writes\. "
            r"Reading it could block forever or without end, so nothing was read"
        ),
    ):
        oeqx.restore(path)


# --- the staged restore refuses what the unstaged one refuses ----------------------


def _staged_pack(tmp_path, monkeypatch):
    """A checkpoint whose restores go through a staging window (as on an
    accelerator), and its pack file. The window is checked to be used."""
    monkeypatch.setenv("ORBAX_EQX_STAGING", "copy")
    path = _checkpoint(tmp_path)
    with staging.watch() as stats:
        oeqx.restore(path)
    assert stats.copy and stats.peak > 0
    return path, _pack(path)


def test_staged_restore_of_a_fifo_pack_fails_fast(tmp_path, monkeypatch):
    path, pack = _staged_pack(tmp_path, monkeypatch)
    pack.unlink()
    os.mkfifo(pack)
    raised = raised_by(lambda: oeqx.restore(path), pack)
    assert isinstance(raised, oeqx.CheckpointDamagedError), raised
    message = _damaged_pack(r"is a FIFO \(named pipe\), not a regular file")
    assert re.fullmatch(message, str(raised)), raised


@pytest.mark.parametrize("change", [100, -100], ids=["longer", "shorter"])
def test_staged_restore_of_a_pack_not_as_written_is_damaged(
    tmp_path, monkeypatch, change
):
    path, pack = _staged_pack(tmp_path, monkeypatch)
    saved = oeqx.metadata(path)
    written = saved.packs[0].nbytes
    with open(pack, "r+b") as f:
        f.truncate(written + change)
    # Longer than the sidecar records; or too short for the leaves' bytes.
    needed = max(r.offset + r.nbytes for r in saved.leaves.values() if r.pack == 0)
    if change < 0:
        assert written + change < needed  # the last leaf is cut
    expected = written if change > 0 else needed
    message = _damaged_pack(
        f"has {written + change} bytes where {expected} were written"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(path)


# --- the other files read: rename map, import index, type-handler index -----------


def test_rename_map_that_would_never_end_is_refused_unread(tmp_path):
    fifo = tmp_path / "renames.json"
    os.mkfifo(fifo)
    raised = raised_by(lambda: load(fifo), fifo)
    assert isinstance(raised, RenameError), raised
    assert str(raised) == (
        f"The rename map {fifo} is a FIFO (named pipe), not a regular file. Pass "
        "the path of the JSON file of renames."
    )
    endless = tmp_path / "zero.json"
    os.symlink("/dev/zero", endless)
    with pytest.raises(
        RenameError,
        match=rf"^The rename map {endless} is a character device, not a regular file\.",
    ):
        load(endless)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk, and never read
    with pytest.raises(
        RenameError,
        match=rf"^The rename map {huge} has {(64 << 20) + 1} bytes, more than the "
        rf"{64 << 20} allowed\. Pass the path of the JSON file of renames\.$",
    ):
        load(huge)
    with pytest.raises(
        RenameError,
        match=rf"^The rename map {tmp_path}/nope\.json does not exist\. Pass the "
        r"path of the JSON file of renames\.$",
    ):
        load(tmp_path / "nope.json")


def test_import_from_a_directory_whose_index_is_a_fifo_fails_fast(tmp_path):
    (tmp_path / "skeletons.py").write_text(SKELETON_PY)
    source = tmp_path / "hf"
    source.mkdir()
    fifo = source / "model.safetensors.index.json"
    os.mkfifo(fifo)
    skeleton = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
    raised = raised_by(lambda: import_(source, tmp_path / "out", skeleton), fifo)
    assert isinstance(raised, ImportMismatchError), raised
    assert str(raised) == (
        f"{fifo} is not a safetensors index: it is a FIFO (named pipe), not a "
        "regular file. Re-download or re-export the directory."
    )
    assert not (tmp_path / "out").exists()


def test_claim_reads_no_sidecar_that_is_a_fifo(tmp_path):
    # Whether a sidecar is this save's, asked after a failure: a FIFO there is
    # no save's (and a link is not followed), never waited on.
    fifo = tmp_path / "orbax_eqx.json"
    os.mkfifo(fifo)
    got = []
    assert raised_by(lambda: got.append(_is_sidecar_of(fifo, "0" * 16)), fifo) is None
    assert got == [False]
    real = tmp_path / "real.json"
    real.write_text('{"token": "0123456789abcdef"}')
    os.symlink(real, tmp_path / "link.json")
    assert _is_sidecar_of(real, "0123456789abcdef")
    assert not _is_sidecar_of(tmp_path / "link.json", "0123456789abcdef")

"""Files that are not files: a FIFO, a directory or a device where the pack,
the sidecar or a shard index should be, a sidecar larger than any sidecar,
and the same in the other files read (a rename map, an import's safetensors
file and index, a sidecar a save asks about after a failure).

Whatever could block (a FIFO) or read without end (`/dev/zero`) runs in a
fresh interpreter with a time and a memory limit (`tests/children.py`), or
in a thread with a time limit (`tests/unblock.py`), so that a regression
fails the test instead of hanging it or filling the machine's memory.

The check a save makes of a sidecar after a failure, which no public call
reaches with a FIFO there: `tests/test_staged_faults.py`.
"""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from children import run_child
from entry import main
from unblock import raised_by

import orbax_eqx as oeqx

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

"""Damaged or hostile checkpoints: each fails with a clear error and touches nothing.

Every case restores a checkpoint that was damaged (files deleted or cut short),
tampered with (an edited sidecar, edited Orbax metadata, escaping names), made
unreadable, or given a wrong skeleton, and checks two things: the error, pinned
by its message, and that no file under the test's directory (the checkpoint
and its parent) was created, changed or removed by the restore.
"""

import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import tensorstore as ts
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format.sidecar import arrays_dir
from orbax_eqx._tree.names import storage_key

KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)
SIDECAR = "orbax_eqx.json"
PACK = re.compile(r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin")  # the one pack file


def _pack(path):
    """The pack file of the checkpoint at `path` (its name holds the save's token)."""
    return path / oeqx.metadata(path).packs[0].file


HUGE = 2**40
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))


# --- helpers ------------------------------------------------------------------


def _snapshot(root) -> dict:
    """Every file and directory under `root`: mode, mtime and (files) bytes."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = None
            if name in filenames and not os.path.islink(path):
                with open(path, "rb") as f:
                    data = f.read()
            found[os.path.relpath(path, root)] = (st.st_mode, st.st_mtime_ns, data)
    st = os.stat(root)
    found["."] = (st.st_mode, st.st_mtime_ns, None)
    return found


def _fails_touching_nothing(root, path, error, match, skeleton=None, **options):
    """Restores `path`, expects `error` matching `match`; nothing under `root` changes.

    `root` holds the checkpoint and its parent, so a file written next to the
    checkpoint, or anywhere else in the test's directory, is caught too.
    """
    before = _snapshot(root)
    with pytest.raises(error, match=match):
        oeqx.restore(path, skeleton, **options)
    assert _snapshot(root) == before
    return before


def _edit_sidecar(path, edit) -> None:
    sidecars.edit(path, edit)  # resealed: what is tested is the reader's rules


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import orbax_eqx as oeqx

    path, warm, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run = getattr(oeqx, sys.argv[4])  # restore, or verify
    if warm:  # loads every module a restore needs, before losing access to them
        run(warm)
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    try:
        run(path)
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e)}))
    else:
        print(json.dumps({"type": None, "message": ""}))
    """
)


def _restore_in_subprocess(path, warm="", uid=-1, run="restore") -> dict:
    """Restores in a fresh interpreter: a crash there (std::bad_alloc) fails the test
    without killing pytest. `uid >= 0`: the restore runs as that user. `run`:
    `"verify"` to verify instead."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PACKAGE_ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(warm), str(uid), run],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert proc.returncode == 0, f"the restore crashed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _unpacked(tmp_path, **options):
    """A checkpoint whose arrays are all in Orbax's array store."""
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    oeqx.save(path, item, pack=False, **options)
    return path, item


def _store(path):
    """The directory of the checkpoint's Orbax array store."""
    return arrays_dir(path, oeqx.metadata(path).token)


def _ocdbt_write(path, key: str, edit) -> None:
    """Edits the JSON value at `key` in an OCDBT store, as a tamperer could."""

    async def run():
        base = f"file://{_store(path)}/"
        store = await ts.KvStore.open({"driver": "ocdbt", "base": base})
        value = json.loads((await store.read(key)).value)
        edit(value)
        await store.write(key, json.dumps(value).encode())

    asyncio.run(run())


# --- 1. Orbax's array store damaged ----------------------------------------------


def _delete_data_files(path):
    for dirpath, _, filenames in os.walk(path):
        if os.path.basename(dirpath) == "d":
            for name in filenames:
                os.unlink(os.path.join(dirpath, name))


def _truncate_data_files(path):
    for dirpath, _, filenames in os.walk(path):
        if os.path.basename(dirpath) == "d":
            for name in filenames:
                full = os.path.join(dirpath, name)
                os.truncate(full, os.path.getsize(full) // 2)


def _truncate_one_chunk(path):
    # The largest data file holds the array chunks; its index is intact.
    files = [
        os.path.join(dirpath, name)
        for dirpath, _, filenames in os.walk(path)
        if os.path.basename(dirpath) == "d"
        for name in filenames
    ]
    biggest = max(files, key=os.path.getsize)
    os.truncate(biggest, os.path.getsize(biggest) // 2)


# Orbax leaves the other reads' coroutines unawaited when one read fails; Python
# reports them when they are collected. Orbax's, not ours.
_ORBAX_UNAWAITED = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@_ORBAX_UNAWAITED
@pytest.mark.parametrize(
    "damage, match",
    [
        (
            lambda p: (_store(p) / "manifest.ocdbt").unlink(),
            r"Leaf `\['a'\]` \(leaf name `a`\) is stored in Orbax's array store, says "
            r"the sidecar, but the store holds no array under key `a`",
        ),
        (
            _delete_data_files,
            r"Orbax's array store of the checkpoint at .*ckpt\S* cannot be read "
            r"\(NOT_FOUND: .*\): the checkpoint is damaged",
        ),
        (
            _truncate_data_files,
            r"Orbax's array store of the checkpoint at .*ckpt\S* cannot be read "
            r"\(OUT_OF_RANGE: .*\): the checkpoint is damaged",
        ),
        (
            _truncate_one_chunk,
            r"Reading leaves `\['a'\]` \(a\); `\['b'\]` \(b\) from Orbax's array "
            r"store of the checkpoint at .*ckpt\S* failed \(OUT_OF_RANGE: Error "
            r'reading "a/0" .*\): the checkpoint is damaged',
        ),
        (
            lambda p: shutil.rmtree(_store(p) / "ocdbt.process_0"),
            r"Reading leaves `\['a'\]` \(a\); `\['b'\]` \(b\) from Orbax's array "
            r"store of the checkpoint at .*ckpt\S* failed \(.*\): the checkpoint is "
            r"damaged",
        ),
    ],
    ids=[
        "manifest_deleted",
        "data_files_deleted",
        "data_files_truncated",
        "chunk_file_truncated",
        "process_tree_deleted",
    ],
)
@pytest.mark.slow
def test_damaged_orbax_store(tmp_path, damage, match):
    path, item = _unpacked(tmp_path)
    damage(path)
    _fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"(?s){match}.*Restore an "
        r"earlier step, or re-save the checkpoint[.;]",
    )
    skeleton = eqx.filter_eval_shape(lambda: item)
    _fails_touching_nothing(
        tmp_path, path, oeqx.CheckpointDamagedError, match, skeleton
    )
    gc.collect()  # Orbax's unawaited coroutines: reported here, where ignored


@_ORBAX_UNAWAITED
@pytest.mark.slow
def test_damaged_orbax_error_keeps_orbax_details_as_the_cause(tmp_path):
    path, _ = _unpacked(tmp_path)
    shutil.rmtree(_store(path) / "ocdbt.process_0")
    with pytest.raises(oeqx.CheckpointDamagedError) as info:
        oeqx.restore(path)
    assert info.value.__cause__ is not None
    assert len(str(info.value)) < 1000  # not Orbax's pages of TensorStore spec
    del info
    gc.collect()


# --- 2. the sidecar and Orbax's array metadata disagree ---------------------------


def _set(name, field, value):
    def edit(content):
        content["leaves"][name][field] = value

    return edit


def _add_stored_leaf(content):
    record = dict(content["leaves"]["a"], path="['c']", key="c")
    content["leaves"]["c"] = record


def _drop_leaf(content):
    del content["leaves"]["b"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _set("a", "shape", [500]),
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[500\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _set("a", "dtype", "int32"),
            r"Leaf `\['a'\]` \(leaf name `a`\) is int32\[1000\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _add_stored_leaf,
            r"Leaf `\['c'\]` \(leaf name `c`\) is stored in Orbax's array store, says "
            r"the sidecar, but the store holds no array under key `c`",
        ),
        (
            _drop_leaf,
            r"Orbax's array store holds an array under key `b`, which the sidecar does "
            r"not list",
        ),
    ],
    ids=["shape", "dtype", "leaf_missing_from_store", "store_has_unlisted_array"],
)
def test_sidecar_disagrees_with_orbax_store(tmp_path, edit, match):
    path, _ = _unpacked(tmp_path)
    _edit_sidecar(path, edit)
    _fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"(?s)The checkpoint at .*ckpt\S* is damaged: its sidecar and Orbax's array "
        rf"store disagree \(1 difference\):\n  - {match}.*do not belong together.*"
        r"Restore an earlier step, or re-save the checkpoint\.",
    )


def test_only_the_leaves_being_read_are_compared(tmp_path):
    path, item = _unpacked(tmp_path)
    _edit_sidecar(path, _set("a", "shape", [500]))
    skeleton = {"b": jax.ShapeDtypeStruct((4, 4), jnp.int32)}
    restored = oeqx.restore(path, skeleton, strict=False)
    np.testing.assert_array_equal(restored["b"], item["b"])


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "no_ocdbt"])
def test_leaves_named_like_orbax_files_pass_the_comparison(tmp_path, use_ocdbt):
    # Whether a store is OCDBT is decided as Orbax does, not by a file name
    # that a leaf name could also give.
    item = {n: jnp.arange(3.0) for n in ("d", "ocdbt.process_0", "manifest.ocdbt")}
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_ocdbt=use_ocdbt)
    skeleton = eqx.filter_eval_shape(lambda: item)
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), item)


@pytest.mark.slow
def test_orbax_metadata_comparison_passes_for_the_dtypes_entry_with_zarr3(tmp_path):
    item = zoo.dtypes(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_zarr3=True)
    restored = oeqx.restore(tmp_path / "ckpt", zoo.skeleton(zoo.dtypes, KEY_SKELETON))
    zoo.assert_same(restored, item)


# --- 3. enormous shapes -----------------------------------------------------------


def _huge_packed(content, shape=(HUGE,)):
    record = content["leaves"]["a"]
    size = int(np.prod(shape, dtype=object)) * 4
    record["shape"], record["nbytes"] = list(shape), size
    content["packs"][0]["nbytes"] = record["offset"] + size + 4096


def _packed(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)})
    return path


def test_enormous_sidecar_shape_fails_the_skeleton_check(tmp_path):
    path = _packed(tmp_path)
    _edit_sidecar(path, _huge_packed)
    skeleton = {
        "a": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "b": jax.ShapeDtypeStruct((4, 4), jnp.int32),
    }
    _fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointMismatchError,
        r"Leaf `a` has shape \(1000,\) in the skeleton but \(1099511627776,\) "
        "in the checkpoint",
        skeleton,
    )


@pytest.mark.parametrize(
    "shape",
    [(HUGE,), (2**62, 2**62)],
    ids=["terabytes", "overflowing_int64"],
)
@pytest.mark.slow
def test_enormous_packed_leaf_is_refused_before_allocating(tmp_path, shape):
    path = _packed(tmp_path)
    _edit_sidecar(path, lambda c: _huge_packed(c, shape))
    size = os.path.getsize(_pack(path))
    # A fresh interpreter: were the buffer allocated first, this must not abort
    # pytest. It needs no memory at all: the file is checked first.
    result = _restore_in_subprocess(path)
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(
        rf"The pack file .*{PACK.pattern} has {size} bytes where \d+ were written: "
        "the checkpoint is damaged",
        result["message"],
    )


def test_enormous_sidecar_shape_of_orbax_leaf_is_refused(tmp_path):
    path, _ = _unpacked(tmp_path)
    _edit_sidecar(path, _set("a", "shape", [HUGE]))
    _fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1099511627776\] in the "
        r"sidecar but <f4\[1000\] in Orbax's array store",
    )


@pytest.mark.parametrize(
    "field, match",
    [
        (
            "shape",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] in the sidecar but "
            r"<f4\[1099511627776\] in Orbax's array store",
        ),
        (
            "chunks",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] but its chunks in "
            r"Orbax's array store are \[1099511627776\] .*larger than the array",
        ),
    ],
    ids=["orbax_shape", "orbax_chunks"],
)
@pytest.mark.slow
def test_enormous_orbax_metadata_is_refused_before_reading(tmp_path, field, match):
    path, _ = _unpacked(tmp_path)
    _ocdbt_write(path, "a/.zarray", lambda z: z.__setitem__(field, [HUGE]))
    before = _snapshot(tmp_path)
    result = _restore_in_subprocess(path)
    assert _snapshot(tmp_path) == before
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(match, result["message"]), result["message"]


# --- 4. names that try to escape the directory ------------------------------------


def _rename_leaf(old, new):
    def edit(content):
        leaves = content["leaves"]
        record = leaves.pop(old)
        if record.get("data") == "orbax":
            record["key"] = storage_key(new)
        leaves[new] = record

    return edit


def _sentinel(tmp_path):
    """A file where an escaping name would point, to see it is never touched."""
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"do not touch")
    return sentinel


@pytest.mark.parametrize(
    "escape",
    ["../sentinel", "../../sentinel", "/{tmp}/sentinel", "a/../../sentinel"],
    ids=["up", "up_twice", "absolute", "down_and_up"],
)
@pytest.mark.parametrize(
    "layout", ["packed", "orbax", "orbax_no_ocdbt"], ids=["packed", "orbax", "files"]
)
def test_escaping_leaf_names_stay_inside(tmp_path, layout, escape):
    name = escape.format(tmp=str(tmp_path).strip("/"))
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    options = {"packed": {}, "orbax": {"pack": False}}.get(
        layout, {"pack": False, "use_ocdbt": False}
    )
    oeqx.save(path, item, **options)
    _edit_sidecar(path, _rename_leaf("a", name))
    sentinel = _sentinel(tmp_path)
    before = _snapshot(tmp_path)
    if layout == "packed":
        # A name is a dict key: the bytes come from the pack file, as recorded,
        # and are checked against a CRC-32 bound to the name (format 5): a
        # renamed leaf is an edited record.
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=rf"\({re.escape(name)}\): XXH3-64 recorded at save",
        ):
            oeqx.restore(path)
    else:
        # The storage key is derived from the name, one path component: no array
        # is stored under it.
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=rf"Leaf `\['a'\]` \(leaf name `{re.escape(name)}`\) is stored in "
            rf"Orbax's array store, says the sidecar, but the store holds no array "
            rf"under key `{re.escape(storage_key(name))}`",
        ):
            oeqx.restore(path)
        assert "/" not in storage_key(name) and storage_key(name) != ".."
    assert _snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"


@pytest.mark.parametrize(
    "target", ["nope", "../sentinel", "/etc/passwd"], ids=["missing", "up", "absolute"]
)
def test_alias_of_a_name_that_is_no_leaf(tmp_path, target):
    path = tmp_path / "ckpt"
    oeqx.save(path, _tied())
    _edit_sidecar(path, lambda c: _retarget_alias(c, target))
    _sentinel(tmp_path)
    _fails_touching_nothing(
        tmp_path,
        path,
        oeqx.SidecarError,
        rf"The sidecar in .*ckpt is damaged: leaf '.*' is an alias of "
        rf"{re.escape(repr(target))}, which is no stored array of the same shape and "
        "dtype. Restore an earlier step",
    )


def _tied():
    w = jnp.ones((3, 3))
    return {"x": w, "y": w}


def _retarget_alias(content, target):
    aliases = [r for r in content["leaves"].values() if r.get("data") == "alias"]
    assert aliases
    aliases[0]["alias_of"] = target


@pytest.mark.parametrize(
    "module", ["../../sentinel", "/etc", "layers/../../x"], ids=["up", "abs", "mixed"]
)
def test_escaping_module_names_are_only_dict_keys(tmp_path, module):
    path = tmp_path / "ckpt"
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(path, model)
    _edit_sidecar(path, lambda c: c["modules"].__setitem__(module, c["modules"][""]))
    sentinel = _sentinel(tmp_path)
    before = _snapshot(tmp_path)
    flat = oeqx.restore(path)
    np.testing.assert_array_equal(flat["layers.0.weight"], model.layers[0].weight)
    assert module in oeqx.metadata(path).modules
    restored = oeqx.restore(path, eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON))
    zoo.assert_same(restored, model)
    assert _snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"


# --- 5. permissions ---------------------------------------------------------------


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
        before = _snapshot(base) if os.geteuid() != 0 else None
        if os.geteuid() == 0:
            warm = os.path.join(base, "warm")
            result = _restore_in_subprocess(path, warm, 65534, run)
            kind, message = result["type"], result["message"]
        else:
            with pytest.raises(oeqx.CheckpointPermissionError) as info:
                getattr(oeqx, run)(path)
            kind, message = type(info.value).__name__, str(info.value)
            assert isinstance(info.value, PermissionError)
        os.chmod(target, 0o755 if what in ("directory", "store") else 0o644)
        if before is not None:
            assert _snapshot(base) == before
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


# --- 6. skeleton mistakes ---------------------------------------------------------


class Saved(eqx.Module):
    x: jax.Array
    y: jax.Array


class Lookalike(eqx.Module):
    x: jax.Array
    y: tuple


def test_lookalike_class_with_same_fields_but_other_structure(tmp_path):
    oeqx.save(tmp_path / "ckpt", Saved(jnp.ones(2), jnp.ones(3)))
    skeleton = Lookalike(
        jax.ShapeDtypeStruct((2,), jnp.float32),
        (jax.ShapeDtypeStruct((3,), jnp.float32),),
    )
    match = (
        r"(?s)\(3 differences\).*Leaf `y\.0` is in the skeleton but not in the "
        r"checkpoint\..*Leaf `y` is in the checkpoint but not in "
        r"the skeleton\..*Module `<root>` is `.*Lookalike` in the skeleton but "
        r"`.*Saved` in the checkpoint\."
    )
    _fails_touching_nothing(
        tmp_path, tmp_path / "ckpt", oeqx.CheckpointMismatchError, match, skeleton
    )


@pytest.mark.parametrize(
    "saved, skeleton, match",
    [
        (
            {"0": jnp.ones(2)},
            {0: jax.ShapeDtypeStruct((2,), jnp.float32)},
            r"(?s)Leaf `0` is in the skeleton but not in the checkpoint\..*"
            r"Leaf `\\0` \(path `\['0'\]`\) is in the checkpoint but not in "
            r"the skeleton\.",
        ),
        (
            {0: jnp.ones(2)},
            {"0": jax.ShapeDtypeStruct((2,), jnp.float32)},
            r"(?s)Leaf `\\0` \(path `\['0'\]`\) is in the skeleton but not in the "
            r"checkpoint\..*Leaf `0` is in the checkpoint but not in the "
            r"skeleton\.",
        ),
        (
            {"w": None, "v": jnp.ones(2)},
            {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "v": jnp.zeros(2)},
            r"Leaf `w` is array float32\[2\] in the skeleton but None in the "
            "checkpoint",
        ),
        (
            zoo.mlp(KEY_SAVE),
            eqx.partition(zoo.mlp(KEY_SKELETON), eqx.is_array)[0],
            r"(?s)Leaf `activation` is None in the skeleton but callable "
            r".*relu in the checkpoint",
        ),
    ],
    ids=["int_key_for_str_key", "str_key_for_int_key", "array_for_none", "params_only"],
)
def test_skeleton_mistakes(tmp_path, saved, skeleton, match):
    oeqx.save(tmp_path / "ckpt", saved)
    _fails_touching_nothing(
        tmp_path, tmp_path / "ckpt", oeqx.CheckpointMismatchError, match, skeleton
    )


def test_static_part_only_skeleton_says_arrays_are_missing(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(KEY_SAVE))
    static = eqx.partition(zoo.mlp(KEY_SKELETON), eqx.is_array)[1]
    _fails_touching_nothing(
        tmp_path,
        tmp_path / "ckpt",
        oeqx.CheckpointMismatchError,
        r"(?s)\(6 differences\).*Leaf `layers\.2\.bias` is None in the skeleton "
        r"but array float32\[2\] in the checkpoint.*\nThe skeleton has None where "
        r"the checkpoint has arrays: a skeleton needs each array's shape and dtype\. "
        r"Pass the whole model, or `eqx.filter_eval_shape\(make_model, key\)`, not "
        r"the static half of `eqx.partition\(model, eqx.is_array\)`\.$",
        static,
    )


def test_concrete_model_as_skeleton_gets_the_checkpoint_values(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    other = zoo.mlp(KEY_SKELETON)
    assert not np.array_equal(other.layers[0].weight, model.layers[0].weight)
    restored = oeqx.restore(tmp_path / "ckpt", other)
    zoo.assert_same(restored, model)


def test_tuple_skeleton_for_a_saved_list_takes_the_skeletons_structure(tmp_path):
    # Leaf names do not record list vs tuple (`l.0` either way): the skeleton
    # gives the structure, the checkpoint the values.
    saved = {"l": [jnp.ones(2), jnp.arange(3.0)]}
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = {"l": tuple(eqx.filter_eval_shape(lambda: saved)["l"])}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert isinstance(restored["l"], tuple)
    np.testing.assert_array_equal(restored["l"][1], saved["l"][1])

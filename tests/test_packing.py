"""The packed layout: unsharded arrays as byte ranges of one pack file.

Internal modules imported here (`_bytes`, `_save.prepare`, `_storage`,
`_storage.transfer`) are the units these tests pin, or the only way to cause or
observe the condition under test; everything else goes through `orbax_eqx` and
the `orbax-eqx` command.
"""

import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zoo
from etils import epath

import orbax_eqx as oeqx
from orbax_eqx._bytes import local as _local
from orbax_eqx._storage import ranges as _ranges
from orbax_eqx._storage.transfer import to_host as _to_host

KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)
PACK = re.compile(r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin")  # the one pack file


def _pack(path):
    """The pack file of the checkpoint at `path` (its name holds the save's token)."""
    return path / oeqx.metadata(path).packs[0].file


def _records(path):
    return oeqx.metadata(path).leaves


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_every_array_is_packed_at_an_aligned_offset(tmp_path, make):
    item = make(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item)
    md = oeqx.metadata(tmp_path / "ckpt")
    packed = [r for r in md.leaves.values() if r.data == "packed"]
    spans = sorted((r.offset, r.offset + r.nbytes) for r in packed)
    for start, _ in spans:
        assert start % 64 == 0
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        assert stop <= start  # no overlap
    arrays = [r for r in md.leaves.values() if r.kind == "array"]
    # One device, so every non-empty array that is not a tied twin is packed.
    assert {r.name for r in packed} == {
        r.name for r in arrays if r.data not in ("none", "alias")
    }
    if packed:
        assert len(md.packs) == 1
        assert PACK.fullmatch(md.packs[0].file)
        assert os.path.getsize(_pack(tmp_path / "ckpt")) == md.packs[0].nbytes
        assert md.nbytes == sum(r.nbytes for r in packed)
    else:
        assert md.packs == () and not list(
            (tmp_path / "ckpt").glob("orbax_eqx~packed*")
        )


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
@pytest.mark.slow
def test_unpacked_layout_still_roundtrips(tmp_path, make):
    item = make(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item, pack=False)
    assert all(r.data != "packed" for r in _records(tmp_path / "ckpt").values())
    assert not list((tmp_path / "ckpt").glob("orbax_eqx~packed*"))
    restored = oeqx.restore(tmp_path / "ckpt", zoo.skeleton(make, KEY_SKELETON))
    zoo.assert_same(restored, item)


def test_typed_prng_keys_are_packed_as_key_data(tmp_path):
    item = zoo.prng_keys(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item)
    leaves = _records(tmp_path / "ckpt")
    for name in ("threefry", "rbg", "batch", "legacy"):
        assert leaves[name].data == "packed"
        data = item[name]
        if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(data)
        assert leaves[name].nbytes == data.nbytes
    assert leaves["none_left"].data == "none"


def test_zero_size_arrays_take_no_pack_bytes(tmp_path):
    item = {"empty": jnp.zeros((0, 3)), "np_empty": np.zeros((2, 0), np.int8)}
    oeqx.save(tmp_path / "ckpt", item)
    md = oeqx.metadata(tmp_path / "ckpt")
    assert [r.data for r in md.leaves.values()] == ["none", "none"]
    assert md.packs == ()
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", item), item)


def test_mixed_containers_and_dtypes_restore_exactly(tmp_path):
    item = {
        **zoo.dtypes(KEY_SAVE),
        **{f"np_{k}": v for k, v in zoo.numpy_leaves(KEY_SAVE).items()},
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "step": 7,
    }
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", item)
    zoo.assert_same(restored, item)
    assert isinstance(restored["np_np_scalar"], np.float32)
    np.testing.assert_array_equal(restored["fortran"], item["fortran"])


def test_plan_merges_close_spans_and_keeps_far_ones_apart():
    spans = {"a": (0, 100), "b": (128, 200), "far": (10_000, 10_064)}
    ranges, where = _ranges.plan(spans, max_gap=64)
    assert ranges == [(0, 200), (10_000, 10_064)]
    assert where == {"a": (0, 0), "b": (0, 128), "far": (1, 0)}
    ranges, where = _ranges.plan({"b": (128, 200), "a": (0, 100)}, max_gap=0)
    assert ranges == [(0, 100), (128, 200)]
    assert where == {"a": (0, 0), "b": (1, 0)}


def _big_small_big():
    mib = 1 << 20
    return {
        "a": jnp.arange(mib, dtype=jnp.float32),  # 4 MiB
        "b": jnp.arange(10, dtype=jnp.int32),
        "c": -jnp.arange(mib, dtype=jnp.float32),  # 4 MiB
    }


def _bytes_read(run) -> int:
    """The bytes this process read through system calls while `run()` ran
    (Linux's `rchar`: `read`, `pread`, ... of every file, page cache or not)."""

    def rchar():
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line[:6] == "rchar:")

    before = rchar()
    run()
    return rchar() - before


def test_partial_restore_reads_only_the_wanted_leaves(tmp_path):
    item = _big_small_big()
    oeqx.save(tmp_path / "ckpt", item)
    sidecar = os.path.getsize(tmp_path / "ckpt" / "orbax_eqx.json")
    skeleton = {"b": jax.ShapeDtypeStruct((10,), jnp.int32)}
    restored = []
    read = _bytes_read(
        lambda: restored.append(oeqx.restore(tmp_path / "ckpt", skeleton, strict=False))
    )
    np.testing.assert_array_equal(restored[0]["b"], item["b"])
    b = _records(tmp_path / "ckpt")["b"]
    # The sidecar, and 40 bytes of 8 MiB (a margin of 4 KiB for small reads).
    assert sidecar + b.nbytes <= read < sidecar + b.nbytes + 4096

    read = _bytes_read(
        lambda: oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    )
    assert 8 * (1 << 20) <= read < 8.1 * (1 << 20)


def test_truncated_pack_fails_loudly_but_earlier_leaves_restore(tmp_path):
    item = _big_small_big()
    oeqx.save(tmp_path / "ckpt", item)
    b = _records(tmp_path / "ckpt")["b"]
    os.truncate(_pack(tmp_path / "ckpt"), b.offset + b.nbytes)
    skeleton = eqx.filter_eval_shape(lambda: item)
    partial = {k: skeleton[k] for k in ("a", "b")}
    restored = oeqx.restore(tmp_path / "ckpt", partial, strict=False)
    zoo.assert_same(restored, {k: item[k] for k in ("a", "b")})
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The pack file .*{PACK.pattern} has \d+ bytes where \d+ were "
        r"written: the checkpoint is damaged .* Restore an earlier step",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)


def test_missing_pack_file(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"w": jnp.ones(3)})
    _pack(tmp_path / "ckpt").unlink()
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=rf"{PACK.pattern} is missing"
    ):
        oeqx.restore(tmp_path / "ckpt")
    assert isinstance(oeqx.CheckpointDamagedError("x"), ValueError)


def test_caller_may_change_or_donate_arrays_once_save_returns(tmp_path):
    """The async save holds what it needs before `save` returns."""
    table = np.arange(1000, dtype=np.int64)
    weight = jnp.arange(1 << 16, dtype=jnp.float32)
    expected = {"table": table.copy(), "weight": np.asarray(weight).copy()}
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler())
    mngr.save(0, args=oeqx.EqxSave({"table": table, "weight": weight}))
    table[:] = -1  # in place, while the save may still be writing
    clobber = jax.jit(lambda x: x * 0 - 5, donate_argnums=0)
    jax.block_until_ready(clobber(weight))
    mngr.wait_until_finished()
    restored = mngr.restore(0)
    mngr.close()
    np.testing.assert_array_equal(restored["table"], expected["table"])
    np.testing.assert_array_equal(restored["weight"], expected["weight"])


def test_a_large_numpy_array_changed_after_an_async_save_keeps_its_bytes(tmp_path):
    """An async save copies numpy arrays before it returns, whatever their layout."""
    big = np.random.default_rng(0).standard_normal((1 << 20) + 3).astype(np.float32)
    odd = np.arange(24, dtype=">i4").reshape(4, 6).T  # big-endian, not C order
    expected = {"big": big.copy(), "odd": odd.copy()}
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler())
    mngr.save(0, args=oeqx.EqxSave({"big": big, "odd": odd}))
    big[:] = -1
    odd[:] = -1
    mngr.wait_until_finished()
    restored = mngr.restore(0)
    mngr.close()
    for name, value in expected.items():
        assert restored[name].dtype == value.dtype
        np.testing.assert_array_equal(restored[name], value)


@pytest.mark.parametrize("copy_numpy", [True, False], ids=["async", "waited"])
def test_a_save_that_waits_packs_numpy_arrays_without_copying(copy_numpy):
    """`oeqx.save` returns once written, so it packs numpy arrays where they
    are (a copy only where one is not C-contiguous); an async save copies."""
    from orbax_eqx._save.prepare import prepare

    base = np.arange(2 * (5 << 20), dtype=np.float32)  # 40 MiB
    item = {
        "big": base[: 5 << 20],
        "small": np.arange(10.0),
        "strided": base[::2],
        "scalar": np.float32(2.5),
    }
    prepared = prepare(item, token="0" * 16, waited=not copy_numpy)
    prepared.finish()
    hosts = dict(
        zip(prepared.packed_names, (h for _, h in prepared.pieces), strict=True)
    )
    for name, x in item.items():
        np.testing.assert_array_equal(hosts[name], x)
        assert hosts[name].flags.c_contiguous
    assert np.shares_memory(hosts["big"], base) is not copy_numpy
    assert np.shares_memory(hosts["small"], item["small"]) is not copy_numpy
    assert not np.shares_memory(hosts["strided"], base)


def test_standalone_save_of_numpy_leaves_of_every_layout(tmp_path):
    base = np.arange(4 * (1 << 20), dtype=np.float64)
    item = {
        "view": base[: 1 << 20],
        "strided": base[1::3],
        "transposed": base[:600].reshape(20, 30).T,
        "fortran": np.asfortranarray(base[:600].reshape(20, 30)),
        "scalar": np.int16(-7),
        "bf16": base[:64].astype(jnp.bfloat16),
    }
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = jax.tree_util.tree_map(np.zeros_like, item)
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    for name, value in item.items():
        assert restored[name].dtype == value.dtype, name
        np.testing.assert_array_equal(restored[name], value)


def test_host_arrays_keep_their_bytes_when_the_array_is_donated():
    """What a save holds stays intact: on CPU it is numpy's view of the device
    buffer, and JAX must not reuse a buffer that numpy holds."""
    weight = jnp.arange(1 << 16, dtype=jnp.float32)
    table = np.arange(10)
    (held, held_table) = _to_host.host_copies([weight, table])
    clobber = jax.jit(lambda x: x * 0 - 5, donate_argnums=0)
    out = jax.block_until_ready(clobber(weight))
    if held.ctypes.data == np.asarray(out).ctypes.data:
        pytest.fail("JAX reused a donated buffer that a save still holds")
    np.testing.assert_array_equal(held, np.arange(1 << 16, dtype=np.float32))
    table[:] = 0
    np.testing.assert_array_equal(held_table, np.arange(10))


def test_restored_arrays_are_ordinary_jax_arrays(tmp_path):
    """Restored without a copy (on CPU), yet donatable and independent."""
    item = {"w": jnp.arange(4096, dtype=jnp.float32), "v": jnp.ones(7)}
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert restored["w"].unsafe_buffer_pointer() % 64 == 0
    doubled = jax.jit(lambda x: 2 * x, donate_argnums=0)(restored["w"])
    np.testing.assert_array_equal(doubled, 2 * item["w"])
    np.testing.assert_array_equal(restored["v"], item["v"])


def test_packed_leaves_restore_onto_explicit_shardings(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    skel = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    restored = oeqx.restore(tmp_path / "ckpt", skel, shardings=lambda n, s: device)
    zoo.assert_same(restored, model)
    assert restored.layers[0].weight.sharding == device


_SHARDED_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, equinox as eqx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx

    path = sys.argv[1]
    mesh = jax.make_mesh((8,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    everywhere = NamedSharding(mesh, P())
    item = {
        "sharded": jax.device_put(jnp.arange(64.0).reshape(16, 4), rows),
        "replicated": jax.device_put(jnp.arange(32).reshape(8, 4), everywhere),
        "single": jnp.ones(5, jnp.bfloat16),
        "np": np.arange(3, dtype=np.int16),
        "key": jax.random.key(3),
        "tied": None,
        "step": 4,
    }
    item["tied"] = item["sharded"]
    oeqx.save(path, item)
    data = {n: r.data for n, r in oeqx.metadata(path).leaves.items()}
    assert data == {
        "sharded": "shards", "replicated": "packed", "single": "packed",
        "np": "packed", "key": "packed", "tied": "alias", "step": None,
    }, data

    def same(a, b):
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        return a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))

    # As saved: the skeleton's own shardings.
    skeleton = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x,
        item,
    )
    restored = oeqx.restore(path, skeleton)
    for name in ("sharded", "replicated", "single", "np", "key", "tied"):
        assert same(restored[name], item[name]), name
    assert restored["sharded"].sharding == rows
    assert restored["replicated"].sharding == everywhere
    assert restored["tied"] is restored["sharded"]

    # Onto another layout: a packed leaf split over the mesh, a sharded one
    # onto one device.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    targets = {"sharded": one, "replicated": rows, "single": everywhere,
               "key": everywhere, "tied": everywhere}
    restored = oeqx.restore(path, skeleton, shardings=lambda n, s: targets.get(n))
    for name in ("sharded", "replicated", "single", "key", "tied"):
        assert same(restored[name], item[name]), name
        assert restored[name].sharding == targets[name], name

    # Part of it only.
    part = {"replicated": skeleton["replicated"], "sharded": skeleton["sharded"]}
    restored = oeqx.restore(path, part, strict=False)
    assert same(restored["replicated"], item["replicated"])
    assert same(restored["sharded"], item["sharded"])
    print("OK", json.dumps(len(jax.devices())))
    """
)


@pytest.mark.slow
def test_sharded_arrays_go_to_shard_packs_on_8_devices(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_WORKER, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK 8")
    # And the 8-device checkpoint restores here, on one device.
    flat = oeqx.restore(path)
    np.testing.assert_array_equal(flat["sharded"], np.arange(64.0).reshape(16, 4))
    np.testing.assert_array_equal(flat["replicated"], np.arange(32).reshape(8, 4))
    assert flat["tied"] is flat["sharded"]
    assert flat["np"].dtype == np.int16
    # The sharded leaf's chunks were checked after restores onto other layouts
    # (above); here on one device, and by verify.
    assert oeqx.metadata(path).leaves["sharded"].sharding == "P('x') over x=8"
    report = oeqx.verify(path)
    assert report.ok and "sharded" in report.checked


def test_read_lets_bytes_be_checked_as_they_arrive(tmp_path, monkeypatch):
    # Internal: the piece size is no option; lowered, 300 kB make many pieces
    # over several threads.
    monkeypatch.setattr(_local, "_PIECE", 4096)
    data = np.random.default_rng(0).integers(0, 256, 300_000, np.uint8)
    path = tmp_path / "pack.bin"
    path.write_bytes(data.tobytes())
    ranges = [(0, 100_000), (150_000, 300_000)]
    seen = []

    def meanwhile(buffers, ready):
        for i, (start, stop) in enumerate(ranges):
            for upto in (1, 5000, stop - start):
                ready(i, upto)  # then the first `upto` bytes are there
                seen.append(
                    bytes(buffers[i][:upto]) == data[start : start + upto].tobytes()
                )

    buffers = _ranges.read(epath.Path(path), ranges, meanwhile=meanwhile)
    assert seen == [True] * 6
    for (start, stop), buffer in zip(ranges, buffers, strict=True):
        np.testing.assert_array_equal(buffer, data[start:stop])
    # A file shorter than the bytes asked for is refused before any is read.
    short = tmp_path / "short.bin"
    short.write_bytes(data[:200_000].tobytes())
    reached = []

    def checking(buffers, ready):
        ready(0, 100_000)
        reached.append(100_000)
        ready(0, 300_000)
        reached.append(300_000)

    with pytest.raises(Exception, match="has 200000 bytes where 300000 were"):
        _ranges.read(epath.Path(short), [(0, 300_000)], meanwhile=checking)
    assert reached == []


def test_large_restore_buffers_are_private_mappings_that_live_with_their_arrays(
    tmp_path,
):
    """Leaves of 4 MiB and more are read into anonymous private mappings (no
    huge-page compaction on the way; see `packfile.aligned_empty`): still
    aligned and taken by CPU devices without a copy, writable, independent of
    each other, and kept alive by the jax array alone."""
    import gc
    import mmap

    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB
    buf = _ranges.aligned_empty(big.nbytes)
    assert isinstance(buf.base.obj, mmap.mmap) and buf.flags.writeable
    assert buf.ctypes.data % mmap.PAGESIZE == 0
    small = _ranges.aligned_empty(1024)
    assert not isinstance(small.base, memoryview) and small.ctypes.data % 64 == 0

    item = {"big": jnp.asarray(big), "also": jnp.asarray(big[::-1].copy())}
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), item)
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    del item
    gc.collect()
    if jax.default_backend() == "cpu":
        assert restored["big"].unsafe_buffer_pointer() % mmap.PAGESIZE == 0
    doubled = jax.jit(lambda x: 2 * x, donate_argnums=0)(restored["big"])
    np.testing.assert_array_equal(doubled, 2 * big)
    np.testing.assert_array_equal(restored["also"], big[::-1])

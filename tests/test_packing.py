"""The packed layout: unsharded arrays as byte ranges of one pack file (its
ranged reads and host copies as units: `tests/test_storage_units.py`)."""

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

import orbax_eqx as oeqx

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

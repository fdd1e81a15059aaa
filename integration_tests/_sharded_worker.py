"""Worker for test_sharded.py: one mode per process, because the number of
fake CPU devices is fixed when JAX starts.

    python _sharded_worker.py save ROOT
    python _sharded_worker.py restore-one ROOT
    python _sharded_worker.py restore-mesh ROOT HOW
    python _sharded_worker.py save-donate ROOT

HOW is where restored arrays go: `replicated` (one Sharding for all), `tree`
(a PyTree of shardings), `function` (a `(name, leaf) -> Sharding`), `skeleton`
(the skeleton's `ShapeDtypeStruct.sharding`) or `default` (nothing given).

ROOT is a CheckpointManager root; `save` also writes ROOT/../expected.npz with
the saved values, for the restoring processes to compare against.
"""

import os
import sys
import warnings

# The same warning policy as pytest's (see pyproject.toml).
warnings.simplefilter("error")
warnings.filterwarnings("ignore", category=DeprecationWarning, module="orbax.*")
warnings.filterwarnings("ignore", category=UserWarning, module="orbax.*")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

STEP = 4


def make_model(key):
    return eqx.nn.MLP(16, 8, 32, 1, key=key)


def make_item(key):
    return {"model": make_model(key), "key": jax.random.key(7), "step": STEP}


def skeleton(shardings=None):
    """A skeleton initialised differently from the saved item."""
    skel = eqx.filter_eval_shape(make_item, jax.random.key(1234))
    skel["step"] = -1
    if shardings is not None:
        skel = jax.tree.map(
            lambda x, s: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                if isinstance(x, jax.ShapeDtypeStruct)
                else x
            ),
            skel,
            shardings,
        )
    return skel


def arrays_by_name(item) -> dict[str, jax.Array]:
    model = item["model"]
    named = {"key": item["key"]}
    for i, layer in enumerate(model.layers):
        named[f"model.layers.{i}.weight"] = layer.weight
        named[f"model.layers.{i}.bias"] = layer.bias
    return named


def host(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def mesh_of(shape: tuple[int, int], names: tuple[str, str]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def spec_for(x, mesh_axes: tuple[str, str]) -> P:
    """Weights split on both mesh axes, biases on the second, scalars replicated."""
    if x.ndim == 2:
        return P(*mesh_axes)
    if x.ndim == 1:
        return P(mesh_axes[1])
    return P()


def check_against_expected(restored, root) -> None:
    expected = np.load(os.path.join(os.path.dirname(root), "expected.npz"))
    named = arrays_by_name(restored)
    assert sorted(named) == sorted(expected.files), (sorted(named), expected.files)
    for name, x in named.items():
        np.testing.assert_array_equal(host(x), expected[name], err_msg=name)
        print(f"{name}: {x.dtype}{list(x.shape)} equal, sharding {x.sharding}")
    assert restored["step"] == STEP
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)


def save(root: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = mesh_of((4, 2), ("data", "model"))
    item = make_item(jax.random.key(0))
    item = jax.tree.map(
        lambda x: (
            jax.device_put(x, NamedSharding(mesh, spec_for(x, mesh.axis_names)))
            if isinstance(x, jax.Array)
            else x
        ),
        item,
    )
    weight = item["model"].layers[0].weight
    assert weight.sharding.spec == P("data", "model")
    assert {s.data.shape for s in weight.addressable_shards} == {(8, 8)}
    np.savez(
        os.path.join(os.path.dirname(root), "expected.npz"),
        **{name: host(x) for name, x in arrays_by_name(item).items()},
    )
    mngr = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())
    mngr.save(STEP, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [STEP]
    mngr.close()
    print("saved", sorted(os.listdir(os.path.join(root, str(STEP), "default"))))


def restore_one(root: str) -> None:
    assert jax.device_count() == 1, jax.devices()
    device = SingleDeviceSharding(jax.devices()[0])
    mngr = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())
    restored = mngr.restore(STEP, args=oeqx.EqxRestore(skeleton()))
    check_against_expected(restored, root)
    for name, x in arrays_by_name(restored).items():
        assert x.sharding == device, (name, x.sharding)
    mngr.close()

    # Without a skeleton, and without handlers: a flat dict on the one device.
    flat = ocp.CheckpointManager(root).restore(STEP)
    expected = np.load(os.path.join(os.path.dirname(root), "expected.npz"))
    for name in expected.files:
        np.testing.assert_array_equal(host(flat[name]), expected[name], err_msg=name)
        assert flat[name].sharding == device, (name, flat[name].sharding)
    assert flat["step"] == STEP
    print("flat restore equal:", sorted(flat))

    # The standalone API reads a manager's step directory the same way.
    standalone = oeqx.restore(os.path.join(root, str(STEP)), skeleton())
    check_against_expected(standalone, root)


def restore_mesh(root: str, how: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = mesh_of((2, 4), ("x", "y"))
    replicated = NamedSharding(mesh, P())

    def wanted(x) -> NamedSharding:
        return NamedSharding(mesh, spec_for(x, ("x", "y")))

    plain = skeleton()
    if how == "default":
        args = oeqx.EqxRestore(plain)
    elif how == "replicated":
        args = oeqx.EqxRestore(plain, shardings=replicated)
    elif how == "tree":
        tree = jax.tree.map(
            lambda x: wanted(x) if isinstance(x, jax.ShapeDtypeStruct) else None,
            plain,
        )
        args = oeqx.EqxRestore(plain, shardings=tree)
    elif how == "function":
        seen = []

        def pick(name, leaf):
            seen.append(name)
            return wanted(leaf)

        args = oeqx.EqxRestore(plain, shardings=pick)
    elif how == "skeleton":
        shardings = jax.tree.map(
            lambda x: wanted(x) if isinstance(x, jax.ShapeDtypeStruct) else None,
            plain,
        )
        args = oeqx.EqxRestore(skeleton(shardings))
    else:
        raise SystemExit(f"unknown mode {how!r}")

    mngr = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())
    restored = mngr.restore(STEP, args=args)
    check_against_expected(restored, root)
    for name, x in arrays_by_name(restored).items():
        if how == "default":  # one local device, whatever the save used
            expected = SingleDeviceSharding(jax.local_devices()[0])
        elif how == "replicated":
            expected = replicated
        else:
            expected = wanted(x)
        assert x.sharding == expected, (name, x.sharding, expected)
        if how == "replicated":
            assert x.is_fully_replicated, name
    if how == "function":
        assert sorted(seen) == sorted(arrays_by_name(restored)), seen
    weight = restored["model"].layers[0].weight  # (32, 16)
    if how in ("default", "replicated"):
        assert {s.data.shape for s in weight.addressable_shards} == {(32, 16)}
    else:
        assert {s.data.shape for s in weight.addressable_shards} == {(16, 4)}
    # The restored model runs, sharded, and computes what the saved one did.
    x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
    out = jax.jit(jax.vmap(restored["model"]))(x)
    reference = make_model(jax.random.key(0))  # the saved model, unsharded
    np.testing.assert_allclose(out, jax.vmap(reference)(x), rtol=1e-5, atol=1e-6)
    mngr.close()


def save_donate(root: str) -> None:
    """Saves a deep model sharded over 8 devices three times (the second and
    third are repeated saves of one structure: their leaves are named in the
    background), each time donating every array to a jitted update as soon
    as `save` returns, as a training step does; every step restores equal to
    what was saved."""
    assert jax.device_count() == 8, jax.devices()
    mesh = mesh_of((8, 1), ("fsdp", "none"))

    def place(x):
        if not isinstance(x, jax.Array):
            return x
        spec = P("fsdp") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    model = eqx.nn.MLP(64, 64, 64, 12, key=jax.random.key(3))  # 26 arrays
    item = {"model": jax.tree.map(place, model), "big": place(jnp.ones((1024, 512)))}
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.5 + 1, t), donate_argnums=0)
    skel = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        item,
    )
    mngr = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())
    expected = {}
    for step in range(3):
        arrays, rest = eqx.partition(item, eqx.is_array)
        expected[step] = [host(x) for x in jax.tree.leaves(arrays)]
        mngr.save(step, args=oeqx.EqxSave(item))
        # Donates every array the save was given (on CPU, JAX copies instead
        # where numpy still holds a buffer: the save's views).
        arrays = update(arrays)
        item = eqx.combine(arrays, rest)
    mngr.wait_until_finished()
    for step in range(3):
        restored = mngr.restore(step, args=oeqx.EqxRestore(skel))
        leaves = [x for x in jax.tree.leaves(restored) if eqx.is_array(x)]
        for got, want in zip(leaves, expected[step], strict=True):
            np.testing.assert_array_equal(host(got), want)
        sharded = sum(not x.is_fully_replicated for x in leaves)
        print(f"step {step}: {len(leaves)} arrays ({sharded} sharded) equal")
    mngr.close()


if __name__ == "__main__":
    mode, root, *rest = sys.argv[1:]
    if mode == "save":
        save(root)
    elif mode == "restore-one":
        restore_one(root)
    elif mode == "restore-mesh":
        restore_mesh(root, *rest)
    elif mode == "save-donate":
        save_donate(root)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("ok")

"""Worker of `test_bridge_mesh.py`: safetensors loaded onto a mesh, by one or
several processes, each counting what it reads and holds.

    python _bridge_worker.py write DIR -              # the files, once
    python _bridge_worker.py load DIR TARGET          # any processes
    python _bridge_worker.py write-gpt2 DIR -         # GPT-2's own, once
    python _bridge_worker.py load-gpt2 DIR TARGET     # through its mapping

The files are a GPT-2-like Hugging Face set (per-layer tensors over 3 files
and an index): `h.{i}.attn.c_attn.weight` (D, 3D) (PyTorch's Conv1D, in x
out: transposed and split into q, k, v), `h.{i}.mlp.c_proj.weight` (D, 4D)
(Linear, out x in: as stored), `h.{i}.ln_1.weight` (D,), and `wte.weight`
(V, D). The skeleton is scanned: `blocks.q`/`k`/`v` (L, D, D), `blocks.proj`
(L, D, 4D), `blocks.ln` (L, D), `wte` (V, D). The plan is made by hand
(`_hand_plan`).

TARGET: `one` (every array on device 0); `layers` (stacked leaves cut
across layers, P("x") over 8 devices); `within` (cut within layers along
the axis that is the tensors' rows: P(None, "x") for `proj`, P(None, None,
"x") for the transposed q, k, v); `columns` (cut along the tensors'
columns: column strips, which read the rows that hold them); `2d` (a (2, 4)
mesh, P("a", "b")). `load` checks every shard of every leaf bitwise against
an independent numpy reference and prints one `RESULT {json}`: the bytes it
asked for (`read`), the bytes its devices' distinct boxes hold (`held`),
`/proc/self/io` rchar during the load, and its peak RSS growth (`VmHWM`
after resetting it through `/proc/self/clear_refs`).
"""

import gc
import json
import os

from _worker import start

L, D, V = 8, 128, 512
FILES = 3


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    out = {"wte.weight": (V, D)}
    for i in range(L):
        out[f"h.{i}.attn.c_attn.weight"] = (D, 3 * D)
        out[f"h.{i}.mlp.c_proj.weight"] = (D, 4 * D)
        out[f"h.{i}.ln_1.weight"] = (D,)
    return out


def values(name: str, shape):
    import zlib

    import numpy as np

    seed = zlib.crc32(name.encode())
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def write(directory: str) -> None:
    from safetensors.numpy import save_file

    shapes = tensor_shapes()
    names = list(shapes)
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    per = -(-len(names) // FILES)
    for k in range(FILES):
        file = f"model-{k + 1:05d}-of-{FILES:05d}.safetensors"
        chunk = names[k * per : (k + 1) * per]
        save_file(
            {n: values(n, shapes[n]) for n in chunk}, os.path.join(directory, file)
        )
        weight_map |= {n: file for n in chunk}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def plan():
    import _hand_plan as hp

    from orbax_eqx._mapping.pieces import Piece
    from orbax_eqx._mapping.plan import whole

    wte = (
        [hp.leaf("wte", (V, D))],
        [hp.tensor("wte.weight", (V, D))],
        [(Piece("wte", whole((V, D)), "wte.weight", whole((V, D)), (0, 1)), (0, 1))],
    )
    return hp.plan_of(
        wte,
        hp.fused(
            ["blocks.q", "blocks.k", "blocks.v"], L, D, D, "h.{}.attn.c_attn.weight"
        ),
        hp.stacked("blocks.proj", L, (D, 4 * D), "h.{}.mlp.c_proj.weight"),
        hp.stacked("blocks.ln", L, (D,), "h.{}.ln_1.weight"),
    )


def reference() -> dict:
    """Each leaf, from the tensors, by the published layout (not the plan)."""
    import numpy as np

    shapes = tensor_shapes()
    t = {n: values(n, s) for n, s in shapes.items()}
    out = {"wte": t["wte.weight"]}
    for j, name in enumerate(["q", "k", "v"]):
        out[f"blocks.{name}"] = np.stack(
            [t[f"h.{i}.attn.c_attn.weight"][:, j * D : (j + 1) * D].T for i in range(L)]
        )
    out["blocks.proj"] = np.stack([t[f"h.{i}.mlp.c_proj.weight"] for i in range(L)])
    out["blocks.ln"] = np.stack([t[f"h.{i}.ln_1.weight"] for i in range(L)])
    return out


def shardings(target: str, leaves) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    if target == "one":
        one = SingleDeviceSharding(jax.devices()[0])
        return {name: one for name in leaves}
    if target == "2d":
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
        return {name: NamedSharding(mesh, P("a", "b")) for name in leaves}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    specs = {}
    for name in leaves:
        transposed = name in ("blocks.q", "blocks.k", "blocks.v")
        if target == "layers":
            spec = P("x")
        elif target == "within":  # the tensors' rows
            spec = P(None, None, "x") if transposed else P(None, "x")
        else:  # "columns": the tensors' columns
            spec = P(None, "x") if transposed else P(None, None, "x")
        if name == "wte":
            spec = P("x") if target != "columns" else P(None, "x")
        if name == "blocks.ln":
            spec = P("x") if target == "layers" else P(None, "x")
        specs[name] = NamedSharding(mesh, spec)
    return specs


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


def load(directory: str, target: str) -> None:
    import jax
    import numpy as np

    from orbax_eqx._bridge.load import leaves
    from orbax_eqx._bridge.safetensors import index as _index
    from orbax_eqx._storage import engine
    from orbax_eqx._storage import put as _put

    the_plan = plan()
    expected = reference()
    put = shardings(target, the_plan.leaves)
    headers = _index.find(directory)
    tensors = {n: (h, t) for h in headers for n, t in h.tensors.items()}
    targets = {name: (spec, put[name]) for name, spec in the_plan.leaves.items()}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss, rchar = _status("VmRSS"), _rchar()
    counts = engine.Counts()
    made = leaves(the_plan, tensors, targets, {})
    counts.held = sum(
        int(np.prod(u.shape)) * u.dtype.itemsize
        for leaf in made
        for _, _, u in leaf.units
    )
    got = dict(zip(targets, _put.arrays(made, counts=counts), strict=True))
    jax.block_until_ready(got)
    rchar, peak = _rchar() - rchar, _status("VmHWM") - rss
    for name, array in got.items():
        assert array.shape == expected[name].shape, name
        for shard in array.addressable_shards:
            want = expected[name][shard.index]
            assert np.array_equal(np.asarray(shard.data), want), (name, shard.index)
    result = {
        "read": counts.read,
        "copied": counts.copied,
        "held": counts.held,
        "rchar": rchar,
        "peak": peak,
        "model": sum(x.nbytes for x in expected.values()),
    }
    print("RESULT " + json.dumps(result), flush=True)


# GPT-2 through the public API and its mapping (tests/bridge_models.py).


def _gpt2():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.join(sys.path[0], "tests"))
    import bridge_models as bm

    config = bm.GPT2Config(vocab=256, positions=32, width=64, heads=4, layers=8)
    sd = bm.gpt2_state_dict(config, seed=3, head=True, masks=True)
    return bm, config, sd


def write_gpt2(directory: str) -> None:
    from safetensors.numpy import save_file

    _, _, sd = _gpt2()
    os.makedirs(directory, exist_ok=True)
    names = list(sd)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate([names[:half], names[half:]]):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, os.path.join(directory, file))
        weight_map |= {n: file for n in part}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def load_gpt2(directory: str, target: str) -> None:
    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import orbax_eqx as oeqx
    from orbax_eqx._bridge.load import load as load_files

    bm, config, sd = _gpt2()
    skeleton = eqx.filter_eval_shape(bm.GPT2, config, key=jax.random.key(1))
    mesh = Mesh(np.array(jax.devices()), ("x",))

    def place(name, leaf):
        shape = leaf.shape
        if target == "within" and name.startswith("blocks.") and len(shape) > 1:
            return NamedSharding(mesh, P(None, "x"))  # within layers
        if shape and shape[0] % 8 == 0:
            return NamedSharding(mesh, P("x"))  # across layers, rows
        return NamedSharding(mesh, P())

    gc.collect()
    rchar = _rchar()
    loaded = load_files(directory, skeleton, mapping=bm.GPT2_MAPPING, shardings=place)
    jax.block_until_ready(jax.tree.leaves(loaded.tree))
    rchar = _rchar() - rchar
    expected = oeqx.from_state_dict(skeleton, sd, bm.GPT2_MAPPING)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(loaded.tree),
        jax.tree.leaves(expected),
        strict=True,
    ):
        want = np.asarray(want)
        for shard in got.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[shard.index]), path
    if jax.process_count() == 1:
        ids = np.array([3, 7, 1, 0, 9, 4, 4, 2, 11, 5])
        ours = np.asarray(loaded.tree(ids))
        np.testing.assert_allclose(
            ours, bm.gpt2_reference(sd, ids, config.heads), rtol=1e-4, atol=1e-4
        )
    if jax.process_count() > 1:
        # An export writes from one process: a tree sharded over processes is
        # refused, naming the leaves, before anything is written.
        out = os.path.join(directory + ".out", str(jax.process_index()))
        try:
            oeqx.export_safetensors(loaded.tree, out, mapping=bm.GPT2_MAPPING)
        except oeqx.BridgeError as e:
            assert str(e).startswith("20 array leaf(s) are on devices of "), e
            assert "Save the tree with `oeqx.save(path, tree)`" in str(e), e
            assert not os.path.exists(out)
            print("export refused", flush=True)
        else:
            raise AssertionError("a tree sharded over processes was exported")
    ignored = sum(
        v.nbytes for n, v in sd.items() if n.endswith((".attn.bias", "masked_bias"))
    )
    result = {
        "read": loaded.counts.read,
        "held": loaded.counts.held,
        "rchar": rchar,
        "model": sum(v.nbytes for v in sd.values())
        - ignored
        - sd["lm_head.weight"].nbytes,
    }
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    args = start("mode", "dir", "target")
    run = {
        "write": lambda: write(args.dir),
        "load": lambda: load(args.dir, args.target),
        "write-gpt2": lambda: write_gpt2(args.dir),
        "load-gpt2": lambda: load_gpt2(args.dir, args.target),
    }
    run[args.mode]()
    print("done", flush=True)


if __name__ == "__main__":
    main()

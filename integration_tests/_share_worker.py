"""Worker of `test_share.py`: what each process of a restore reads and holds.

    python _share_worker.py save DIR                 # 2 processes x 4 devices
    python _share_worker.py restore DIR TARGET       # any processes
    python _share_worker.py staged DIR TARGET        # restore, through a window
    python _share_worker.py fail DIR TARGET          # expects an error
    python _share_worker.py save DIR manager         # step 0 of a manager
    python _share_worker.py fail-manager DIR TARGET  # through the manager

The model: `BLOCKS` blocks of `w1` (D, 4D) `P("fsdp")`, `w2` (4D, D)
`P(None, "tp")` and `b` (4D,) `P("tp")`, plus a replicated `scale`; saved on
a (2, 4) mesh over ("fsdp", "tp"), so stored chunks are 512 KiB, 256 KiB and
512 bytes (well under the 1 MiB of the old CRC blocks), and 16 typed PRNG
keys `P("fsdp")`. TARGET is a mesh
shape over ("fsdp", "tp") (`8x1`, `4x2`, `2x4`, the specs as saved), `one`
(every array on `jax.devices()[0]`) or `first4` (a mesh over
`jax.devices()[:4]`). `restore` prints one `RESULT {json}` line: bytes read
(`/proc/self/io` rchar), peak RSS growth (`VmHWM` after resetting it through
`/proc/self/clear_refs`), and the distinct bytes this process's devices hold;
every shard is checked bitwise. `staged` restores as `restore` does, with a
1 GiB `max_staged_bytes`, which CPU devices copy through as an accelerator's
do. `fail` prints `ERROR {json}` with the error
(DIR may differ per process: `DIR.p<process>` if it exists). `vanish`:
process 1 exits without restoring; process 0 prints its `ERROR`.
"""

import gc
import json
import os

from _worker import start

BLOCKS = 12
D = 256


def model_values(i: int, shape):
    import numpy as np

    if shape == KEYS:  # key data
        data = np.random.default_rng(i).integers(0, 2**32, KEYS + (2,))
        return data.astype(np.uint32)
    return np.random.default_rng(i).standard_normal(shape).astype(np.float32)


KEYS = (16,)


def specs():
    from jax.sharding import PartitionSpec as P

    out = {"scale": ((4,), P()), "keys": (KEYS, P("fsdp"))}
    for k in range(BLOCKS):
        out[f"blocks.{k}.w1"] = ((D, 4 * D), P("fsdp"))
        out[f"blocks.{k}.w2"] = ((4 * D, D), P(None, "tp"))
        out[f"blocks.{k}.b"] = ((4 * D,), P("tp"))
    return out


def shardings(target: str):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    if target == "one":
        one = SingleDeviceSharding(jax.devices()[0])
        return {name: one for name in specs()}
    if target == "first4":
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    else:
        shape = tuple(int(n) for n in target.split("x"))
        mesh = jax.make_mesh(shape, ("fsdp", "tp"))
    return {name: NamedSharding(mesh, spec) for name, (_, spec) in specs().items()}


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


def _views(directory, restored) -> tuple[int, int]:
    """Of the pairs of stored chunks that lie one after the other in a shard
    pack (padding between them only) and are each a whole box here, how many
    are device buffers at the same distance as in the file: views of one
    buffer read, no copy (CPU devices); and how many pairs there are."""
    import glob

    where = {}  # (leaf name as stored, box) -> (file, offset, nbytes)
    for path in glob.glob(os.path.join(directory, "orbax_eqx~shards.*.json")):
        with open(path) as f:
            content = json.load(f)
        for leaf, rows in content["chunks"].items():
            for row in rows:
                box = tuple(zip(row[0], row[1], strict=True))
                where[(leaf.replace("\\.", "."), box)] = (path, row[2], row[3])
    found = []  # (file, offset, nbytes, device pointer)
    for name, x in restored.items():
        if name == "keys":
            continue
        for shard in x.addressable_shards:
            box = tuple(
                (s.start or 0, s.stop or n)
                for s, n in zip(shard.index, x.shape, strict=True)
            )
            place = where.get((name, box))
            if place is not None:
                found.append((*place, shard.data.unsafe_buffer_pointer()))
    found = sorted(set(found))
    views = pairs = 0
    for (f1, o1, n1, p1), (f2, o2, _, p2) in zip(found, found[1:], strict=False):
        if f1 == f2 and 0 <= o2 - (o1 + n1) < 64:
            pairs += 1
            views += p2 - p1 == o2 - o1
    return views, pairs


def _save(args) -> None:
    """Saves the model on a 2x4 mesh at DIR (or step 0 of a manager there)."""
    import jax

    import orbax_eqx as oeqx

    names = list(specs())
    put = shardings("2x4")
    tree = {}
    for i, name in enumerate(names):
        shape, _ = specs()[name]
        full = model_values(i, shape)
        tree[name] = jax.make_array_from_callback(
            full.shape, put[name], lambda index, full=full: full[index]
        )
        if name == "keys":
            tree[name] = jax.random.wrap_key_data(tree[name])
    if args.target == "manager":  # step 0 of a CheckpointManager at DIR
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(args.dir, item_handlers=oeqx.EqxHandler())
        mngr.save(0, args=oeqx.EqxSave(tree))
        mngr.wait_until_finished()
        mngr.close()
    else:
        oeqx.save(args.dir, tree)
    print("saved ok", flush=True)


def main() -> None:
    args = start("mode", "dir", "target")
    import jax
    import numpy as np

    import orbax_eqx as oeqx

    names = list(specs())
    if args.mode == "save":
        _save(args)
        return
    skeleton = {
        name: jax.ShapeDtypeStruct(shape, np.float32)
        for name, (shape, _) in specs().items()
    }
    skeleton["keys"] = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 16))
    directory = args.dir
    mine = f"{args.dir}.p{jax.process_index()}"
    if os.path.exists(mine):
        directory = mine
    target = shardings(args.target)
    gc.collect()
    vanish = args.mode == "vanish"
    if vanish:
        import orbax.checkpoint as ocp

        ocp.multihost.coordination_timeout = lambda: 20  # bounded, and short
        if jax.process_index() == 1:
            os._exit(0)  # as a process that crashed before its part
        args.mode = "fail"
    if args.mode == "fail-manager":  # step 0 of a CheckpointManager at DIR
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(directory, item_handlers=oeqx.EqxHandler())
        try:
            mngr.restore(0, args=oeqx.EqxRestore(skeleton, shardings=target))
        except Exception as e:
            print("ERROR " + json.dumps([type(e).__name__, str(e)]), flush=True)
            mngr.close()
            return
        raise SystemExit("the restore did not fail")
    if args.mode == "fail":
        try:
            oeqx.restore(directory, skeleton, shardings=target)
        except Exception as e:
            print("ERROR " + json.dumps([type(e).__name__, str(e)]), flush=True)
            if vanish:  # JAX's shutdown would wait for the vanished process
                os._exit(0)
            return
        raise SystemExit("the restore did not fail")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss, rchar = _status("VmRSS"), _rchar()
    window = 1 << 30 if args.mode == "staged" else None
    restored = oeqx.restore(
        directory, skeleton, shardings=target, max_staged_bytes=window
    )
    jax.block_until_ready(restored)
    read, peak = _rchar() - rchar, _status("VmHWM") - rss
    held = 0
    for i, name in enumerate(names):
        x = restored[name]
        assert x.sharding == target[name], (name, x.sharding)
        full = model_values(i, specs()[name][0])
        if name == "keys":
            assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            x = jax.random.key_data(x)  # on each shard's own device
        seen = set()
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            box = tuple((s.start, s.stop) for s in shard.index)
            if box not in seen:
                seen.add(box)
                held += shard.data.nbytes
    views, pairs = _views(directory, restored)
    print(
        "RESULT "
        + json.dumps(
            {
                "process": jax.process_index(),
                "read": read,
                "peak": peak,
                "held": held,
                "views": views,
                "pairs": pairs,
                "model": sum(4 * int(np.prod(s)) for s, _ in specs().values())
                + 4 * int(np.prod(KEYS)),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

"""How a target box is made of stored chunks, and when it needs no copy.

Restoring onto the saving mesh hands each chunk's bytes to its device as they
were read. Restoring onto fewer devices along the first dimension makes each
box of several whole chunks; a shard pack holds a process's chunks of a leaf
one after the other, so such a box is one run of the bytes read, and a view of
them is used too. Any other box (a column strip, a box cut out of a chunk
along a later axis) is assembled in a buffer of its own. On CPU a restored
shard is the buffer it was read into, so boxes that are views of one read
lie end to end in memory; copies do not. Saved and restored on 8 fake CPU
devices, in a subprocess, through `oeqx.save` and `oeqx.restore`.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx

    path = sys.argv[1]
    values = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    devices = np.array(jax.devices())
    eight = NamedSharding(Mesh(devices, ("x",)), P("x"))
    oeqx.save(path, {"w": jax.device_put(values, eight)})
    skeleton = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype)}
    four = Mesh(devices[:4], ("x",))
    two_d = Mesh(devices.reshape(4, 2), ("x", "y"))
    targets = {
        "saving-mesh": eight,
        "stacked-chunks": NamedSharding(four, P("x")),
        "one-device": NamedSharding(Mesh(devices[:1], ("x",)), P()),
        "columns": NamedSharding(four, P(None, "x")),
        "two-dimensional": NamedSharding(two_d, P("x", "y")),
    }
    out = {}
    for case, sharding in targets.items():
        w = oeqx.restore(path, skeleton, shardings=sharding)["w"]
        np.testing.assert_array_equal(np.asarray(w), values)
        shards = sorted(w.addressable_shards, key=lambda s: s.index[0].start or 0)
        distinct = {}
        for s in shards:  # one per box (none is replicated here)
            distinct.setdefault(str(s.index), s)
        shards = list(distinct.values())
        pointers = [s.data.unsafe_buffer_pointer() for s in shards]
        size = shards[0].data.nbytes
        out[case] = all(
            b - a == size for a, b in zip(pointers, pointers[1:])
        ) and len(shards) > 1
        for s in shards:
            np.testing.assert_array_equal(np.asarray(s.data), values[s.index])
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def views(tmp_path_factory) -> dict[str, bool]:
    path = tmp_path_factory.mktemp("geometry") / "ckpt"
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, viewed",
    [
        ("saving-mesh", True),  # each box is its chunk: views of one read
        ("stacked-chunks", True),  # two whole chunks end to end: one run
        ("columns", False),  # a column strip of every chunk: assembled
        ("two-dimensional", False),  # half of each row of two chunks
    ],
    ids=["saving-mesh", "stacked-chunks", "columns", "two-dimensional"],
)
def test_boxes_of_whole_chunks_in_order_are_views_of_the_bytes_read(
    views, case, viewed
):
    assert views[case] is viewed

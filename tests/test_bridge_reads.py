"""What a safetensors load reads, copies and holds, and a file replaced while
it is read (`_bridge.load.load`'s byte counts and progress hook).

Reaches inside because no public seam reports these: `load_safetensors`
returns the tree only, and nothing public can act between a load's header
reads and its tensor reads.
"""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_bridge_files as files
from safetensors.numpy import save_file

import orbax_eqx as oeqx
from orbax_eqx._bridge.load import load


def _values(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_reads_only_the_tensors_it_fills(tmp_path):
    tensors = {f"t{i}": _values((64, 64), i) for i in range(8)}
    save_file(tensors, tmp_path / "m.safetensors")
    skeleton = {"t3": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    loaded = load(tmp_path / "m.safetensors", skeleton, allow_unused=True)
    np.testing.assert_array_equal(loaded.tree["t3"], tensors["t3"])
    assert loaded.counts.read == 64 * 64 * 4  # that tensor's bytes, no more
    assert loaded.counts.copied == 0  # read straight into its buffer
    assert loaded.counts.held == 64 * 64 * 4


# --------------------------------------------------------------- layouts


LAYERS = 4


def _stacked(tmp_path, transposed=False):
    tensors = {
        f"h.{i}.w": _values((5, 6) if transposed else (6, 5), i) for i in range(LAYERS)
    }
    mapping = oeqx.StateDictMapping().stack("blocks", "h.{i}")
    if transposed:
        mapping = mapping.transpose("h.{i}.w")
    want = {"blocks.w": np.stack([t.T if transposed else t for t in tensors.values()])}
    return tensors, mapping, want


def _fused(tmp_path):
    # GPT-2's c_attn: Conv1D (in, 3 x out), transposed and split into q, k, v.
    tensors = {f"h.{i}.qkv": _values((6, 12), i) for i in range(LAYERS)}
    mapping = (
        oeqx.StateDictMapping()
        .stack("blocks", "h.{i}")
        .fuse([f"h.{{i}}.{x}" for x in "qkv"], "h.{i}.qkv", axis=0)
        .transpose("h.{i}.qkv")
    )
    t = list(tensors.values())
    want = {
        f"blocks.{x}": np.stack([v[:, 4 * j : 4 * j + 4].T for v in t])
        for j, x in enumerate("qkv")
    }
    return tensors, mapping, want


def _skeleton_of(want):
    tree: dict = {}
    for name, x in want.items():
        node = tree
        *path, last = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return tree


def _saved(tmp_path, tensors, per_file=3):
    names = list(tensors)
    for k in range(0, len(names), per_file):
        save_file(
            {n: tensors[n] for n in names[k : k + per_file]},
            tmp_path / f"f{k}.safetensors",
        )


@pytest.mark.parametrize(
    "make, direct",
    [
        (_stacked, True),
        (lambda p: _stacked(p, transposed=True), False),
        (_fused, False),
    ],
    ids=["stacked", "stacked-transposed", "fused-qkv"],
)
def test_layouts_read_each_tensor_once(tmp_path, make, direct):
    # Read in batches of about 1,000 bytes: a fused tensor that three leaves
    # need is still read once, and straight into place where no copy is needed.
    tensors, mapping, want = make(tmp_path)
    _saved(tmp_path, tensors)
    loaded = load(tmp_path, _skeleton_of(want), mapping=mapping, window=1000)
    got = {k: v for k, v in jax.tree_util.tree_leaves_with_path(loaded.tree)}
    for path, x in got.items():
        name = ".".join(k.key for k in path)
        np.testing.assert_array_equal(np.asarray(x), want[name])
    total = sum(v.nbytes for v in tensors.values())
    assert loaded.counts.read == total == loaded.counts.held
    assert loaded.counts.copied == (0 if direct else total)


_BOXES = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_eqx as oeqx
from orbax_eqx._bridge.load import load

devices = np.array(jax.devices())
rows = Mesh(devices, ("x",))
two = Mesh(devices[:2], ("x",))
four = Mesh(devices[:4], ("x",))
cases = {
    "replicated": NamedSharding(rows, P()),
    "layers": NamedSharding(four, P("x")),
    "rows": NamedSharding(rows, P(None, "x")),
    "columns": NamedSharding(two, P(None, None, "x")),
}
mapping = oeqx.StateDictMapping().stack("blocks", "h.{i}")
skeleton = {"blocks": {"w": jax.ShapeDtypeStruct((4, 8, 6), np.float32)}}
want = np.stack([np.load(f"{sys.argv[1]}/h{i}.npy") for i in range(4)])
out = {}
for case, sharding in cases.items():
    loaded = load(sys.argv[1], skeleton, mapping=mapping, shardings=sharding)
    w = loaded.tree["blocks"]["w"]
    np.testing.assert_array_equal(np.asarray(w), want)
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    out[case] = [loaded.counts.read, loaded.counts.copied, loaded.counts.held]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_box_reads_the_rows_that_hold_it(tmp_path):
    # What each device's box of a stacked leaf costs, on 8 devices: the bytes
    # read, and whether they go straight into the boxes' buffers.
    import subprocess
    import sys

    tensors = {f"h.{i}.w": _values((8, 6), i) for i in range(4)}
    _saved(tmp_path, tensors)
    for i, t in enumerate(tensors.values()):
        np.save(tmp_path / f"h{i}.npy", t)
    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": root,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }
    result = subprocess.run(
        [sys.executable, "-c", _BOXES, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.splitlines()[-1])
    total = 4 * 8 * 6 * 4
    assert counts["replicated"] == [total, 0, total]  # one box, read once
    assert counts["layers"] == [total, 0, total]  # a layer a device
    assert counts["rows"] == [total, 0, total]  # a row of every layer
    # Half the columns of every row: each box needs the rows from its first
    # to its last element, copied in; the two boxes' rows overlap, and are
    # read once.
    assert counts["columns"] == [total, total, total]


class _Replacing:
    """A progress bar that changes the file once the headers are read: at its
    start (`when` 0) or after the first bytes arrive (`when` 1), it runs
    `change(path)`."""

    def __init__(self, path, change, when=0):
        self.path, self.change, self.when = path, change, when

    def __call__(self, nbytes):
        if self.when == 0:
            self.change(self.path)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def advance(self, nbytes):
        self.when -= 1
        if self.when == 0:
            self.change(self.path)


def _longer(path):
    with open(path, "ab") as f:
        f.write(b"more")


def _swapped(path):
    """Puts a file of the same size in place, its two tensors swapped (as a
    re-download or re-export renamed into place would)."""
    tensors = {f"h.{i}.w": _values((4,), 1 - i) for i in range(2)}
    save_file(tensors, path + ".new")
    assert os.path.getsize(path + ".new") == os.path.getsize(path)
    os.replace(path + ".new", path)


_REPLACED = (
    r" \(its header was read from a \d+-byte file\); it was replaced while "
    r"being read\. Load it again\.$"
)


@pytest.mark.parametrize(
    "change, found",
    [
        (_longer, r"has \d+ bytes where \d+ were written"),
        (_swapped, "is not the version of the file its reads were planned from"),
    ],
    ids=["longer", "same-size"],
)
def test_file_replaced_after_its_header_was_read(tmp_path, change, found):
    tensors = {f"h.{i}.w": _values((4,), i) for i in range(2)}
    save_file(tensors, tmp_path / "m.safetensors")
    path = str(tmp_path / "m.safetensors")
    skeleton = {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32)}
    mapping = oeqx.StateDictMapping().stack("w", "h.{i}.w")
    with pytest.raises(oeqx.BridgeError, match=rf"^{path} {found}{_REPLACED}"):
        load(path, skeleton, mapping=mapping, progress=_Replacing(path, change))


def test_a_file_replaced_between_batches_mixes_nothing(tmp_path):
    # Batches of one tensor each: the second one opens the file again, and
    # finds another file there than the one whose header planned the load.
    tensors = {f"h.{i}.w": _values((4,), i) for i in range(2)}
    save_file(tensors, tmp_path / "m.safetensors")
    path = str(tmp_path / "m.safetensors")
    skeleton = {"a": jax.ShapeDtypeStruct((4,), jnp.float32)}
    skeleton["b"] = skeleton["a"]
    renames = {"a": "h.0.w", "b": "h.1.w"}
    progress = _Replacing(path, _swapped, when=1)
    with pytest.raises(oeqx.BridgeError, match=rf"^{path} is not the version"):
        load(path, skeleton, mapping=renames, window=16, progress=progress)


_PEAK = """
import json, sys
import jax, numpy as np
import orbax_eqx as oeqx
from orbax_eqx._bridge.load import load

mapping = (
    oeqx.StateDictMapping().stack("blocks", "h.{i}").transpose("h.{i}.conv.weight")
)
layers, n = 24, 512
skeleton = {"blocks": {
    "conv": {"weight": jax.ShapeDtypeStruct((layers, n, 2 * n), np.float32)},
    "lin": {"weight": jax.ShapeDtypeStruct((layers, n, n), np.float32)},
}}
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
loaded = load(sys.argv[1], skeleton, mapping=mapping, window=16 << 20)
jax.block_until_ready(loaded.tree)
print(json.dumps({"peak": status("VmHWM") - base, "held": loaded.counts.held,
                  "read": loaded.counts.read}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.slow
def test_peak_memory_is_the_share_plus_a_window(tmp_path):
    """144 MiB of per-layer tensors (two thirds transposed, copied in) load
    into stacked leaves with a peak RSS growth of at most 1.3x what is held."""
    import subprocess
    import sys

    layers, n = 24, 512
    rng = np.random.default_rng(0)
    for half in (0, 1):
        tensors = {}
        for i in range(half * layers // 2, (half + 1) * layers // 2):
            tensors[f"h.{i}.conv.weight"] = rng.standard_normal((2 * n, n), np.float32)
            tensors[f"h.{i}.lin.weight"] = rng.standard_normal((n, n), np.float32)
        save_file(tensors, tmp_path / f"part{half}.safetensors")
        del tensors
    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout.splitlines()[-1])
    assert r["held"] == r["read"] == layers * 3 * n * n * 4
    assert r["peak"] <= 1.3 * r["held"], r


def test_a_checked_fused_tensor_is_read_in_whole_blocks(tmp_path):
    # q, k and v fused into one exported tensor, its checksums of 4 KiB blocks:
    # each leaf reads its third, whole blocks, no more.
    tree = {x: _values((64, 256), i) for i, x in enumerate("qkv")}
    mapping = oeqx.StateDictMapping().fuse(["q", "k", "v"], "qkv", axis=0)
    oeqx.export_safetensors(tree, tmp_path / "hf", mapping=mapping)
    skeleton = {x: jax.ShapeDtypeStruct((64, 256), jnp.float32) for x in "qkv"}
    loaded = load(tmp_path / "hf", skeleton, mapping=mapping)
    for x in "qkv":
        np.testing.assert_array_equal(np.asarray(loaded.tree[x]), tree[x])
    assert loaded.counts.read == 3 * 64 * 256 * 4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.slow
def test_gpt2_and_llama_read_each_tensor_once(tmp_path, family):
    # Read once each, and nothing else: not the masks or the rotary buffers
    # the mapping ignores, nor GPT-2's head tied to the embedding.
    make_sd, make, mapping, reference = files._families()[family]
    sd = make_sd(0)
    source = files._write_hf(tmp_path / "hf", sd)
    skeleton = eqx.filter_eval_shape(make, jax.random.key(5))
    loaded = load(source, skeleton, mapping=mapping)
    np.testing.assert_allclose(
        np.asarray(loaded.tree(files.IDS)), reference(sd), rtol=1e-5, atol=1e-5
    )
    skipped = [n for n in sd if n.endswith((".attn.bias", "masked_bias", "inv_freq"))]
    skipped += ["lm_head.weight"] if family == "gpt2" else []
    wanted = sum(v.nbytes for n, v in sd.items() if n not in skipped)
    assert loaded.counts.read == wanted == loaded.nbytes

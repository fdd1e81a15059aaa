"""What a read plans and what it reads: the boxes of a mapping's plan, the
bytes a safetensors load reads, copies and holds, the groups an export
writes together, a restore's plan through `renames=`, and the blocks of a
plain Orbax array; and a file replaced while a load reads it.

Reaches inside: no public call reports a read's plan, its bytes, or acts mid-read.

`load_safetensors` returns the tree only, a plan and its pieces show
publicly only as whole arrays, and nothing public can act between a load's
header reads and its tensor reads (`_mapping.plan`, `_mapping.pieces`,
`_bridge.load.load`, `_bridge.export`, `_restore.select`, `_orbax.plain`).
"""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_bridge_files as files
import test_cli_plain as plain
import test_partial as partial
from safetensors.numpy import save_file

import orbax_eqx as oeqx
from integration_tests import _hand_plan as hp
from orbax_eqx._bridge import export as _export
from orbax_eqx._bridge.load import load
from orbax_eqx._format.sidecar import LeafMetadata
from orbax_eqx._mapping.pieces import shape, slices, to_leaf, to_tensor
from orbax_eqx._mapping.plan import leaf_specs, plan_export
from orbax_eqx._orbax.plain import StoreReader
from orbax_eqx._restore.select import select
from orbax_eqx._tree.walk import ARRAY, walk

M = oeqx.StateDictMapping


def _arange(*shape, dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


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


# --- a mapping's plan: any box, from the pieces alone


BOXES_3D = [
    ((0, 4), (0, 6), (0, 2)),  # whole
    ((1, 2), (0, 6), (0, 2)),  # one layer
    ((1, 3), (2, 5), (0, 1)),  # across layers, inside the fused axis
    ((0, 4), (3, 4), (1, 2)),  # one column of every layer
    ((2, 4), (0, 3), (0, 2)),
]


@pytest.mark.parametrize("box", BOXES_3D, ids=[str(b) for b in BOXES_3D])
def test_any_box_of_a_leaf_and_of_a_tensor(box):
    w = _arange(4, 6, 2)
    tree = {"blocks": {"qkv": w}}
    mapping = (
        M()
        .stack("blocks", "h.{i}")
        .transpose("h.{i}.qkv")
        .split("h.{i}.qkv", ["h.{i}.q", "h.{i}.kv"], axis=1, sizes=[2, 4])
        .split("h.{i}.kv", ["h.{i}.k", "h.{i}.v"], axis=1)
    )
    tensors = oeqx.to_state_dict(tree, mapping)
    plan = plan_export(mapping, leaf_specs(walk(tree)))
    # A leaf box from the tensors' boxes.
    out = np.full(shape(box), np.nan, np.float32)
    for p in plan.leaf_pieces("blocks.qkv", box):
        at = tuple(
            slice(a - s, b - s) for (a, b), (s, _) in zip(p.leaf_box, box, strict=True)
        )
        assert np.isnan(out[at]).all()  # covered once
        out[at] = to_leaf(p, tensors[p.tensor][slices(p.tensor_box)])
    np.testing.assert_array_equal(out, w[slices(box)])
    # Every box of every tensor from the leaf's boxes.
    for name, t in tensors.items():
        for tbox in [((0, t.shape[0]), (0, t.shape[1])), ((1, 2), (0, 1))]:
            got = np.full(shape(tbox), np.nan, np.float32)
            for p in plan.tensor_pieces(name, tbox):
                at = tuple(
                    slice(a - s, b - s)
                    for (a, b), (s, _) in zip(p.tensor_box, tbox, strict=True)
                )
                got[at] = to_tensor(p, w[slices(p.leaf_box)])
            np.testing.assert_array_equal(got, t[slices(tbox)])


def test_planning_is_per_tensor_not_per_element():
    """A 256-layer stack of large leaves plans in pieces: one per tensor."""
    specs = leaf_specs(
        walk({"blocks": {"w": jax.ShapeDtypeStruct((256, 4096, 4096), jnp.bfloat16)}})
    )
    plan = plan_export(M().stack("blocks", "h.{i}").transpose("h.{i}.w"), specs)
    assert len(plan.tensors) == 256
    assert len(plan.leaf_pieces("blocks.w")) == 256
    (piece,) = plan.tensor_pieces("h.7.w")
    assert piece.leaf_box == ((7, 8), (0, 4096), (0, 4096))


FUSE_BOXES = [
    ((0, 3), (0, 2), (0, 3)),
    ((1, 3), (1, 2), (0, 2)),
    ((2, 3), (0, 1), (2, 3)),
]


@pytest.mark.parametrize("box", FUSE_BOXES, ids=[str(b) for b in FUSE_BOXES])
def test_any_box_through_a_fuse(box):
    """Stacked q (L, 2, 3) and k (L, 1, 3), fused per layer and transposed:
    a box of q reads a strip of each layer's fused tensor; a box of a fused
    tensor reads boxes of both leaves."""
    q, k = _arange(3, 2, 3), _arange(3, 1, 3) + 100
    tree = {"blocks": {"q": q, "k": k}}
    mapping = (
        M()
        .stack("blocks", "h.{i}")
        .fuse(["h.{i}.q", "h.{i}.k"], "h.{i}.qk", axis=0)
        .transpose("h.{i}.qk")
    )
    tensors = oeqx.to_state_dict(tree, mapping)
    for i in range(3):
        np.testing.assert_array_equal(
            tensors[f"h.{i}.qk"], np.concatenate([q[i], k[i]]).T
        )
    plan = plan_export(mapping, leaf_specs(walk(tree)))
    out = np.full(shape(box), np.nan, np.float32)
    for p in plan.leaf_pieces("blocks.q", box):
        at = tuple(
            slice(a - s, b - s) for (a, b), (s, _) in zip(p.leaf_box, box, strict=True)
        )
        out[at] = to_leaf(p, tensors[p.tensor][slices(p.tensor_box)])
    np.testing.assert_array_equal(out, q[slices(box)])
    tbox = ((box[2][0], box[2][1]), (1, 3))  # rows of the fused tensor: q's 2nd, k
    got = np.full(shape(tbox), np.nan, np.float32)
    leaves = {"blocks.q": q, "blocks.k": k}
    for p in plan.tensor_pieces("h.1.qk", tbox):
        at = tuple(
            slice(a - s, b - s)
            for (a, b), (s, _) in zip(p.tensor_box, tbox, strict=True)
        )
        got[at] = to_tensor(p, leaves[p.leaf][slices(p.leaf_box)])
    np.testing.assert_array_equal(got, tensors["h.1.qk"][slices(tbox)])


class _Costs:
    def __init__(self, plan):
        self.plan = plan

    def cost(self, leaf):
        return int(np.prod(self.plan.leaves[leaf].shape)) * 4


def test_groups_keep_a_tensors_leaves_together_within_the_buffer():
    plan = hp.plan_of(
        hp.fused(["q", "k", "v"], 4, 8, 8, "h.{}.qkv"),  # 3 x 1 KiB, one group
        hp.stacked("mlp", 4, (8, 8), "h.{}.mlp"),  # 1 KiB
        hp.stacked("norm", 4, (8,), "h.{}.norm"),  # 128 bytes
    )
    groups = list(_export._groups(plan, _Costs(plan), buffer=2 * 1200))
    assert [g.leaves for g in groups] == [["q", "k", "v"], ["mlp", "norm"]]
    assert groups[0].tensors == [f"h.{i}.qkv" for i in range(4)]
    assert groups[1].tensors == [f"h.{i}.mlp" for i in range(4)] + [
        f"h.{i}.norm" for i in range(4)
    ]


# --- a restore's plan through `renames=`


def test_a_fused_leaf_is_planned_into_the_skeletons_parts(tmp_path):
    """The restore's entry point: for each skeleton leaf, its pieces over the
    checkpoint's leaves, planned from the sidecar alone."""

    old = partial.OldNet(partial.KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", old)
    saved = oeqx.metadata(tmp_path / "ckpt")
    skeleton = eqx.filter_eval_shape(partial.NewNet, partial.KEY_SKELETON)
    walked = walk(skeleton)
    selection = select(
        saved,
        walked,
        prefix=None,
        renames=partial.FUSED,
        renames_must_match=True,
        pieces=True,
    )
    assert selection.plan is not None
    arrays = {leaf.name for leaf in walked.leaves if leaf.kind == ARRAY}
    assert selection.planned == arrays
    stored = oeqx.restore(tmp_path / "ckpt")  # every leaf, flat, by its name
    for i in range(2):
        for k, p in enumerate("qkv"):
            (piece,) = selection.plan.leaf_pieces(f"layers.{i}.attn.{p}.weight")
            assert piece.tensor == f"blocks.{i}.attn.qkv.weight"
            assert piece.tensor_box == ((4 * k, 4 * k + 4), (0, 4))
            part = np.asarray(stored[piece.tensor])[slices(piece.tensor_box)]
            np.testing.assert_array_equal(
                to_leaf(piece, part),
                old.blocks[i]["attn"].qkv.weight[4 * k : 4 * k + 4],
            )
        (piece,) = selection.plan.leaf_pieces(f"layers.{i}.out.weight")
        assert piece.tensor == f"blocks.{i}.out.weight"
    assert selection.renamed["blocks.0.out.bias"] == "layers.0.out.bias"


def test_a_split_restore_is_checked_before_any_read(tmp_path):
    oeqx.save(tmp_path / "ckpt", partial.OldNet(partial.KEY_SAVE))
    skeleton = eqx.filter_eval_shape(partial.NewNet, partial.KEY_SKELETON)
    wrong = (
        oeqx.StateDictMapping()
        .rename("layers", "blocks")
        .fuse(
            [f"blocks.{{i}}.attn.{p}.weight" for p in "qk"],
            "blocks.{i}.attn.qkv.weight",
            axis=0,
        )
    )

    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)The skeleton does not match the checkpoint at .* through "
        r"`renames=` \(\d+ problems\):\n  - Tensor `blocks\.0\.attn\.qkv\.weight` "
        r"\(leaves `layers\.0\.attn\.q\.weight`, `layers\.0\.attn\.k\.weight`\) has "
        r"shape \(12, 4\) in the checkpoint, but the mapping makes \(8, 4\)",
    ):
        select(
            oeqx.metadata(tmp_path / "ckpt"),
            walk(skeleton),
            prefix=None,
            renames=wrong,
            renames_must_match=True,
            pieces=True,
        )


# --- plain Orbax arrays


def test_a_plain_orbax_array_is_read_a_block_of_whole_chunks_at_a_time(tmp_path):
    # 64 chunks of 8 x 16 float32 (512 bytes each): blocks of whole chunks.
    x = jax.random.normal(jax.random.key(3), (64, 128))
    tree = {"x": x, "i": jnp.arange(1000, dtype=jnp.int32)}
    save_args = {"x": ocp.SaveArgs(chunk_byte_size=4096), "i": ocp.SaveArgs()}
    item = plain.write("pytree", tmp_path / "ckpt", tree, save_args=save_args)
    record = LeafMetadata("x", "['x']", "array", (64, 128), "float32", key="x")
    blocks = list(StoreReader(item).blocks(record, 8192))
    assert len(blocks) > 1 and max(b.nbytes for b in blocks) <= 8192
    assert sum(b.size for b in blocks) == x.size

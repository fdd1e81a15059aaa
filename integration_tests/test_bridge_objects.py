"""safetensors from object stores (`gs://`, `s3://`), against the loopback
servers: a Hugging Face directory with its index, a single file, what is
read (only the tensors wanted), and the refusals: an index naming a file
outside its directory, a directory with neither an index nor a
`model.safetensors`, an object cut short after its header was read.
Exports read a checkpoint saved on the bucket.
"""

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors.numpy import save

import orbax_eqx as oeqx
from orbax_eqx._bridge.load import load
from orbax_eqx._bytes import route as _route

KEY = jax.random.key(0)


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    return request.getfixturevalue(f"{request.param}_bucket")


def _tensors(model):
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.weight"] = np.asarray(layer.weight)
        out[f"layers.{i}.bias"] = np.asarray(layer.bias)
    return out


def _put(url, data: bytes):
    _route.for_path(url).write_whole(url, data)


def _upload_hf(root, tensors):
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[:2], names[2:]]
    for half, f in zip(halves, files, strict=True):
        _put(f"{root}/{f}", save({n: tensors[n] for n in half}))
    weight_map = {n: f for half, f in zip(halves, files, strict=True) for n in half}
    _put(
        f"{root}/model.safetensors.index.json",
        json.dumps({"weight_map": weight_map}).encode(),
    )


def _skeleton():
    return eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 8, 1, key=jax.random.key(7))


def test_a_directory_with_its_index(bucket):
    model = eqx.nn.MLP(3, 2, 8, 1, key=KEY)
    tensors = _tensors(model)
    _upload_hf(f"{bucket}/hf", tensors)
    loaded = load(f"{bucket}/hf", _skeleton())
    for got, want in zip(loaded.tree.layers, model.layers, strict=True):
        np.testing.assert_array_equal(got.weight, want.weight)
        np.testing.assert_array_equal(got.bias, want.bias)
    assert loaded.files == [
        f"{bucket}/hf/model-00001-of-00002.safetensors",
        f"{bucket}/hf/model-00002-of-00002.safetensors",
    ]
    assert loaded.counts.read == sum(t.nbytes for t in tensors.values())


def test_a_single_file_reads_only_what_it_fills(bucket):
    tensors = {f"t{i}": np.full((256, 64), i, np.float32) for i in range(6)}
    _put(f"{bucket}/m.safetensors", save(tensors))
    skeleton = {"t4": jax.ShapeDtypeStruct((256, 64), np.float32)}
    loaded = load(f"{bucket}/m.safetensors", skeleton, allow_unused=True)
    np.testing.assert_array_equal(loaded.tree["t4"], tensors["t4"])
    assert loaded.counts.read == 256 * 64 * 4
    # A directory holding only model.safetensors needs no index.
    _put(f"{bucket}/one/model.safetensors", save(tensors))
    again = oeqx.load_safetensors(f"{bucket}/one", skeleton, allow_unused=True)
    np.testing.assert_array_equal(again["t4"], tensors["t4"])


def test_refusals(bucket):
    _put(
        f"{bucket}/evil/model.safetensors.index.json",
        json.dumps({"weight_map": {"w": "../secret.safetensors"}}).encode(),
    )
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{bucket}/evil/model\.safetensors\.index\.json names what an index "
        r"may not: `w` is in '\.\./secret\.safetensors', not a file beside the "
        r"index\.",
    ):
        oeqx.load_safetensors(f"{bucket}/evil", {})
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{bucket}/nothing holds neither model\.safetensors\.index\.json nor "
        r"model\.safetensors \(an object store is not listed for other files\)\. "
        r"Give the URL of a \.safetensors file, or a list of them\.$",
    ):
        oeqx.load_safetensors(f"{bucket}/nothing", {})
    data = save({"w": np.ones(1000, np.float32)})
    _put(f"{bucket}/cut.safetensors", data[:-10])
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{bucket}/cut\.safetensors is not a valid safetensors file: the "
        r"header describes \d+ bytes of file, but it ends before byte \d+\. ",
    ):
        oeqx.load_safetensors(f"{bucket}/cut.safetensors", {})


class _Replacing:
    """A progress bar that, once the headers are read, puts another object of
    the same size in place (its tensors swapped)."""

    def __init__(self, url):
        self.url = url

    def __call__(self, nbytes):
        _put(
            self.url, save({"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)})
        )
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def advance(self, nbytes):
        pass


def test_an_object_replaced_after_its_header_was_read(bucket):
    url = f"{bucket}/swap/model.safetensors"
    _put(url, save({"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}))
    skeleton = {"a": jax.ShapeDtypeStruct((4,), np.float32)}
    skeleton["b"] = skeleton["a"]
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{url} is not the version of the file its reads were planned "
        r"from \(its header was read from a \d+-byte file\); it was replaced "
        r"while being read\. Load it again\.$",
    ):
        load(url, skeleton, progress=_Replacing(url))


def test_export_of_a_checkpoint_on_the_bucket(bucket, tmp_path):
    model = eqx.nn.MLP(3, 2, 8, 1, key=KEY)
    oeqx.save(f"{bucket}/ckpt", model)
    result = oeqx.export_safetensors(f"{bucket}/ckpt", tmp_path / "hf")
    assert result.tensors == 4
    loaded = oeqx.load_safetensors(tmp_path / "hf", _skeleton())
    np.testing.assert_array_equal(loaded.layers[1].weight, model.layers[1].weight)

"""The recipes of docs/guides/from-pytorch.md, each run against the architecture.

For GPT-NeoX (Pythia), ViT and BERT: a small Equinox model (layers stacked
with `eqx.filter_vmap`, run with `jax.lax.scan`), random weights written with
`safetensors.numpy.save_file` under the names and shapes `save_pretrained`
gives them for that architecture, an independent numpy forward pass of the
published architecture that reads those tensors directly, and the guide's
mapping between the two (the guide shows the same text: a test checks). The
Equinox model loaded through the mapping must give the reference's logits;
exported, it must give back the published names, shapes and values. No
PyTorch, no `transformers`.

Also: a fuse of the right shapes in the wrong order loads without error and
gives other logits (NeoX through GPT-2's recipe); a bfloat16 skeleton from
`eqx.filter_eval_shape`; and a model loaded onto a mesh of 8 CPU devices
runs (in a subprocess: JAX takes its device count at start).
"""

import ast
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import orbax_eqx as oeqx

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "from-pytorch.md"
IDS = np.array([3, 7, 1, 0, 9, 4, 4, 2, 11, 5])
TOL = dict(rtol=1e-5, atol=1e-5)


# The mappings (shown as they are in docs/guides/from-pytorch.md) -------------


def neox_mapping(heads: int) -> oeqx.StateDictMapping:
    """GPT-NeoX's `query_key_value` holds q, k, v interleaved per head:
    `[q_h0, k_h0, v_h0, q_h1, ...]`. Split each of q, k, v by head, then fuse
    the heads in that order."""
    at = "gpt_neox.layers.{i}.attention."
    names = {"embed_in": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm"}
    mapping = oeqx.StateDictMapping().rename(names)
    mapping = mapping.stack("layers", "gpt_neox.layers.{i}")
    for kind in ("weight", "bias"):
        for p in "qkv":
            heads_of_p = [f"{at}{p}{h}.{kind}" for h in range(heads)]
            mapping = mapping.split(f"{at}{p}.{kind}", heads_of_p, axis=0)
        interleaved = [f"{at}{p}{h}.{kind}" for h in range(heads) for p in "qkv"]
        mapping = mapping.fuse(interleaved, f"{at}query_key_value.{kind}", axis=0)
    # Buffers older checkpoints hold: the causal mask and the rotary frequencies.
    return mapping.ignore([f"{at}bias", f"{at}masked_bias", f"{at}rotary_emb.inv_freq"])


VIT_MAPPING = (
    oeqx.StateDictMapping()
    .rename(
        {
            "embeddings": "vit.embeddings",
            "layers.norm1": "layers.layernorm_before",
            "layers.attn.query": "layers.attention.attention.query",
            "layers.attn.key": "layers.attention.attention.key",
            "layers.attn.value": "layers.attention.attention.value",
            "layers.attn.out": "layers.attention.output.dense",
            "layers.norm2": "layers.layernorm_after",
            "layers.fc1": "layers.intermediate.dense",
            "layers.fc2": "layers.output.dense",
            "norm": "vit.layernorm",
        }
    )
    .stack("layers", "vit.encoder.layer.{i}")
    # eqx.nn.Conv2d's bias is (D, 1, 1), PyTorch's (D,)
    .squeeze("vit.embeddings.patch_embeddings.projection.bias")
    # PyTorch keeps a batch axis (and a token axis) of 1 on these
    .reshape("vit.embeddings.cls_token", [1, 1, -1])
    .expand_dims("vit.embeddings.position_embeddings", 0)
)

BERT_MAPPING = (
    oeqx.StateDictMapping()
    .rename(
        {
            "embed.word": "bert.embeddings.word_embeddings",
            "embed.position": "bert.embeddings.position_embeddings",
            "embed.token_type": "bert.embeddings.token_type_embeddings",
            "embed.norm": "bert.embeddings.LayerNorm",
            "layers.attn.query": "layers.attention.self.query",
            "layers.attn.key": "layers.attention.self.key",
            "layers.attn.value": "layers.attention.self.value",
            "layers.attn.out": "layers.attention.output.dense",
            "layers.attn_norm": "layers.attention.output.LayerNorm",
            "layers.fc1": "layers.intermediate.dense",
            "layers.fc2": "layers.output.dense",
            "layers.out_norm": "layers.output.LayerNorm",
            "mlm.dense": "cls.predictions.transform.dense",
            "mlm.norm": "cls.predictions.transform.LayerNorm",
            "mlm.bias": "cls.predictions.bias",
        }
    )
    .stack("layers", "bert.encoder.layer.{i}")
    # The MLM decoder is the word embeddings (and its bias the head's):
    # `state_dict()` holds the copies, `save_pretrained` leaves them out.
    .tie("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")
    .tie("cls.predictions.decoder.bias", "cls.predictions.bias")
    .ignore("bert.embeddings.position_ids")  # a buffer older files hold
)


# Shared pieces ---------------------------------------------------------------


def _scan(stacked, x):
    """Runs stacked layers one after another."""
    dynamic, static = eqx.partition(stacked, eqx.is_array)

    def step(y, layer):
        return eqx.combine(layer, static)(y), None

    return jax.lax.scan(step, x, dynamic)[0]


def _heads_attention(q, k, v, heads, causal):
    """Multi-head attention in jax over (t, d) projections."""
    t, d = q.shape
    dh = d // heads
    q, k, v = (y.reshape(t, heads, dh) for y in (q, k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v)
    return out.reshape(t, d)


def _np_attention(q, k, v, heads, causal):
    """The same in numpy, over (t, heads, dh) arrays."""
    t, _, dh = q.shape
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
    if causal:
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v).reshape(t, heads * dh)


def _np_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _np_gelu(x):
    """GELU as PyTorch's `nn.GELU()` (erf, not tanh)."""
    return 0.5 * x * (1 + _erf(x / np.sqrt(2)))


def _normal(rng, *shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _linear(width_in, width_out, key, bias=True):
    return eqx.nn.Linear(width_in, width_out, use_bias=bias, key=key)


# GPT-NeoX (Pythia) -------------------------------------------------------------

NEOX = dict(vocab=64, width=16, heads=2, layers=2, hidden=64, rotary=4)


class NeoXAttention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    dense: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    rotary: int = eqx.field(static=True)  # leading dims of each head rotated

    def __init__(self, width, heads, rotary, key):
        kq, kk, kv, kd = jax.random.split(key, 4)
        self.q, self.k = _linear(width, width, kq), _linear(width, width, kk)
        self.v, self.dense = _linear(width, width, kv), _linear(width, width, kd)
        self.heads, self.rotary = heads, rotary

    def __call__(self, x):
        t, d = x.shape
        h, r = self.heads, self.rotary
        q, k, v = (
            jax.vmap(f)(x).reshape(t, h, d // h) for f in (self.q, self.k, self.v)
        )
        inv = 1.0 / 10000 ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r)
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
        cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None]
        sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None]

        def rope(y):  # on the first `r` dims of each head, as NeoX's `rotary_pct`
            rot, rest = y[..., :r], y[..., r:]
            half = jnp.concatenate([-rot[..., r // 2 :], rot[..., : r // 2]], -1)
            return jnp.concatenate([rot * cos + half * sin, rest], -1)

        out = _heads_attention(
            rope(q).reshape(t, d), rope(k).reshape(t, d), v.reshape(t, d), h, True
        )
        return jax.vmap(self.dense)(out)


class NeoXMLP(eqx.Module):
    dense_h_to_4h: eqx.nn.Linear
    dense_4h_to_h: eqx.nn.Linear

    def __init__(self, width, hidden, key):
        k1, k2 = jax.random.split(key)
        self.dense_h_to_4h = _linear(width, hidden, k1)
        self.dense_4h_to_h = _linear(hidden, width, k2)

    def __call__(self, x):
        up = jax.nn.gelu(jax.vmap(self.dense_h_to_4h)(x), approximate=False)
        return jax.vmap(self.dense_4h_to_h)(up)


class NeoXLayer(eqx.Module):
    input_layernorm: eqx.nn.LayerNorm
    post_attention_layernorm: eqx.nn.LayerNorm
    attention: NeoXAttention
    mlp: NeoXMLP

    def __init__(self, c, key):
        k1, k2 = jax.random.split(key)
        self.input_layernorm = eqx.nn.LayerNorm(c["width"], eps=1e-5)
        self.post_attention_layernorm = eqx.nn.LayerNorm(c["width"], eps=1e-5)
        self.attention = NeoXAttention(c["width"], c["heads"], c["rotary"], k1)
        self.mlp = NeoXMLP(c["width"], c["hidden"], k2)

    def __call__(self, x):  # Pythia's parallel residual
        a = self.attention(jax.vmap(self.input_layernorm)(x))
        return x + a + self.mlp(jax.vmap(self.post_attention_layernorm)(x))


class NeoX(eqx.Module):
    embed_in: eqx.nn.Embedding
    layers: NeoXLayer  # stacked
    final_norm: eqx.nn.LayerNorm
    embed_out: eqx.nn.Linear  # untied

    def __init__(self, c, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed_in = eqx.nn.Embedding(c["vocab"], c["width"], key=k1)
        keys = jax.random.split(k2, c["layers"])
        self.layers = eqx.filter_vmap(lambda k: NeoXLayer(c, k))(keys)
        self.final_norm = eqx.nn.LayerNorm(c["width"], eps=1e-5)
        self.embed_out = _linear(c["width"], c["vocab"], k3, bias=False)

    def __call__(self, ids):
        x = _scan(self.layers, jax.vmap(self.embed_in)(ids))
        return jax.vmap(self.embed_out)(jax.vmap(self.final_norm)(x))


def neox_files(c: dict, seed: int, buffers: bool = False) -> dict:
    """Random weights named and shaped as `GPTNeoXForCausalLM.save_pretrained`
    writes them; `buffers` adds those older checkpoints hold."""
    rng = np.random.default_rng(seed)
    d, hid = c["width"], c["hidden"]
    sd = {"gpt_neox.embed_in.weight": _normal(rng, c["vocab"], d)}
    for i in range(c["layers"]):
        p = f"gpt_neox.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[p + norm + ".weight"] = 1 + _normal(rng, d)
            sd[p + norm + ".bias"] = _normal(rng, d)
        sd[p + "attention.query_key_value.weight"] = _normal(rng, 3 * d, d)
        sd[p + "attention.query_key_value.bias"] = _normal(rng, 3 * d)
        sd[p + "attention.dense.weight"] = _normal(rng, d, d)
        sd[p + "attention.dense.bias"] = _normal(rng, d)
        sd[p + "mlp.dense_h_to_4h.weight"] = _normal(rng, hid, d)
        sd[p + "mlp.dense_h_to_4h.bias"] = _normal(rng, hid)
        sd[p + "mlp.dense_4h_to_h.weight"] = _normal(rng, d, hid)
        sd[p + "mlp.dense_4h_to_h.bias"] = _normal(rng, d)
        if buffers:
            t = 16
            sd[p + "attention.bias"] = np.tril(np.ones((t, t), bool))[None, None]
            sd[p + "attention.masked_bias"] = np.array(-1e9, np.float32)
            r = c["rotary"]
            inv = 1.0 / 10000 ** (np.arange(0, r, 2, dtype=np.float32) / r)
            sd[p + "attention.rotary_emb.inv_freq"] = inv.astype(np.float32)
    sd["gpt_neox.final_layer_norm.weight"] = 1 + _normal(rng, d)
    sd["gpt_neox.final_layer_norm.bias"] = _normal(rng, d)
    sd["embed_out.weight"] = _normal(rng, c["vocab"], d)
    return sd


def neox_reference(sd: dict, ids: np.ndarray, c: dict) -> np.ndarray:
    """GPT-NeoX's forward pass in numpy, from the tensors: `query_key_value`
    viewed as (heads, 3 * head_size), rotary embeddings on the first
    `rotary_ndims` of each head, the parallel residual."""
    t, h, r = len(ids), c["heads"], c["rotary"]
    x = sd["gpt_neox.embed_in.weight"][ids]
    d = x.shape[1]
    dh = d // h
    inv = 1.0 / 10000 ** (np.arange(0, r, 2, dtype=np.float32) / r)
    emb = np.concatenate([np.arange(t)[:, None] * inv[None]] * 2, -1)
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]

    def rotary(y):
        rot = y[..., :r]
        half = np.concatenate([-rot[..., r // 2 :], rot[..., : r // 2]], -1)
        return np.concatenate([rot * cos + half * sin, y[..., r:]], -1)

    for i in range(c["layers"]):
        w = {
            k[len(f"gpt_neox.layers.{i}.") :]: v
            for k, v in sd.items()
            if k.startswith(f"gpt_neox.layers.{i}.")
        }

        def norm(y, name, w=w):
            return _np_layer_norm(y, w[name + ".weight"], w[name + ".bias"], 1e-5)

        a = norm(x, "input_layernorm")
        qkv = a @ w["attention.query_key_value.weight"].T
        qkv = (qkv + w["attention.query_key_value.bias"]).reshape(t, h, 3 * dh)
        q, k, v = qkv[..., :dh], qkv[..., dh : 2 * dh], qkv[..., 2 * dh :]
        out = _np_attention(rotary(q), rotary(k), v, h, causal=True)
        attn = out @ w["attention.dense.weight"].T + w["attention.dense.bias"]
        m = norm(x, "post_attention_layernorm")
        m = m @ w["mlp.dense_h_to_4h.weight"].T + w["mlp.dense_h_to_4h.bias"]
        m = _np_gelu(m) @ w["mlp.dense_4h_to_h.weight"].T + w["mlp.dense_4h_to_h.bias"]
        x = x + attn + m
    x = _np_layer_norm(
        x,
        sd["gpt_neox.final_layer_norm.weight"],
        sd["gpt_neox.final_layer_norm.bias"],
        1e-5,
    )
    return x @ sd["embed_out.weight"].T


def _skeleton(cls, c):
    return eqx.filter_eval_shape(cls, c, jax.random.key(5))


@pytest.mark.parametrize("buffers", [False, True], ids=["files", "older-files"])
def test_neox_loads_and_runs_as_the_reference(tmp_path, buffers):
    sd = neox_files(NEOX, seed=0, buffers=buffers)
    save_file(sd, tmp_path / "model.safetensors")
    model = oeqx.load_safetensors(
        tmp_path / "model.safetensors",
        _skeleton(NeoX, NEOX),
        mapping=neox_mapping(NEOX["heads"]),
    )
    ours = np.asarray(model(IDS))
    assert ours.shape == (len(IDS), NEOX["vocab"])
    np.testing.assert_allclose(ours, neox_reference(sd, IDS, NEOX), **TOL)
    # Head 1's key is rows [3 * dh + dh, 3 * dh + 2 * dh) of the fused tensor.
    dh = NEOX["width"] // NEOX["heads"]
    fused = sd["gpt_neox.layers.1.attention.query_key_value.weight"]
    np.testing.assert_array_equal(
        model.layers.attention.k.weight[1, dh:], fused[4 * dh : 5 * dh]
    )


def test_neox_exports_the_published_names_shapes_and_values():
    sd = neox_files(NEOX, seed=1)
    mapping = neox_mapping(NEOX["heads"])
    model = oeqx.from_state_dict(_skeleton(NeoX, NEOX), sd, mapping)
    out = oeqx.to_state_dict(model, mapping)
    assert set(out) == set(sd)
    for name, value in sd.items():
        assert (out[name].shape, out[name].dtype) == (value.shape, value.dtype), name
        assert out[name].tobytes() == value.tobytes(), name


def test_neox_through_gpt2s_recipe_loads_and_is_wrong():
    """Fusing q, k and v whole (GPT-2's `c_attn`) has the right shapes: it
    loads without a word, and the logits are another model's."""
    at = "gpt_neox.layers.{i}.attention."
    gpt2_way = (
        oeqx.StateDictMapping()
        .rename(
            {"embed_in": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm"}
        )
        .stack("layers", "gpt_neox.layers.{i}")
    )
    for kind in ("weight", "bias"):
        parts = [f"{at}{p}.{kind}" for p in "qkv"]
        gpt2_way = gpt2_way.fuse(parts, f"{at}query_key_value.{kind}", axis=0)
    sd = neox_files(NEOX, seed=0)
    wrong = oeqx.from_state_dict(_skeleton(NeoX, NEOX), sd, gpt2_way)
    reference = neox_reference(sd, IDS, NEOX)
    assert np.abs(np.asarray(wrong(IDS)) - reference).max() > 0.05
    right = oeqx.from_state_dict(_skeleton(NeoX, NEOX), sd, neox_mapping(NEOX["heads"]))
    np.testing.assert_allclose(np.asarray(right(IDS)), reference, **TOL)


# ViT -------------------------------------------------------------------------

VIT = dict(
    image=8, patch=4, channels=3, width=16, heads=2, layers=2, hidden=64, labels=5
)


class ViTAttention(eqx.Module):
    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width, heads, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query, self.key = _linear(width, width, kq), _linear(width, width, kk)
        self.value, self.out = _linear(width, width, kv), _linear(width, width, ko)
        self.heads = heads

    def __call__(self, x):
        q, k, v = (jax.vmap(f)(x) for f in (self.query, self.key, self.value))
        return jax.vmap(self.out)(_heads_attention(q, k, v, self.heads, False))


class ViTLayer(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: ViTAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, c, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(c["width"], eps=1e-12)
        self.attn = ViTAttention(c["width"], c["heads"], k1)
        self.norm2 = eqx.nn.LayerNorm(c["width"], eps=1e-12)
        self.fc1 = _linear(c["width"], c["hidden"], k2)
        self.fc2 = _linear(c["hidden"], c["width"], k3)

    def __call__(self, x):  # pre-LN
        x = x + self.attn(jax.vmap(self.norm1)(x))
        up = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm2)(x)), approximate=False)
        return x + jax.vmap(self.fc2)(up)


class PatchEmbeddings(eqx.Module):
    projection: eqx.nn.Conv2d  # weight (D, C, P, P), bias (D, 1, 1)


class ViTEmbeddings(eqx.Module):
    cls_token: jax.Array  # (D,)
    position_embeddings: jax.Array  # (patches + 1, D)
    patch_embeddings: PatchEmbeddings


class ViT(eqx.Module):
    embeddings: ViTEmbeddings
    layers: ViTLayer  # stacked
    norm: eqx.nn.LayerNorm
    classifier: eqx.nn.Linear

    def __init__(self, c, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        p, d = c["patch"], c["width"]
        patches = (c["image"] // p) ** 2
        conv = eqx.nn.Conv2d(c["channels"], d, kernel_size=p, stride=p, key=k1)
        self.embeddings = ViTEmbeddings(
            jax.random.normal(k2, (d,)),
            jax.random.normal(k3, (patches + 1, d)),
            PatchEmbeddings(conv),
        )
        keys = jax.random.split(k4, c["layers"])
        self.layers = eqx.filter_vmap(lambda k: ViTLayer(c, k))(keys)
        self.norm = eqx.nn.LayerNorm(d, eps=1e-12)
        self.classifier = _linear(d, c["labels"], k5)

    def __call__(self, pixels):  # (C, H, W)
        e = self.embeddings
        patches = e.patch_embeddings.projection(pixels)  # (D, H/P, W/P)
        x = patches.reshape(patches.shape[0], -1).T
        x = jnp.concatenate([e.cls_token[None], x]) + e.position_embeddings
        x = jax.vmap(self.norm)(_scan(self.layers, x))
        return self.classifier(x[0])


def vit_files(c: dict, seed: int) -> dict:
    """Random weights named and shaped as `ViTForImageClassification
    .save_pretrained` writes them."""
    rng = np.random.default_rng(seed)
    d, p, hid = c["width"], c["patch"], c["hidden"]
    patches = (c["image"] // p) ** 2
    e = "vit.embeddings."
    sd = {
        e + "cls_token": _normal(rng, 1, 1, d),
        e + "position_embeddings": _normal(rng, 1, patches + 1, d),
        e + "patch_embeddings.projection.weight": _normal(rng, d, c["channels"], p, p),
        e + "patch_embeddings.projection.bias": _normal(rng, d),
    }
    for i in range(c["layers"]):
        q = f"vit.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            sd[q + f"attention.attention.{name}.weight"] = _normal(rng, d, d)
            sd[q + f"attention.attention.{name}.bias"] = _normal(rng, d)
        sd[q + "attention.output.dense.weight"] = _normal(rng, d, d)
        sd[q + "attention.output.dense.bias"] = _normal(rng, d)
        sd[q + "intermediate.dense.weight"] = _normal(rng, hid, d)
        sd[q + "intermediate.dense.bias"] = _normal(rng, hid)
        sd[q + "output.dense.weight"] = _normal(rng, d, hid)
        sd[q + "output.dense.bias"] = _normal(rng, d)
        for norm in ("layernorm_before", "layernorm_after"):
            sd[q + norm + ".weight"] = 1 + _normal(rng, d)
            sd[q + norm + ".bias"] = _normal(rng, d)
    sd["vit.layernorm.weight"] = 1 + _normal(rng, d)
    sd["vit.layernorm.bias"] = _normal(rng, d)
    sd["classifier.weight"] = _normal(rng, c["labels"], d)
    sd["classifier.bias"] = _normal(rng, c["labels"])
    return sd


def vit_reference(sd: dict, pixels: np.ndarray, c: dict) -> np.ndarray:
    """ViT's forward pass in numpy, from the tensors: a strided convolution as
    a matrix product over patches (row-major over the grid), the class token
    first, pre-LN blocks, the classifier on the class token."""
    e = "vit.embeddings."
    p, h = c["patch"], c["heads"]
    ch, size, _ = pixels.shape
    n = size // p
    grid = pixels.reshape(ch, n, p, n, p).transpose(1, 3, 0, 2, 4).reshape(n * n, -1)
    kernel = sd[e + "patch_embeddings.projection.weight"].reshape(-1, ch * p * p)
    x = grid @ kernel.T + sd[e + "patch_embeddings.projection.bias"]
    x = np.concatenate([sd[e + "cls_token"][0], x]) + sd[e + "position_embeddings"][0]
    t, d = x.shape
    for i in range(c["layers"]):
        w = {
            k[len(f"vit.encoder.layer.{i}.") :]: v
            for k, v in sd.items()
            if k.startswith(f"vit.encoder.layer.{i}.")
        }

        def dense(y, name, w=w):
            return y @ w[name + ".weight"].T + w[name + ".bias"]

        def norm(y, name, w=w):
            return _np_layer_norm(y, w[name + ".weight"], w[name + ".bias"], 1e-12)

        a = norm(x, "layernorm_before")
        q, k, v = (
            dense(a, f"attention.attention.{n}").reshape(t, h, d // h)
            for n in ("query", "key", "value")
        )
        x = x + dense(_np_attention(q, k, v, h, causal=False), "attention.output.dense")
        m = _np_gelu(dense(norm(x, "layernorm_after"), "intermediate.dense"))
        x = x + dense(m, "output.dense")
    x = _np_layer_norm(x, sd["vit.layernorm.weight"], sd["vit.layernorm.bias"], 1e-12)
    return x[0] @ sd["classifier.weight"].T + sd["classifier.bias"]


def _pixels(c):
    rng = np.random.default_rng(7)
    return rng.standard_normal((c["channels"], c["image"], c["image"])).astype("f4")


def test_vit_loads_and_runs_as_the_reference(tmp_path):
    sd = vit_files(VIT, seed=0)
    save_file(sd, tmp_path / "model.safetensors")
    model = oeqx.load_safetensors(
        tmp_path / "model.safetensors", _skeleton(ViT, VIT), mapping=VIT_MAPPING
    )
    pixels = _pixels(VIT)
    ours = np.asarray(model(pixels))
    assert ours.shape == (VIT["labels"],)
    np.testing.assert_allclose(ours, vit_reference(sd, pixels, VIT), **TOL)
    # The leading axes of 1 are gone, and the conv's bias has its own two.
    e = model.embeddings
    assert e.cls_token.shape == (VIT["width"],)
    assert e.position_embeddings.shape == ((VIT["image"] // VIT["patch"]) ** 2 + 1, 16)
    assert e.patch_embeddings.projection.bias.shape == (VIT["width"], 1, 1)


def test_vit_exports_the_published_names_shapes_and_values():
    sd = vit_files(VIT, seed=1)
    model = oeqx.from_state_dict(_skeleton(ViT, VIT), sd, VIT_MAPPING)
    out = oeqx.to_state_dict(model, VIT_MAPPING)
    assert set(out) == set(sd)
    for name, value in sd.items():
        assert (out[name].shape, out[name].dtype) == (value.shape, value.dtype), name
        assert out[name].tobytes() == value.tobytes(), name


def test_vit_without_the_reshape_rules_says_which():
    """What a user sees before adding the three rules: each shape named, with
    the rule that is missing."""
    bare = oeqx.StateDictMapping(VIT_MAPPING.rules[:2])
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.from_state_dict(_skeleton(ViT, VIT), vit_files(VIT, seed=0), bare)
    text = str(info.value)
    assert "(3 problems):" in text
    for name, found, made in [
        ("cls_token", r"(1, 1, 16)", r"(16,)"),
        ("position_embeddings", r"(1, 5, 16)", r"(5, 16)"),
        ("patch_embeddings.projection.bias", r"(16,)", r"(16, 1, 1)"),
    ]:
        assert (
            f"Tensor `vit.embeddings.{name}` (leaf `embeddings.{name}`) has shape "
            f"{found} in the tensors, but the mapping makes {made} of the skeleton "
            "(the same axes but for axes of length 1: a `squeeze` or `expand_dims` "
            "rule may be missing)." in text
        ), text
    assert (
        "If the layout holds the same values in another shape, add a `reshape`" in text
    )


# BERT ------------------------------------------------------------------------

BERT = dict(vocab=64, width=16, heads=2, layers=2, hidden=64, positions=16, types=2)


class BertEmbeddings(eqx.Module):
    word: eqx.nn.Embedding
    position: eqx.nn.Embedding
    token_type: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm


class BertLayer(eqx.Module):
    attn: ViTAttention  # query, key, value, out
    attn_norm: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    out_norm: eqx.nn.LayerNorm

    def __init__(self, c, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = ViTAttention(c["width"], c["heads"], k1)
        self.attn_norm = eqx.nn.LayerNorm(c["width"], eps=1e-12)
        self.fc1 = _linear(c["width"], c["hidden"], k2)
        self.fc2 = _linear(c["hidden"], c["width"], k3)
        self.out_norm = eqx.nn.LayerNorm(c["width"], eps=1e-12)

    def __call__(self, x):  # post-LN
        x = jax.vmap(self.attn_norm)(x + self.attn(x))
        up = jax.nn.gelu(jax.vmap(self.fc1)(x), approximate=False)
        return jax.vmap(self.out_norm)(x + jax.vmap(self.fc2)(up))


class MLMHead(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    bias: jax.Array  # the decoder's; its weight is the word embeddings


class Bert(eqx.Module):
    embed: BertEmbeddings
    layers: BertLayer  # stacked
    mlm: MLMHead

    def __init__(self, c, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        d = c["width"]
        self.embed = BertEmbeddings(
            eqx.nn.Embedding(c["vocab"], d, key=k1),
            eqx.nn.Embedding(c["positions"], d, key=k2),
            eqx.nn.Embedding(c["types"], d, key=k3),
            eqx.nn.LayerNorm(d, eps=1e-12),
        )
        keys = jax.random.split(k4, c["layers"])
        self.layers = eqx.filter_vmap(lambda k: BertLayer(c, k))(keys)
        self.mlm = MLMHead(
            _linear(d, d, k5), eqx.nn.LayerNorm(d, eps=1e-12), jnp.zeros(c["vocab"])
        )

    def __call__(self, ids, token_types):
        e = self.embed
        x = jax.vmap(e.word)(ids) + jax.vmap(e.position)(jnp.arange(len(ids)))
        x = jax.vmap(e.norm)(x + jax.vmap(e.token_type)(token_types))
        x = _scan(self.layers, x)
        h = jax.nn.gelu(jax.vmap(self.mlm.dense)(x), approximate=False)
        h = jax.vmap(self.mlm.norm)(h)
        return h @ e.word.weight.T + self.mlm.bias  # the tied decoder


def bert_files(c: dict, seed: int, state_dict: bool = False) -> dict:
    """Random weights named and shaped as `BertForMaskedLM.save_pretrained`
    writes them, which leaves out the decoder tied to the word embeddings;
    `state_dict` adds the copies `model.state_dict()` holds."""
    rng = np.random.default_rng(seed)
    d, hid = c["width"], c["hidden"]
    e = "bert.embeddings."
    sd = {
        e + "word_embeddings.weight": _normal(rng, c["vocab"], d),
        e + "position_embeddings.weight": _normal(rng, c["positions"], d),
        e + "token_type_embeddings.weight": _normal(rng, c["types"], d),
        e + "LayerNorm.weight": 1 + _normal(rng, d),
        e + "LayerNorm.bias": _normal(rng, d),
    }
    for i in range(c["layers"]):
        q = f"bert.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            sd[q + f"attention.self.{name}.weight"] = _normal(rng, d, d)
            sd[q + f"attention.self.{name}.bias"] = _normal(rng, d)
        sd[q + "attention.output.dense.weight"] = _normal(rng, d, d)
        sd[q + "attention.output.dense.bias"] = _normal(rng, d)
        sd[q + "attention.output.LayerNorm.weight"] = 1 + _normal(rng, d)
        sd[q + "attention.output.LayerNorm.bias"] = _normal(rng, d)
        sd[q + "intermediate.dense.weight"] = _normal(rng, hid, d)
        sd[q + "intermediate.dense.bias"] = _normal(rng, hid)
        sd[q + "output.dense.weight"] = _normal(rng, d, hid)
        sd[q + "output.dense.bias"] = _normal(rng, d)
        sd[q + "output.LayerNorm.weight"] = 1 + _normal(rng, d)
        sd[q + "output.LayerNorm.bias"] = _normal(rng, d)
    sd["cls.predictions.bias"] = _normal(rng, c["vocab"])
    sd["cls.predictions.transform.dense.weight"] = _normal(rng, d, d)
    sd["cls.predictions.transform.dense.bias"] = _normal(rng, d)
    sd["cls.predictions.transform.LayerNorm.weight"] = 1 + _normal(rng, d)
    sd["cls.predictions.transform.LayerNorm.bias"] = _normal(rng, d)
    if state_dict:
        sd["cls.predictions.decoder.weight"] = sd[e + "word_embeddings.weight"].copy()
        sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"].copy()
    return sd


def bert_reference(sd: dict, ids, token_types, c: dict) -> np.ndarray:
    """BertForMaskedLM's forward pass in numpy, from the tensors: the three
    embeddings summed and normed, post-LN blocks (norm after each residual),
    the prediction head decoding with the word embeddings."""
    e = "bert.embeddings."
    h = c["heads"]
    x = sd[e + "word_embeddings.weight"][ids]
    x = x + sd[e + "position_embeddings.weight"][np.arange(len(ids))]
    x = x + sd[e + "token_type_embeddings.weight"][token_types]
    x = _np_layer_norm(x, sd[e + "LayerNorm.weight"], sd[e + "LayerNorm.bias"], 1e-12)
    t, d = x.shape
    for i in range(c["layers"]):
        w = {
            k[len(f"bert.encoder.layer.{i}.") :]: v
            for k, v in sd.items()
            if k.startswith(f"bert.encoder.layer.{i}.")
        }

        def dense(y, name, w=w):
            return y @ w[name + ".weight"].T + w[name + ".bias"]

        def norm(y, name, w=w):
            return _np_layer_norm(y, w[name + ".weight"], w[name + ".bias"], 1e-12)

        q, k, v = (
            dense(x, f"attention.self.{n}").reshape(t, h, d // h)
            for n in ("query", "key", "value")
        )
        a = dense(_np_attention(q, k, v, h, causal=False), "attention.output.dense")
        x = norm(x + a, "attention.output.LayerNorm")
        m = dense(_np_gelu(dense(x, "intermediate.dense")), "output.dense")
        x = norm(x + m, "output.LayerNorm")
    p = "cls.predictions."
    m = _np_gelu(
        x @ sd[p + "transform.dense.weight"].T + sd[p + "transform.dense.bias"]
    )
    m = _np_layer_norm(
        m,
        sd[p + "transform.LayerNorm.weight"],
        sd[p + "transform.LayerNorm.bias"],
        1e-12,
    )
    return m @ sd[e + "word_embeddings.weight"].T + sd[p + "bias"]


TYPES = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 0])


@pytest.mark.parametrize("state_dict", [False, True], ids=["files", "state_dict"])
def test_bert_loads_and_runs_as_the_reference(tmp_path, state_dict):
    sd = bert_files(BERT, seed=0, state_dict=state_dict)
    save_file(sd, tmp_path / "model.safetensors")
    model = oeqx.load_safetensors(
        tmp_path / "model.safetensors", _skeleton(Bert, BERT), mapping=BERT_MAPPING
    )
    ours = np.asarray(model(IDS, TYPES))
    assert ours.shape == (len(IDS), BERT["vocab"])
    np.testing.assert_allclose(ours, bert_reference(sd, IDS, TYPES, BERT), **TOL)
    # ... and from memory, where the copies are compared with what they copy.
    again = oeqx.from_state_dict(_skeleton(Bert, BERT), sd, BERT_MAPPING)
    np.testing.assert_array_equal(np.asarray(again(IDS, TYPES)), ours)


def test_bert_untied_decoder_is_refused():
    sd = bert_files(BERT, seed=0, state_dict=True)
    sd["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"] + 1
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Tensor `cls\.predictions\.decoder\.weight` is tied to "
        r"`bert\.embeddings\.word_embeddings\.weight` by the mapping, but holds "
        r"other values\.",
    ):
        oeqx.from_state_dict(_skeleton(Bert, BERT), sd, BERT_MAPPING)


@pytest.mark.parametrize("copies", [False, True], ids=["files", "state_dict"])
def test_bert_exports_the_published_names_shapes_and_values(copies):
    sd = bert_files(BERT, seed=1, state_dict=copies)
    model = oeqx.from_state_dict(_skeleton(Bert, BERT), sd, BERT_MAPPING)
    mapping = BERT_MAPPING
    if copies:  # the ties, written too (`export=True`), as `state_dict()` has them
        kept = [r for r in BERT_MAPPING.rules if r.__class__.__name__ != "Tie"]
        mapping = oeqx.StateDictMapping(tuple(kept))
        mapping = mapping.tie(
            "cls.predictions.decoder.weight",
            "bert.embeddings.word_embeddings.weight",
            export=True,
        ).tie("cls.predictions.decoder.bias", "cls.predictions.bias", export=True)
    out = oeqx.to_state_dict(model, mapping)
    assert set(out) == set(sd)
    for name, value in sd.items():
        assert (out[name].shape, out[name].dtype) == (value.shape, value.dtype), name
        assert out[name].tobytes() == value.tobytes(), name
    if copies:  # each its own array
        word = out["bert.embeddings.word_embeddings.weight"]
        assert not np.shares_memory(out["cls.predictions.decoder.weight"], word)


# The guide's text --------------------------------------------------------------


@pytest.mark.parametrize("name", ["neox_mapping", "VIT_MAPPING", "BERT_MAPPING"])
def test_guide_shows_the_tested_mappings(name):
    """The guide's recipes are these mappings, to the character."""
    source = pathlib.Path(__file__).read_text()
    (node,) = [
        n
        for n in ast.parse(source).body
        if (isinstance(n, ast.FunctionDef) and n.name == name)
        or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)
    ]
    text = ast.get_source_segment(source, node)
    assert text is not None and text in GUIDE.read_text()


@pytest.mark.parametrize("name", ["neox_mapping", "VIT_MAPPING", "BERT_MAPPING"])
def test_mappings_round_trip_through_json(name):
    mapping = globals()[name]
    mapping = mapping(NEOX["heads"]) if callable(mapping) else mapping
    again = oeqx.StateDictMapping.from_json(mapping.to_json())
    assert again == mapping and again.to_json() == mapping.to_json()


# A bfloat16 skeleton -----------------------------------------------------------


def as_bfloat16(skeleton):
    """The guide's bfloat16 skeleton: every floating `jax.ShapeDtypeStruct` of a
    skeleton from `eqx.filter_eval_shape`, in bfloat16."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
            if isinstance(x, jax.ShapeDtypeStruct)
            and jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        skeleton,
    )


def test_a_bfloat16_skeleton_from_eval_shape(tmp_path):
    sd = neox_files(NEOX, seed=0)
    save_file(sd, tmp_path / "model.safetensors")
    skeleton = _skeleton(NeoX, NEOX)
    # The pitfall: `eqx.is_array` is False on a jax.ShapeDtypeStruct, so this
    # changes nothing, silently.
    unchanged = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) if eqx.is_array(x) else x,
        skeleton,
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(unchanged))
    half = as_bfloat16(skeleton)
    model = oeqx.load_safetensors(
        tmp_path / "model.safetensors",
        half,
        mapping=neox_mapping(NEOX["heads"]),
        cast=True,
    )
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert arrays and all(x.dtype == jnp.bfloat16 for x in arrays)
    np.testing.assert_array_equal(
        model.embed_out.weight, sd["embed_out.weight"].astype(jnp.bfloat16)
    )
    assert "as_bfloat16" in GUIDE.read_text()


# A mesh that a loaded model runs on --------------------------------------------

_MESH_SCRIPT = """
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import orbax_eqx as oeqx
import test_bridge_recipes as r

assert len(jax.devices()) == 8
sd = r.neox_files(r.NEOX, seed=0)
# Auto axes: JAX places what the model computes (as the guide's meshes do).
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

def where(name, leaf):
    if leaf.ndim == 3 and name.endswith("weight"):  # stacked (L, out, in)
        return NamedSharding(mesh, P(None, "model", None))
    if name == "embed_in.weight":
        return NamedSharding(mesh, P("data", "model"))
    return NamedSharding(mesh, P())

skeleton = eqx.filter_eval_shape(r.NeoX, r.NEOX, jax.random.key(5))
model = oeqx.from_state_dict(skeleton, sd, r.neox_mapping(2), shardings=where)
assert model.embed_in.weight.sharding.spec == P("data", "model")
logits = eqx.filter_jit(lambda m, ids: m(ids))(model, jnp.asarray(r.IDS))
np.testing.assert_allclose(np.asarray(logits), r.neox_reference(sd, r.IDS, r.NEOX),
                           rtol=1e-5, atol=1e-5)
print("ran on", len(logits.sharding.device_set), "devices")
"""


def test_a_model_loaded_onto_a_mesh_runs(tmp_path):
    """On 8 fake CPU devices (in a process of their own, killed if it hangs),
    a model loaded onto a mesh of Auto axes runs, and gives the reference's
    logits."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_MESH_SCRIPT)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)  # JAX swallows SIGTERM
        out, _ = proc.communicate()
        pytest.fail(f"the mesh run hung:\n{out}")
    assert proc.returncode == 0, out
    assert "ran on " in out

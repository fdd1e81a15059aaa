"""Two real layouts for the state_dict bridge: GPT-2 and a LLaMA-style decoder.

For each family: a small scanned Equinox model (layers stacked with
`eqx.filter_vmap`, run with `jax.lax.scan`), random weights under the exact
tensor names and shapes Hugging Face `transformers` publishes, an independent
numpy forward pass of the published architecture that reads those tensors
directly, and the mapping between the two. The mappings are written once,
here; `docs/guides/from-pytorch.md` shows the same text (a test checks).

GPT-2's Equinox side keeps q, k and v apart (the mapping fuses them into
`c_attn` and transposes for `Conv1D`); the LLaMA side fuses q, k, v into one
projection (the mapping splits it, with grouped-query sizes). No PyTorch.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import orbax_eqx as oeqx

# The mappings (shown as they are in docs/guides/from-pytorch.md).

GPT2_MAPPING = (
    oeqx.StateDictMapping()
    .field_keys()  # attn.proj -> attn.c_proj, mlp.fc -> mlp.c_fc, ...
    .stack("blocks", "h.{i}")
    .fuse(
        ["h.{i}.attn.q.weight", "h.{i}.attn.k.weight", "h.{i}.attn.v.weight"],
        "h.{i}.attn.c_attn.weight",
        axis=0,
    )
    .fuse(
        ["h.{i}.attn.q.bias", "h.{i}.attn.k.bias", "h.{i}.attn.v.bias"],
        "h.{i}.attn.c_attn.bias",
        axis=0,
    )
    .transpose("h.{i}.*.c_*.weight")  # Conv1D holds (in, out)
    .ignore(["h.{i}.attn.bias", "h.{i}.attn.masked_bias"])  # causal masks
    .tie("lm_head.weight", "wte.weight")
)

LLAMA_MAPPING = (
    oeqx.StateDictMapping()
    .rename(
        {
            "embed": "model.embed_tokens",
            "layers.attn_norm": "layers.input_layernorm",
            "layers.attn": "layers.self_attn",
            "layers.attn.o": "layers.self_attn.o_proj",
            "layers.mlp_norm": "layers.post_attention_layernorm",
            "layers.mlp.gate": "layers.mlp.gate_proj",
            "layers.mlp.up": "layers.mlp.up_proj",
            "layers.mlp.down": "layers.mlp.down_proj",
            "norm": "model.norm",
            "head": "lm_head",
        }
    )
    .stack("layers", "model.layers.{i}")
    .split(
        "model.layers.{i}.self_attn.qkv.weight",
        [
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        axis=0,
        sizes=[32, 16, 16],  # 4 query heads, 2 key/value heads, of 8
    )
    .ignore("model.layers.{i}.self_attn.rotary_emb.inv_freq")
)


# GPT-2 ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab: int = 50
    positions: int = 16
    width: int = 16
    heads: int = 4
    layers: int = 3


class GPT2Attention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    proj: eqx.nn.Linear = eqx.field(metadata={"state_dict_key": "c_proj"})
    heads: int = eqx.field(static=True)

    def __init__(self, width, heads, *, key):
        kq, kk, kv, kp = jax.random.split(key, 4)
        self.q = eqx.nn.Linear(width, width, key=kq)
        self.k = eqx.nn.Linear(width, width, key=kk)
        self.v = eqx.nn.Linear(width, width, key=kv)
        self.proj = eqx.nn.Linear(width, width, key=kp)
        self.heads = heads

    def __call__(self, x):
        t, d = x.shape
        h = self.heads

        def split(y):
            return y.reshape(t, h, d // h).transpose(1, 0, 2)

        q, k, v = (split(jax.vmap(f)(x)) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        out = jax.nn.softmax(scores, axis=-1) @ v
        return jax.vmap(self.proj)(out.transpose(1, 0, 2).reshape(t, d))


class GPT2MLP(eqx.Module):
    fc: eqx.nn.Linear = eqx.field(metadata={"state_dict_key": "c_fc"})
    proj: eqx.nn.Linear = eqx.field(metadata={"state_dict_key": "c_proj"})

    def __init__(self, width, *, key):
        k1, k2 = jax.random.split(key)
        self.fc = eqx.nn.Linear(width, 4 * width, key=k1)
        self.proj = eqx.nn.Linear(4 * width, width, key=k2)

    def __call__(self, x):
        return jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(x), approximate=True))


class GPT2Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    attn: GPT2Attention
    ln_2: eqx.nn.LayerNorm
    mlp: GPT2MLP

    def __init__(self, config, *, key):
        k1, k2 = jax.random.split(key)
        self.ln_1 = eqx.nn.LayerNorm(config.width, eps=1e-5)
        self.attn = GPT2Attention(config.width, config.heads, key=k1)
        self.ln_2 = eqx.nn.LayerNorm(config.width, eps=1e-5)
        self.mlp = GPT2MLP(config.width, key=k2)

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.ln_1)(x))
        return x + self.mlp(jax.vmap(self.ln_2)(x))


class GPT2(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    blocks: GPT2Block  # stacked: every leaf has the layers first
    ln_f: eqx.nn.LayerNorm

    def __init__(self, config, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.wte = eqx.nn.Embedding(config.vocab, config.width, key=k1)
        self.wpe = eqx.nn.Embedding(config.positions, config.width, key=k2)
        keys = jax.random.split(k3, config.layers)
        self.blocks = eqx.filter_vmap(lambda k: GPT2Block(config, key=k))(keys)
        self.ln_f = eqx.nn.LayerNorm(config.width, eps=1e-5)

    def __call__(self, ids):
        x = jax.vmap(self.wte)(ids) + jax.vmap(self.wpe)(jnp.arange(ids.shape[0]))
        x = _scan(self.blocks, x)
        return jax.vmap(self.ln_f)(x) @ self.wte.weight.T  # the tied head


def gpt2_state_dict(config: GPT2Config, seed: int, *, head=False, masks=False):
    """Random weights as `GPT2Model.state_dict()` names and shapes them (Conv1D
    weights (in, out)); `head` adds GPT2LMHeadModel's tied `lm_head.weight`,
    `masks` the causal-mask buffers older checkpoints hold."""
    rng = np.random.default_rng(seed)
    d, p = config.width, config.positions

    def normal(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    sd = {"wte.weight": normal(config.vocab, d), "wpe.weight": normal(p, d)}
    for i in range(config.layers):
        h = f"h.{i}."
        sd[h + "ln_1.weight"] = 1 + normal(d)
        sd[h + "ln_1.bias"] = normal(d)
        sd[h + "attn.c_attn.weight"] = normal(d, 3 * d)
        sd[h + "attn.c_attn.bias"] = normal(3 * d)
        sd[h + "attn.c_proj.weight"] = normal(d, d)
        sd[h + "attn.c_proj.bias"] = normal(d)
        sd[h + "ln_2.weight"] = 1 + normal(d)
        sd[h + "ln_2.bias"] = normal(d)
        sd[h + "mlp.c_fc.weight"] = normal(d, 4 * d)
        sd[h + "mlp.c_fc.bias"] = normal(4 * d)
        sd[h + "mlp.c_proj.weight"] = normal(4 * d, d)
        sd[h + "mlp.c_proj.bias"] = normal(d)
        if masks:
            sd[h + "attn.bias"] = np.tril(np.ones((p, p), np.float32))[None, None]
            sd[h + "attn.masked_bias"] = np.array(-1e4, np.float32)
    sd["ln_f.weight"] = 1 + normal(d)
    sd["ln_f.bias"] = normal(d)
    if head:
        sd["lm_head.weight"] = sd["wte.weight"].copy()
    return sd


def gpt2_reference(sd: dict, ids: np.ndarray, heads: int) -> np.ndarray:
    """GPT-2's forward pass (logits), in numpy, straight from the tensors."""
    t = len(ids)
    x = sd["wte.weight"][ids] + sd["wpe.weight"][np.arange(t)]
    layers = sum(1 for k in sd if k.endswith(".ln_1.weight"))
    for i in range(layers):
        w = {k[len(f"h.{i}.") :]: v for k, v in sd.items() if k.startswith(f"h.{i}.")}
        a = _layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], 1e-5)
        qkv = a @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]  # Conv1D
        q, k, v = np.split(qkv, 3, axis=-1)
        out = _attention(q, k, v, heads, heads)
        x = x + out @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
        m = _layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], 1e-5)
        m = _gelu_new(m @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"])
        x = x + m @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
    x = _layer_norm(x, sd["ln_f.weight"], sd["ln_f.bias"], 1e-5)
    return x @ sd.get("lm_head.weight", sd["wte.weight"]).T


# LLaMA ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    width: int = 32
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 48
    layers: int = 2
    theta: float = 10000.0
    eps: float = 1e-6


class LlamaAttention(eqx.Module):
    qkv: eqx.nn.Linear  # q, k and v fused: (heads + 2 kv_heads) * head_dim rows
    o: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)

    def __init__(self, c: LlamaConfig, *, key):
        k1, k2 = jax.random.split(key)
        dh = c.width // c.heads
        rows = (c.heads + 2 * c.kv_heads) * dh
        self.qkv = eqx.nn.Linear(c.width, rows, use_bias=False, key=k1)
        self.o = eqx.nn.Linear(c.heads * dh, c.width, use_bias=False, key=k2)
        self.heads, self.kv_heads, self.theta = c.heads, c.kv_heads, c.theta

    def __call__(self, x):
        t, d = x.shape
        h, kvh = self.heads, self.kv_heads
        dh = d // h
        qkv = jax.vmap(self.qkv)(x)
        q = qkv[:, : h * dh].reshape(t, h, dh)
        k = qkv[:, h * dh : (h + kvh) * dh].reshape(t, kvh, dh)
        v = qkv[:, (h + kvh) * dh :].reshape(t, kvh, dh)
        inv = 1.0 / (self.theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
        cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None]
        sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None]

        def rope(y):
            half = jnp.concatenate([-y[..., dh // 2 :], y[..., : dh // 2]], -1)
            return y * cos + half * sin

        q, k = rope(q), rope(k)
        k = jnp.repeat(k, h // kvh, axis=1)
        v = jnp.repeat(v, h // kvh, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v)
        return jax.vmap(self.o)(out.reshape(t, h * dh))


class LlamaMLP(eqx.Module):
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, c: LlamaConfig, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(c.width, c.hidden, use_bias=False, key=k1)
        self.up = eqx.nn.Linear(c.width, c.hidden, use_bias=False, key=k2)
        self.down = eqx.nn.Linear(c.hidden, c.width, use_bias=False, key=k3)

    def __call__(self, x):
        g = jax.nn.silu(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x)
        return jax.vmap(self.down)(g)


class LlamaBlock(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    attn: LlamaAttention
    mlp_norm: eqx.nn.RMSNorm
    mlp: LlamaMLP

    def __init__(self, c: LlamaConfig, *, key):
        k1, k2 = jax.random.split(key)
        self.attn_norm = eqx.nn.RMSNorm(c.width, eps=c.eps, use_bias=False)
        self.attn = LlamaAttention(c, key=k1)
        self.mlp_norm = eqx.nn.RMSNorm(c.width, eps=c.eps, use_bias=False)
        self.mlp = LlamaMLP(c, key=k2)

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.attn_norm)(x))
        return x + self.mlp(jax.vmap(self.mlp_norm)(x))


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: LlamaBlock  # stacked
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear  # untied

    def __init__(self, c: LlamaConfig, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(c.vocab, c.width, key=k1)
        keys = jax.random.split(k2, c.layers)
        self.layers = eqx.filter_vmap(lambda k: LlamaBlock(c, key=k))(keys)
        self.norm = eqx.nn.RMSNorm(c.width, eps=c.eps, use_bias=False)
        self.head = eqx.nn.Linear(c.width, c.vocab, use_bias=False, key=k3)

    def __call__(self, ids):
        x = _scan(self.layers, jax.vmap(self.embed)(ids))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def llama_state_dict(c: LlamaConfig, seed: int, *, inv_freq=False):
    """Random weights as `LlamaForCausalLM.state_dict()` names and shapes them
    (`nn.Linear` weights (out, in)); `inv_freq` adds the rotary buffers older
    checkpoints hold."""
    rng = np.random.default_rng(seed)
    dh = c.width // c.heads

    def normal(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    sd = {"model.embed_tokens.weight": normal(c.vocab, c.width)}
    for i in range(c.layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(c.heads * dh, c.width)
        sd[p + "self_attn.k_proj.weight"] = normal(c.kv_heads * dh, c.width)
        sd[p + "self_attn.v_proj.weight"] = normal(c.kv_heads * dh, c.width)
        sd[p + "self_attn.o_proj.weight"] = normal(c.width, c.heads * dh)
        sd[p + "mlp.gate_proj.weight"] = normal(c.hidden, c.width)
        sd[p + "mlp.up_proj.weight"] = normal(c.hidden, c.width)
        sd[p + "mlp.down_proj.weight"] = normal(c.width, c.hidden)
        sd[p + "input_layernorm.weight"] = 1 + normal(c.width)
        sd[p + "post_attention_layernorm.weight"] = 1 + normal(c.width)
        if inv_freq:
            inv = 1.0 / (c.theta ** (np.arange(0, dh, 2, dtype=np.float32) / dh))
            sd[p + "self_attn.rotary_emb.inv_freq"] = inv.astype(np.float32)
    sd["model.norm.weight"] = 1 + normal(c.width)
    sd["lm_head.weight"] = normal(c.vocab, c.width)
    return sd


def llama_reference(sd: dict, ids: np.ndarray, c: LlamaConfig) -> np.ndarray:
    """A LLaMA decoder's forward pass (logits), in numpy, straight from the
    tensors: RMSNorm, rotary embeddings as `rotate_half`, grouped-query
    attention (`repeat_kv`), a SiLU-gated MLP."""
    t = len(ids)
    x = sd["model.embed_tokens.weight"][ids]
    dh = c.width // c.heads
    inv = 1.0 / (c.theta ** (np.arange(0, dh, 2, dtype=np.float32) / dh))
    freqs = np.arange(t, dtype=np.float32)[:, None] * inv[None]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rotate_half(y):
        return np.concatenate([-y[..., dh // 2 :], y[..., : dh // 2]], -1)

    layers = sum(1 for k in sd if k.endswith(".input_layernorm.weight"))
    for i in range(layers):
        p = f"model.layers.{i}."
        a = _rms_norm(x, sd[p + "input_layernorm.weight"], c.eps)
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).reshape(t, -1, dh)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T).reshape(t, -1, dh)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).reshape(t, -1, dh)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        out = _attention(
            q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), q.shape[1], k.shape[1]
        )
        x = x + out @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms_norm(x, sd[p + "post_attention_layernorm.weight"], c.eps)
        gate = m @ sd[p + "mlp.gate_proj.weight"].T
        up = m @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, sd["model.norm.weight"], c.eps)
    return x @ sd["lm_head.weight"].T


# Shared pieces -------------------------------------------------------------


def _scan(stacked, x):
    """Runs stacked layers one after another."""
    dynamic, static = eqx.partition(stacked, eqx.is_array)

    def step(y, layer):
        return eqx.combine(layer, static)(y), None

    return jax.lax.scan(step, x, dynamic)[0]


def _layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _rms_norm(x, weight, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def _gelu_new(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _attention(q, k, v, heads, kv_heads):
    """Causal multi-head attention over (t, heads * dh) inputs; each key/value
    head serves `heads // kv_heads` query heads in a row (`repeat_kv`)."""
    t = q.shape[0]
    dh = q.shape[1] // heads
    q = q.reshape(t, heads, dh).transpose(1, 0, 2)
    k = k.reshape(t, kv_heads, dh).transpose(1, 0, 2).repeat(heads // kv_heads, 0)
    v = v.reshape(t, kv_heads, dh).transpose(1, 0, 2).repeat(heads // kv_heads, 0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(t, heads * dh)

"""The state_dict bridge on two real layouts, GPT-2 and LLaMA, end to end.

Weights made in Hugging Face's layout (exact published names and shapes) are
loaded into a small scanned Equinox model through the family's mapping; the
model's forward pass must equal an independent numpy forward pass of the
published architecture fed the same tensors. Exporting gives back exactly
the published names, shapes and values.
"""

import ast
import pathlib
import re

import bridge_models as bm
import equinox as eqx
import jax
import numpy as np
import pytest

import orbax_eqx as oeqx

ROOT = pathlib.Path(__file__).resolve().parent.parent
IDS = np.array([3, 7, 1, 0, 9, 4, 4, 2, 11, 5])


def _gpt2_names(config: bm.GPT2Config) -> set[str]:
    per_layer = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]
    names = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    return names | {f"h.{i}.{n}" for i in range(config.layers) for n in per_layer}


@pytest.mark.parametrize(
    "head, masks", [(False, False), (True, True)], ids=["GPT2Model", "LMHead+masks"]
)
@pytest.mark.slow
def test_gpt2_loads_and_runs_as_the_reference(head, masks):
    config = bm.GPT2Config()
    sd = bm.gpt2_state_dict(config, seed=0, head=head, masks=masks)
    skeleton = eqx.filter_eval_shape(bm.GPT2, config, key=jax.random.key(5))
    model = oeqx.from_state_dict(skeleton, sd, bm.GPT2_MAPPING)
    ours = np.asarray(model(IDS))
    reference = bm.gpt2_reference(sd, IDS, config.heads)
    assert ours.shape == (len(IDS), config.vocab)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    # The Conv1D weight, fused and transposed, landed in q, k and v rows.
    d = config.width
    c_attn = sd["h.2.attn.c_attn.weight"]
    np.testing.assert_array_equal(model.blocks.attn.k.weight[2], c_attn[:, d : 2 * d].T)


def test_gpt2_exports_the_published_names_shapes_and_values():
    config = bm.GPT2Config()
    sd = bm.gpt2_state_dict(config, seed=1)
    skeleton = eqx.filter_eval_shape(bm.GPT2, config, key=jax.random.key(5))
    model = oeqx.from_state_dict(skeleton, sd, bm.GPT2_MAPPING)
    out = oeqx.to_state_dict(model, bm.GPT2_MAPPING)
    assert set(out) == _gpt2_names(config)
    for name, value in sd.items():
        assert out[name].shape == value.shape, name
        assert out[name].dtype == value.dtype, name
        assert out[name].tobytes() == value.tobytes(), name  # bitwise
    # ... and back again, bitwise, into a differently initialised model.
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), model)
    again = oeqx.from_state_dict(zeros, out, bm.GPT2_MAPPING)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow
def test_gpt2_model_exports_what_the_reference_runs():
    """The other way: an Equinox-initialised model, exported, runs the same in
    the numpy reference."""
    config = bm.GPT2Config()
    model = bm.GPT2(config, key=jax.random.key(3))
    sd = oeqx.to_state_dict(model, bm.GPT2_MAPPING)
    np.testing.assert_allclose(
        np.asarray(model(IDS)),
        bm.gpt2_reference(sd, IDS, config.heads),
        rtol=1e-5,
        atol=1e-5,
    )


def test_gpt2_untied_head_is_refused():
    config = bm.GPT2Config()
    sd = bm.gpt2_state_dict(config, seed=0, head=True)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    skeleton = eqx.filter_eval_shape(bm.GPT2, config, key=jax.random.key(5))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"(?s)Tensor `lm_head.weight` is tied to `wte.weight` by the mapping, "
        r"but holds other values\..*untied head",
    ):
        oeqx.from_state_dict(skeleton, sd, bm.GPT2_MAPPING)


def test_gpt2_export_with_the_tied_head():
    """`export=True` writes the tied copy, as `GPT2LMHeadModel.state_dict()`
    holds it."""
    config = bm.GPT2Config()
    model = bm.GPT2(config, key=jax.random.key(3))
    mapping = bm.GPT2_MAPPING.tie("lm_head.weight", "wte.weight", export=True)
    # The same tie twice would be one rule too many: build it from the rules.
    mapping = oeqx.StateDictMapping(mapping.rules[:-2] + mapping.rules[-1:])
    out = oeqx.to_state_dict(model, mapping)
    assert set(out) == _gpt2_names(config) | {"lm_head.weight"}
    assert out["lm_head.weight"].tobytes() == out["wte.weight"].tobytes()
    assert oeqx.from_state_dict(model, out, mapping) is not None


@pytest.mark.parametrize("inv_freq", [False, True], ids=["plain", "inv_freq"])
@pytest.mark.slow
def test_llama_loads_and_runs_as_the_reference(inv_freq):
    config = bm.LlamaConfig()
    sd = bm.llama_state_dict(config, seed=0, inv_freq=inv_freq)
    skeleton = eqx.filter_eval_shape(bm.Llama, config, key=jax.random.key(5))
    model = oeqx.from_state_dict(skeleton, sd, bm.LLAMA_MAPPING)
    ours = np.asarray(model(IDS))
    np.testing.assert_allclose(
        ours, bm.llama_reference(sd, IDS, config), rtol=1e-5, atol=1e-5
    )
    # Grouped-query attention: k is 16 rows after q's 32.
    np.testing.assert_array_equal(
        model.layers.attn.qkv.weight[1, 32:48],
        sd["model.layers.1.self_attn.k_proj.weight"],
    )


def test_llama_exports_the_published_names_shapes_and_values():
    config = bm.LlamaConfig()
    sd = bm.llama_state_dict(config, seed=2)
    skeleton = eqx.filter_eval_shape(bm.Llama, config, key=jax.random.key(5))
    model = oeqx.from_state_dict(skeleton, sd, bm.LLAMA_MAPPING)
    out = oeqx.to_state_dict(model, bm.LLAMA_MAPPING)
    assert list(out) == sorted(sd, key=_natural)
    for name, value in sd.items():
        assert out[name].shape == value.shape, name
        assert out[name].tobytes() == value.tobytes(), name


def test_llama_bfloat16_export_and_load():
    """A `cast` rule writes bf16 tensors; loading them back into the f32 model
    needs no `cast=True` (the mapping says so), and rounds as bf16 does."""
    config = bm.LlamaConfig()
    skeleton = eqx.filter_eval_shape(bm.Llama, config, key=jax.random.key(5))
    sd = bm.llama_state_dict(config, seed=4)
    model = oeqx.from_state_dict(skeleton, sd, bm.LLAMA_MAPPING)
    mapping = bm.LLAMA_MAPPING.cast("**", "bfloat16")
    out = oeqx.to_state_dict(model, mapping)
    assert {str(v.dtype) for v in out.values()} == {"bfloat16"}
    back = oeqx.from_state_dict(model, out, mapping)
    np.testing.assert_array_equal(
        back.head.weight, np.asarray(model.head.weight).astype("bfloat16").astype("f4")
    )


@pytest.mark.parametrize("name", ["GPT2_MAPPING", "LLAMA_MAPPING"])
def test_mappings_round_trip_through_json(name):
    mapping = getattr(bm, name)
    data = mapping.to_json()
    import json

    again = oeqx.StateDictMapping.from_json(json.dumps(data))
    assert again == mapping
    assert again.to_json() == data


@pytest.mark.parametrize("name", ["GPT2_MAPPING", "LLAMA_MAPPING"])
def test_guide_shows_the_tested_mappings(name):
    """The guide's examples are these mappings, to the character."""
    source = (ROOT / "tests" / "bridge_models.py").read_text()
    tree = ast.parse(source)
    (node,) = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and n.targets[0].id == name  # type: ignore[attr-defined]
    ]
    text = ast.get_source_segment(source, node)
    assert (
        text is not None and text in (ROOT / "docs/guides/from-pytorch.md").read_text()
    )


def _natural(name):
    """Digit runs as numbers (`h.2` before `h.10`): the order of an export."""
    parts: list = re.split(r"(\d+)", name)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)

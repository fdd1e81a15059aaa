"""GPT-2 and LLaMA through safetensors files, end to end, with their mappings.

Files in Hugging Face's layout (exact published names and shapes, sharded
over files with an index, written by the `safetensors` library) are loaded
with `oeqx.load_safetensors` into small scanned Equinox models
(`bridge_models.py`); the forward pass equals an independent numpy forward
pass of the published architecture fed the same tensors. `export_safetensors`
writes back exactly the published names, shapes and values, from the model
in memory or from its checkpoint, and the files load again (the bytes such
a load reads: `tests/test_read_plans.py`).
"""

import json
import pathlib
import re

import bridge_models as bm
import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import orbax_eqx as oeqx

IDS = np.array([3, 7, 1, 0, 9, 4, 4, 2, 11, 5])


def _write_hf(directory, sd, files=2):
    """`sd` as Hugging Face's `save_pretrained` lays it out: files in order
    of the names, and `model.safetensors.index.json`."""
    directory.mkdir()
    names = list(sd)
    per = -(-len(names) // files)
    weight_map = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = names[k * per : (k + 1) * per]
        save_file({n: sd[n] for n in part}, directory / file, {"format": "pt"})
        weight_map |= {n: file for n in part}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def _read(out):
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def _families():
    gpt2 = bm.GPT2Config()
    llama = bm.LlamaConfig()
    return {
        "gpt2": (
            lambda seed: bm.gpt2_state_dict(gpt2, seed, head=True, masks=True),
            lambda key: bm.GPT2(gpt2, key=key),
            bm.GPT2_MAPPING,
            lambda sd: bm.gpt2_reference(sd, IDS, gpt2.heads),
        ),
        "llama": (
            lambda seed: bm.llama_state_dict(llama, seed, inv_freq=True),
            lambda key: bm.Llama(llama, key=key),
            bm.LLAMA_MAPPING,
            lambda sd: bm.llama_reference(sd, IDS, llama),
        ),
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.slow
def test_loads_from_files_and_runs_as_the_reference(tmp_path, family):
    make_sd, make, mapping, reference = _families()[family]
    sd = make_sd(0)
    source = _write_hf(tmp_path / "hf", sd)
    skeleton = eqx.filter_eval_shape(make, jax.random.key(5))
    loaded = oeqx.load_safetensors(source, skeleton, mapping=mapping)
    np.testing.assert_allclose(
        np.asarray(loaded(IDS)), reference(sd), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_exports_the_published_layout_from_memory_and_checkpoints(tmp_path, family):
    make_sd, make, mapping, _ = _families()[family]
    sd = make_sd(1)
    skeleton = eqx.filter_eval_shape(make, jax.random.key(5))
    model = oeqx.from_state_dict(skeleton, sd, mapping)
    published = oeqx.to_state_dict(model, mapping)
    oeqx.export_safetensors(model, tmp_path / "mem", mapping=mapping)
    oeqx.save(tmp_path / "ckpt", model)
    result = oeqx.export_safetensors(
        tmp_path / "ckpt",
        tmp_path / "ckpt-hf",
        mapping=mapping.resolve(skeleton),  # field keys, without the model
        max_shard_size=3000,
    )
    assert len(result.files) > 2  # sharded, with an index
    for out in (tmp_path / "mem", tmp_path / "ckpt-hf"):
        got = _read(out)
        assert list(got) == sorted(got)  # each file in name order, files too
        assert set(got) == set(published)
        for name, value in published.items():
            assert got[name].shape == value.shape, name
            assert got[name].tobytes() == value.tobytes(), name
        again = oeqx.load_safetensors(out, skeleton, mapping=mapping)
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_mapping_that_does_not_fit_is_reported_before_any_read(tmp_path):
    config = bm.GPT2Config()
    sd = bm.gpt2_state_dict(config, 0)
    source = _write_hf(tmp_path / "hf", sd)
    deeper = eqx.filter_eval_shape(
        bm.GPT2, bm.GPT2Config(layers=config.layers + 1), key=jax.random.key(5)
    )
    with pytest.raises(oeqx.BridgeError) as raised:
        oeqx.load_safetensors(source, deeper, mapping=bm.GPT2_MAPPING)
    assert isinstance(raised.value, oeqx.BridgeError)  # caught either way
    assert "Layer 3 is missing from the tensors" in str(raised.value)


@pytest.mark.slow
def test_export_of_a_checkpoint_needs_field_keys_resolved(tmp_path):
    config = bm.GPT2Config()
    model = bm.GPT2(config, key=jax.random.key(0))
    oeqx.save(tmp_path / "ckpt", model)
    with pytest.raises(
        oeqx.BridgeError,
        match=r'(?s)rule 0 `\{"op": "field_keys", "key": "state_dict_key"\}` '
        r"reads field metadata from a tree, but the mapping was applied to names "
        r"only\.\nResolve the "
        r"mapping against the model first: `mapping\.resolve\(model_or_skeleton\)` "
        r"turns field keys into renames\.",
    ):
        oeqx.export_safetensors(
            tmp_path / "ckpt", tmp_path / "hf", mapping=bm.GPT2_MAPPING
        )
    assert not (tmp_path / "hf").exists()


def test_the_command_line_exports_and_imports_through_a_mapping(tmp_path, capsys):
    from entry import main

    tests = str(pathlib.Path(__file__).resolve().parent)
    (tmp_path / "models.py").write_text(
        f"import sys\nsys.path.insert(0, {tests!r})\n"
        "import bridge_models as bm, equinox as eqx, jax\n"
        "def skeleton():\n"
        "    return eqx.filter_eval_shape(bm.GPT2, bm.GPT2Config(), "
        "key=jax.random.key(3))\n"
        "def deeper():\n"
        "    return eqx.filter_eval_shape(bm.GPT2, bm.GPT2Config(layers=4), "
        "key=jax.random.key(3))\n"
    )
    mapping = tmp_path / "gpt2.json"
    mapping.write_text(json.dumps(bm.GPT2_MAPPING.to_json()))
    model = bm.GPT2(bm.GPT2Config(), key=jax.random.key(0))
    oeqx.save(tmp_path / "ckpt", model)
    skeleton = f"{tmp_path / 'models.py'}:skeleton"
    hf = tmp_path / "hf"
    argv = ["export", str(tmp_path / "ckpt"), str(hf), "--mapping", str(mapping)]
    assert main([*argv, "--skeleton", skeleton]) == 0
    assert capsys.readouterr().out.startswith("Exported 40 tensors")
    assert set(_read(hf)) == set(oeqx.to_state_dict(model, bm.GPT2_MAPPING))
    back = tmp_path / "back"
    argv = ["import", str(hf), str(back), "--skeleton", skeleton]
    assert main([*argv, "--mapping", str(mapping)]) == 0
    again = oeqx.restore(back, eqx.filter_eval_shape(lambda: model))
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # A mapping's problems, one a line, then the fix; --rename and --mapping
    # exclude.
    deeper = f"{tmp_path / 'models.py'}:deeper"
    argv = ["import", str(hf), str(tmp_path / "x"), "--skeleton", deeper]
    assert main([*argv, "--mapping", str(mapping)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"orbax_eqx: error: The tensors do not fit the skeleton through the mapping "
        r"\(1 problem\):\n  - Layer 3 is missing from the tensors: none of its 12 "
        r"tensors is there \(.*\)\.\nBuild the skeleton of the model the tensors "
        r"hold .*\n",
        err,
    ), err
    with pytest.raises(SystemExit):
        main([*argv, "--mapping", str(mapping), "--rename", str(mapping)])
    assert "not allowed with argument --mapping" in capsys.readouterr().err

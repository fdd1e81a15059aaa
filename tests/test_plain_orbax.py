"""Plain Orbax checkpoints of Equinox models restore into skeletons.

`StandardCheckpointer`/`PyTreeCheckpointer` of `eqx.filter(model,
eqx.is_array)`, alone or as a `CheckpointManager` step saved with
`StandardSave`/`PyTreeSave`: arrays by key path, the rest from the skeleton,
every difference reported at once as for an orbax_eqx checkpoint.
"""

import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zoo

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)

CHECKPOINTERS = {
    "standard": ocp.StandardCheckpointer,
    "pytree": ocp.PyTreeCheckpointer,
}
SAVE_ARGS = {"standard": ocp.args.StandardSave, "pytree": ocp.args.PyTreeSave}


def _params(model):
    return eqx.filter(model, eqx.is_array)


@pytest.mark.parametrize("make", CHECKPOINTERS.values(), ids=CHECKPOINTERS.keys())
@pytest.mark.parametrize(
    "model_fn",
    [zoo.mlp, zoo.transformer_block, zoo.vmap_stacked],
    ids=["mlp", "transformer_block", "vmap_stacked"],
)
def test_checkpointer_into_skeleton(tmp_path, make, model_fn):
    model = model_fn(KEY_SAVE)
    with make() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", _params(model))
    skeleton = eqx.filter_eval_shape(model_fn, KEY_SKELETON)
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    zoo.assert_same(restored, model)


@pytest.mark.parametrize("kind", SAVE_ARGS, ids=SAVE_ARGS.keys())
def test_manager_step_into_skeleton(tmp_path, kind):
    model = zoo.transformer_block(KEY_SAVE)
    item = {"model": _params(model), "step": 7}
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(7, args=SAVE_ARGS[kind](item))
        mngr.wait_until_finished()
    skeleton = {"model": eqx.filter_eval_shape(zoo.transformer_block, KEY_SKELETON)}
    skeleton["step"] = 0
    with ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler()) as mngr:
        restored = mngr.restore(7, args=oeqx.EqxRestore(skeleton))
    zoo.assert_same(restored["model"], model)
    assert restored["step"] == 7 and type(restored["step"]) is int
    # The step directory, standalone.
    again = oeqx.restore(tmp_path / "7", skeleton)
    zoo.assert_same(again["model"], model)


def test_shardings_and_cast(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", _params(model))
    skeleton = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    half = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        skeleton,
    )
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = oeqx.restore(tmp_path / "ckpt", half, cast=True, shardings=device)
    assert restored.layers[0].weight.dtype == jnp.bfloat16
    assert restored.layers[0].weight.sharding == device
    np.testing.assert_array_equal(
        restored.layers[0].weight, model.layers[0].weight.astype(jnp.bfloat16)
    )


def test_every_difference_at_once(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", _params(model))
    wider = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 16, 2, key=KEY_SKELETON)
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", wider)
    text = str(info.value)
    assert text.startswith(
        f"The skeleton does not match the checkpoint at {tmp_path / 'ckpt'} "
        "(5 differences):\n"
        "  - Leaf `layers.0.weight` has shape (16, 3) in the skeleton but (8, 3) "
        "in the checkpoint.\n"
    )
    assert "`ocp.PyTreeCheckpointHandler().metadata(path)` lists the saved" in text
    assert "orbax_eqx inspect" not in text


def test_missing_unexpected_and_dtype(tmp_path):
    item = {"w": jnp.ones((2, 3)), "extra": jnp.zeros(4), "b": jnp.ones(2)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", item)
    skeleton = {
        "w": jax.ShapeDtypeStruct((2, 3), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.bfloat16),
        "new": jax.ShapeDtypeStruct((1,), jnp.float32),
    }
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)\(3 differences\):\n"
        r"  - Leaf `b` has dtype bfloat16 in the skeleton but float32 in the "
        r"checkpoint\.\n"
        r"  - Leaf `new` is in the skeleton but not in the checkpoint\.\n"
        r"  - Leaf `extra` is in the checkpoint but not "
        r"in the skeleton\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    # strict=False leaves `extra` unread; cast=True casts `b`.
    del skeleton["new"]
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, strict=False, cast=True)
    assert set(restored) == {"w", "b"} and restored["b"].dtype == jnp.bfloat16


def test_needs_a_skeleton(tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    # What it lacks for these is a sidecar: our errors, which are ValueErrors.
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"is a plain Orbax checkpoint \(no orbax_eqx sidecar\): it holds "
        r"arrays only, with no classes or static fields, so it restores into a "
        r"skeleton only\. Pass the skeleton of the model",
    ):
        oeqx.restore(tmp_path / "ckpt")
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"not with prefix='w'\.$"):
        oeqx.restore(tmp_path / "ckpt", {"w": jnp.ones(2)}, prefix="w")
    with pytest.raises(oeqx.RebuildError, match=r"not with allow=\['equinox'\]\.$"):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox"])


@pytest.mark.parametrize(
    "text",
    ["{garbage", "[1, 2]", '{"tree_metadata": 3}', ""],
    ids=["not-json", "a-list", "odd-shape", "empty"],
)
def test_an_orbax_metadata_file_it_cannot_read_is_damage(tmp_path, text):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    (tmp_path / "ckpt" / "_METADATA").write_text(text)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"{tmp_path / 'ckpt' / '_METADATA'}, Orbax's record of the arrays "
        r"of this plain Orbax checkpoint, cannot be read \(\w+: .*\): the "
        r"checkpoint is damaged \(or something else was put in its place\)\. "
        r"Restore an earlier step\.",
    ):
        oeqx.restore(tmp_path / "ckpt", {"w": jnp.zeros(2)})


_FIFO_CHILD = """
import json, sys
import jax.numpy as jnp
import orbax_eqx as oeqx
try:
    oeqx.restore(sys.argv[1], {"w": jnp.zeros(2)})
    print(json.dumps({"type": None}))
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "message": str(e)}))
"""


@pytest.mark.slow
def test_a_fifo_in_a_plain_checkpoint_is_refused_not_read(tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    (tmp_path / "ckpt" / "_METADATA").unlink()
    os.mkfifo(tmp_path / "ckpt" / "_METADATA")  # a read of it would never end
    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    result = subprocess.run(  # killed (SIGKILL) if it blocks past the limit
        [sys.executable, "-c", _FIFO_CHILD, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
    )
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["type"] == "CheckpointDamagedError", result.stderr
    assert "_METADATA" in found["message"] and "FIFO" in found["message"]


def test_metadata_and_inspect_say_what_it_is(tmp_path, capsys):
    from entry import main as cli_main

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    message = (
        rf"{tmp_path / 'ckpt'} is a plain Orbax checkpoint \(saved by Orbax's own "
        r"handlers, with no orbax_eqx sidecar\): it holds arrays only\. "
        r"`oeqx\.restore\(path, skeleton\)` restores it into a skeleton"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.metadata(tmp_path / "ckpt")
    # The command line shows what it holds, from Orbax's own metadata
    # (tests/test_cli_plain.py has the rest).
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Plain Orbax checkpoint {tmp_path / 'ckpt'}\n")
    assert "  w     float32  (2,)     8 B  single device (cpu:0)\n" in out

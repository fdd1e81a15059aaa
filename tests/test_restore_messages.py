"""Restore messages say what happened and offer only fixes that work.

Every fix a mismatch message offers is followed here, and the restore then
succeeds; a fix that could not help is not offered.
"""

import re
import runpy
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zoo
from entry import main

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


# ------------------------------------------------- fixes offered, and followed


def test_shapes_and_static_fields_differ_offers_only_a_new_skeleton(tmp_path, capsys):
    saved = zoo.Block(KEY_SAVE, dim=8)
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, dim=16)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `norm\.weight` has shape \(16,\) in the skeleton but "
        r"\(8,\) in the checkpoint\..*Static field `query_size` of module `attn` "
        r"is 16 in the skeleton but 8 in the checkpoint\..*\nIf you changed "
        r"hyperparameters, rebuild the skeleton with the saved ones \(see `python "
        r"-m orbax_eqx inspect .*ckpt`\)\.$",
    ) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton)
    # `on_static_mismatch="warn"` cannot make different shapes fit: not offered.
    assert "on_static_mismatch" not in str(info.value)
    # The advice: inspect shows the saved hyperparameters; rebuilt with them,
    # the skeleton restores.
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "query_size=8" in capsys.readouterr().out
    skeleton = eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, dim=8)
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), saved)


def test_static_field_alone_offers_the_warning_and_it_works(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.Block(KEY_SAVE, num_heads=2))
    skeleton = eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, num_heads=4)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)If you changed hyperparameters, rebuild.*\nTo restore into the "
        r"skeleton as it is \(the same class under another module name, a "
        r"deliberate change of a static field or callable\), pass "
        r'`EqxRestore\(\.\.\., on_static_mismatch="warn"\)`',
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    with pytest.warns(oeqx.StaticMismatchWarning, match="restoring anyway"):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    assert restored.num_heads == 4


def test_warn_policy_does_not_claim_to_restore_when_shapes_differ(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.Block(KEY_SAVE, dim=8))
    skeleton = eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, dim=16)
    # No "restoring anyway" warning: nothing is restored, and the error says why.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(oeqx.CheckpointMismatchError, match=r"has shape \(16,\)"):
            oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    assert not [w for w in caught if w.category is oeqx.StaticMismatchWarning]


def test_dtype_difference_offers_cast_and_it_works(tmp_path):
    saved = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON),
    )
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)has dtype bfloat16 in the skeleton but float32 in the checkpoint"
        r".*\nTo cast arrays to the skeleton's dtypes, pass "
        r"`EqxRestore\(\.\.\., cast=True\)`\.$",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, cast=True)
    assert restored.layers[0].weight.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        restored.layers[0].weight.astype(jnp.float32),
        saved.layers[0].weight,
        rtol=1e-2,
    )


def test_kind_difference_says_which_kind_and_it_works(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"step": 3, "w": jnp.ones(2), "lr": 0.5})
    skeleton = {"step": jax.ShapeDtypeStruct((), jnp.int32), "w": 1.0, "lr": 1}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `lr` is a Python int in the skeleton but a Python "
        r"float in the checkpoint\..*Leaf `step` is array int32\[\] in the "
        r"skeleton but int 3 in the checkpoint\..*Leaf `w` is float 1\.0 in "
        r"the skeleton but array float32\[2\] in the checkpoint\..*\nGive each such "
        r"skeleton leaf the kind the checkpoint holds there: a Python value of the "
        r"saved type for a Python value \(any value: the saved one is restored\), "
        r"an array of the saved shape and dtype for an array",
    ) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton)
    assert "hyperparameters" not in str(info.value)
    skeleton = {"step": 0, "w": jax.ShapeDtypeStruct((2,), jnp.float32), "lr": 0.0}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert restored["step"] == 3 and restored["lr"] == 0.5


def test_key_type_difference_offers_the_saved_key_type_and_it_works(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"k": jax.random.key(7, impl="rbg")})
    skeleton = {"k": jax.eval_shape(lambda: jax.random.key(0))}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)has dtype key<fry> in the skeleton but key<rbg> in the "
        r"checkpoint\..*\nPRNG keys are never cast: build those skeleton leaves "
        r"with the saved key type, e\.g\. `jax\.random\.key\(0, impl=\"rbg\"\)`",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, cast=True)
    skeleton = {"k": jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    zoo.assert_same(restored, {"k": jax.random.key(7, impl="rbg")})


def test_filtered_skeleton_advice_works(tmp_path):
    saved = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", saved)
    _, static = eqx.partition(zoo.mlp(KEY_SKELETON), eqx.is_array)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Pass the whole model, or `eqx\.filter_eval_shape\(make_model, key\)`",
    ):
        oeqx.restore(tmp_path / "ckpt", static)
    skeleton = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), saved)


def test_part_of_a_checkpoint_advice_works(tmp_path):
    saved = {"model": {"encoder": zoo.mlp(KEY_SAVE)}, "step": 1}
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = zoo.skeleton(zoo.mlp, KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r'pass `EqxRestore\(\.\.\., prefix="model\.encoder"\)`\.',
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, prefix="model.encoder")
    zoo.assert_same(restored, saved["model"]["encoder"])
    # The other fix offered for leaves the skeleton lacks: `strict=False`.
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"To leave out checkpoint leaves that the skeleton lacks, pass "
        r"`EqxRestore\(\.\.\., strict=False\)`",
    ):
        oeqx.restore(tmp_path / "ckpt", {"model": {"encoder": skeleton}})
    restored = oeqx.restore(
        tmp_path / "ckpt", {"model": {"encoder": skeleton}}, strict=False
    )
    zoo.assert_same(restored["model"]["encoder"], saved["model"]["encoder"])


def test_mistyped_prefix_suggestion_works(tmp_path):
    saved = {"model": {"encoder": zoo.mlp(KEY_SAVE)}}
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = zoo.skeleton(zoo.mlp, KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointMismatchError, match=r"Did you mean `model\.encoder`\?"
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, prefix="model.encodr")
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, prefix="model.encoder")
    zoo.assert_same(restored, saved["model"]["encoder"])


def test_missing_leaves_advice_works(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"body": zoo.mlp(KEY_SAVE)})
    head = eqx.nn.Linear(2, 5, key=KEY_SKELETON)
    skeleton = {"body": zoo.skeleton(zoo.mlp, KEY_SKELETON), "head": head}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"or, to keep the skeleton's own values for new leaves \(a fresh head "
        r"for fine-tuning\), pass `EqxRestore\(\.\.\., missing=\"keep\"\)`\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"Pass `report=True` to get this list as a `RestoreReport` instead "
        r"of this warning\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, missing="keep")
    # Both pieces of advice, followed: kept, and listed in the report instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, report = oeqx.restore(
            tmp_path / "ckpt", skeleton, missing="keep", report=True
        )
    assert not [w for w in caught if w.category is oeqx.OrbaxEqxWarning]
    assert restored["head"].weight is head.weight
    assert report.kept == ("head.weight", "head.bias")


def test_abstract_leaves_to_keep_advice_works(tmp_path):
    saved = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", {"body": saved})
    abstract = eqx.filter_eval_shape(eqx.nn.Linear, 2, 5, key=KEY_SKELETON)
    skeleton = {"body": zoo.skeleton(zoo.mlp, KEY_SKELETON), "head": abstract}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"A leaf kept from the skeleton needs a value: build those parts of "
        r"the skeleton as concrete arrays",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, missing="keep")
    skeleton["head"] = eqx.nn.Linear(2, 5, key=KEY_SKELETON)
    restored, _ = oeqx.restore(tmp_path / "ckpt", skeleton, missing="keep", report=True)
    zoo.assert_same(restored["body"], saved)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_a_cast_refuses_values_it_cannot_keep_and_a_float_skeleton_restores(
    tmp_path, pack
):
    big = np.zeros(1 << 19, np.float32)  # (placed by the copying threads)
    big[[3, 9]] = [np.inf, -np.inf]
    saved = {
        "w": jnp.array([np.nan, 1.0, np.inf]),
        "big": jnp.asarray(big),
        "n": np.array([2**40, 5, -(2**31)], np.int64),
        "ok": jnp.array([-3.7, 2.9]),
    }
    oeqx.save(tmp_path / "ckpt", saved, pack=pack)
    ints = {
        "w": jax.ShapeDtypeStruct((3,), jnp.int32),
        "big": jax.ShapeDtypeStruct(big.shape, jnp.int32),
        "n": np.zeros(3, np.int32),
        "ok": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"^Some leaves of the checkpoint in \S+ckpt hold values a cast to the "
        r"skeleton's dtypes \(`cast=True`\) cannot keep:\n"
        r"  - Leaf `\['big'\]` \(big\) holds 2 NaN or infinite values, which a cast "
        r"to int32 cannot keep\.\n"
        r"  - Leaf `\['n'\]` \(n\) holds 1 value outside int32's range "
        r"\[-2147483648, 2147483647\], which a cast to int32 cannot keep\.\n"
        r"  - Leaf `\['w'\]` \(w\) holds 2 NaN or infinite values, which a cast "
        r"to int32 cannot keep\.\n"
        r"A cast of such values has no defined result: give those leaves of the "
        r"skeleton a float dtype \(or a wider integer one\), or restore them as "
        r"saved and clean the values \(`jnp\.nan_to_num`, `jnp\.clip`\) before "
        r"casting them\.$",
    ):
        oeqx.restore(tmp_path / "ckpt", ints, cast=True)
    # The fix: float (or wider integer) leaves where the values need them.
    fixed = dict(
        ints,
        w=jax.ShapeDtypeStruct((3,), jnp.float16),
        big=jax.ShapeDtypeStruct(big.shape, jnp.bfloat16),
        n=np.zeros(3, np.int64),
    )
    restored = oeqx.restore(tmp_path / "ckpt", fixed, cast=True)
    np.testing.assert_array_equal(restored["n"], saved["n"])
    np.testing.assert_array_equal(restored["ok"], [-3, 2])
    assert np.isnan(restored["w"][0]) and restored["big"][3] == np.inf


# ------------------------------------------- a class from a script, or a module

_MODEL_SOURCE = textwrap.dedent(
    """
    import equinox as eqx
    import jax


    def act(x):
        return x


    class Model(eqx.Module):
        linear: eqx.nn.Linear
        act: object

        def __init__(self, key):
            self.linear = eqx.nn.Linear(2, 3, key=key)
            self.act = act


    if __name__ == "__main__":
        import orbax_eqx as oeqx

        oeqx.save(PATH, Model(jax.random.key(SEED)))
    """
)


@pytest.fixture
def script_and_module(tmp_path, monkeypatch):
    """`train.py`, run as a script, saves `Model`; importing it gives `train.Model`.

    Returns (run the script and get its globals, the imported module).
    """
    name = f"train_{tmp_path.name}"  # a module name no other test imports
    (tmp_path / f"{name}.py").write_text(_MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    monkeypatch.setitem(sys.modules, name, module)

    def run_script(path, seed):
        # What `python train.py` does: the file runs as `__main__`.
        return runpy.run_path(
            str(tmp_path / f"{name}.py"),
            init_globals={"PATH": str(path), "SEED": seed},
            run_name="__main__",
        )

    return run_script, module


def test_class_saved_from_a_script_restored_from_its_module(
    tmp_path, script_and_module
):
    run_script, module = script_and_module
    script = run_script(tmp_path / "ckpt", seed=0)
    skeleton = eqx.filter_eval_shape(module.Model, KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `act` is callable train_\w+\.act in the skeleton but "
        r"__main__\.act in the checkpoint: the same name `act` in another module"
        r".*Module `<root>` is `train_\w+\.Model` in the skeleton but "
        r"`__main__\.Model` in the checkpoint: the same name `Model` in another "
        r"module, as when a script run directly \(so its module is `__main__`\) "
        r"saved the checkpoint and `Model` is now imported from `train_\w+`\."
        r"\nTo restore into the skeleton as it is \(the same class under another "
        r"module name",
    ) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton)
    assert "hyperparameters" not in str(info.value)  # none changed
    # The advice, followed.
    with pytest.warns(oeqx.StaticMismatchWarning, match="__main__.Model"):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    assert type(restored) is module.Model
    saved = script["Model"](jax.random.key(0))  # what the script saved
    np.testing.assert_array_equal(restored.linear.weight, saved.linear.weight)
    np.testing.assert_array_equal(restored.linear.bias, saved.linear.bias)


def test_class_saved_from_a_module_restored_by_a_script(tmp_path, script_and_module):
    run_script, module = script_and_module
    saved = module.Model(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", saved)
    script = run_script(tmp_path / "other", seed=1)  # the script's own `Model`
    skeleton = eqx.filter_eval_shape(script["Model"], KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Module `<root>` is `__main__\.Model` in the skeleton but "
        r"`train_\w+\.Model` in the checkpoint: the same name `Model` in another "
        r"module, as when the checkpoint was saved with `Model` imported from "
        r"`train_\w+` and a script run directly \(so its module is `__main__`\) "
        r"now defines it\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    with pytest.warns(oeqx.StaticMismatchWarning):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    np.testing.assert_array_equal(restored.linear.weight, saved.linear.weight)


def test_import_checks_classes_as_restore_does(tmp_path, capsys, script_and_module):
    pytest.importorskip("safetensors")
    from entry import skeleton_spec

    run_script, module = script_and_module
    run_script(tmp_path / "ckpt", seed=0)
    oeqx.export_safetensors(tmp_path / "ckpt", tmp_path / "model.safetensors")
    skeleton = eqx.filter_eval_shape(module.Model, KEY_SKELETON)
    argv = ["import", str(tmp_path / "model.safetensors"), str(tmp_path / "imported")]
    argv += ["--skeleton", skeleton_spec(skeleton)]
    assert main(argv) == 2
    assert re.fullmatch(
        r"orbax_eqx: error: The skeleton does not fit the safetensors at \S+ \(1 "
        r"problem\):\n  - Module `<root>` is `train_\w+\.Model` in the skeleton but "
        r"`__main__\.Model` in the files: the same name `Model` in another module, "
        r".*\nPass --ignore-static to keep the skeleton's\.\n",
        capsys.readouterr().err,
    )
    # The advice, followed; then the imported checkpoint restores plainly.
    assert main([*argv, "--ignore-static"]) == 0
    restored = oeqx.restore(tmp_path / "imported", skeleton)
    flat = oeqx.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(restored.linear.weight, flat["linear.weight"])


# ------------------------------------------------------------ a missing step


@pytest.fixture
def manager_root(tmp_path):
    root = tmp_path / "run"
    with ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler()) as mngr:
        for step in (1, 2, 5):
            mngr.save(step, args=oeqx.EqxSave(zoo.mlp(jax.random.key(step))))
        mngr.wait_until_finished()
    return root


def test_missing_step_lists_the_steps_there(manager_root):
    skeleton = zoo.skeleton(zoo.mlp, KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"run/99 does not exist\. .*run holds steps 1, 2, 5; the latest is 5\. "
        r"Pass a step that is there, such as .*run/5\.$",
    ):
        oeqx.restore(manager_root / "99", skeleton)
    # The item directory of a missing step: the same, with the item's name.
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"run/99/default does not exist\. .*run holds steps 1, 2, 5; the "
        r"latest is 5\. Pass a step that is there, such as .*run/5/default\.$",
    ):
        oeqx.restore(manager_root / "99" / "default", skeleton)
    # The advice, followed.
    restored = oeqx.restore(manager_root / "5", skeleton)
    zoo.assert_same(restored, zoo.mlp(jax.random.key(5)))


def test_missing_step_in_the_command_line(manager_root, capsys):
    assert main(["inspect", str(manager_root / "99")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "run/99 does not exist." in line
    assert "holds steps 1, 2, 5; the latest is 5." in line


def test_a_path_that_is_no_step_lists_nothing(tmp_path):
    with pytest.raises(
        oeqx.CheckpointNotFoundError, match=r"nowhere/99 does not exist\.$"
    ):
        oeqx.restore(tmp_path / "nowhere" / "99")


def test_many_steps_are_cut_to_the_newest(tmp_path):
    root = tmp_path / "run"
    for step in range(12):
        oeqx.save(root / str(step) / "default", {"w": np.zeros(1)})
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"run holds 12 steps, the newest steps 2, 3, .*, 11; the latest is 11",
    ):
        oeqx.metadata(root / "99")


def test_filtered_checkpoint_into_a_full_skeleton_says_so_and_the_fix_works(tmp_path):
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    path = tmp_path / "ckpt"
    oeqx.save(path, eqx.filter(model, eqx.is_array))
    skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 2, 2, 4, 1, key=jax.random.key(1))
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)\(2 differences\):\n  - Leaf `activation` is callable "
        r"\S+relu in the skeleton but None in the checkpoint\.\n.*\n"
        r"The checkpoint looks like `eqx\.filter\(model, eqx\.is_array\)` of this "
        r"skeleton: it holds None wherever the skeleton has a value that is no "
        r"array \(a callable, a Python value\)\. .*`arrays, rest = eqx\.partition\(",
    ) as info:
        oeqx.restore(path, skeleton)
    assert "on_static_mismatch" not in str(info.value)  # it would not help
    # The advice, followed.
    arrays, rest = eqx.partition(
        skeleton, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )
    restored = eqx.combine(oeqx.restore(path, arrays), rest)
    assert eqx.tree_equal(restored, model)


def test_a_none_for_a_value_among_other_differences_gets_the_general_advice(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"f": None, "w": jnp.ones(2)})
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", {"f": 1.0, "w": jnp.ones(3)})
    assert "eqx.filter(model, eqx.is_array)" not in str(info.value)
    assert "Give each such skeleton leaf the kind the checkpoint holds" in str(
        info.value
    )

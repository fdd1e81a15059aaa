"""Restore without a skeleton: `allow=[...]` rebuilds the saved tree.

The rebuilt tree has the saved classes, static fields, containers, callables
and Python values, and imports nothing outside `allow`, whatever the sidecar
names: checked in fresh processes, with `sys.modules` and with a planted
module that would write a file if imported.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sidecars
import zoo
from entry import main as cli_main

import orbax_eqx as oeqx

KEY = jax.random.key(0)
ALLOW = ["equinox", "jax", "optax", "zoo"]
TIMEOUT_S = 120
# The checkout under test, for fresh processes (not an installed copy).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))

# A user's package: a module with static fields, containers, a callable of its
# own, an enum, a namedtuple and Python values.
USER_PACKAGE = """
import collections
import enum

import equinox as eqx
import jax
import jax.numpy as jnp

Pair = collections.namedtuple("Pair", "left right")


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


def double(x):
    return 2 * x


class Net(eqx.Module):
    layers: list
    table: dict
    pair: Pair
    act: object
    scale: float
    name: str
    sizes: tuple = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    dtype: object = eqx.field(static=True)

    def __init__(self, key, sizes=(3, 4, 2)):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)
        ]
        self.table = {"bias": jnp.arange(2.0), "steps": 7, "off": None, "empty": {}}
        self.pair = Pair(jnp.ones(2), (1.5, "x"))
        self.act = double
        self.scale = 0.5
        self.name = "net"
        self.sizes = sizes
        self.mode = Mode.SLOW
        self.dtype = jnp.float32

    def __call__(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return x * self.scale + self.table["bias"]
"""


def _vector_field(t, y, args):
    return -y


class _Tagged(eqx.Module):
    w: jax.Array
    tag: object = eqx.field(static=True)


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    root = tmp_path / "site"
    (root / "mymodels").mkdir(parents=True)
    (root / "mymodels" / "__init__.py").write_text("")
    (root / "mymodels" / "nets.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(root))
    import mymodels.nets

    yield root, mymodels.nets
    for name in ("mymodels", "mymodels.nets"):
        sys.modules.pop(name, None)


def _leaves_equal(a, b):
    la, da = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, db = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert da == db
    for x, y in zip(la, lb, strict=True):
        if isinstance(y, (jax.Array, np.ndarray)):
            assert type(x) is type(y) or isinstance(x, jax.Array)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x is y or x == y


# ------------------------------------------------------------------ rebuilds


# `eqx.nn.Shared`'s lambdas come back as selectors: `test_shared_wiring_rebuilds`.
REBUILT_AS_SAVED = {k: v for k, v in zoo.ZOO.items() if k != "shared_tied"}


@pytest.mark.parametrize("make", REBUILT_AS_SAVED.values(), ids=REBUILT_AS_SAVED.keys())
def test_zoo_rebuilds_as_saved(make, tmp_path):
    item = make(KEY)
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", allow=ALLOW)
    zoo.assert_same(restored, item)


@pytest.mark.slow
def test_mlp_rebuilds_and_runs(tmp_path):
    model = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, key=KEY)
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax"])
    assert type(restored) is eqx.nn.MLP and restored.activation is jax.nn.gelu
    assert eqx.tree_equal(restored, model)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(restored(x), model(x))


@pytest.mark.slow
def test_user_package_rebuilds(tmp_path, user_package):
    _, nets = user_package
    model = nets.Net(KEY)
    oeqx.save(tmp_path / "ckpt", {"model": model, "step": 3})
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax", "mymodels"])
    assert eqx.tree_equal(restored, {"model": model, "step": 3})
    got = restored["model"]
    assert type(got) is nets.Net and type(got.pair) is nets.Pair
    assert got.act is nets.double and got.mode is nets.Mode.SLOW
    assert got.sizes == (3, 4, 2) and got.dtype is jnp.float32
    assert got.table["empty"] == {} and got.table["off"] is None
    np.testing.assert_array_equal(got(jnp.ones(3)), model(jnp.ones(3)))


@pytest.mark.slow
def test_batchnorm_state_rebuilds_and_runs(tmp_path):
    model, state = zoo.batchnorm_state(KEY)
    oeqx.save(tmp_path / "ckpt", (model, state))
    got_model, got_state = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "zoo"])
    assert type(got_state) is eqx.nn.State
    x = jnp.ones((5, 3))
    run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    run_got = jax.vmap(
        got_model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    (y, _), (y_got, _) = run(x, state), run_got(x, got_state)
    np.testing.assert_array_equal(y, y_got)


def test_shared_wiring_rebuilds(tmp_path):
    model = zoo.shared_tied(KEY)
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "zoo"])
    embed, head = restored.shared()
    assert embed.weight is head.weight  # tied again
    np.testing.assert_array_equal(restored(3), model(3))
    assert "stands in for zoo.TiedLM.__init__.<locals>.<lambda>" in repr(
        restored.shared.where
    )


@pytest.mark.slow
def test_third_party_diffrax(tmp_path):
    diffrax = pytest.importorskip("diffrax")
    term = diffrax.ODETerm(_vector_field)
    tree = {
        "solver": diffrax.Tsit5(),
        "controller": diffrax.PIDController(rtol=1e-3, atol=1e-6),
        "saveat": diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 4)),
        "term": term,
    }
    oeqx.save(tmp_path / "ckpt", tree)
    restored = oeqx.restore(
        tmp_path / "ckpt",
        allow=["equinox", "jax", "diffrax", "optimistix", "test_rebuild"],
    )
    assert eqx.tree_equal(restored, tree)
    y0 = jnp.array([0.5])

    def solve(t):
        return diffrax.diffeqsolve(
            t["term"],
            t["solver"],
            0.0,
            1.0,
            0.1,
            y0,
            saveat=t["saveat"],
            stepsize_controller=t["controller"],
        ).ys

    np.testing.assert_array_equal(solve(restored), solve(tree))


@pytest.mark.slow
def test_third_party_lineax(tmp_path):
    lx = pytest.importorskip("lineax")
    tree = {
        "operator": lx.MatrixLinearOperator(jnp.eye(3) * 2.0),
        "solver": lx.LU(),
    }
    oeqx.save(tmp_path / "ckpt", tree)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax", "lineax"])
    assert eqx.tree_equal(restored, tree)
    b = jnp.arange(3.0)
    got = lx.linear_solve(restored["operator"], b, restored["solver"]).value
    np.testing.assert_array_equal(got, b / 2)


@pytest.mark.slow
def test_third_party_esm2quinox(tmp_path):
    esm2quinox = pytest.importorskip("esm2quinox")
    # Its `__init__` runs op by op (seconds): traced instead, then filled.
    shapes = eqx.filter_eval_shape(esm2quinox.ESM2, 2, 32, 4, True, key=KEY)
    model = jax.tree_util.tree_map(
        lambda x: (
            jnp.full(x.shape, 0.5, x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        shapes,
    )
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax", "esm2quinox"])
    # Equal as PyTrees: the same classes, static fields, callables and arrays
    # (running it op by op would take seconds).
    assert eqx.tree_equal(restored, model) and type(restored) is esm2quinox.ESM2


@pytest.mark.slow
def test_options_apply_as_with_a_skeleton(tmp_path):
    model = zoo.transformer_block(KEY)
    oeqx.save(tmp_path / "ckpt", {"model": model, "step": 3})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mlp = oeqx.restore(
        tmp_path / "ckpt",
        allow=["equinox", "jax", "zoo"],
        prefix="model.mlp",
        shardings=device,
    )
    assert eqx.tree_equal(mlp, model.mlp)
    assert mlp.layers[0].weight.sharding == device
    restored, report = oeqx.restore(
        tmp_path / "ckpt", allow=["equinox", "jax", "zoo"], report=True
    )
    assert not report.kept and restored["step"] == 3


def test_through_checkpoint_manager(tmp_path):
    model = zoo.transformer_block(KEY)
    with ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler()) as mngr:
        mngr.save(1, args=oeqx.EqxSave(model))
        mngr.wait_until_finished()
        restored = mngr.restore(
            1, args=oeqx.EqxRestore(allow=["equinox", "jax", "zoo"])
        )
    zoo.assert_same(restored, model)


def test_through_orbax_v1(tmp_path):
    from orbax.checkpoint import v1 as ocp1

    model = zoo.transformer_block(KEY)
    ocp1.save_checkpointables(tmp_path / "ckpt", {"model": model})
    args = oeqx.EqxRestore(allow=["equinox", "jax", "zoo"])
    loaded = ocp1.load_checkpointables(tmp_path / "ckpt", {"model": args})
    zoo.assert_same(loaded["model"], model)


def test_without_allow_still_flat(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(KEY))
    flat = oeqx.restore(tmp_path / "ckpt")
    assert isinstance(flat, dict) and "layers.0.weight" in flat


# ------------------------------------------------------------------ refusals


def test_outside_allow_lists_every_leaf_and_what_to_allow(tmp_path):
    model = zoo.transformer_block(KEY)
    oeqx.save(tmp_path / "ckpt", model)
    with pytest.raises(oeqx.RebuildError) as info:
        oeqx.restore(tmp_path / "ckpt", allow=["equinox"])
    text = str(info.value)
    assert text.startswith(
        f"Cannot rebuild the checkpoint at {tmp_path / 'ckpt'} without a skeleton "
        "under `allow=['equinox']`: 2 leaves or modules cannot be rebuilt:\n"
    )
    assert (
        "  - `<root>`: class `zoo.Block` is outside `allow` (to allow it: `zoo`)\n"
        in text
    )
    assert (
        "  - `mlp.activation`: callable `jax._src.nn.functions.gelu` is outside "
        "`allow` (to allow it: `jax`)\n" in text
    )
    assert "pass `allow=['equinox', 'jax', 'zoo']`" in text
    assert info.value.needed == ["jax", "zoo"]
    # `problems` holds leaf paths (`keystr`), as `RebuildError` documents.
    assert [path for path, _ in info.value.problems] == ["<root>", ".mlp.activation"]


def test_lambdas_local_classes_and_objects_cannot_be_rebuilt(tmp_path):
    class Local(eqx.Module):
        w: jax.Array

    class Holder(eqx.Module):
        f: object
        thing: object

    tree = {"local": Local(jnp.ones(2)), "h": Holder(lambda x: x, object())}
    oeqx.save(tmp_path / "ckpt", tree)
    with pytest.raises(
        oeqx.RebuildError,
        match=r"(?s)4 leaves or modules cannot be rebuilt:.*"
        r"`h`: class `test_rebuild\.test_lambdas_local.*<locals>\.Holder` is "
        r"defined inside a function, so it cannot be imported by name.*"
        r"`h\.f`: callable .*<lambda>` is defined inside a function.*"
        r"`h\.thing`: an object recorded only as its text `<object object>` "
        r"cannot be rebuilt.*"
        r"What cannot be rebuilt needs a skeleton: restore into one",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "test_rebuild"])


def test_refusals_name_leaves_as_inspect_does(tmp_path):
    # Escaped dict keys show their leaf path beside the name; a static field
    # is named under its module.
    tree = {key: _Tagged(jnp.ones(2), object()) for key in ("0", "a.b", "plain")}
    oeqx.save(tmp_path / "ckpt", tree)
    with pytest.raises(oeqx.RebuildError) as info:
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "test_rebuild"])
    why = "an object recorded only as its text `<object object>` cannot be rebuilt"
    assert (
        "3 leaves or modules cannot be rebuilt:\n"
        f"  - `\\0.tag` (path `['0'].tag`): {why}\n"
        f"  - `a\\.b.tag` (path `['a.b'].tag`): {why}\n"
        f"  - `plain.tag`: {why}\n"
    ) in str(info.value)
    assert [path for path, _ in info.value.problems] == [
        "['0'].tag",
        "['a.b'].tag",
        "['plain'].tag",
    ]


def test_unknown_container_cannot_be_rebuilt(tmp_path):
    import collections

    oeqx.save(tmp_path / "ckpt", {"o": collections.OrderedDict(a=jnp.ones(2))})
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`o`: a `collections\.OrderedDict` container cannot be rebuilt",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["collections"])


def test_module_wrapping_a_function_cannot_be_rebuilt(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"f": eqx.filter_jit(_vector_field)})
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`f`: a module wrapping a function cannot be rebuilt",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "test_rebuild"])


def test_changed_class_is_refused(tmp_path, user_package):
    root, nets = user_package
    oeqx.save(tmp_path / "ckpt", nets.Net(KEY))
    text = (root / "mymodels" / "nets.py").read_text()
    (root / "mymodels" / "nets.py").write_text(
        text.replace("    scale: float\n", "    scale: float\n    extra: int = 0\n")
    )
    sys.modules.pop("mymodels.nets")
    sys.modules.pop("mymodels")
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`<root>`: class `mymodels\.nets\.Net` has changed since the save: "
        r"it has fields \('layers', 'table', 'pair', 'act', 'scale', 'extra', "
        r"'name'\)",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax", "mymodels.nets"])


def _crc32_records(content) -> None:
    """Packed records as a format-4 sidecar spells them (a `crc32`, not format
    6's `xxh3`; its value is not checked by what these tests do)."""
    for record in content["leaves"].values():
        if "xxh3" in record:
            record["crc32"] = int(record.pop("xxh3"), 16) & 0xFFFFFFFF


@pytest.mark.parametrize(
    "allow, match",
    [
        ("equinox", r"allow='equinox': expected a list of module names"),
        (["equinox", "os.path; rm"], r"allow: 'os.path; rm' is not a module name"),
        ([3], r"allow: 3 is not a module name"),
    ],
    ids=["a string", "not a name", "not a string"],
)
def test_allow_must_be_module_names(tmp_path, allow, match):
    with pytest.raises((TypeError, ValueError), match=match):
        oeqx.EqxRestore(allow=allow)


def test_allow_with_a_skeleton_is_refused():
    with pytest.raises(ValueError, match=r"pass one or the other"):
        oeqx.EqxRestore(zoo.mlp(KEY), allow=["equinox"])


def test_names_reached_through_an_allowed_module_are_refused(tmp_path, user_package):
    _, nets = user_package
    oeqx.save(tmp_path / "ckpt", nets.Net(KEY))
    content = sidecars.read(tmp_path / "ckpt")
    content["leaves"]["act"]["value"] = {"callable": "mymodels.nets.jax.numpy.sin"}
    sidecars.write(tmp_path / "ckpt", content)
    with pytest.raises(
        oeqx.RebuildError,
        match=r"`act`: callable `mymodels\.nets\.jax\.numpy\.sin` is not what "
        r"`mymodels\.nets\.jax\.numpy\.sin` names now: that is `jax\.numpy\.sin`",
    ):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax", "mymodels"])


# ------------------------------------------- nothing outside `allow` is imported

_CHILD = """
import json, sys
import orbax_eqx as oeqx
try:
    oeqx.restore(sys.argv[1], allow=json.loads(sys.argv[2]))
    outcome = "restored"
except oeqx.RebuildError as e:
    outcome = str(e)
print(json.dumps({"outcome": outcome, "imported": sorted(
    n for n in sys.modules if n.split(".")[0] in ("mymodels", "planted")
)}))
"""


def _restore_in_fresh_process(path, allow, site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), PACKAGE_ROOT])}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), json.dumps(allow)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_module_outside_allow_is_not_imported(tmp_path, user_package):
    site, nets = user_package
    oeqx.save(tmp_path / "ckpt", nets.Net(KEY))
    found = _restore_in_fresh_process(tmp_path / "ckpt", ["equinox", "jax"], site)
    assert (
        "`<root>`: class `mymodels.nets.Net` is outside `allow` (to allow it: "
        "`mymodels.nets`)" in found["outcome"]
    )
    assert found["imported"] == []
    # The package alone does not import its module `nets`: neither does a
    # rebuild, which says which module to allow.
    found = _restore_in_fresh_process(
        tmp_path / "ckpt", ["equinox", "jax", "mymodels"], site
    )
    assert (
        "`<root>`: class `mymodels.nets.Net` is in module `mymodels.nets`, which "
        "no allowed module imports (a rebuild imports only what `allow` names; to "
        "allow it: `mymodels.nets`)" in found["outcome"]
    )
    assert (
        "pass `allow=['equinox', 'jax', 'mymodels', 'mymodels.nets']`"
        in (found["outcome"])
    )
    assert found["imported"] == ["mymodels"]
    # And with it allowed, it is imported and rebuilt.
    found = _restore_in_fresh_process(
        tmp_path / "ckpt", ["equinox", "jax", "mymodels.nets"], site
    )
    assert found == {"outcome": "restored", "imported": ["mymodels", "mymodels.nets"]}


@pytest.mark.slow
def test_planted_module_named_by_an_edited_sidecar_never_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "planted-ran"
    (site / "planted.py").write_text(
        textwrap.dedent(f"""
        open({str(marker)!r}, "w").write("imported")

        def f(x):
            return x
        """)
    )
    model = eqx.nn.MLP(2, 2, 4, 1, key=KEY)
    oeqx.save(tmp_path / "ckpt", model)
    content = sidecars.read(tmp_path / "ckpt")
    content["modules"][""]["class"] = "planted.Evil"
    content["modules"]["layers.0"]["class"] = "os.system"
    content["leaves"]["activation"]["value"] = {"callable": "planted.f"}
    content["leaves"]["final_activation"]["value"] = {"callable": "posix.system"}
    sidecars.write(tmp_path / "ckpt", content)
    found = _restore_in_fresh_process(tmp_path / "ckpt", ["equinox", "jax"], site)
    assert not marker.exists()
    assert found["imported"] == []
    for line in [
        "`<root>`: class `planted.Evil` is outside `allow` (to allow it: `planted`)",
        "`layers.0`: class `os.system` is outside `allow` (to allow it: `os`)",
        "`activation`: callable `planted.f` is outside `allow` (to allow it: "
        "`planted`)",
        "`final_activation`: callable `posix.system` is outside `allow` (to allow "
        "it: `posix`)",
    ]:
        assert line in found["outcome"]


# ------------------------------------------------------------- the command line


def test_inspect_says_what_to_allow(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"model": zoo.transformer_block(KEY), "step": 3})
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    # The public module of each name: narrow, and enough under the rule.
    assert out.endswith(
        "Without a skeleton: restore with `allow=['equinox.nn', 'jax', 'zoo']` to "
        "rebuild it.\nCallables a rebuild installs: `jax._src.nn.functions.gelu`, "
        "`equinox.nn._mlp.<lambda>`.\n"
    )
    assert cli_main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["rebuild"] == {
        "recorded": True,
        "allow": ["equinox.nn", "jax", "zoo"],
        "callables": ["jax._src.nn.functions.gelu", "equinox.nn._mlp.<lambda>"],
        "cannot": [],
    }
    # What it says restores.
    restored = oeqx.restore(tmp_path / "ckpt", allow=item["rebuild"]["allow"])
    assert restored["step"] == 3


def test_inspect_says_what_cannot_be_rebuilt(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"f": lambda x: x, "g": object()})
    assert cli_main(["inspect", "--flat", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"\nWithout a skeleton: not rebuildable: `f`: callable "
        r"`test_rebuild\.test_inspect_says_what_cannot_be_rebuilt\.<locals>\.<lambda>` "
        r"is defined inside a function, so it cannot be imported by name \(and 1 "
        r"more\); restore it into a skeleton\.\n$",
        out,
    )
    assert cli_main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    cannot = [(c["name"], c["path"]) for c in item["rebuild"]["cannot"]]
    assert cannot == [("f", "['f']"), ("g", "['g']")]


# ------------------------------------------------------ damaged records of nodes


def _edit_nodes(path, edit):
    content = sidecars.read(path)
    edit(content["nodes"])
    sidecars.write(path, content)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda n: n["layers"]["children"].append("layers"),
            r"is damaged: node 'layers' is reached twice",
        ),
        (
            lambda n: n["layers"]["children"].append("nowhere"),
            r"is damaged: node or leaf 'nowhere' is named but not recorded",
        ),
        (
            lambda n: n[""]["fields"].pop(),
            r"is damaged: node '' has 2 fields",
        ),
        (
            lambda n: n.update({"": "junk"}),
            r"is damaged: node '' is malformed \(Expected `int \| object`, got `str`\)",
        ),
        (
            lambda n: n["layers.0"].update(children=[{"x": 1}, None]),
            r"is damaged: node 'layers.0' is malformed \(Expected `str \| null`, got "
            r"`object` - at `\$\.children\[0\]`\)",
        ),
    ],
    ids=["a cycle", "a dangling name", "fields and children", "not a record", "junk"],
)
def test_damaged_nodes_are_sidecar_errors(tmp_path, edit, match):
    oeqx.save(tmp_path / "ckpt", eqx.nn.MLP(2, 2, 4, 1, key=KEY))
    _edit_nodes(tmp_path / "ckpt", edit)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(tmp_path / "ckpt", allow=["equinox", "jax"])


def test_restore_latest_raises_what_allow_lacks_at_once(tmp_path):
    with ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler()) as mngr:
        for step in (1, 2):
            mngr.save(step, args=oeqx.EqxSave(zoo.transformer_block(KEY)))
        mngr.wait_until_finished()
        with pytest.raises(oeqx.RebuildError, match=r"class `zoo\.Block` is outside"):
            oeqx.restore_latest(mngr, oeqx.EqxRestore(allow=["equinox", "jax"]))
        step, model = oeqx.restore_latest(
            mngr, oeqx.EqxRestore(allow=["equinox", "jax", "zoo"])
        )
    assert step == 2
    zoo.assert_same(model, zoo.transformer_block(KEY))

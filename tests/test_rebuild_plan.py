"""`inspect`'s rebuild plan (`--json`'s `rebuild`, a dry run that imports
nothing) says what a rebuild under the `allow` it suggests then refuses: the
same leaves and modules, in the same order, for the same reasons. Many
modules alike (the layers of a model) are looked up once for what they
need, and each one that cannot be rebuilt is still said."""

import enum
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from entry import main

import orbax_eqx as oeqx


class Mode(enum.Enum):  # as a leaf: recorded as its text, not rebuilt
    FAST = 1


def _plain(width: int):
    return eqx.nn.Linear(width, width, key=jax.random.key(width))


def _tree(kind: str):
    class Local(eqx.Module):  # defined in a function: cannot be imported
        w: jax.Array
        act: object = eqx.field(static=True)

    if kind == "local-classes":
        return [Local(jnp.ones(2), jax.nn.relu) for _ in range(5)] + [
            _plain(3) for _ in range(4)
        ]
    if kind == "local-callables":
        fns = [lambda x: x, jax.nn.gelu]
        return {
            "layers": [
                eqx.nn.MLP(2, 2, 4, 1, activation=fns[i % 2], key=jax.random.key(i))
                for i in range(6)
            ],
            "mode": Mode.FAST,
        }
    return {  # numpy leaves, 64-bit with x64 off: numpy stand-ins
        "layers": [_plain(2) for _ in range(3)],
        "wide": np.arange(3, dtype=np.int64),
        "scalar": np.float64(2.5),
    }


@pytest.mark.parametrize(
    "kind",
    ["local-classes", "local-callables", "numpy"],
    ids=["local-classes", "local-callables", "numpy"],
)
def test_the_plan_is_what_a_rebuild_under_its_allow_says(tmp_path, capsys, kind):
    ckpt = tmp_path / "ckpt"
    oeqx.save(ckpt, _tree(kind))
    assert main(["inspect", "--json", str(ckpt)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    plan = item["rebuild"]
    allow = tuple(plan["allow"])
    said = [(c["path"], c["why"]) for c in plan["cannot"]]
    if not said:
        oeqx.restore(ckpt, allow=allow)  # rebuilds
        return
    with pytest.raises(oeqx.RebuildError) as caught:
        oeqx.restore(ckpt, allow=allow)
    assert caught.value.problems == said
    if kind == "local-classes":  # each of the 5 modules, once
        assert [p for p, _ in said] == [f"[{i}]" for i in range(5)]

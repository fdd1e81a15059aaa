"""A save whose sidecar would be larger than readers read back is refused,
saying why and giving the fix that fits: many leaves (save fewer, larger
arrays, or split the item) or one large record (a big Python value). Each fix
is then shown to work under the same limit.

The limit is 256 MiB; these tests lower it (`sealed.MAX_BYTES`, the one the
save checks against) so that a few hundred leaves reach it. So for the most
records a sidecar may hold (`sealed.MAX_RECORDS`, 2**21), which bounds what
reading one costs where short records would let 256 MiB name ten million.
"""

import re

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx
from orbax_eqx._format import sealed  # the limit, lowered for these tests

LIMIT = 60_000


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(sealed, "MAX_BYTES", LIMIT)


# The fix both "too many" messages end with.
FEWER = (
    r"Save fewer, larger arrays \(stack repeated layers into one array per "
    r"parameter, as `eqx\.filter_vmap` builds them and `jax\.lax\.scan` runs "
    r"them\), or split the item into several items of one checkpoint "
    r"\(`ocp\.args\.Composite`\), each with a sidecar of its own\.$"
)


def _layers(n: int) -> dict[str, np.ndarray]:
    return {f"layer{i:03d}": np.full((2,), i, np.float32) for i in range(n)}


def test_too_many_leaves_says_so_and_the_fixes_work(tmp_path, small_limit):
    item = _layers(400)
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", item)
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would be \d+ bytes, more than the "
        rf"{LIMIT} orbax_eqx reads back\. It records 400 leaves and 0 modules; "
        r"the largest record, that of node `<root>`, is \d+ bytes\. That "
        r"is about \d+ bytes a leaf\. " + FEWER,
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()

    # Fix 1: one stacked array instead of 400 small ones.
    stacked = {"layers": np.stack(list(item.values()))}
    oeqx.save(tmp_path / "stacked", stacked)
    back = oeqx.restore(tmp_path / "stacked", stacked)
    np.testing.assert_array_equal(back["layers"], stacked["layers"])

    # Fix 2: the same leaves as two items of one step, a sidecar each.
    halves = {
        "first": dict(list(item.items())[:200]),
        "second": dict(list(item.items())[200:]),
    }
    handlers = {name: oeqx.EqxHandler() for name in halves}
    with ocp.CheckpointManager(
        tmp_path / "root", item_names=tuple(halves), item_handlers=handlers
    ) as mngr:
        saved = {name: oeqx.EqxSave(part) for name, part in halves.items()}
        mngr.save(0, args=ocp.args.Composite(**saved))
        mngr.wait_until_finished()
        wanted = {name: oeqx.EqxRestore(part) for name, part in halves.items()}
        back = mngr.restore(0, args=ocp.args.Composite(**wanted))
    for name, part in halves.items():
        assert eqx.tree_equal(dict(back[name]), part)


class Tagged(eqx.Module):
    weight: np.ndarray
    note: str = eqx.field(static=True)


def test_one_large_value_says_so_and_the_fix_works(tmp_path, small_limit):
    text = "x" * LIMIT
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", Tagged(jnp.ones(2), text))
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would be \d+ bytes, more than the "
        rf"{LIMIT} orbax_eqx reads back\. It records 1 leaf and 1 module; the "
        r"largest record, that of module `<root>`, is \d+ bytes\. Keep large "
        r"Python values \(str, bytes, static fields\) out of the item, or store "
        r"them as arrays \(`np\.frombuffer\(data, np\.uint8\)`\)\.$",
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()
    # The fix: the text as an array of its bytes.
    fixed = {"weight": jnp.ones(2), "note": np.frombuffer(text.encode(), np.uint8)}
    oeqx.save(tmp_path / "ckpt", fixed)
    back = oeqx.restore(tmp_path / "ckpt", fixed)
    assert back["note"].tobytes().decode() == text


@pytest.fixture
def few_records(monkeypatch):
    monkeypatch.setattr(sealed, "MAX_RECORDS", 150)


def test_too_many_records_says_so_and_the_fix_works(tmp_path, few_records):
    item = _layers(200)  # 200 leaves and the root dict's node
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", item)
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would hold 201 records \(of 200 "
        r"leaves, their modules and the tree's inner nodes\), more than the 150 "
        r"orbax_eqx reads back\. " + FEWER,
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()
    stacked = {"layers": np.stack(list(item.values()))}  # the fix
    oeqx.save(tmp_path / "stacked", stacked)
    back = oeqx.restore(tmp_path / "stacked", stacked)
    np.testing.assert_array_equal(back["layers"], stacked["layers"])


def test_a_sidecar_of_more_records_is_not_read(tmp_path, monkeypatch):
    oeqx.save(tmp_path / "ckpt", _layers(200))  # as another writer might
    monkeypatch.setattr(sealed, "MAX_RECORDS", 150)
    damaged = (
        r"The sidecar in \S+ is damaged: it holds 201 records \(leaves, modules "
        r"and nodes\), more than any save writes \(150\)\."
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=damaged):
        oeqx.metadata(tmp_path / "ckpt")
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=damaged.replace("201", "200")
    ):
        oeqx.restore(tmp_path / "ckpt", _layers(200))  # (its nodes read past)

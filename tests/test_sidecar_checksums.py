"""The data checksums of a sidecar's records, edited (resealed, as an
attacker would: `tests/sidecars.py`): bytes of another save under this one's
names are damage; checksums stripped from a sidecar that says it has them are
damage. (An edit that is not resealed is damage before any record is read:
`tests/test_sidecar_seal.py`.)
"""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx

ITEM = {
    "a": np.arange(6, dtype=np.float32),
    "b": np.arange(6, dtype=np.float32) + 10,
    "c": np.arange(3.0),
}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, ITEM)
    return path


def _edit(path, change):
    sidecars.edit(path, change)  # resealed


def _damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


def test_a_pack_of_another_save_under_this_token_is_damage(tmp_path, saved):
    other = tmp_path / "other"
    oeqx.save(other, {n: x + 1 for n, x in ITEM.items()})
    (mine,) = saved.glob("orbax_eqx~packed.*.bin")
    (theirs,) = other.glob("orbax_eqx~packed.*.bin")
    shutil.copyfile(theirs, mine)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(saved, ITEM)
    assert sorted(d.name for d in oeqx.verify(saved).damaged) == ["a", "b", "c"]


# --- checksums stripped -----------------------------------------------------------


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_stripped_checksums_are_damage(tmp_path, capsys, pack):
    # Restore and verify agree: the sidecar is damaged (format 5).
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0), "b": jnp.ones(3)}, pack=pack)

    def strip(content):
        for record in content["leaves"].values():
            record.pop("xxh3" if pack else "sum32")

    _edit(path, strip)
    where, kind = (
        ("is packed", "xxh3")
        if pack
        else (
            "is in Orbax's array store",
            "sum32",
        )
    )
    match = _damaged(
        rf"leaf `\['a'\]` \(leaf name 'a'\) {where} but records no {kind}, though "
        r"a save with checksums records one for every such leaf: it was edited"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.verify(path)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(path, {"a": jnp.zeros(10), "b": jnp.zeros(3)})
    assert main(["verify", str(path)]) != 0
    assert "records no" in capsys.readouterr().err


def test_checksums_flag_that_is_no_bool_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)
    _edit(path, lambda c: c.update(checksums="no"))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(
            r'its "checksums" is malformed \(Expected `bool`, got `str`.*\)'
        ),
    ):
        oeqx.verify(path)

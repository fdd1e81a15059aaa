"""A damaged sidecar under Orbax's v1 API: what each entry point gives.

Orbax 0.12.8's `checkpointables_metadata` logs a handler's error and gives
None for that checkpointable (its choice, not ours); `oeqx.metadata` and a
load raise our error. Pinned so that a change on either side is seen."""

import logging

import equinox as eqx
import jax
import pytest
from orbax.checkpoint import v1 as ocp

import orbax_eqx as oeqx

DAMAGED = (
    r"orbax_eqx\.json is not JSON as orbax_eqx writes it .*the checkpoint is damaged"
)


@pytest.fixture
def cut_short(tmp_path):
    model = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    ocp.save_checkpointables(tmp_path / "ckpt", {"model": model})
    sidecar = tmp_path / "ckpt" / "model" / "orbax_eqx.json"
    raw = sidecar.read_bytes()
    sidecar.write_bytes(raw[: len(raw) // 2])
    return tmp_path / "ckpt", model


def test_checkpointables_metadata_logs_our_error_and_gives_none(cut_short, caplog):
    path, _ = cut_short
    with caplog.at_level(logging.WARNING):
        found = ocp.checkpointables_metadata(path).metadata
    assert found == {"model": None}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Failed to get metadata for checkpointable: model" in logged
    assert (
        "is not JSON as orbax_eqx writes it" in logged
        and "Restore an earlier step" in logged
    )


def test_metadata_and_load_raise_it(cut_short):
    path, model = cut_short
    with pytest.raises(oeqx.CheckpointDamagedError, match=DAMAGED):
        oeqx.metadata(path / "model")
    with pytest.raises(oeqx.CheckpointDamagedError, match=DAMAGED):
        ocp.load_checkpointables(path, {"model": model})

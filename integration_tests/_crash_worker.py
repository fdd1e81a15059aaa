"""Saves steps through a CheckpointManager until it is killed.

Usage: python _crash_worker.py ROOT FIRST_STEP

Step `s` saves `crash_item(s)`, so whoever restores a step knows exactly
which values it must hold. Prints `saving S` before each save.
"""

import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import orbax_eqx as oeqx


def crash_item(step: int) -> dict:
    """About 8 MiB in 12 arrays, plus Python leaves; different for every step."""
    key = jax.random.key(0)
    arrays = {
        f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (256, 512)) + step
        for i in range(12)
    }
    return {"arrays": arrays, "step": step, "tag": f"step-{step}"}


def manager(root: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        root,
        item_handlers=oeqx.EqxHandler(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=3, cleanup_tmp_directories=True
        ),
    )


def main() -> None:
    root, first = sys.argv[1], int(sys.argv[2])
    mngr = manager(root)
    for step in range(first, first + 1000):
        print(f"saving {step}", flush=True)
        mngr.save(step, args=oeqx.EqxSave(crash_item(step)))
    mngr.wait_until_finished()


if __name__ == "__main__":
    jnp.zeros(1).block_until_ready()  # start JAX before announcing anything
    main()

"""Train, save every N steps, and resume after a crash.

    python examples/train_resume.py ckpts --steps 200 --save-every 25

Run it, kill it (Ctrl-C, `kill -9`, a preempted machine: try `--crash-at 130`,
which ends the process at once, as a crash does), run the same command again:
it picks up from the newest step that was saved whole and finishes as if it
had never stopped. Everything the run depends on is in the checkpoint: the
model, the optimizer state and the step, and the data of each step comes from
the step number, so a resumed run computes exactly what an uninterrupted one
does.

What to notice:

- `CheckpointManagerOptions(save_interval_steps=N)`: `mngr.save(step, ...)`
  is called every step and saves every N-th (and returns whether it did).
- Saves are asynchronous: training goes on while a step is written. A step is
  committed whole or not at all; one in flight when the process dies is
  simply not there, and the run resumes from the one before.
- The manager is used in a `with` block, so the last save is waited for
  before the script ends (`mngr.wait_until_finished()` does the same).
- Resuming needs a skeleton of what was saved, built without allocating
  anything (`eqx.filter_eval_shape`), and `oeqx.restore_latest`, which also
  falls back past a step whose files were damaged after it was saved.
"""

import argparse
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import orbax_eqx as oeqx

OPTIMIZER = optax.adam(1e-2)
BATCH = 32


def init_state(key):
    """Everything the run needs to go on: model, optimizer state, step."""
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=32, depth=2, key=key)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": 0}


def batch(step):
    """The data of one step, from the step number alone (as a sharded data
    loader that can seek to a step gives it)."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (BATCH, 4))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return x, y


@eqx.filter_jit
def train_step(model, opt_state, x, y):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = OPTIMIZER.update(
        grads, opt_state, eqx.filter(model, eqx.is_array)
    )
    return eqx.apply_updates(model, updates), opt_state, loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="where the checkpoints go")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument(
        "--crash-at", type=int, help="end the process at once after this step"
    )
    args = parser.parse_args(argv)

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=args.save_every, max_to_keep=3
    )
    with ocp.CheckpointManager(
        os.path.abspath(args.ckpt_dir), item_handlers=oeqx.EqxHandler(), options=options
    ) as mngr:
        if mngr.latest_step() is None:
            state = init_state(jax.random.key(0))
            print("Starting from scratch.", flush=True)
        else:
            skeleton = eqx.filter_eval_shape(init_state, jax.random.key(0))
            saved_at, state = oeqx.restore_latest(mngr, oeqx.EqxRestore(skeleton))
            print(f"Resuming after step {saved_at}.", flush=True)

        model, opt_state, loss = state["model"], state["opt_state"], None
        for step in range(state["step"], args.steps):
            model, opt_state, loss = train_step(model, opt_state, *batch(step))
            # The state after `step`: a resumed run starts at `step + 1`.
            done = {"model": model, "opt_state": opt_state, "step": step + 1}
            mngr.save(step + 1, args=oeqx.EqxSave(done), metrics={"loss": float(loss)})
            if step + 1 == args.crash_at:
                print(f"Crashing after step {step + 1}.", flush=True)
                os._exit(1)  # no clean-up at all, as a killed process
        last = "" if loss is None else f", last loss {float(loss):.6f}"
        print(f"Done: {args.steps} steps{last}.", flush=True)


if __name__ == "__main__":
    main()

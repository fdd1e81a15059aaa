"""`python -m orbax_eqx demo`: train, checkpoint every step, restore the best one.

The whole workflow a training job needs, small enough to read in one sitting
and to run in seconds on a laptop CPU: a model with `eqx.nn.BatchNorm` (so
there is `eqx.nn.State` to save too) and an optax optimizer, saved
asynchronously through Orbax's `CheckpointManager`, which keeps the best steps
by loss; then the best step is restored into a skeleton that holds no values
at all, and checked against what was saved.
"""

import os
import re
import shlex
import shutil
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from .._orbax.handler import EqxHandler, EqxRestore, EqxSave
from .render import human_bytes

IN_SIZE, HIDDEN = 8, 32
N_SAMPLES, BATCH = 256, 16
SEED = 0
OPTIMIZER = optax.adam(3e-2)

# What an earlier demo leaves in its directory: finished steps, and the
# temporary directories of steps that were being saved when it was stopped.
_STEP_DIR = re.compile(r"[0-9]+")
_TMP_STEP_DIR = re.compile(r"[0-9]+\.orbax-checkpoint-tmp.*")
_STEP_METADATA = "_CHECKPOINT_METADATA"


def make_model(key):
    k1, k2 = jax.random.split(key)
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(IN_SIZE, HIDDEN, key=k1),
            eqx.nn.BatchNorm(HIDDEN, axis_name="batch", mode="batch"),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(HIDDEN, 1, key=k2),
        ]
    )


def make_train_state(key):
    """Everything a run saves: model, its `eqx.nn.State`, optimizer state, step."""
    model, state = eqx.nn.make_with_state(make_model)(key)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "state": state, "opt_state": opt_state, "step": 0}


def _batched(model, x, state):
    # BatchNorm needs the batch as a named axis; its state is shared, not batched.
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )


@eqx.filter_jit
def train_step(model, state, opt_state, x, y):
    def loss_fn(model, state):
        pred, state = _batched(model, x, state)
        return jnp.mean((pred[:, 0] - y) ** 2), state

    (_, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), state, opt_state


@eqx.filter_jit
def eval_loss(model, state, x, y):
    # Inference mode uses BatchNorm's running statistics, which live in
    # `state`: a restore that lost the state would change this loss.
    pred, _ = _batched(eqx.nn.inference_mode(model), x, state)
    return jnp.mean((pred[:, 0] - y) ** 2)


def synthetic_data(seed: int):
    """A training and a validation set: `y = sin(2 x @ w) + noise`."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=IN_SIZE) / np.sqrt(IN_SIZE)

    def sample():
        x = rng.normal(size=(N_SAMPLES, IN_SIZE)).astype(np.float32)
        y = np.sin(2 * x @ w) + 0.05 * rng.normal(size=N_SAMPLES)
        return jnp.asarray(x), jnp.asarray(y.astype(np.float32))

    return sample(), sample()


def run(args) -> int:
    """`demo --dir --steps`: exit status 0 if every check passed, else 1."""
    return 0 if demo(args.dir, args.steps) else 1


def demo(directory: str = "demo_checkpoints", steps: int = 10) -> bool:
    """Runs the demo and prints what it did; True if every check passed.

    One function on purpose: it reads top to bottom as the demo's story
    (train, save every step, restore the best, check). An earlier demo's
    checkpoints in `directory` are deleted first; anything else there stops
    it before it writes a byte.
    """
    path = _fresh_directory(directory)
    (x, y), (x_val, y_val) = synthetic_data(SEED)
    batches = np.random.default_rng(SEED + 1)
    train_state = make_train_state(jax.random.key(SEED))
    model, state, opt_state = (train_state[k] for k in ("model", "state", "opt_state"))
    first_loss = float(eval_loss(model, state, x_val, y_val))

    saved, losses = {}, {}
    mngr = ocp.CheckpointManager(
        path,
        item_handlers=EqxHandler(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min"
        ),
    )
    try:
        for step in range(1, steps + 1):
            # Small minibatches make the validation loss wander, so the best
            # step need not be the latest: that is what `best_fn` is for.
            i = batches.choice(N_SAMPLES, BATCH, replace=False)
            model, state, opt_state = train_step(model, state, opt_state, x[i], y[i])
            loss = float(eval_loss(model, state, x_val, y_val))
            item = {
                "model": model,
                "state": state,
                "opt_state": opt_state,
                "step": step,
            }
            # Returns once the arrays are copied off the device; the writes go
            # on in the background while the next step trains.
            mngr.save(step, args=EqxSave(item), metrics={"loss": loss})
            saved[step], losses[step] = item, loss
        mngr.wait_until_finished()
        kept, best = list(mngr.all_steps()), mngr.best_step()

        # A different key, to show the values come from disk: the skeleton is
        # all `jax.ShapeDtypeStruct`s and holds no values anyway.
        skeleton = eqx.filter_eval_shape(make_train_state, jax.random.key(SEED + 1))
        restored = mngr.restore(best, args=EqxRestore(skeleton))
    finally:
        mngr.close()

    restored_loss = float(eval_loss(restored["model"], restored["state"], x_val, y_val))
    n_leaves = len(jax.tree.leaves(restored, is_leaf=lambda x: x is None))
    arrays = jax.tree.leaves(eqx.filter(restored, eqx.is_array))
    nbytes = sum(a.nbytes for a in arrays)
    n_params = sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))

    print(
        f"Trained an MLP with BatchNorm ({IN_SIZE} -> {HIDDEN} -> 1, {n_params} "
        f"parameters) for {steps} steps with optax.adam: validation loss "
        f"{first_loss:.4f} -> {losses[steps]:.4f}."
    )
    print(
        f"Saved every step asynchronously to {path}; Orbax kept steps "
        f"{', '.join(map(str, kept))} (max_to_keep=3, best by lowest loss)."
    )
    print(f"Best step: {best}, loss {losses.get(best, float('nan')):.6f}.")
    print(
        f"Restored step {best} into a skeleton from eqx.filter_eval_shape (built "
        f"with another key): {n_leaves} leaves, {len(arrays)} of them arrays "
        f"({human_bytes(nbytes)}) read from disk; loss {restored_loss:.6f}."
    )

    failures = _failures(best, kept, saved, losses, restored, restored_loss)
    if failures:
        for failure in failures:
            print(f"Check failed: {failure}.", file=sys.stderr)
        return False
    print(
        "Checked: same loss as recorded, and every array and Python leaf "
        "(model, BatchNorm state, optimizer state, step) equals the one saved."
    )
    print(f"Next: {_python()} -m orbax_eqx inspect {shlex.quote(directory)}")
    return True


def _failures(best, kept, saved, losses, restored, restored_loss) -> list[str]:
    """What the restore of step `best` got wrong, if anything."""
    if best not in saved or best not in kept:
        return [f"the best step {best} is not one of the kept steps {kept}"]
    failures = []
    if restored["step"] != best:
        failures.append(f"the restored step counter is {restored['step']!r}")
    if restored_loss != losses[best]:
        failures.append(
            f"the restored model's loss {restored_loss!r} differs from the "
            f"loss recorded for step {best}, {losses[best]!r}"
        )
    if not bool(eqx.tree_equal(restored, saved[best])):
        failures.append("the restored arrays differ from those saved")
    return failures


def _python() -> str:
    """This interpreter, as a command that works from the current directory.

    Not `python`: after the README's set-up (`python3 -m venv .venv` and
    `.venv/bin/python -m orbax_eqx demo`) the venv is never activated, so a
    bare `python` is another interpreter, without orbax_eqx.
    """
    executable = os.path.abspath(sys.executable or "python")
    relative = os.path.relpath(executable)
    if not relative.startswith(os.pardir + os.sep):
        # Inside the current directory: `.venv/bin/python`; a path with a
        # slash, so that the shell does not look it up on PATH.
        executable = (
            os.path.join(os.curdir, relative) if os.sep not in relative else relative
        )
    return shlex.quote(executable)


def _fresh_directory(directory: str) -> str:
    """An empty directory at `directory`, deleting an earlier demo's checkpoints."""
    path = os.path.abspath(directory)
    if os.path.lexists(path):
        if not (
            os.path.isdir(path) and not os.path.islink(path) and _holds_steps(path)
        ):
            raise FileExistsError(
                f"{path} exists and does not look like the demo's checkpoints "
                "(only CheckpointManager step directories), so the demo will not "
                "delete it. Pass --dir to choose another directory."
            )
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def _holds_steps(path: str) -> bool:
    """True if `path` holds nothing but CheckpointManager steps (or nothing)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                return False
            if _TMP_STEP_DIR.fullmatch(entry.name):
                continue
            finished = os.path.isfile(os.path.join(entry.path, _STEP_METADATA))
            if not (_STEP_DIR.fullmatch(entry.name) and finished):
                return False
    return True

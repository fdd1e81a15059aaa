"""`demo`: train a small model with BatchNorm and optax, checkpoint every step
through `CheckpointManager`, restore the best one into a skeleton and check it."""

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


def make_train_state(key):
    """Everything a run saves: model, its `eqx.nn.State`, optimizer state, step."""
    k1, k2 = jax.random.split(key)
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(IN_SIZE, HIDDEN, key=k1),
            eqx.nn.BatchNorm(HIDDEN, axis_name="batch", mode="batch"),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(HIDDEN, 1, key=k2),
        ]
    )
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "state": state, "opt_state": opt_state, "step": 0}


def _loss(model, state, x, y):
    # BatchNorm needs the batch as a named axis; its state is shared, not batched.
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batched(x, state)
    return jnp.mean((pred[:, 0] - y) ** 2), state


@eqx.filter_jit
def train_step(model, state, opt_state, x, y):
    grad = eqx.filter_value_and_grad(_loss, has_aux=True)
    (_, state), grads = grad(model, state, x, y)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), state, opt_state


@eqx.filter_jit
def eval_loss(model, state, x, y):
    # Inference mode uses BatchNorm's running statistics, which live in
    # `state`: a restore that lost the state would change this loss.
    return _loss(eqx.nn.inference_mode(model), state, x, y)[0]


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
    """Runs the demo, printing what it did; True if every check passed.

    One function on purpose: it reads top to bottom as the demo's story. An
    earlier demo's checkpoints in `directory` are deleted first; anything
    else there stops it before it writes a byte.
    """
    path = _fresh_directory(directory)
    (x, y), (x_val, y_val) = synthetic_data(SEED)
    batches = np.random.default_rng(SEED + 1)
    item = make_train_state(jax.random.key(SEED))
    model, state, opt_state = item["model"], item["state"], item["opt_state"]
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
            item = dict(model=model, state=state, opt_state=opt_state, step=step)
            # Returns once the arrays are copied off the device; the writes go
            # on in the background while the next step trains.
            mngr.save(step, args=EqxSave(item), metrics={"loss": loss})
            saved[step], losses[step] = item, loss
        mngr.wait_until_finished()
        kept, best = list(mngr.all_steps()), mngr.best_step()
        # Another key, to show the values come from disk: the skeleton is all
        # `jax.ShapeDtypeStruct`s and holds no values anyway.
        skeleton = eqx.filter_eval_shape(make_train_state, jax.random.key(SEED + 1))
        restored = mngr.restore(best, args=EqxRestore(skeleton))
    finally:
        mngr.close()

    restored_loss = float(eval_loss(restored["model"], restored["state"], x_val, y_val))
    n_leaves = len(jax.tree.leaves(restored, is_leaf=lambda x: x is None))
    arrays = jax.tree.leaves(eqx.filter(restored, eqx.is_array))
    n_params = sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"Trained an MLP with BatchNorm ({IN_SIZE} -> {HIDDEN} -> 1, {n_params} "
        f"parameters) for {steps} steps with optax.adam: validation loss "
        f"{first_loss:.4f} -> {losses[steps]:.4f}.\n"
        f"Saved every step asynchronously to {path}; Orbax kept steps "
        f"{', '.join(map(str, kept))} (max_to_keep=3, best by lowest loss).\n"
        f"Best step: {best}, loss {losses.get(best, float('nan')):.6f}.\n"
        f"Restored step {best} into a skeleton from eqx.filter_eval_shape (built "
        f"with another key): {n_leaves} leaves, {len(arrays)} of them arrays "
        f"({human_bytes(sum(a.nbytes for a in arrays))}) read from disk; loss "
        f"{restored_loss:.6f}."
    )
    failures = []
    if best not in saved or best not in kept:
        failures.append(f"the best step {best} is not one of the kept steps {kept}")
    else:
        if restored["step"] != best:
            failures.append(f"the restored step counter is {restored['step']!r}")
        if restored_loss != losses[best]:
            failures.append(
                f"the restored model's loss {restored_loss!r} differs from the loss "
                f"recorded for step {best}, {losses[best]!r}"
            )
        if not eqx.tree_equal(restored, saved[best]):
            failures.append("the restored arrays differ from those saved")
    for failure in failures:
        print(f"Check failed: {failure}.", file=sys.stderr)
    if failures:
        return False
    print(
        "Checked: same loss as recorded, and every array and Python leaf "
        "(model, BatchNorm state, optimizer state, step) equals the one saved."
    )
    print(f"Next: {_python()} -m orbax_eqx inspect {shlex.quote(directory)}")
    return True


def _python() -> str:
    """This interpreter as a command that works from the current directory: not
    a bare `python`, which after the README's set-up (a venv never activated)
    is another interpreter, without orbax_eqx."""
    executable = os.path.abspath(sys.executable or "python")
    relative = os.path.relpath(executable)
    if not relative.startswith(os.pardir + os.sep):  # `.venv/bin/python`: a
        # path with a slash, so that the shell does not look it up on PATH
        executable = relative if os.sep in relative else os.path.join(".", relative)
    return shlex.quote(executable)


def _fresh_directory(directory: str) -> str:
    """An empty directory at `directory`, deleting an earlier demo's checkpoints."""
    path = os.path.abspath(directory)
    if os.path.lexists(path):
        steps = os.path.isdir(path) and not os.path.islink(path)
        if steps:
            with os.scandir(path) as entries:
                steps = all(map(_is_step, entries))
        if not steps:
            raise FileExistsError(
                f"{path} exists and does not look like the demo's checkpoints "
                "(only CheckpointManager step directories), so the demo will not "
                "delete it. Pass --dir to choose another directory."
            )
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def _is_step(entry: os.DirEntry) -> bool:
    """A CheckpointManager step, finished or being saved when a demo stopped."""
    if not entry.is_dir(follow_symlinks=False):
        return False
    if re.fullmatch(r"[0-9]+\.orbax-checkpoint-tmp.*", entry.name):
        return True
    finished = os.path.join(entry.path, "_CHECKPOINT_METADATA")
    return bool(re.fullmatch("[0-9]+", entry.name)) and os.path.isfile(finished)

"""`EqxSave` and `EqxRestore`: the arguments of `EqxHandler`, checked when
made (before Orbax makes any directory); registered in `handler.py`."""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import orbax.checkpoint as ocp

from .._rebuild.allow import check_allow
from .._restore.renames import Renames
from .._restore.select import check_options
from .._save.checks import check_global
from .._save.prepare import check_has_data, flatten
from .._storage.transfer import staging as _staging

# Orbax has no `py.typed`: deriving from its `Any` would let type checkers
# accept any keyword, so they see `object` instead.
if TYPE_CHECKING:
    _CheckpointArgs = object
else:
    _CheckpointArgs = ocp.args.CheckpointArgs


@dataclasses.dataclass
class EqxSave(_CheckpointArgs):
    """Arguments to save `item` with `EqxHandler`.

    **Arguments:**

    - `item`: any PyTree (an `eqx.Module`, `(model, state)`, a dict with an
        optax state...). In a multi-host run every jax array must be global;
        a host-local one is an error, raised here.
    - `dedup`: store packed arrays whose bytes the newest step holds as
        references to them, as `EqxHandler(dedup=True)` does for every save
        (under a manager, or Orbax's v1 `Checkpointer`).
    """

    item: Any
    dedup: bool = dataclasses.field(default=False, kw_only=True)
    # `item` flattened once, for the checks here and the handler's save.
    _flat: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # Set by `oeqx.save`: no step directory and item to record (see `saved_as`).
    _standalone: bool = dataclasses.field(
        default=False, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        # Here, not in the handler: the manager makes directories before the
        # handler runs, and a save that cannot happen should leave none.
        self._flat = flatten(self.item)
        check_has_data(self.item, self._flat[0])
        check_global(self.item, self._flat)

    def take_flat(self) -> Any:
        """The flatten made here, once (a second save flattens anew)."""
        flat, self._flat = self._flat, None
        return flat


@dataclasses.dataclass
class EqxRestore(_CheckpointArgs):
    r"""Arguments to restore with `EqxHandler`.

    **Arguments:**

    - `skeleton`: a PyTree of the saved structure, usually
        `eqx.filter_eval_shape(make_model, key)`: it supplies classes, static
        fields, callables and `eqx.nn.Shared` wiring; the checkpoint supplies
        arrays and Python-scalar leaves. Leaves may be `jax.ShapeDtypeStruct`s
        or arrays. `None` restores a flat `{leaf name: value}` dict, or with
        `allow=` rebuilds the saved tree.
    - `allow`: without a skeleton, rebuild the saved tree importing only these
        modules and their submodules: `allow=["equinox", "jax", "my_models"]`.
        Anything named outside them, or not rebuildable (a lambda, a local
        class), is one `RebuildError` listing every such leaf.
    - `shardings`: where restored jax arrays go: one `jax.sharding.Sharding`,
        a PyTree like the skeleton with a Sharding (or None) per leaf, or a
        function `(leaf name, skeleton leaf) -> Sharding`. Default: the
        skeleton leaf's `.sharding`, else the first local device.
    - `cast`: if True, arrays whose dtype differs from the skeleton's are cast
        to it (float32 weights into a bfloat16 model); if False (the
        default), a dtype difference is an error.
    - `strict`: if True (the default), checkpoint leaves the skeleton lacks are
        an error; if False they are left unread, so a skeleton of part of the
        checkpoint restores that part and reads only its arrays.
    - `prefix`: a leaf name (`"model.encoder"`, as `python -m orbax_eqx
        inspect` shows) put before every skeleton leaf name, to restore one
        part into a skeleton of that part. Leaves outside it are never read
        and no error even with `strict=True`.
    - `renames`: restore a checkpoint saved under other names or layout: an
        `oeqx.StateDictMapping` from the skeleton's leaf names (after
        `prefix`) to the checkpoint's (`rename`, `rename_regex` with RE2
        patterns, `stack`, `transpose`, `reshape`, `split`, `fuse`, `cast`,
        `ignore`), or a dict `{old name: new name}` of exact names (`None`
        leaves a checkpoint leaf unread). A mapping that changes arrays is
        planned against the sidecar's shapes and checked before any read.
    - `renames_must_match`: if True (the default), a rule or entry of
        `renames` that matches no name, one shadowed by longer entries, and a
        rename whose every new name the checkpoint lacks are errors (almost
        always typos).
    - `missing`: `"error"` (the default) or `"keep"`: a skeleton leaf the
        checkpoint lacks keeps the skeleton's value (a fresh head for
        fine-tuning). A `jax.ShapeDtypeStruct` has no value to keep, so is
        still an error. Kept jax arrays go where `shardings` says.
    - `report`: if True, return `(tree, report)`, the report naming the leaves
        kept from the skeleton, the checkpoint leaves left unread and the
        renames done. If False, a restore that kept leaves warns
        (`oeqx.OrbaxEqxWarning`) listing them, so that a mistyped rename
        cannot silently leave a layer freshly initialised.
    - `on_static_mismatch`: `"error"` (the default) or `"warn"` (keep the
        skeleton's) when static fields, callables or module classes differ.
    - `on_moved`: `"warn"` (the default), `"error"` or `"ignore"`, when a
        checkpoint a `CheckpointManager` saved as one step and item is
        restored from another (a step copied over another, items swapped);
        `"error"` raises `CheckpointMismatchError`.
    - `verify`: if True (the default), every array read is checked against its
        checksum recorded at save; a mismatch is a `CheckpointDamagedError`
        naming the leaf. Costs a few percent of the restore time. Arrays cast
        by `cast=True` from Orbax's store, and checkpoints saved without
        checksums, are read unchecked.
    - `max_staged_bytes`: the most host memory, in bytes, array data takes on
        its way to devices that copy it (GPUs, TPUs): read a job at a time (at
        most half of this, at most a 32nd of the restore, at least 1 MiB), the
        next job read while one transfers; a leaf larger than a job streams
        into place in parts. Default (None): the smaller of 1 GiB and a tenth
        of the RAM, at least 8 MiB. CPU devices take aligned host buffers
        without a copy, so stage nothing unless this is given.

    **Returns** (from `restore`): the skeleton's structure filled with the
    checkpoint's values; with `report=True`, `(tree, RestoreReport)`.

    !!! example

        ```python
        # The model alone, from a checkpoint of {"model": m, "opt_state": s, ...}.
        args = oeqx.EqxRestore({"model": skeleton}, strict=False)
        model = mngr.restore(step, args=args)["model"]
        # One submodule.
        args = oeqx.EqxRestore(encoder_skeleton, prefix="model.encoder")
        # Fine-tuning: a fresh head, everything else from the checkpoint.
        args = oeqx.EqxRestore(new_model, missing="keep", report=True)
        model, report = mngr.restore(step, args=args)  # report.kept: the head
        # After a refactor that renamed `blocks` to `layers`.
        args = oeqx.EqxRestore(skeleton, renames={"blocks": "layers"})
        # No skeleton: the saved tree rebuilt, importing only these modules.
        args = oeqx.EqxRestore(allow=["equinox", "jax", "my_models"])
        ```
    """

    skeleton: Any = None
    allow: Sequence[str] | None = dataclasses.field(default=None, kw_only=True)
    shardings: Any = dataclasses.field(default=None, kw_only=True)
    cast: bool = dataclasses.field(default=False, kw_only=True)
    strict: bool = dataclasses.field(default=True, kw_only=True)
    prefix: str | None = dataclasses.field(default=None, kw_only=True)
    renames: Renames | None = dataclasses.field(default=None, kw_only=True)
    renames_must_match: bool = dataclasses.field(default=True, kw_only=True)
    missing: Literal["error", "keep"] = dataclasses.field(default="error", kw_only=True)
    report: bool = dataclasses.field(default=False, kw_only=True)
    on_static_mismatch: Literal["error", "warn"] = dataclasses.field(
        default="error", kw_only=True
    )
    on_moved: Literal["warn", "error", "ignore"] = dataclasses.field(
        default="warn", kw_only=True
    )
    verify: bool = dataclasses.field(default=True, kw_only=True)
    max_staged_bytes: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        _staging.check_max_bytes(self.max_staged_bytes)
        if self.on_static_mismatch not in ("error", "warn"):
            raise ValueError(
                f"EqxRestore(on_static_mismatch={self.on_static_mismatch!r}): expected "
                '"error" or "warn".'
            )
        if self.on_moved not in ("warn", "error", "ignore"):
            raise ValueError(
                f"EqxRestore(on_moved={self.on_moved!r}): expected "
                '"warn", "error" or "ignore".'
            )
        if self.missing not in ("error", "keep"):
            raise ValueError(
                f'EqxRestore(missing={self.missing!r}): expected "error" or "keep".'
            )
        check_options(self.prefix, self.renames)
        if self.allow is not None:
            self.allow = check_allow(self.allow)
            if self.skeleton is not None:
                raise ValueError(
                    "EqxRestore(skeleton, allow=...): `allow` rebuilds the tree "
                    "when there is no skeleton; pass one or the other."
                )
        if self.skeleton is None and self.allow is None:
            asked = [
                f"{name}={getattr(self, name)!r}"
                for name, default in _NEED_SKELETON.items()
                if getattr(self, name) != default
            ]
            if asked:
                raise ValueError(
                    f"EqxRestore({', '.join(asked)}) needs a skeleton: without "
                    "one, restore returns every leaf in a flat {leaf name: value} "
                    "dict. Pass the skeleton of what to restore."
                )


# Options that act on a skeleton, with their defaults.
_NEED_SKELETON = {
    "prefix": None,
    "renames": None,
    "missing": "error",
    "report": False,
}

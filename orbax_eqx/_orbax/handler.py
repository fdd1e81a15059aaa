"""`EqxHandler`: Equinox modules (and any PyTree holding them) through Orbax."""

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .._bytes import store as _store
from .._errors import ObjectStoreError, UnsupportedLeafError
from .._format import sidecar as _sidecar
from .._format import sidecar_read as _sidecar_read
from .._rebuild.allow import check_allow
from .._restore.renames import Renames
from .._restore.restore import restore_flat, restore_tree
from .._restore.select import check_options
from .._restore.together import together
from .._restore.vanished import CheckpointReplacedError, noticed
from .._save import at_exit as _at_exit
from .._save import background as _background
from .._save import claim as _claim
from .._save import released as _released
from .._save.hosts import check_global
from .._save.polite import Polite
from .._save.prepare import check_has_data, flatten, prepare
from .._storage import packing as _packing
from .._storage import shards as _shards
from .._storage import staging as _staging
from .._storage import store_files as _store_files
from .._storage.checksum import host_sum32
from . import object_commit as _object_commit
from . import plain as _plain
from . import rebuilt as _rebuilt

TYPESTR = "orbax_eqx.EqxHandler"


class EqxHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores a PyTree of Equinox modules, arrays and Python values.

    Unsharded arrays (numpy, on one device, or fully replicated) are packed end
    to end into one pack file, written and read at disk speed with no cost per
    leaf; sharded arrays go to shard packs: each process writes the distinct
    shards it holds into a file of its own, with an index of chunk boxes, and
    a restore onto any sharding reads just the byte ranges each device needs.
    No computation runs over a sharded array (on accelerators, small arrays
    are stacked on their own device before one copy to host, and a restore
    streams large leaves into place on their device; see `max_staged_bytes`),
    and processes meet only at Orbax's own barriers. With `pack=False`,
    every array goes, one stored array per leaf, through Orbax's own array
    machinery (OCDBT). Everything else
    (static fields, Python scalars, callables, tied-weight markers) and where
    every array is goes into a JSON sidecar, which restore checks against a
    skeleton before reading any array. Every leaf restores on its own: a
    partial restore reads only the bytes of the leaves it wants.

    **Arguments:**

    - `pack`: pack unsharded arrays and write sharded ones to shard packs (the
        default). `False` stores every array through Orbax, one stored array
        per leaf, as orbax_eqx 0.1 did: for storage that pack files cannot be
        written to (object stores without ranged writes).
    - `use_ocdbt`: store Orbax's arrays in its OCDBT format (fewer, larger files).
    - `use_zarr3`: use the Zarr v3 array format for Orbax's arrays.
    - `use_compression`: compress Orbax's array chunks with zstd (packed arrays
        are never compressed: it takes `pack=False`, or sharded arrays). Off
        by default on every store: on float weights it saves ~8% of the bytes
        and, measured on disk and gs://, costs 2-6x the restore time of packs;
        it pays on constants, such as a fresh optimizer state's zeros (see
        BENCHMARKS.md, "Compression").
    - `save_concurrent_gb`, `restore_concurrent_gb`: caps, in GB (fractions
        work: `0.05`), on the bytes of Orbax's array data in flight at once,
        to bound host memory. Packed
        arrays are all held in host memory from `save` until written.
    - `multiprocessing_options`: Orbax's options for multi-host runs; the
        sidecar and the pack file are written by `primary_host` only, each
        process writes its own shard pack.
    - `checksums`: record a checksum of every array (the default), which
        restores and `oeqx.verify` check: CRC-32s of packed arrays and of
        every 1 MiB of shard-pack chunks, computed on host while the files are
        written; for Orbax-stored arrays (`pack=False`) a sum computed on host
        where one process holds the whole array (multi-host `pack=False`
        saves are not summed; see `_storage.checksum`). Costs a few percent of the
        save time (BENCHMARKS.md); False saves without them.

    !!! example

        ```python
        mngr = ocp.CheckpointManager(path, item_handlers=oeqx.EqxHandler())
        mngr.save(step, args=oeqx.EqxSave(model))
        model = mngr.restore(step, args=oeqx.EqxRestore(skeleton))
        ```
    """

    def __init__(
        self,
        *,
        pack: bool = True,
        use_ocdbt: bool = True,
        use_zarr3: bool = False,
        use_compression: bool = False,
        save_concurrent_gb: float | None = None,
        restore_concurrent_gb: float | None = None,
        multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
        checksums: bool = True,
    ):
        mp = multiprocessing_options or ocp.options.MultiprocessingOptions()
        self._primary_host = mp.primary_host
        self._pack = pack
        self._checksums = checksums
        # Item directories this handler is saving: (token, `_save.claim.Started` on
        # the primary host, whether Orbax stores arrays). `finalize` needs
        # them; re-reading the sidecar costs ~0.1 s on a 6,000-leaf model.
        self._saving: dict[str, tuple[str, Any, bool]] = {}
        self._inner = ocp.PyTreeCheckpointHandler(
            use_ocdbt=use_ocdbt,
            use_zarr3=use_zarr3,
            use_compression=use_compression,
            save_concurrent_gb=save_concurrent_gb,
            restore_concurrent_gb=restore_concurrent_gb,
            multiprocessing_options=mp,
        )

    @classmethod
    def typestr(cls) -> str:
        # Pinned: checkpoints record it, so moving the class must not break them.
        return TYPESTR

    async def async_save(
        self,
        directory: epath.Path,
        item: Any = None,
        args: "EqxSave | None" = None,
    ) -> list[ocp.Future]:
        """Starts a save; returns once arrays are safe in host memory.

        Packed arrays are taken to host memory here (the caller may donate or
        change them as soon as this returns; see `_packing.host_copies`);
        writing them happens in the background.
        """
        _object_commit.check(directory, self._pack)
        primary = ocp.multihost.is_primary_host(self._primary_host)
        try:
            _object_commit.reachable(directory)  # the first save into a bucket
        except ObjectStoreError:
            # As for a refused leaf below: let Orbax finish the directories.
            await _undo_directories(epath.Path(directory), primary)
            raise
        flat = None
        if args is None:
            check_global(item)  # EqxSave checks its own item when made
        else:
            flat = args.take_flat()
        tree = args.item if args is not None else item
        token = _claim.new_token()
        try:
            prepared = prepare(
                tree,
                token=token,
                pack=self._pack,
                copy_packed=primary,
                checksums=self._checksums,
                flat=flat,
            )
        except UnsupportedLeafError:
            # Refused before anything was written (with `pack=False`, a dtype
            # Orbax's store cannot hold: only this handler knows `pack`). Orbax
            # is making this save's directories in the background meanwhile:
            # let it finish, so that a save of the step right after does not
            # run into it, and remove them if they hold nothing else.
            await _undo_directories(epath.Path(directory), primary)
            raise
        started = _claim.Started(epath.Path(directory), token) if primary else None
        if started is not None:
            started.stored_keys = tuple(prepared.stored)
        # The directory is noted when the writes start (`_write_files`), once
        # Orbax has made it: one here already may be a leftover of a save that
        # was killed, which Orbax deletes and makes anew in the background
        # (a job resumed after a crash saves that step again).
        self._saving[os.fspath(directory)] = (
            token,
            started,
            bool(prepared.stored),
            prepared.shard_files,
        )
        futures = []
        where = _background.target(directory)  # named by errors of the writes
        _at_exit.started(where, _background.final_directory(directory))
        try:
            if prepared.stored:
                inner = await _released.run(
                    self._inner.async_save(
                        _sidecar.arrays_dir(directory, token),
                        args=ocp.args.PyTreeSave(prepared.stored),
                    ),
                    name="orbax_eqx_arrays",
                )
                explain = functools.partial(_claim.explain, started)
                futures.extend(
                    _background.NotedFuture(f, where, explain) for f in inner or []
                )
            futures.append(
                _released.commit_future(
                    _background.noted_coroutine(
                        self._write_files(directory, prepared, started), where
                    ),
                    name="orbax_eqx_files",
                )
            )
        except BaseException:
            _at_exit.ended(where)  # raised here, to the caller: nothing to finish
            raise
        return futures

    async def _write_files(self, directory: epath.Path, prepared, started) -> None:
        # Every host has this future and writes its shard pack; only the
        # primary took host copies of packed arrays, and writes them and the
        # sidecar. It runs in a thread of its own (Orbax's commit future), so
        # the blocking writes hold up nothing else. The sidecar goes last: it
        # records the checksums, and a step without it is no checkpoint.
        primary = ocp.multihost.is_primary_host(self._primary_host)
        if primary and started.identity is None:
            _claim.begin(started)
        try:
            # The leaves' names and the sidecar's content, and the rest of
            # the host copies (see `_save/prepare.py`).
            prepared.finish()
            if prepared.local is not None:
                token = prepared.content["token"]
                process = jax.process_index()
                for path in _shards.write(directory, token, process, prepared.local):
                    if primary:
                        _claim.wrote(started, path)
            if primary:
                self._write_pack_and_sidecar(directory, prepared, started)
        except OSError as e:  # perhaps because another save took the directory
            _claim.explain(started, e)
            raise

    def _write_pack_and_sidecar(self, directory, prepared, started) -> None:
        crcs = {}
        token = prepared.content["token"]
        if prepared.pack_nbytes:
            path = directory / _sidecar.pack_file(token, 0)
            found = _packing.write(
                path, prepared.pieces, prepared.pack_nbytes, self._checksums
            )
            _claim.wrote(started, path)
            crcs = dict(zip(prepared.packed_names, found))
            # Lets go of the host copies now, not after the sidecar: a view of
            # a CPU array's buffer keeps donating that array from reusing it.
            prepared.pieces = []
        sums = {name: host_sum32(np.asarray(x)) for name, x in prepared.sums.items()}
        _sidecar.record_checksums(prepared.content, crcs, sums)
        _claim.before_sidecar(started)
        try:
            _sidecar.write(directory, prepared.content, Polite())
        except FileExistsError:
            _claim.claim_failed(started)
        _claim.wrote(started, directory / _sidecar.FILE_NAME)

    def save(
        self, directory: epath.Path, item: Any = None, args: "EqxSave | None" = None
    ) -> None:
        """Saves and waits until every write is done."""

        async def save_and_wait():
            _background.wait_all(await self.async_save(directory, item, args))

        _run_sync(save_and_wait())

    def restore(
        self,
        directory: epath.Path,
        item: Any = None,
        args: "EqxRestore | None" = None,
    ) -> Any:
        """Restores into `args.skeleton`, or into a flat `{name: value}` dict."""
        if args is None:
            args = EqxRestore(item)
        # With several processes, all succeed or all raise one error (see
        # `together`): one failing alone would leave the rest in Orbax's
        # barriers for good.
        return together(directory, lambda: self._restore_current(directory, args))

    def _restore_current(self, directory: epath.Path, args: "EqxRestore") -> Any:
        try:
            return self._restore(directory, args)
        except CheckpointReplacedError:
            # Another save swapped a new checkpoint in under this restore:
            # the caller asked for what is at `directory`, which is the new one.
            return self._restore(directory, args)

    def _restore(self, directory: epath.Path, args: "EqxRestore") -> Any:
        # Says so if the step is deleted or replaced meanwhile.
        with noticed(directory):
            if _plain.is_plain(epath.Path(directory)):  # saved by Orbax alone
                return _plain.restore(epath.Path(directory), args)
            saved = _sidecar_read.read(epath.Path(directory))
            if args.skeleton is None and args.allow is not None:
                return _rebuilt.restore(self._inner, directory, saved, args)
            if args.skeleton is None:
                return restore_flat(
                    self._inner,
                    directory,
                    saved,
                    verify=args.verify,
                    max_staged_bytes=args.max_staged_bytes,
                )
            return restore_tree(self._inner, directory, saved, args)

    def metadata(self, directory: epath.Path) -> _sidecar.Metadata:
        """What the sidecar records: every leaf, module and static field."""
        return _sidecar_read.read(epath.Path(directory))

    def finalize(self, directory: epath.Path) -> None:
        # Merges the per-process OCDBT trees (without it, multi-host saves
        # leave arrays unreadable), then checks that no other save of the same
        # step took the directory over, just before Orbax commits it.
        saving = self._saving.pop(os.fspath(directory), None)
        if saving is None:
            saving = _saved_here(epath.Path(directory))
        token, started, stored, shard_files = saving
        where = _background.target(directory)
        _at_exit.ended(where)  # Orbax commits the step once this returns
        with _background.noted(where):
            if stored:
                arrays = _sidecar.arrays_dir(directory, token)
                try:
                    # Orbax's merge and our commit check read the store.
                    _store_files.check(arrays, saving=True)
                    self._inner.finalize(arrays)
                except Exception as e:
                    _claim.explain(started, e)
                    raise
            # Orbax's barrier has passed: every process's writes are done.
            _check_shard_files(epath.Path(directory), token, shard_files, started)
            if started is not None:
                _claim.before_commit(started)

    def close(self) -> None:
        self._inner.close()


# How long a refused save waits for Orbax to make its directories.
_DIRECTORIES_WAIT_S = 30.0
_ORBAX_TMP = ".orbax-checkpoint-tmp"


async def _undo_directories(directory: epath.Path, primary: bool) -> None:
    """Waits for Orbax's background making of this save's directories (its
    "directory made" signals), then, on the primary host, removes the item
    directory if empty and the temporary step directory around it if it
    holds only Orbax's step metadata: a save refused before writing leaves
    nothing behind.

    Orbax writes the step metadata (`_CHECKPOINT_METADATA`) in a thread of
    its own after the signal; the step directory goes only once that file is
    there, else Orbax's write would find no directory and fail the manager's
    next call (`FileNotFoundError`). If it never comes, the directory stays
    (Orbax replaces a leftover temporary directory on the next save).
    """

    async def nothing() -> None:
        return None

    made = _released.commit_future(nothing(), name="orbax_eqx_refused")
    try:
        await asyncio.to_thread(made.result, _DIRECTORIES_WAIT_S)
    except Exception:  # not made in time, or could not be: leave it to Orbax
        return
    if not primary or "://" in os.fspath(directory):
        return
    try:
        os.rmdir(directory)  # fails unless empty
        step = directory.parent
        if _ORBAX_TMP not in step.name:
            return
        if not await asyncio.to_thread(_appears, step / _STEP_METADATA):
            return
        if set(os.listdir(step)) <= {_STEP_METADATA}:
            for name in os.listdir(step):
                os.remove(step / name)
            os.rmdir(step)
    except OSError:
        pass  # something else is there: keep it


_STEP_METADATA = "_CHECKPOINT_METADATA"


def _appears(path: epath.Path) -> bool:
    """Whether `path` exists within `_DIRECTORIES_WAIT_S`. Once it does, Orbax's
    write of it has opened it: removing it and its directory then harms no
    write (the open file is written and dropped)."""
    deadline = time.monotonic() + _DIRECTORIES_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _saved_here(directory: epath.Path) -> tuple[str | None, None, bool, int]:
    """What `finalize` needs, from the sidecar, for a save this handler did not
    start (Orbax finalizing with a new handler)."""
    if not (directory / _sidecar.FILE_NAME).exists():
        return None, None, True, 0
    saved = _sidecar_read.read(directory)
    stored = any(leaf.data == _sidecar.STORED for leaf in saved.leaves.values())
    return saved.token, None, stored, saved.shard_files


def _check_shard_files(directory: epath.Path, token, shard_files: int, started):
    """Every process's shard pack and index must be there before the commit."""
    if token is None or not shard_files:
        return
    missing = [
        name
        for process in range(shard_files)
        for name in (
            _sidecar.shard_file(token, process),
            _sidecar.shard_index(token, process),
        )
        if not _store.for_path(directory / name).exists(directory / name)
    ]
    if missing:
        error = FileNotFoundError(
            f"Before committing the save in {directory}: the shard-pack files "
            f"{', '.join(missing[:4])} of {shard_files} process(es) are missing."
        )
        _claim.explain(started, error)  # another save of the step deleted them?
        raise error


def _run_sync(coro) -> Any:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None:
        return asyncio.run(coro)
    # Called from inside an event loop (a notebook, say): run in a thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


_Args = TypeVar("_Args", bound=type)

# _TYPED_INIT: Orbax ships no `py.typed`, so to mypy `ocp.args.CheckpointArgs`
# is `Any`, and a dataclass deriving from `Any` takes any keyword: a misspelt
# option would pass. So type checkers see an `__init__` written out (the
# dataclass makes the real one; tests/test_typing.py checks that the two
# agree).


def _registered(*, for_save: bool = False) -> Callable[[_Args], _Args]:
    """`ocp.args.register_with_handler(EqxHandler, ...)`, typed: Orbax ships no
    `py.typed`, so type checkers would see the args classes as `Any` and miss
    a misspelt option."""

    def register(cls: _Args) -> _Args:
        return ocp.args.register_with_handler(
            EqxHandler, for_save=for_save, for_restore=not for_save
        )(cls)

    return register


@_registered(for_save=True)
@dataclasses.dataclass
class EqxSave(ocp.args.CheckpointArgs):
    """Arguments to save `item` with `EqxHandler`.

    **Arguments:**

    - `item`: any PyTree: an `eqx.Module`, `(model, state)`,
        `{"model": m, "opt_state": s, "step": 3}`, an optax state... In a
        multi-host run every jax array in it must be global (span the
        processes' devices); a host-local one is an error, raised here.
    """

    item: Any
    # `item` flattened once, for the checks here and the handler's save.
    _flat: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    if TYPE_CHECKING:  # see `_TYPED_INIT`

        def __init__(self, item: Any) -> None: ...

    def __post_init__(self):
        # Here, not in the handler: the manager makes directories before the
        # handler runs, and a save that cannot happen should leave none.
        self._flat = flatten(self.item)
        check_has_data(self.item, self._flat[0])
        check_global(self.item, self._flat)

    def take_flat(self) -> Any:
        """The flatten made here, once (a second save with these args, after
        the item's dicts or lists changed, flattens anew)."""
        flat, self._flat = self._flat, None
        return flat


@_registered()
@dataclasses.dataclass
class EqxRestore(ocp.args.CheckpointArgs):
    r"""Arguments to restore with `EqxHandler`.

    **Arguments:**

    - `skeleton`: a PyTree of the saved structure, usually
        `eqx.filter_eval_shape(make_model, key)`. It supplies classes, static
        fields, callables and `eqx.nn.Shared` wiring; the checkpoint supplies
        arrays and Python-scalar leaves. Leaves may be `jax.ShapeDtypeStruct`s
        or concrete arrays. `None` restores a flat `{leaf name: value}` dict,
        or with `allow=` rebuilds the saved tree.
    - `allow`: without a skeleton, rebuild the saved tree (its modules,
        containers, static fields, callables) from the checkpoint, importing
        only these modules (a name allows that module and its submodules),
        whatever the checkpoint names: `allow=["equinox", "jax", "my_models"]`.
        Anything the checkpoint names outside them, or that cannot be rebuilt
        (a lambda, a local class), is one `RebuildError` listing every such
        leaf. Needs a checkpoint saved with sidecar format 5 or later.
    - `shardings`: where restored jax arrays go: one `jax.sharding.Sharding`
        for all, a PyTree shaped like the skeleton with a Sharding (or None) at
        each leaf, or a function `(leaf name, skeleton leaf) -> Sharding`.
        Default: the skeleton leaf's `.sharding`, else the first local device.
    - `cast`: if True, arrays whose dtype differs from the skeleton's are cast
        to the skeleton's dtype (to load float32 weights into a bfloat16 model).
        If False (the default), a dtype difference is an error.
    - `strict`: if True (the default), checkpoint leaves that the skeleton
        lacks are an error; if False they are left unread, so a skeleton of
        part of the checkpoint (`{"model": skeleton}` of a checkpoint of
        `{"model": m, "opt_state": s, "step": 3}`) restores that part and reads
        only its arrays.
    - `prefix`: restore one part of the checkpoint into a skeleton of that
        part: a leaf name (`"model.encoder"`, as `python -m orbax_eqx inspect`
        shows names) put before every skeleton leaf name, so the skeleton leaf
        `layers.0.weight` is restored from `model.encoder.layers.0.weight`.
        Leaves outside the prefix are never read, and are no error even with
        `strict=True`, which then applies to the leaves under the prefix.
    - `renames`: restore a checkpoint saved under older names. Maps checkpoint
        leaf names to the names the skeleton has, as if the checkpoint had
        been saved with the new ones (`prefix` applies after it): a dict
        `{old name: new name}`; a list of `(regex, replacement)` rules, of
        which the first whose pattern matches the whole name gives the new name
        (`re.Match.expand`: `(r"blocks\.(.*)", r"layers.\1")`); or a function
        `old name -> new name`. A new name of `None` leaves the leaf out (it
        is then no error with `strict=True`). Renames map names to names
        only: to change an array (split a fused `attn.qkv` into `q`, `k`, `v`),
        restore it under a name of its own and change it after the restore
        (the README shows how); a restore never computes on your arrays.
    - `renames_must_match`: if True (the default), a dict entry or rule that
        matches no checkpoint leaf name, a function that renames nothing, and
        a rename whose new names the skeleton lacks are errors, since they are
        almost always typos. False allows them.
    - `missing`: `"error"` (the default) or `"keep"`. With `"keep"`, a skeleton
        leaf that the checkpoint lacks keeps the skeleton's own value: build
        the skeleton with a freshly initialised new head, and every other leaf
        comes from the checkpoint (fine-tuning). A `jax.ShapeDtypeStruct`
        has no value to keep, so it is still an error. Kept jax arrays go
        where `shardings` says.
    - `report`: if True, return `(tree, report)`, where `report` is a
        `oeqx.RestoreReport` naming the leaves kept from the skeleton, the
        checkpoint leaves left unread, and the renames done. If False (the
        default), a restore that kept leaves warns (`oeqx.KeptLeavesWarning`)
        and lists them: kept leaves are asked for, but a mistyped rename would
        otherwise leave a layer at its fresh initialisation without a sign. A
        caller that asks for the report has the list, so is not warned.
    - `on_static_mismatch`: `"error"` (the default) or `"warn"`. What to do
        when static fields, callables or module classes differ between the
        skeleton and the checkpoint; with `"warn"` the skeleton's are kept.
    - `verify`: if True (the default), every array read is checked against
        the checksum recorded when it was saved, and a mismatch is a
        `CheckpointDamagedError` naming the leaf: a flipped bit is never
        restored as a wrong value. Costs a few percent of the restore time
        (BENCHMARKS.md). Arrays cast by `cast=True` from Orbax's store, and
        checkpoints saved without checksums, are read unchecked.
    - `max_staged_bytes`: the most host memory, in bytes, that array data takes
        on its way to devices that copy it (GPUs, TPUs): bytes are read a job
        at a time (at most half of this, and at most a 32nd of what is
        restored but at least 1 MiB), the next job read while this one is
        transferred, and let go
        once it is on its devices; a leaf larger than a job is streamed into
        place in parts. Default (None): the smaller of 1 GiB and a tenth of
        the RAM; at least 8 MiB. On CPU devices aligned host buffers become
        the arrays without a copy, so nothing is staged (the environment
        variable `ORBAX_EQX_STAGING=copy` makes CPUs copy too, for tests).

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
        args = oeqx.EqxRestore(skeleton, renames=[(r"blocks\.(.*)", r"layers.\1")])
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
    verify: bool = dataclasses.field(default=True, kw_only=True)
    max_staged_bytes: int | None = dataclasses.field(default=None, kw_only=True)

    if TYPE_CHECKING:  # see `_TYPED_INIT`; the same parameters as the fields

        def __init__(
            self,
            skeleton: Any = None,
            *,
            allow: Sequence[str] | None = None,
            shardings: Any = None,
            cast: bool = False,
            strict: bool = True,
            prefix: str | None = None,
            renames: Renames | None = None,
            renames_must_match: bool = True,
            missing: Literal["error", "keep"] = "error",
            report: bool = False,
            on_static_mismatch: Literal["error", "warn"] = "error",
            verify: bool = True,
            max_staged_bytes: int | None = None,
        ) -> None: ...

    def __post_init__(self):
        _staging.check_max_bytes(self.max_staged_bytes)
        if self.on_static_mismatch not in ("error", "warn"):
            raise ValueError(
                f"EqxRestore(on_static_mismatch={self.on_static_mismatch!r}): expected "
                '"error" or "warn".'
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

"""`EqxHandler`: Equinox modules (and any PyTree holding them) through Orbax."""

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import warnings
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from .._bytes import damage as _damage
from .._bytes import route as _route
from .._errors import (
    ObjectStoreError,
    ObjectStoreSaveError,
    OrbaxEqxWarning,
    UnsupportedLeafError,
)
from .._format import sidecar as _sidecar
from .._format import sidecar_read as _sidecar_read
from .._format.locate import is_plain_item
from .._gc import paused
from .._restore.check import check_place
from .._restore.restore import restore_flat, restore_tree
from .._restore.together import together
from .._restore.vanished import CheckpointReplacedError, noticed
from .._save import at_exit as _at_exit
from .._save import claim as _claim
from .._save import files as _files
from .._save import futures as _futures
from .._save.checks import check_global
from .._save.prepare import prepare
from .._storage import shared as _shared
from .._storage.orbax_store import files as _store_files
from .._storage.transfer.pool import MAX_IDLE, HostPool
from . import plain as _plain
from . import rebuilt as _rebuilt
from . import refused as _refused
from .args import EqxRestore, EqxSave

TYPESTR = "orbax_eqx.EqxHandler"
# Set while `EqxHandler.save` runs: the save returns only once written, so the
# caller cannot change a numpy array meanwhile and none needs copying first.
_WAITED = contextvars.ContextVar("orbax_eqx_waited", default=False)


class EqxHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores a PyTree of Equinox modules, arrays and Python values.

    Unsharded arrays are packed end to end into one pack file; each process
    writes the distinct shards of sharded arrays it holds into a shard pack
    of its own, and a restore onto any sharding reads just the byte ranges
    each device needs. No computation runs over a sharded array, and
    processes meet only at Orbax's barriers. Everything else (static fields,
    Python scalars, callables, tied weights) and where every array is goes
    into a JSON sidecar, checked against the skeleton before any array is
    read. A partial restore reads only the bytes of the leaves it wants.

    **Arguments:**

    - `pack`: pack arrays (the default). `False` stores every array through
        Orbax (OCDBT), one per leaf: for storage that takes no pack files
        (object stores without ranged writes).
    - `use_ocdbt`: store Orbax's arrays in its OCDBT format (fewer files).
    - `use_zarr3`: use the Zarr v3 array format for Orbax's arrays.
    - `use_compression`: compress Orbax's array chunks with zstd (packs are
        never compressed). Off by default: on float weights it saves ~8% of
        the bytes at several times the restore time; it pays on constants,
        such as a fresh optimizer state's zeros.
    - `save_concurrent_gb`, `restore_concurrent_gb`: caps, in GB (`0.05`
        works), on Orbax's array bytes in flight, to bound host memory.
        Packed arrays are held in host memory from `save` until written.
    - `multiprocessing_options`: Orbax's multi-host options; the sidecar and
        the pack file are written by `primary_host` only.
    - `checksums`: record a checksum of every array (the default), checked by
        restores and `oeqx.verify`: XXH3-64s of packed arrays and of every
        block of shard-pack chunks; for `pack=False` a sum computed where one
        process holds the whole array. Costs a few percent of the save time.
    - `kept_copy_bytes`: the most host memory, in bytes (8 GiB by default),
        kept between async saves for copies of numpy leaves (reusing buffers
        halves an async save's time for large ones), until a save of other
        shapes or `close()`; `0` keeps none.
    - `dedup`: under a `CheckpointManager`, write only the packed arrays and
        sharded chunks whose bytes changed since the newest step; the rest
        are references to bytes in `orbax_eqx~shared/` beside the steps
        (docs/guides/frozen-weights.md). Deleting a step never breaks
        another; each save deletes shared bytes no step refers to. Needs
        `pack=True`.

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
        kept_copy_bytes: int = MAX_IDLE,
        dedup: bool = False,
    ):
        if dedup and not pack:
            raise ValueError(
                "EqxHandler(dedup=True, pack=False): only packed arrays are "
                "stored once across steps. Leave `pack=True` (the default), or "
                "drop `dedup=True`."
            )
        mp = multiprocessing_options or ocp.options.MultiprocessingOptions()
        self._primary_host = mp.primary_host
        self._pack = pack
        self._dedup = dedup
        self._checksums = checksums
        # For `finalize`, by item directory: (token, `_save.claim.Started` on the
        # primary host, whether Orbax stores arrays, how many shard packs).
        self._saving: dict[str, tuple[str | None, Any, bool, int]] = {}
        self._deduped: set[str] = set()  # of those, saved with `dedup`
        self._known = _shared.Known()  # identities of jax arrays saved with it
        self._roots: set[str] = set()  # of its dedup saves, collected at `close`
        # Buffers of async saves' numpy copies, reused by the next save.
        self._pool = HostPool(kept_copy_bytes)
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
        """Starts a save; returns once arrays are safe in host memory (the
        caller may then donate or change them); writes run in the background."""
        primary = ocp.multihost.is_primary_host(self._primary_host)
        dedup = self._dedup or (args is not None and args.dedup)
        if dedup and not self._pack:
            raise ValueError(
                "EqxSave(dedup=True) with EqxHandler(pack=False): only packed "
                "arrays are stored once across steps. Save with `pack=True` (the "
                "default), or drop `dedup=True`."
            )
        if dedup and _saved_as(directory, args) is None:
            raise ValueError(
                f"`dedup=True` saves the steps of a CheckpointManager, "
                f"whose later steps refer to earlier ones' bytes; {directory} is a "
                "checkpoint of its own. Save it through `ocp.CheckpointManager`, "
                "or with a handler without `dedup=True`."
            )
        await self._check_store(directory, primary)
        token = _claim.new_token()
        prepared = await self._prepare(directory, item, args, token, primary)
        started = _claim.Started(epath.Path(directory), token) if primary else None
        if started is not None:
            started.stored_keys = tuple(prepared.stored)
        # The directory is noted once Orbax has made it (`files`): one here
        # now may be a killed save's leftover, which Orbax makes anew.
        self._saving[os.fspath(directory)] = (
            token,
            started,
            bool(prepared.stored),
            prepared.shard_files,
        )
        if dedup:
            self._deduped.add(os.fspath(directory))
        where = _futures.target(directory)  # named by errors of the writes
        _at_exit.started(where, _futures.final_directory(directory))
        try:
            return await self._start_writes(
                directory, token, prepared, started, where, dedup
            )
        except BaseException:
            _at_exit.ended(where)  # raised here, to the caller: nothing to finish
            raise

    async def _check_store(self, directory, primary: bool) -> None:
        """Refuses a save an object store cannot take, before any write."""
        try:
            _refused.check(directory, self._pack)
            _refused.reachable(directory)  # the first save into a bucket
        except (ObjectStoreSaveError, ObjectStoreError):
            # Let Orbax finish making this save's directories, or its threads
            # would wait out their timeout at exit.
            await _refused.undo_directories(epath.Path(directory), primary)
            raise

    async def _prepare(self, directory, item, args, token: str, primary: bool):
        """The save's plan and its host copies (`_save.prepare`)."""
        flat = None
        if args is None:
            check_global(item)  # EqxSave checks its own item when made
        else:
            flat = args.take_flat()
        tree = args.item if args is not None else item
        try:
            with paused():  # see `_gc`
                return prepare(
                    tree,
                    token=token,
                    pack=self._pack,
                    copy_packed=primary,
                    checksums=self._checksums,
                    flat=flat,
                    waited=_WAITED.get(),
                    lease=self._pool.lease(),
                    saved_as=_saved_as(directory, args),
                )
        except UnsupportedLeafError:
            # (With `pack=False`, a dtype Orbax's store cannot hold.) Let Orbax
            # finish making the directories, then remove them if empty.
            await _refused.undo_directories(epath.Path(directory), primary)
            raise

    async def _start_writes(
        self, directory, token: str, prepared, started, where, dedup: bool
    ) -> list[Any]:
        """Orbax's write of its arrays, if any, and ours, as futures."""
        futures: list[Any] = []
        if prepared.stored:
            inner = await _futures.run(
                self._inner.async_save(
                    _sidecar.arrays_dir(directory, token),
                    args=ocp.args.PyTreeSave(prepared.stored),
                ),
                name="orbax_eqx_arrays",
            )
            explain = functools.partial(_claim.explain, started)
            futures.extend(_futures.NotedFuture(f, where, explain) for f in inner or [])
        primary = ocp.multihost.is_primary_host(self._primary_host)

        async def files() -> None:
            _files.write(
                directory,
                prepared,
                started,
                primary,
                self._checksums,
                dedup,
                self._known,
            )

        future = _futures.commit_future(files(), name="orbax_eqx_files")
        futures.append(_futures.NotedFuture(future, where))
        return futures

    def save(
        self, directory: epath.Path, item: Any = None, args: "EqxSave | None" = None
    ) -> None:
        """Saves and waits until every write is done."""

        async def save_and_wait():
            waited = _WAITED.set(True)
            try:
                futures = await self.async_save(directory, item, args)
            finally:
                _WAITED.reset(waited)
            _futures.wait_all(futures)

        with paused():
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

        def current() -> Any:
            try:
                return self._restore(directory, args)
            except CheckpointReplacedError:
                # Another save swapped a new checkpoint in under this restore:
                # the caller asked for what is at `directory`, the new one.
                return self._restore(directory, args)

        # All processes succeed or all raise one error (`together`); object
        # store bytes that fail their checks are read again (`_bytes.damage`).
        with paused():  # one object per leaf, many times over: see `_gc`
            return together(directory, lambda: _damage.confirmed(directory, current))

    def _restore(self, directory: epath.Path, args: "EqxRestore") -> Any:
        # Says so if the step is deleted or replaced meanwhile.
        with noticed(directory):
            if is_plain_item(epath.Path(directory)):  # saved by Orbax alone
                return _plain.restore(epath.Path(directory), args)
            rebuild = args.skeleton is None and args.allow is not None
            # Only a rebuild reads the records of inner nodes.
            saved = _sidecar_read.read(epath.Path(directory), nodes=rebuild)
            check_place(epath.Path(directory), saved, args.on_moved)
            if rebuild:
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
        # Merges the per-process OCDBT trees, then checks that no other save
        # of the step took the directory over, just before Orbax commits it.
        saving = self._saving.pop(os.fspath(directory), None)
        if saving is None:
            saving = _saved_here(epath.Path(directory))
        token, started, stored, shard_files = saving
        where = _futures.target(directory)
        _at_exit.committing(where)  # Orbax commits the step once this returns
        with _futures.noted(where):
            if stored:
                arrays = epath.Path(directory)  # (no sidecar here: not known)
                if token is not None:
                    arrays = _sidecar.arrays_dir(directory, token)
                try:
                    # Orbax's merge and our commit check read the store.
                    _store_files.check(arrays, saving=True)
                    self._inner.finalize(arrays)
                except Exception as e:
                    _claim.explain(started, e)
                    raise
            deduped = os.fspath(directory) in self._deduped
            self._deduped.discard(os.fspath(directory))
            # Orbax's barrier has passed: every process's writes are done.
            _check_shard_files(
                epath.Path(directory), token, shard_files, started, deduped
            )
            if started is not None:
                _claim.before_commit(started)
            if deduped and ocp.multihost.is_primary_host(self._primary_host):
                step = epath.Path(directory).parent
                _collect(step.parent, saving=step)
                # Once Orbax has deleted the steps its retention drops after
                # this one, `close` collects what they alone held.
                self._roots.add(os.fspath(step.parent))

    def close(self) -> None:
        for root in sorted(self._roots):  # every save has ended: see `finalize`
            _collect(epath.Path(root))
        self._roots.clear()
        self._pool.close()
        self._inner.close()


def _saved_as(directory, args: "EqxSave | None") -> tuple[str, str] | None:
    """The step directory and item the sidecar records (none for `oeqx.save`,
    whose checkpoint may be moved anywhere)."""
    if args is not None and args._standalone:
        return None
    return _futures.step_and_item(directory)


def _collect(root: epath.Path, saving: epath.Path | None = None) -> None:
    """Deletes the shared packs in `root` no step refers to; a failure only
    warns (the next save tries again)."""
    try:
        _shared.collect(root, saving=saving)
    except _shared.Busy:
        pass  # (after the saves, a save under way elsewhere: its files stay)
    except Exception as e:
        warnings.warn(
            f"orbax_eqx could not delete the shared bytes no step refers to "
            f"any more, beside the steps in {root}: {e}. Nothing in use was "
            "deleted; the next save tries again.",
            OrbaxEqxWarning,
            stacklevel=2,
        )


def _saved_here(directory: epath.Path) -> tuple[str | None, None, bool, int]:
    """What `finalize` needs, from the sidecar, for a save of another handler."""
    if not (directory / _sidecar.FILE_NAME).exists():
        return None, None, True, 0
    saved = _sidecar_read.read(directory, nodes=False)
    stored = any(leaf.data == _sidecar.STORED for leaf in saved.leaves.values())
    return saved.token, None, stored, saved.shard_files


def _check_shard_files(directory, token, shard_files: int, started, dedup: bool):
    """Every process's shard pack and index must be there before the commit
    (with `dedup`, the index: its shard pack is in the shared directory)."""
    if token is None or not shard_files:
        return
    missing = [
        name
        for process in range(shard_files)
        for name in (
            *(() if dedup else (_sidecar.shard_file(token, process),)),
            _sidecar.shard_index(token, process),
        )
        if not _route.for_path(directory / name).exists(directory / name)
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


ocp.args.register_with_handler(EqxHandler, for_save=True)(EqxSave)
ocp.args.register_with_handler(EqxHandler, for_restore=True)(EqxRestore)

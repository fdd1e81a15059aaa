"""Standalone `save`, `restore` and `metadata`: one checkpoint, no manager."""

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import orbax.checkpoint as ocp

from .._bytes import route as _route
from .._bytes.route import is_remote
from .._errors import CheckpointNotFoundError, OrbaxEqxError
from .._format.locate import as_path, find_item
from .._format.sidecar import Metadata
from .._format.sidecar_read import read
from .._save import replace as _replace
from .._save.claim import ConcurrentSaveError, from_process
from .._save.replace import CheckpointExistsError as CheckpointExistsError
from .._save.replace import NotACheckpointError as NotACheckpointError
from .._storage.typed.write import GROUP_PREFIX
from .handler import EqxHandler, EqxRestore, EqxSave
from .refused import COMMIT_FILE

P = ParamSpec("P")
R = TypeVar("R")
Directory = str | os.PathLike[str]


class NotWritableError(OrbaxEqxError, PermissionError):
    """`save` was asked to write where it cannot."""


def save(
    directory: str | os.PathLike[str],
    item: Any,
    *,
    overwrite: bool = False,
    pack: bool = True,
    use_ocdbt: bool = True,
    use_zarr3: bool = False,
    use_compression: bool = False,
    save_concurrent_gb: float | None = None,
    multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
    checksums: bool = True,
) -> None:
    """Saves `item` to `directory`, atomically on local paths, and waits for the disk.

    **Arguments:**

    - `directory`: where to save; relative paths are fine. Must not exist
        unless `overwrite=True`.
    - `item`: any PyTree of Equinox modules, arrays and Python values.
    - `overwrite`: replace an existing checkpoint at `directory`. On a local
        path, atomically: the new one is written beside it and swapped in,
        so that at every instant `directory` holds the old checkpoint or the
        new one, whole; a save that fails leaves the old one. Only a
        checkpoint (an item directory, or a step of item directories and
        Orbax's files) or an empty directory is replaced: anything else, a
        directory that holds a checkpoint among other files too, is a
        `NotACheckpointError`.
    - `pack`, `use_ocdbt`, `use_zarr3`, `use_compression`,
        `save_concurrent_gb`, `multiprocessing_options`, `checksums`: as for
        `EqxHandler`.

    A save killed part way leaves its temporary directories beside
    `directory` (`.<name>.oeqx-*`); the next save to `directory` deletes them.

    On a path that is not local (`gs://...`) an object store has no atomic
    rename, so Orbax writes there itself (`force=overwrite`): with
    `overwrite=True` it first deletes the old checkpoint, then writes the new
    one, committed on `gs://` by its `commit_success.txt` written last
    (elsewhere by renaming its temporary directory, a copy of every object).
    Until the commit there is no whole checkpoint at `directory`: a save that
    fails or is killed in between leaves neither the old one nor the new one
    (on `gs://`, part of the new one, without its commit file), and restores
    meanwhile fail.

    !!! example

        ```python
        oeqx.save("ckpt/model", model)
        model = oeqx.restore("ckpt/model", eqx.filter_eval_shape(make_model, key))
        ```
    """
    path = as_path(directory)
    args = EqxSave(item)  # checks the item before anything is touched
    args._standalone = True  # it may be moved anywhere: no step and item recorded
    options: dict[str, Any] = dict(
        pack=pack,
        use_ocdbt=use_ocdbt,
        use_zarr3=use_zarr3,
        use_compression=use_compression,
        save_concurrent_gb=save_concurrent_gb,
        multiprocessing_options=multiprocessing_options,
        checksums=checksums,
    )
    if is_remote(path):  # object stores have no atomic rename
        store = _route.for_path(path)
        store.check_reachable(path)
        try:
            _replace.check_target(path, overwrite)
            with ocp.Checkpointer(
                EqxHandler(**options), temporary_path_class=COMMIT_FILE
            ) as checkpointer:
                checkpointer.save(path, args=args, force=overwrite)
        except Exception as e:
            wrapped = store.wrap(e, path)
            if wrapped is e:
                raise
            raise wrapped from e
        return
    # The handler's primary host (it writes the sidecar) tidies, publishes and
    # says whether publishing worked: one process, process 0 where Orbax's
    # `primary_host=None` would make every process one.
    mp = multiprocessing_options or ocp.options.MultiprocessingOptions()
    source = 0 if mp.primary_host is None else mp.primary_host
    primary = ocp.multihost.is_primary_host(source)
    if primary:
        _replace.tidy(path)
    owner = _replace.new_owner()  # with several processes: after the tidy
    _replace.check_target(path, overwrite)
    _check_writable(path)
    with _replace.saving(owner):
        _save_beside(path, args, owner, overwrite, (primary, source), options)


def _save_beside(path, args, owner, overwrite, host, options) -> None:
    """Saves beside `path` and swaps the new checkpoint in; `host`: whether
    this process is the primary host, and which process that is."""
    primary, source = host
    new = _replace.beside(path, owner, _replace.NEW)
    try:
        with ocp.Checkpointer(EqxHandler(**options)) as checkpointer:
            checkpointer.save(new, args=args)
    except BaseException as e:
        if primary:
            _replace.discard(new)
        e.add_note(
            f"orbax_eqx: this save did not change {path}; its temporary files "
            "were removed."
        )
        raise
    failed = None
    if primary:
        try:
            _replace.publish(new, path, owner, overwrite)
        except BaseException as e:
            _replace.discard(new)
            failed = e
    # Process `source`'s verdict, in every process (through the coordinator's
    # key-value store: no computation on a device).
    if from_process("published", "1" if failed is None else "0", source) != "1":
        raise failed or ConcurrentSaveError(
            f"Process {source} could not put the new checkpoint in place at "
            f"{path} (its error says why); this save did not change it."
        )


def _check_writable(path) -> None:
    """Fails before any work if the nearest existing ancestor is read-only."""
    if is_remote(path):
        return  # object stores: permissions are checked by the store itself
    ancestor = os.fspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.access(ancestor, os.W_OK):
        raise NotWritableError(
            f"Cannot save to {path}: {ancestor} is not writable (read-only file "
            "system or no permission). Choose a writable directory."
        )


def typed_like(
    options: Callable[P, Any],
) -> Callable[[Callable[..., R]], Callable[Concatenate[Directory, P], R]]:
    """Types the decorated `f(directory, **options)`, which passes its options
    on to the class `options`, as taking `directory` and that class's
    parameters: type checkers catch a misspelt option, and `help()` shows
    every parameter. One spelling of each set of options."""

    def wrap(f: Callable[..., R]) -> Callable[Concatenate[Directory, P], R]:
        first = next(iter(inspect.signature(f).parameters.values()))
        rest = inspect.signature(options).parameters.values()
        f.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [first, *rest], return_annotation=inspect.signature(f).return_annotation
        )
        return f

    return wrap


@typed_like(EqxRestore)
def restore(directory: Directory, skeleton: Any = None, **options: Any) -> Any:
    """Restores the checkpoint at `directory`.

    Takes the parameters of `EqxRestore` after `directory`, with the same
    defaults: `restore(directory, skeleton=None, *, allow, shardings, cast,
    strict, prefix, renames, renames_must_match, missing, report,
    on_static_mismatch, on_moved, verify, max_staged_bytes)`.

    **Arguments:**

    - `directory`: an item directory, or a step directory holding one item.
    - `skeleton`: the structure to restore into (see `EqxRestore`); without
        one, returns a flat `{leaf name: value}` dict, or with `allow=`
        rebuilds the saved tree.
    - `allow`: without a skeleton, the modules a rebuild of the saved tree
        may import, such as `["equinox", "jax", "my_models"]` (see
        `EqxRestore`); nothing outside them is imported.
    - `shardings`, `cast`, `strict`, `prefix`, `renames`,
        `renames_must_match`, `missing`, `report`, `on_static_mismatch`,
        `on_moved`, `verify`, `max_staged_bytes`: as for `EqxRestore`.

    **Returns:** the restored PyTree; with `report=True`, `(tree, RestoreReport)`.
    """
    args = EqxRestore(skeleton, **options)  # checks them before any I/O
    path = _find(directory)
    with contextlib.closing(EqxHandler()) as handler:
        return handler.restore(path, args=args)


def metadata(directory: str | os.PathLike) -> Metadata:
    """Reads what a checkpoint holds (leaves, modules, static fields), no array data."""
    return read(_find(directory))


def _find(directory: str | os.PathLike[str]) -> Any:
    """The item directory at `directory` (see `find_item`), its store reached
    first; a checkpoint saved
    through the type handler is no error of the path, and is told apart."""
    path = as_path(directory)
    _route.for_path(path).check_reachable(path)  # says what to set, if not
    path = _replace.recover(path)
    if not (_typed(path) or any(_typed(p) for p in _dirs(path))):
        return find_item(path)
    raise CheckpointNotFoundError(
        f"{path} was saved through `oeqx.type_handler_registry()` by Orbax's own "
        "PyTreeCheckpointHandler, which writes no orbax_eqx sidecar: restore it "
        "with that handler (`ocp.PyTreeCheckpointHandler(type_handler_registry="
        "oeqx.type_handler_registry())`); `python -m orbax_eqx inspect` and "
        "`verify` read it."
    )


def _dirs(path) -> list:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _typed(path) -> bool:
    """Whether `path` holds arrays saved through the type handler."""
    return any(p.name.startswith(GROUP_PREFIX) for p in _dirs(path))

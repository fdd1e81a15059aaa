"""Standalone `save`, `restore` and `metadata`: one checkpoint, no manager."""

import os
from typing import Any

import orbax.checkpoint as ocp

from .._errors import OrbaxEqxError
from .._format.locate import as_path, find_item
from .._format.sidecar import Metadata
from .._format.sidecar_read import read
from .handler import EqxHandler, EqxRestore, EqxSave


class CheckpointExistsError(OrbaxEqxError, FileExistsError):
    """`save` was asked to write where a checkpoint already is."""


class NotWritableError(OrbaxEqxError, PermissionError):
    """`save` was asked to write where it cannot."""


def save(
    directory: str | os.PathLike, item: Any, *, overwrite: bool = False, **options
) -> None:
    """Saves `item` to `directory`, atomically, and waits until it is on disk.

    **Arguments:**

    - `directory`: where to save; relative paths are fine. Must not exist
        unless `overwrite=True`.
    - `item`: any PyTree of Equinox modules, arrays and Python values.
    - `overwrite`: replace an existing checkpoint at `directory`.
    - `**options`: passed to `EqxHandler` (`use_ocdbt=`, `use_compression=`...).

    !!! example

        ```python
        oeqx.save("ckpt/model", model)
        model = oeqx.restore("ckpt/model", eqx.filter_eval_shape(make_model, key))
        ```
    """
    path = as_path(directory)
    if path.exists() and not overwrite:
        raise CheckpointExistsError(
            f"{path} already exists. Pass `overwrite=True` to replace it, or "
            "choose another directory."
        )
    _check_writable(path)
    with ocp.Checkpointer(EqxHandler(**options)) as checkpointer:
        checkpointer.save(path, args=EqxSave(item), force=overwrite)


def _check_writable(path) -> None:
    """Fails before any work if the nearest existing ancestor is read-only."""
    if "://" in os.fspath(path):
        return  # object stores: permissions are checked by the store itself
    ancestor = os.fspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.access(ancestor, os.W_OK):
        raise NotWritableError(
            f"Cannot save to {path}: {ancestor} is not writable (read-only file "
            "system or no permission). Choose a writable directory."
        )


def restore(directory: str | os.PathLike, skeleton: Any = None, **options) -> Any:
    """Restores the checkpoint at `directory`.

    **Arguments:**

    - `directory`: an item directory, or a step directory holding one item.
    - `skeleton`: the structure to restore into (see `EqxRestore`); without
        one, returns a flat `{leaf name: value}` dict.
    - `**options`: `shardings=`, `cast=`, `strict=`, `prefix=`, `renames=`,
        `renames_must_match=`, `missing=`, `report=`, `on_static_mismatch=`,
        `verify=`, as for `EqxRestore`.

    **Returns:** the restored PyTree; with `report=True`, `(tree, RestoreReport)`.
    """
    path = find_item(directory)
    handler = EqxHandler()
    try:
        return handler.restore(path, args=EqxRestore(skeleton, **options))
    finally:
        handler.close()


def metadata(directory: str | os.PathLike) -> Metadata:
    """Reads what a checkpoint holds (leaves, modules, static fields), no array data."""
    return read(find_item(directory))

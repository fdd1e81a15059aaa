"""Checks the sidecar's Orbax-stored leaves against Orbax's own array metadata."""

import json
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from ..._errors import CheckpointDamagedError, bullet_list
from ..._format.sidecar import LeafMetadata
from ..._tree.walk import is_key_dtype, key_data_struct, parse_dtype
from .keys import ZARR2, ZARR3, first_line, open_store, permission_error

_FIX = (
    "The sidecar and the arrays do not belong together (an edited sidecar, files "
    "mixed from two saves, or a damaged store). Restore an earlier step, or "
    "re-save the checkpoint."
)


def check_stored(
    directory: epath.Path, records: Sequence[LeafMetadata], listed: set[str]
) -> None:
    """Raises `CheckpointDamagedError` unless Orbax's store holds `records` as said."""
    store = open_store(directory)
    # Every Orbax-stored leaf's record has its key (`sidecar_read` checks).
    keys = [r.key or "" for r in records]
    found = _metadata(store, keys, directory)
    problems = []
    for record, key, meta in zip(records, keys, found, strict=True):
        problem = _compare(record, key, meta)
        if problem is not None:
            problems.append(problem)
    if not problems and ocp.type_handlers.is_ocdbt_checkpoint(directory):
        problems = _unlisted(store, listed)
    if problems:
        n = len(problems)
        raise CheckpointDamagedError(
            f"The checkpoint at {directory} is damaged: its sidecar and Orbax's "
            f"array store disagree ({n} difference{'s' if n != 1 else ''}):\n"
            f"{bullet_list(problems)}\n{_FIX}"
        )


def _metadata(store: ts.KvStore, keys: list[str], directory) -> list[dict | None]:
    """Each key's array metadata record in the store (None: none there)."""
    found = _read_all(store, [f"{k}/{ZARR2}" for k in keys], directory)
    if any(v is None for v in found):  # Zarr v3 (`use_zarr3=True`), or missing
        v3 = _read_all(store, [f"{k}/{ZARR3}" for k in keys], directory)
        found = [a if a is not None else b for a, b in zip(found, v3, strict=True)]
    return found


def _unlisted(store: ts.KvStore, listed: set[str]) -> list[str]:
    """What `check_stored` says of the arrays in an OCDBT store that are not
    `listed` (listing it reads its index, already in memory)."""
    stored = {
        k.decode("utf-8", "surrogateescape").rsplit("/", 1)[0]
        for k in store.list().result()
        if k.endswith(b"/" + ZARR2.encode()) or k.endswith(b"/" + ZARR3.encode())
    }
    return [
        f"Orbax's array store holds an array under key `{key}`, which the "
        "sidecar does not list."
        for key in sorted(stored - listed)
    ]


def _read_all(store: ts.KvStore, keys: list[str], directory) -> list[dict | None]:
    futures = [store.read(k) for k in keys]  # all in flight at once
    out: list[dict | None] = []
    for future in futures:
        try:
            result = future.result()
        except Exception as e:
            denied = permission_error(e, directory)
            if denied is not None:
                raise denied from None
            raise CheckpointDamagedError(
                f"Orbax's array store of the checkpoint at {directory} cannot be "
                f"read ({first_line(e)}): the checkpoint is damaged. Restore an "
                "earlier step, or re-save the checkpoint."
            ) from e
        if result.state != "value":
            out.append(None)
            continue
        try:
            meta = json.loads(result.value)
        except (UnicodeDecodeError, json.JSONDecodeError):
            meta = {}
        out.append(meta if isinstance(meta, dict) else {})
    return out


def _compare(record: LeafMetadata, key: str, meta: dict | None) -> str | None:
    where = f"Leaf `{record.path}` (leaf name `{record.name}`)"
    if meta is None:
        return (
            f"{where} is stored in Orbax's array store, says the sidecar, but the "
            f"store holds no array under key `{key}`."
        )
    shape, dtype = tuple(record.shape or ()), parse_dtype(record.dtype)
    if is_key_dtype(dtype):  # stored as its key data
        data = key_data_struct(dtype)
        shape, dtype = shape + tuple(data.shape), data.dtype
    stored_shape = meta.get("shape")
    stored_dtype = meta.get("dtype", meta.get("data_type"))
    chunks = meta.get("chunks")
    if chunks is None:
        grid = meta.get("chunk_grid")
        chunks = grid.get("configuration", {}).get("chunk_shape") if grid else None
    if not _is_shape(stored_shape):
        return f"{where} has no readable shape in Orbax's array store."
    try:
        same_dtype = jnp.dtype(stored_dtype) == dtype
    except (TypeError, ValueError):
        same_dtype = False
    if tuple(stored_shape) != shape or not same_dtype:
        return (
            f"{where} is {dtype}{list(shape)} in the sidecar but "
            f"{stored_dtype}{list(stored_shape)} in Orbax's array store."
        )
    # A chunk is allocated whole when read: one larger than the array is absurd.
    if not _is_shape(chunks) or len(chunks) != len(shape):
        return f"{where} has no readable chunk shape in Orbax's array store."
    if any(c > max(d, 1) for c, d in zip(chunks, shape, strict=True)):
        return (
            f"{where} is {dtype}{list(shape)} but its chunks in Orbax's array "
            f"store are {list(chunks)} ({math.prod(chunks)} elements), larger than "
            "the array."
        )
    return None


def _is_shape(x: Any) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(type(d) is int and d >= 0 for d in x)

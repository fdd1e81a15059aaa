"""Restore: check the skeleton, read exactly the arrays it needs, rebuild the tree."""

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from . import _packing
from ._check import check
from ._names import storage_key
from ._shardings import resolve
from ._sidecar import ALIAS, EMPTY, PACKED, STORED, LeafMetadata, Metadata
from ._values import decode_scalar, describe
from ._walk import (
    ARRAY,
    JAX,
    NUMPY_SCALAR,
    SCALAR,
    container,
    is_key_dtype,
    key_data_struct,
    key_impl,
    parse_dtype,
    walk,
)


@dataclasses.dataclass(frozen=True)
class RecordedLeaf:
    """A leaf that a checkpoint records but cannot rebuild without a skeleton.

    Returned by a restore without a skeleton for callables, other objects and
    `eqx.nn.Shared` markers: `kind` is `"callable"`, `"object"` or `"shared"`,
    `description` what the sidecar says of it (a qualified name or a repr).
    """

    kind: str
    description: str


@dataclasses.dataclass(frozen=True)
class _Request:
    """One array to read: where it is stored and what to turn it into."""

    record: LeafMetadata
    dtype: Any  # target dtype
    container: str
    sharding: Any  # target sharding, for jax arrays


def restore_tree(inner, directory, saved: Metadata, args) -> Any:
    """Restores into `args.skeleton`; see `EqxRestore`."""
    skeleton = args.skeleton
    walked = walk(skeleton)
    check(
        walked,
        saved,
        cast=args.cast,
        strict=args.strict,
        on_static_mismatch=args.on_static_mismatch,
    )
    shardings = resolve(args.shardings, walked)
    requests = {}
    for leaf in walked.leaves:
        if leaf.kind == ARRAY:
            x = leaf.value
            requests[leaf.name] = _Request(
                saved.leaves[leaf.name],
                x.dtype,
                container(x),
                shardings.get(leaf.name),
            )
    arrays = read_arrays(inner, directory, saved, requests)
    values = []
    for leaf in walked.leaves:
        if leaf.kind == ARRAY:
            values.append(arrays[leaf.name])
        elif leaf.kind == SCALAR:
            values.append(decode_scalar(saved.leaves[leaf.name].value))
        else:  # callables, objects, shared markers: the skeleton's own
            values.append(leaf.value)
    return jtu.tree_unflatten(walked.treedef, values)


def restore_flat(inner, directory, saved: Metadata) -> dict[str, Any]:
    """Restores every leaf into a flat `{leaf name: value}` dict, without a skeleton."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    requests = {
        name: _Request(
            record,
            parse_dtype(record.dtype),
            record.container,
            device,
        )
        for name, record in saved.leaves.items()
        if record.kind == ARRAY
    }
    arrays = read_arrays(inner, directory, saved, requests)
    result = {}
    for name, record in saved.leaves.items():
        if record.kind == ARRAY:
            result[name] = arrays[name]
        elif record.kind == SCALAR:
            result[name] = decode_scalar(record.value)
        else:
            text = describe(record.value) if record.value is not None else record.kind
            result[name] = RecordedLeaf(record.kind, text)
    return result


def read_arrays(inner, directory, saved: Metadata, requests: dict[str, _Request]):
    """Reads each requested array once, from its pack or from Orbax; builds empty
    ones and aliases."""
    to_read: dict[str, _Request] = {}
    for request in requests.values():
        source = request.record
        if source.data == ALIAS:
            source = saved.leaves[source.alias_of]
            request = dataclasses.replace(request, record=source)
        if source.data != EMPTY:
            to_read.setdefault(source.name, request)
    packed = {n: r for n, r in to_read.items() if r.record.data == PACKED}
    stored = {n: r for n, r in to_read.items() if r.record.data == STORED}
    loaded = _orbax_read(inner, directory, stored) if stored else {}
    if packed:
        loaded.update(_packing.read(epath.Path(directory), saved.packs, packed))
    result = {}
    for name, request in requests.items():
        record = request.record
        if record.data == EMPTY:
            result[name] = _empty(request)
            continue
        source = record.alias_of if record.data == ALIAS else record.name
        value = loaded[source]
        if request is not to_read.get(source) and request.container == JAX:
            # The same stored array wanted twice (tied weights), maybe elsewhere.
            if value.sharding != request.sharding:
                value = jax.device_put(value, request.sharding)
        result[name] = _finish(value, request)
    return result


def _orbax_read(inner, directory, to_read: dict[str, _Request]) -> dict[str, Any]:
    item, restore_args = {}, {}
    for name, request in to_read.items():
        record = request.record
        key = storage_key(name)  # derived from the name, never read from the file
        cast = None if _same_dtype(record.dtype, request.dtype) else request.dtype
        if request.container == JAX:
            item[key] = jax.ShapeDtypeStruct(
                record.shape,
                _saved_dtype(record.dtype, request.dtype),
                sharding=request.sharding,
            )
            restore_args[key] = ocp.ArrayRestoreArgs(
                sharding=request.sharding, dtype=cast
            )
        else:
            item[key] = jax.ShapeDtypeStruct(record.shape, parse_dtype(record.dtype))
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast)
    restored = inner.restore(
        directory,
        args=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True
        ),
    )
    return {name: restored[storage_key(name)] for name in to_read}


def _finish(value: Any, request: _Request) -> Any:
    if request.container == JAX:
        return value
    value = np.asarray(value)
    return value[()] if request.container == NUMPY_SCALAR else value


def _empty(request: _Request) -> Any:
    shape = request.record.shape
    if request.container != JAX:
        return _finish(np.zeros(shape, request.dtype), request)
    if is_key_dtype(request.dtype):
        data = key_data_struct(request.dtype)
        zeros = np.zeros(shape + data.shape, data.dtype)
        return jax.random.wrap_key_data(
            jax.device_put(zeros, request.sharding), impl=key_impl(request.dtype)
        )
    zeros = np.zeros(shape, request.dtype)
    return jax.make_array_from_callback(shape, request.sharding, lambda i: zeros[i])


def _same_dtype(saved: str, target: Any) -> bool:
    return saved == str(target)


def _saved_dtype(saved: str, target: Any) -> Any:
    return target if _same_dtype(saved, target) else parse_dtype(saved)

"""Restore: check the skeleton, read exactly the arrays it needs, rebuild the tree."""

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from etils import epath

from .._format.sidecar import (
    ALIAS,
    STORED,
    Metadata,
)
from .._storage import read as _storage_read
from .._storage.orbax_store import read as _stored_read
from .._storage.read import Request as _Request
from .._storage.transfer import staging as _staging
from .._tree.values import decode_scalar, describe
from .._tree.walk import (
    ARRAY,
    JAX,
    NUMPY_SCALAR,
    SCALAR,
    parse_dtype,
    walk,
)
from .check import check
from .select import select, warn_kept
from .shardings import resolve
from .wide import flat_container, wanted_container


@dataclasses.dataclass(frozen=True)
class RecordedLeaf:
    """A leaf that a checkpoint records but cannot rebuild without a skeleton.

    Returned by a restore without a skeleton for callables, other objects and
    `eqx.nn.Shared` markers: `kind` is `"callable"`, `"object"` or `"shared"`,
    `description` what the sidecar says of it (a qualified name or a repr).
    """

    kind: str
    description: str


def restore_tree(inner, directory, saved: Metadata, args) -> Any:
    """Restores into `args.skeleton`; see `EqxRestore`."""
    skeleton = args.skeleton
    walked = walk(skeleton)
    selection = select(
        saved,
        walked,
        prefix=args.prefix,
        renames=args.renames,
        renames_must_match=args.renames_must_match,
    )
    view = selection.saved  # keyed by `selection.target(skeleton leaf name)`
    kept = check(
        walked,
        view,
        cast=args.cast,
        strict=args.strict,
        on_static_mismatch=args.on_static_mismatch,
        missing=args.missing,
        target=selection.target if selection.prefix else None,
    )
    kept_names = {leaf.name for leaf in kept}
    shardings = resolve(args.shardings, walked)
    records = view.leaves
    targets = selection.targets  # (`selection.target`, without a call per leaf)
    requests = _requests(walked, records, targets, kept_names, shardings)
    # The full sidecar, not the view: aliases name their source by its saved name.
    arrays = read_arrays(
        inner,
        directory,
        saved,
        requests,
        verify=args.verify,
        max_staged_bytes=args.max_staged_bytes,
    )
    for leaf in kept:
        arrays[leaf.name] = _kept(leaf, shardings.get(leaf.name))
    values = []
    for leaf in walked.leaves:
        kind = leaf.kind
        if kind == ARRAY or leaf.name in kept_names:
            values.append(arrays[leaf.name])
        elif kind == SCALAR:
            name = leaf.name
            values.append(decode_scalar(records[targets.get(name, name)].value))
        else:  # callables, objects, shared markers: the skeleton's own
            values.append(leaf.value)
    tree = jtu.tree_unflatten(walked.treedef, values)
    if args.report:
        return tree, selection.report(walked, kept)
    if kept:
        warn_kept(selection.report(walked, kept), saved.directory)
    return tree


def _requests(walked, records, targets, kept_names, shardings) -> dict:
    """`{leaf name: _Request}` for the skeleton's array leaves to read."""
    requests = {}
    for leaf in walked.leaves:
        if leaf.kind == ARRAY:
            name = leaf.name
            if name in kept_names:
                continue
            x = leaf.value
            record = records[targets.get(name, name)]
            requests[name] = _Request(
                record,
                x.dtype,
                wanted_container(x, record),  # never narrows a 64-bit array
                shardings.get(name),
            )
    return requests


def _kept(leaf, sharding) -> Any:
    """A skeleton leaf kept as it is; a jax array goes where `shardings=` says."""
    x = leaf.value
    if (
        leaf.kind == ARRAY
        and isinstance(x, jax.Array)
        and sharding is not None
        and not x.sharding.is_equivalent_to(sharding, x.ndim)
    ):
        return jax.device_put(x, sharding)
    return x


def restore_flat(
    inner,
    directory,
    saved: Metadata,
    *,
    verify: bool = True,
    max_staged_bytes: int | None = None,
) -> dict[str, Any]:
    """Restores every leaf into a flat `{leaf name: value}` dict, without a skeleton."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    requests = {
        name: _Request(
            record,
            parse_dtype(record.dtype),
            flat_container(record),  # 64-bit arrays as numpy while x64 is off
            device,
        )
        for name, record in saved.leaves.items()
        if record.kind == ARRAY
    }
    arrays = read_arrays(
        inner,
        directory,
        saved,
        requests,
        verify=verify,
        max_staged_bytes=max_staged_bytes,
    )
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


def read_arrays(
    inner,
    directory,
    saved: Metadata,
    requests: dict[str, _Request],
    *,
    verify: bool = True,
    max_staged_bytes: int | None = None,
):
    """Reads each requested array once, from its pack, the shard packs or Orbax;
    builds empty ones and aliases. With `verify`, checks each against its
    recorded checksum. Packed and shard-packed bytes go to devices through a
    window of `max_staged_bytes` where transfers copy (see
    `_storage.transfer.staging`)."""
    to_read, ours, stored = _sources(saved, requests)
    loaded = {}
    if stored:
        checked = _storage_read.cast_checked(stored)
        asked = {**stored, **checked}
        loaded = _stored_read.read(inner, directory, saved, asked, verify=verify)
        _storage_read.cast_after(directory, {n: stored[n] for n in checked}, loaded)
    # Each target sharding once (by identity: leaves share them), not per leaf.
    targets = {id(r.sharding): r.sharding for r in ours.values()}
    staging = _staging.for_restore(max_staged_bytes, list(targets.values()))
    if ours:
        path = epath.Path(directory)
        loaded.update(
            _storage_read.read(path, saved, ours, verify=verify, staging=staging)
        )
    return _placed(saved, requests, to_read, loaded)


def _sources(saved: Metadata, requests: dict[str, _Request]):
    """Each stored array to read once, by the name its data is saved under:
    all of them, then those of packs and shard packs (and zero-size ones),
    then those Orbax stores."""
    to_read: dict[str, _Request] = {}
    ours: dict[str, _Request] = {}
    stored: dict[str, _Request] = {}
    for request in requests.values():
        source = request.record
        if source.data == ALIAS:
            source = saved.source(source)
            request = request._replace(record=source)
        name = source.name
        if name not in to_read:
            to_read[name] = request
            (stored if source.data == STORED else ours)[name] = request
    return to_read, ours, stored


def _placed(saved: Metadata, requests, to_read, loaded) -> dict[str, Any]:
    """Every requested array, from the arrays read (`loaded`, by saved name),
    tied ones placed where each asks."""
    result = {}
    for name, request in requests.items():
        record = request.record
        if record.data == ALIAS:
            record = saved.source(record)
        held_by = record.name
        value = loaded[held_by]
        if request.container != JAX:
            value = _finish(value, request)
        elif (
            to_read[held_by].sharding is not request.sharding  # read as asked
            and not value.sharding.is_equivalent_to(request.sharding, value.ndim)
        ):
            # The same stored array wanted twice (tied weights), placed elsewhere.
            # (Equivalence, not `==`: Orbax may spell P() as P(None,); a needless
            # device_put copies, and fails for keys on a multi-host mesh.)
            value = jax.device_put(value, request.sharding)
        result[name] = value
    return result


def _finish(value: Any, request: _Request) -> Any:
    if request.container == JAX:
        return value
    value = np.asarray(value)
    return value[()] if request.container == NUMPY_SCALAR else value

"""Splits an item into the sidecar, the pack, the shard packs and Orbax's store."""

import dataclasses
from typing import Any

import jax
import numpy as np

from .._errors import UnsupportedLeafError, bullet_list
from .._format.sidecar import STORED, build, nbytes
from .._storage import shards as _shards
from .._storage.packing import host_copies, layout, packable
from .._tree.names import storage_key
from .._tree.walk import ARRAY, JAX, Walked, container, walk
from . import recordable


@dataclasses.dataclass
class Prepared:
    """What one save writes. The writer empties `pieces` once they are written."""

    content: dict[str, Any]  # the sidecar's JSON, checksums still to fill in
    stored: dict[str, Any]  # {storage key: array}, for Orbax
    pieces: list[tuple[int, np.ndarray]]  # (offset, host copy), for pack 0
    pack_nbytes: int
    packed_names: list[str]  # the leaf of each piece
    # {leaf name: host copy}, for arrays Orbax stores whose every byte this
    # process holds: summed (`sum32`) in the background.
    sums: dict[str, Any]
    # This process's chunks of sharded arrays, for its shard pack (or None).
    local: _shards.Local | None = None


def prepare(
    item: Any,
    *,
    token: str,
    pack: bool = True,
    copy_packed: bool = True,
    checksums: bool = True,
) -> Prepared:
    """Decides where every leaf of `item` goes and copies packed arrays to host.

    `token` names the files of this save (see `_claim`). Checks the whole
    item first and raises one error listing every leaf that cannot be saved,
    before anything is written. With `pack`, unsharded arrays are packed (see
    `_packing`); `copy_packed=False` (hosts other than the primary, which do
    not write the pack) skips their host copies. Sharded arrays go to the
    shard packs: every process copies its distinct shards to host here (see
    `_storage/shards.py`). Nothing here computes on a device.
    With `checksums`, Orbax-stored arrays that this process holds whole are
    copied to host, to be summed in the background.
    """
    walked = walk(item)
    _check_savable(walked)
    recordable.check(walked)
    aliases = _aliases(walked)
    to_pack, to_shard = [], []
    for leaf in walked.leaves:
        if leaf.kind == ARRAY and leaf.name not in aliases and pack:
            size = nbytes(leaf.value)
            if size and packable(leaf.value):
                to_pack.append((leaf, size))
            elif size:
                to_shard.append((leaf.name, leaf.value))
    offsets, pack_nbytes = layout((leaf.name, size) for leaf, size in to_pack)
    content = build(
        walked,
        aliases,
        offsets,
        pack_nbytes,
        token,
        sharded={name: _shards.describe(x.sharding) for name, x in to_shard},
        shard_files=jax.process_count() if to_shard else 0,
    )
    if not checksums:
        content["checksums"] = False  # so that `verify` tells it from damage
    stored, sums = {}, {}
    for leaf in walked.leaves:
        record = content["leaves"][leaf.name]
        if leaf.kind == ARRAY and record["data"] == STORED:
            x = _host_safe(leaf.value)
            stored[storage_key(leaf.name)] = x
            if checksums and _held_whole(x):
                # Now: the caller may donate or change the array once `save`
                # returns. (Orbax copies it too; the pack path needs neither.)
                sums[leaf.name] = _shards.gather(x) if container(x) == JAX else x
    local = _shards.take(to_shard) if to_shard else None
    pieces, names = [], []
    if copy_packed and to_pack:
        copies = host_copies([leaf.value for leaf, _ in to_pack])
        pieces = [(offsets[leaf.name], x) for (leaf, _), x in zip(to_pack, copies)]
        names = [leaf.name for leaf, _ in to_pack]
    return Prepared(content, stored, pieces, pack_nbytes, names, sums, local)


def _held_whole(x: Any) -> bool:
    """Whether this process holds every byte of an array (so can sum it)."""
    return container(x) != JAX or x.is_fully_addressable


def check_has_data(item: Any) -> None:
    """Refuses skeletons early and cheaply, before Orbax starts a save."""
    leaves = jax.tree_util.tree_leaves(item)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        _check_savable(walk(item))


def _check_savable(walked: Walked) -> None:
    problems = []
    seen: dict[str, str] = {}
    for leaf in walked.leaves:
        if isinstance(leaf.value, jax.ShapeDtypeStruct):
            problems.append(
                f"Leaf `{leaf.path_str}` is a jax.ShapeDtypeStruct, which holds no "
                "data to save."
            )
        if leaf.name in seen:
            problems.append(
                f"Leaves `{seen[leaf.name]}` and `{leaf.path_str}` would both be "
                f"stored as `{leaf.name}`."
            )
        seen.setdefault(leaf.name, leaf.path_str)
    if problems:
        raise UnsupportedLeafError(
            "Cannot save this item:\n" + bullet_list(problems) + "\nSave a model "
            "with concrete arrays (skeletons from `eqx.filter_eval_shape` are for "
            "restoring), and give distinct dict keys distinct names."
        )


def _aliases(walked: Walked) -> dict[str, str]:
    """Leaves holding the very same array object as an earlier leaf (tied weights)."""
    first: dict[int, str] = {}
    aliases = {}
    for leaf in walked.leaves:
        x = leaf.value
        if leaf.kind != ARRAY or isinstance(x, np.generic) or 0 in x.shape:
            continue
        twin = first.setdefault(id(leaf.value), leaf.name)
        if twin != leaf.name:
            aliases[leaf.name] = twin
    return aliases


def _host_safe(x: Any) -> Any:
    # Orbax copies jax arrays off the device before `save` returns, but reads
    # numpy arrays later, from the background: copy them now, so that the
    # caller may change them in place as soon as `save` returns.
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x, copy=True)
    return x

"""Splits an item into the sidecar, the pack, the shard packs and Orbax's store.

`prepare` runs before `save` returns: it checks the item and takes the
arrays' bytes (the caller may then donate or change them). `Prepared.finish`
runs in the background: it names the leaves and builds the sidecar, the
costly part, which packing does not need. A later save of an equal tree
structure (treedef) checks only the leaves' values before returning; `finish`
then walks a snapshot of the item and checks it again.
"""

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import OrbaxEqxError, UnsupportedLeafError, bullet_list
from .._format.sidecar import build, nbytes
from .._storage.packed.write import packable
from .._storage.ranges import layout
from .._storage.sharded import write as _shards
from .._storage.transfer.pool import Lease
from .._storage.transfer.to_host import gather, start_host_copies
from .._tree.names import storage_key
from .._tree.values import is_text
from .._tree.walk import JAX, Walked, container, is_array_leaf, walk
from . import checks

# Tree structures whose save was checked before returning (a job saves few).
_CHECKED: collections.OrderedDict = collections.OrderedDict()
_CHECKED_MAX = 16
_CHECKED_LOCK = threading.Lock()


def flatten(item: Any) -> tuple[list[Any], Any]:
    """`item`'s leaves and treedef, as a walk flattens it (None is a leaf)."""
    return jtu.tree_flatten(item, is_leaf=_is_none)


@dataclasses.dataclass
class Prepared:
    """What one save writes; `finish()`, in the background, fills the rest."""

    stored: dict[str, Any]  # {storage key: array}, for Orbax
    # {leaf name: host copy} of Orbax-stored arrays held whole, to sum.
    sums: dict[str, Any]
    shard_files: int  # processes writing shard packs (0: none)
    local: _shards.Local | None
    _finish: Callable[[], tuple] | None
    content: dict[str, Any] | None = None  # the sidecar's JSON, sans checksums
    pieces: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    pack_nbytes: int = 0
    packed_names: list[str] = dataclasses.field(default_factory=list)
    # The packed leaves as given, in the pieces' order (for `dedup`).
    packed_leaves: list[Any] = dataclasses.field(default_factory=list)
    # `pieces_of`: `(offset, host copy)` in file order, once copied.
    writes_pack: bool = False
    pieces_of: Callable[[], list[tuple[int, np.ndarray]]] | None = None
    _taken: list[tuple[int, np.ndarray]] | None = None
    lease: Lease | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def finish(self) -> None:
        """Names the leaves and builds the sidecar's content, once."""
        if self._finish is not None:
            found = self._finish()
            self.content, self.pack_nbytes, self.packed_names = found[:3]
            self.packed_leaves = found[3]
            self.pieces = self.take_pieces()
            self._finish = None

    def take_pieces(self) -> list[tuple[int, np.ndarray]]:
        """The packed pieces, taken once, from any thread (the pack is written
        while `finish` names the leaves)."""
        with self._lock:
            if self._taken is None and self.pieces_of is not None:
                self._taken, self.pieces_of = self.pieces_of(), None
            return self._taken or []

    def give_back(self) -> None:
        """Gives the pooled buffers back, once the pack is written."""
        if self.lease is not None:
            self.lease.give_back()

    def drop_pieces(self) -> None:
        """Lets go of the host copies (a view keeps a donated buffer alive)."""
        with self._lock:
            self._taken, self.pieces_of, self.pieces = None, None, []


def prepare(
    item: Any,
    *,
    token: str,
    pack: bool = True,
    copy_packed: bool = True,
    checksums: bool = True,
    flat: tuple[list[Any], Any] | None = None,
    waited: bool = False,
    lease: Lease | None = None,
    saved_as: tuple[str, str] | None = None,
) -> Prepared:
    """Decides where every leaf of `item` goes and takes packed arrays' bytes.

    Raises one error listing every leaf that cannot be saved, before anything
    is written. `token` names this save's files (`claim`). With `pack`,
    unsharded arrays are packed and sharded ones go to shard packs; else all
    go to Orbax. `copy_packed=False` (processes that do not write the pack)
    skips host copies. `flat`: `flatten(item)`, if known. `waited` (the save
    returns only once written): numpy arrays are packed uncopied; else copied
    into `lease`'s buffers. `saved_as`: recorded in the sidecar.
    """
    leaves, treedef, walked = _checked_leaves(item, flat, pack)
    aliases = _aliases(leaves)
    # The arrays with bytes of their own (a tied weight's are its twin's).
    sizes = {
        i: size
        for i, x in enumerate(leaves)
        if is_array_leaf(x) and i not in aliases and (size := nbytes(x))
    }
    to_pack, to_shard, stored, sums = _place(leaves, sizes, pack, walked, checksums)
    local = None
    if to_shard:
        local = _shards.start_take([(i, leaves[i]) for i in to_shard])
    hosts = None
    if copy_packed and to_pack:
        packed = [_plain_bools(leaves[i]) for i in to_pack]  # (0 and 1 bytes)
        hosts = start_host_copies(packed, not waited, lease)
    shard_files = jax.process_count() if to_shard else 0
    at, pack_nbytes = layout((i, sizes[i]) for i in to_pack)  # (names aside)

    def pieces_of() -> list[tuple[int, np.ndarray]]:
        copies = hosts() if hosts is not None else []  # (waits for the copies)
        return [(at[i], h) for i, h in zip(to_pack, copies, strict=True)]

    def finish() -> tuple:
        named = walked if walked is not None else _walk_snapshot(leaves, treedef)
        names = [leaf.name for leaf in named.leaves]
        offsets = {names[i]: at[i] for i in to_pack}
        content = build(
            named,
            {names[i]: names[j] for i, j in aliases.items()},
            offsets,
            pack_nbytes,
            token,
            sharded={names[i]: _shards.describe(leaves[i].sharding) for i in to_shard},
            shard_files=shard_files,
            saved_as=saved_as,
        )
        if not checksums:
            content["checksums"] = False  # so that `verify` tells it from damage
        if local is not None:
            local.names = [names[i] for i in local.names]
        packed_names = [names[i] for i in to_pack] if hosts is not None else []
        packed_leaves = [leaves[i] for i in to_pack] if hosts is not None else []
        return content, pack_nbytes, packed_names, packed_leaves

    return Prepared(
        stored,
        sums,
        shard_files,
        local,
        finish,
        pack_nbytes=pack_nbytes if hosts is not None else 0,
        writes_pack=hosts is not None,
        pieces_of=pieces_of if hosts is not None else None,
        lease=lease,
    )


def _place(leaves: list[Any], arrays: Iterable[int], pack, walked, checksums: bool):
    """`(to_pack, to_shard, stored, sums)` of the arrays (by place)."""
    to_pack: list[int] = []
    to_shard: list[int] = []
    if pack:
        for i in arrays:
            (to_pack if packable(leaves[i]) else to_shard).append(i)
        return to_pack, to_shard, {}, {}
    assert walked is not None  # (walked whenever not `pack`)
    stored, sums = _to_store(walked, leaves, arrays, checksums)
    return to_pack, to_shard, stored, sums


def _checked_leaves(item: Any, flat, pack: bool) -> tuple[list[Any], Any, Any]:
    """`(leaves, treedef, walked)` of an item checked savable; `walked` None
    where the walk is left to the background (a packed, known structure)."""
    leaves, treedef = flat if flat is not None else flatten(item)
    walked = None
    if not (pack and _checked(treedef)):
        walked = walk(item)
        _check(walked, pack)
        leaves, treedef = [leaf.value for leaf in walked.leaves], walked.treedef
        if pack:
            _remember(treedef)
    elif _bad_values(leaves):
        _check(walk(item))  # raises, naming the leaves
    return leaves, treedef, walked


def _to_store(
    walked: Walked, leaves: list[Any], arrays: Iterable[int], checksums: bool
):
    """`(stored, sums)`: Orbax's arrays by storage key, and host copies to
    sum by leaf name."""
    stored, sums = {}, {}
    for i in arrays:
        name = walked.leaves[i].name
        x = _plain_bools(_host_safe(leaves[i]))
        stored[storage_key(name)] = x
        if checksums and _held_whole(x):
            # Now: the caller may donate or change it once `save` returns.
            sums[name] = gather(x) if container(x) == JAX else x
    return stored, sums


def _walk_snapshot(leaves: list[Any], treedef: Any) -> Walked:
    """The walk of the item as it was at `save`, checked as a first save's
    (an equal treedef may name differently: `{1: x}` after `{True: x}`); a
    failed check forgets the structure."""
    walked = walk(jtu.tree_unflatten(treedef, leaves))
    try:
        _same_leaves(walked, leaves)
        # The bytes were taken already: the arrays may be donated since.
        _check(walked, taken=True)
    except Exception:
        _forget(treedef)
        raise
    return walked


def _same_leaves(walked: Walked, leaves: list[Any]) -> None:
    # Never fails; if it did, the pack would hold bytes under wrong names.
    # (By type: a custom node may make new leaf objects on each flatten.)
    if len(walked.leaves) != len(leaves) or any(
        type(a.value) is not type(b) for a, b in zip(walked.leaves, leaves, strict=True)
    ):
        raise OrbaxEqxError(
            "Internal error: the walk of the item found other leaves than its "
            "flatten did; nothing was saved. Please report it to orbax_eqx with "
            "the item's structure."
        )


def _check(walked: Walked, pack: bool = True, taken: bool = False) -> None:
    _check_savable(walked)
    checks.check_arrays(walked, pack, taken)
    checks.check_recordable(walked)


def _bad_values(leaves: list[Any]) -> bool:
    """Whether a leaf's value (not its place) would be refused."""
    for x in leaves:
        kind = type(x)
        if kind is jax.ShapeDtypeStruct or (kind is str and not is_text(x)):
            return True
        if checks.bad_value(x):
            return True
    return False


def _checked(treedef: Any) -> bool:
    try:
        with _CHECKED_LOCK:
            if treedef in _CHECKED:
                _CHECKED.move_to_end(treedef)
                return True
    except Exception:  # static fields that cannot be hashed or compared
        pass
    return False


def _remember(treedef: Any) -> None:
    try:
        with _CHECKED_LOCK:
            _CHECKED[treedef] = None
            _CHECKED.move_to_end(treedef)
            while len(_CHECKED) > _CHECKED_MAX:
                _CHECKED.popitem(last=False)
    except Exception:
        pass  # not hashable: every save of it is checked before returning


def _forget(treedef: Any) -> None:
    try:
        with _CHECKED_LOCK:
            _CHECKED.pop(treedef, None)
    except Exception:
        pass


def _held_whole(x: Any) -> bool:
    """Whether this process holds every byte of an array (so can sum it)."""
    return container(x) != JAX or x.is_fully_addressable


def check_has_data(item: Any, leaves: list[Any] | None = None) -> None:
    """Refuses skeletons and unrestorable arrays, before Orbax starts a save."""
    if leaves is None:
        leaves = jax.tree_util.tree_leaves(item)
    if any(type(x) is jax.ShapeDtypeStruct for x in leaves):
        _check_savable(walk(item))
    if any(checks.bad_value(x) for x in leaves):
        checks.check_arrays(walk(item))


def _check_savable(walked: Walked) -> None:
    problems = []
    seen: dict[str, str] = {}
    for leaf in walked.leaves:
        if isinstance(leaf.value, jax.ShapeDtypeStruct):
            problems.append(
                f"Leaf {leaf.label} is a jax.ShapeDtypeStruct, which holds no "
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


def _aliases(leaves: list[Any]) -> dict[int, int]:
    """Tied weights, by place: `{leaf: its first twin}`."""
    first: dict[int, int] = {}
    aliases = {}
    for i, x in enumerate(leaves):
        if (
            not is_array_leaf(x)
            or isinstance(x, (np.generic, jax.ShapeDtypeStruct))
            or 0 in x.shape
        ):
            continue
        twin = first.setdefault(id(x), i)
        if twin != i:
            aliases[i] = twin
    return aliases


def _is_none(x: Any) -> bool:
    return x is None


def _plain_bools(x: Any) -> Any:
    """A bool array with bytes 0 or 1 only (a restore refuses others): one
    viewed from other bytes is stored as the 0/1 host copy of its values.
    Arrays not held whole here are kept as they are."""
    if x.dtype != np.bool_ or not _held_whole(x):
        return x
    host = gather(x) if container(x) == JAX else x
    if np.asarray(host).view(np.uint8).max(initial=0) <= 1:
        return x
    return np.asarray(host).view(np.uint8) != 0


def _host_safe(x: Any) -> Any:
    # Orbax reads numpy arrays later, in the background: copied now.
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x, copy=True)
    return x

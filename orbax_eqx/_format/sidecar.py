"""The sidecar (docs/guides/format.md): file names and constants of the format,
`Metadata` as `oeqx.metadata` returns it, and `build`, the sidecar's JSON for
a walked item.

The `token` is drawn at random for each save and names every file the save
writes, so that two processes saving the same step into one directory (which
Orbax allows) never write to the same file. File names are derived from
tokens and leaf names, never read from the sidecar.
"""

import dataclasses
import functools
import importlib.metadata
import math
import platform
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from etils import epath

from .._tree import nodes as _nodes
from .._tree.names import storage_key
from .._tree.values import describe, encode, scalar_type
from .._tree.walk import (
    ARRAY,
    JAX,
    SCALAR,
    SHARED,
    ModuleInfo,
    Walked,
    container,
    dtype_str,
    is_key_dtype,
    key_data_struct,
)
from .paths import Paths
from .sealed import CHECKSUM as CHECKSUM
from .sealed import MAX_BYTES as MAX_BYTES
from .sealed import checksum_line as checksum_line

FILE_NAME = "orbax_eqx.json"
FORMAT = "orbax_eqx"
# The one format this release writes and reads (docs/guides/format.md).
FORMAT_VERSION = 7
# `~` never appears in a storage key except before a 16-digit hash, so these
# names cannot collide with a directory Orbax makes for a leaf.
PACK_FILE = "orbax_eqx~packed.{token}.{index}.bin"
ARRAYS_DIR = "orbax_eqx~arrays.{token}"  # Orbax's array store
# Beside the steps of a manager (`<root>/orbax_eqx~shared/`): the packs of
# saves with `dedup=True`, which later steps refer to instead of rewriting.
SHARED_DIR = "orbax_eqx~shared"
# One shard pack per process of a save: its chunks, and their index.
SHARD_FILE = "orbax_eqx~shards.{token}.{process}.bin"
SHARD_INDEX = "orbax_eqx~shards.{token}.{process}.json"
# Files named by a save's token, each starting with one of these and the token.
TOKEN_FILE_PREFIXES = ("orbax_eqx~packed.", "orbax_eqx~shards.")
TOKEN = re.compile(r"[0-9a-f]{16}")  # a save's token: 16 hex digits
PACK_ALIGNMENT = 64  # what `jax.device_put` needs on CPU to take a buffer as is
# numpy's most dimensions (NPY_MAXDIMS): no save records a shape of more (and
# the product of a million dimensions, as a reader checks sizes, takes hours).
MAX_DIMS = 64

# Where an array leaf's data lives.
STORED = "orbax"  # in Orbax's array store, under the leaf's storage key
PACKED = "packed"  # a byte range of a pack file
SHARDS = "shards"  # chunks of the shard packs, one per process
EMPTY = "none"  # a zero-size array: shape and dtype say everything
ALIAS = "alias"  # the very same array object as another leaf (tied weights)

_PACKAGES = ("orbax_eqx", "jax", "jaxlib", "equinox", "orbax-checkpoint", "numpy")


# Slots: a sidecar of a million tiny leaves makes a million of these.
@dataclasses.dataclass(frozen=True, slots=True)
class LeafMetadata:
    """What the sidecar says about one leaf."""

    name: str
    path: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    container: str | None = None
    data: str | None = None
    alias_of: str | None = None
    nbytes: int = 0
    value: Any = None  # encoded value or description, for non-array leaves
    pack: int | None = None  # for packed leaves: which pack file...
    offset: int | None = None  # ...and where in it
    checksum: int | None = None  # packed leaves: XXH3-64 of their bytes
    identity: str | None = None  # packed leaves of a dedup save: their XXH3-128
    sum32: int | None = None  # Orbax-stored leaves' checksum
    sharding: str | None = None  # shard-pack leaves: the saved sharding, as text
    key: str | None = None  # Orbax-stored leaves' storage key (`_tree.names`)

    def describe(self) -> str:
        if self.kind == ARRAY:
            return f"array {self.dtype}{list(self.shape or ())}"
        if self.kind == SCALAR:
            if self.value is None:
                return "None"
            return f"{scalar_type(self.value)} {describe(self.value)}"
        if self.kind == SHARED:
            return "shared-node marker"
        return f"{self.kind} {describe(self.value)}"


# `LeafMetadata`'s twin, of the same slots but not frozen: a frozen
# dataclass sets each of its 17 fields through `object.__setattr__`, which
# made 2.1 us of each leaf's read (0.1 s of a 50,000-leaf restore).
_Unfrozen = dataclasses.make_dataclass(
    "_Unfrozen",
    [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(LeafMetadata)
    ],
    slots=True,
)


def leaf_metadata(*args: Any, **kwargs: Any) -> LeafMetadata:
    """`LeafMetadata(*args, **kwargs)`, made ~3x sooner: built as its
    unfrozen twin, then given its class (their slots are the same, which
    CPython checks)."""
    made = _Unfrozen(*args, **kwargs)
    made.__class__ = LeafMetadata
    return made


@dataclasses.dataclass(frozen=True)
class PackMetadata:
    """One pack file: packed leaves' bytes, end to end."""

    file: str
    nbytes: int
    shared: bool = False  # in the manager's shared directory, not the item's


@dataclasses.dataclass(frozen=True)
class Metadata:
    """The contents of a checkpoint's sidecar, as returned by `orbax_eqx.metadata`."""

    directory: str
    format_version: int
    versions: dict[str, str]
    leaves: dict[str, LeafMetadata]
    modules: dict[str, ModuleInfo]
    packs: tuple[PackMetadata, ...] = ()
    token: str = ""  # names the save's files ("": no sidecar, a plain Orbax item)
    shard_files: int = 0  # shard packs: one per process of the save
    # False: saved with `checksums=False` (see `oeqx.verify`).
    checksums: bool = True
    # Every inner node of the saved tree, as `_tree/nodes.py` records it
    # (None: not read, see `sidecar_read.read(nodes=False)`).
    nodes: dict[str, dict[str, Any]] | None = None
    # `(step directory, item)` a manager saved it as (None: a standalone save).
    saved_as: tuple[str, str] | None = None

    def source(self, leaf: LeafMetadata) -> LeafMetadata:
        """The leaf whose data `leaf` holds: `leaf` itself, or for a tied
        weight (`leaf.data == "alias"`) the leaf it is an alias of (the reader
        checked that it is there)."""
        if leaf.data == ALIAS and leaf.alias_of is not None:
            return self.leaves[leaf.alias_of]
        return leaf

    @property
    def nbytes(self) -> int:
        """Bytes of array data stored; tied weights count once."""
        return sum(
            leaf.nbytes
            for leaf in self.leaves.values()
            if leaf.data in (STORED, PACKED, SHARDS)
        )


def pack_file(token: str, index: int) -> str:
    """The name of pack file `index` of the save `token`."""
    return PACK_FILE.format(token=token, index=index)


def shard_file(token: str, process: int) -> str:
    """The name of the shard pack of process `process` of the save `token`."""
    return SHARD_FILE.format(token=token, process=process)


def shard_index(token: str, process: int) -> str:
    """The name of the index of that shard pack."""
    return SHARD_INDEX.format(token=token, process=process)


def shared_dir(directory: epath.Path) -> epath.Path:
    """The shared directory of the steps beside the item directory `directory`
    (`<root>/<step>/<item>`): `<root>/orbax_eqx~shared`."""
    return epath.Path(directory).parent.parent / SHARED_DIR


def pack_path(directory: epath.Path, pack: PackMetadata) -> epath.Path:
    """Where the pack file `pack` of the item in `directory` is."""
    if pack.shared:
        return shared_dir(directory) / pack.file
    return epath.Path(directory) / pack.file


def arrays_dir(directory: epath.Path, token: str) -> epath.Path:
    """Where Orbax's array store of the save `token` is."""
    return epath.Path(directory) / ARRAYS_DIR.format(token=token)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def build(
    walked: Walked,
    aliases: dict[str, str],
    packed: dict[str, int],
    pack_nbytes: int,
    token: str,
    sharded: dict[str, str] | None = None,
    shard_files: int = 0,
    pause: Callable[[], None] | None = None,
    saved_as: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The sidecar's JSON for a walked item, saved with `token` (as the step
    directory and item `saved_as`, under a manager).

    `aliases` maps a leaf to its twin; `packed` maps each packed leaf to its
    offset in pack 0, which is `pack_nbytes` long; leaves in `sharded` (to
    their saved sharding, as text) go to the `shard_files` shard packs. Other
    arrays are stored through Orbax. `pause` is called once per leaf (see
    `walk`).
    """
    sharded = sharded or {}
    leaves: dict[str, Any] = {}
    paths = Paths(walked.modules)
    for leaf in walked.leaves:
        if pause is not None:
            pause()
        row = _row(leaf, packed, aliases, paths)
        if row is not None:
            leaves[leaf.name] = row
            continue
        leaves[leaf.name] = _record(leaf, aliases, packed, sharded)
    modules = {
        name: {"path": m.path, "class": m.cls, "static": m.static}
        for name, m in walked.modules.items()
    }
    packs = []
    if packed:
        packs.append(
            {
                "file": pack_file(token, 0),
                "nbytes": pack_nbytes,
                "byteorder": sys.byteorder,
                "alignment": PACK_ALIGNMENT,
            }
        )
    content = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": package_versions(),
        "token": token,
        "packs": packs,
        "shard_files": shard_files,
        "leaves": leaves,
        "modules": modules,
    }
    if saved_as is not None:
        content["saved_as"] = {"step": saved_as[0], "item": saved_as[1]}
    if walked.name_of is not None:  # what a rebuild needs
        content["nodes"] = _nodes.record(walked)
    return content


def record_checksums(
    content: dict[str, Any], xxh3: dict[str, int], sum32: dict[str, int]
) -> None:
    """Adds `{leaf name: checksum}` to the sidecar's JSON `content`, in place:
    packed leaves' XXH3-64s, Orbax-stored leaves' `sum32`s. With checksums, an
    Orbax-stored array that no process held whole (multi-host) records
    `"sum32": null`, so that a missing one is damage."""
    leaves = content["leaves"]
    for name, value in xxh3.items():
        record = leaves[name]
        if type(record) is list and type(record[3]) is list:  # a dedup row
            record[3][0] = f"{value:016x}"
        elif type(record) is list:  # a row (`compact`)
            record[3] = f"{value:016x}"
        else:
            record["xxh3"] = f"{value:016x}"
    for name, value in sum32.items():
        leaves[name]["sum32"] = value
    if content.get("checksums", True):
        for record in leaves.values():
            if type(record) is dict and record.get("data") == STORED:
                record.setdefault("sum32", None)


def _record(leaf, aliases: dict, packed: dict, sharded: dict) -> dict[str, Any]:
    """A leaf's whole record (see `build`)."""
    record: dict[str, Any] = {"path": leaf.path_str, "kind": leaf.kind}
    if leaf.kind == ARRAY:
        x = leaf.value
        record["shape"] = list(x.shape)
        record["dtype"] = dtype_str(x)
        record["container"] = container(x)
        record["nbytes"] = nbytes(x)
        if leaf.name in aliases:
            record["data"] = ALIAS
            record["alias_of"] = aliases[leaf.name]
        elif record["nbytes"] == 0:
            record["data"] = EMPTY
        elif leaf.name in packed:
            record["data"] = PACKED
            record["pack"] = 0
            record["offset"] = packed[leaf.name]
        elif leaf.name in sharded:
            record["data"] = SHARDS
            record["sharding"] = sharded[leaf.name]
        else:
            record["data"] = STORED
            record["key"] = storage_key(leaf.name)
    elif leaf.kind != SHARED:
        record["value"] = encode(leaf.value)
    return record


def _row(leaf, packed: dict[str, int], aliases, paths: Paths) -> list | None:
    """A packed jax array's row (`compact`), made here rather than from its
    whole record: its checksum (None) is set later (`record_checksums`)."""
    if leaf.kind != ARRAY or leaf.name not in packed or leaf.name in aliases:
        return None
    x = leaf.value
    if container(x) != JAX or leaf.path_str != paths(leaf.name):
        return None
    return [dtype_str(x), list(x.shape), packed[leaf.name], None]


def nbytes(x: Any) -> int:
    """Bytes of an array leaf's data as stored (a PRNG key array: its key data)."""
    return math.prod(x.shape) * itemsize(x.dtype)


@functools.cache
def itemsize(dtype: Any) -> int:
    if is_key_dtype(dtype):
        data = key_data_struct(dtype)
        return math.prod(data.shape) * data.dtype.itemsize
    # numpy's itemsize: one byte per element for int4 and bool, as numpy and
    # the pack files hold them.
    return np.dtype(dtype).itemsize

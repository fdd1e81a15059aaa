"""The format as declarative schemas (msgspec Structs): the sidecar's records
and the shard packs' indexes, each said once as types, literals and bounds.

Anything else fails to decode, and the reader words the failure as damage
naming the record and the field; fields the format does not name are read
past. What depends on other records or on the file itself (tokens, aliases,
packs, the tiling of shard chunks) is checked by the readers. A record
arrives as `msgspec.Raw` when its document failed to decode whole, to be
decoded again on its own. `json_schema()` publishes these structures
(docs/format.schema.json).
"""

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec

from .._tree import nodes as _nodes
from .._tree.walk import (
    ARRAY,
    CALLABLE,
    JAX,
    NUMPY,
    NUMPY_SCALAR,
    OBJECT,
    SCALAR,
    SHARED,
)
from . import compact as _compact
from .sidecar import (
    ALIAS,
    EMPTY,
    FORMAT,
    FORMAT_VERSION,
    MAX_DIMS,
    PACKED,
    SHARDS,
    STORED,
)

L = TypeVar("L")  # how leaf records arrive
M = TypeVar("M")  # how module records arrive
N = TypeVar("N")  # how node records arrive
UNSET: Any = msgspec.UNSET  # a field the record does not have at all

Size = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**62)]  # past it, no numpy array
Shape = Annotated[list[Dim], msgspec.Meta(max_length=MAX_DIMS)]
Sum32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
Hex128 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
Digest = Annotated[str, msgspec.Meta(pattern="^xxh3:[0-9a-f]{16}$")]
Container = Literal[JAX, NUMPY, NUMPY_SCALAR]  # type: ignore[valid-type]
Data = Literal[STORED, PACKED, SHARDS, EMPTY, ALIAS]  # type: ignore[valid-type]
Path = str | msgspec.UnsetType  # a leaf's key path as printed; its name if unset


class Versioned(msgspec.Struct):
    """What a reader looks at first: the format and its version."""

    format: Any = None
    format_version: Any = None


class PackRecord(msgspec.Struct):
    """One pack file: `file` must be a pack file's name (`sidecar.PACK_FILE`)."""

    file: str
    nbytes: Size
    byteorder: Literal["little", "big"]
    alignment: Literal[64] = 64
    shared: bool = False  # in the shared directory beside the steps


class SavedAs(msgspec.Struct):
    """The step directory and item a manager saved the item as."""

    step: str
    item: str


# A packed jax array's short record (`compact`): `[dtype, shape, offset, xxh3]`,
# in pack 0; with dedup `[dtype, shape, offset, [xxh3, xxh3_128, pack]]`.
Stored = tuple[Hex64 | None, Hex128, Size]
Row = tuple[str, Shape, Size, Hex64 | None | Stored]
TypeIndex = Annotated[int, msgspec.Meta(ge=0)]


class ArrayRecord(msgspec.Struct, tag_field="kind", tag=ARRAY):
    """An array leaf, written whole."""

    shape: Shape
    dtype: str
    container: Container
    data: Data
    nbytes: Size
    path: Path = UNSET
    pack: Size | None = None  # packed: which pack ...
    offset: Size | None = None  # ... and where in it
    xxh3: Hex64 | None = None  # packed: XXH3-64 of its bytes
    xxh3_128: Hex128 | None = None  # packed, with dedup: XXH3-128 of its bytes
    key: str | None = None  # in Orbax's store: its storage key
    sum32: Sum32 | None | msgspec.UnsetType = UNSET  # in Orbax's store
    alias_of: str | None = None  # an alias: the leaf whose array it is
    sharding: str | msgspec.UnsetType = UNSET  # in shard packs: as saved


class ValueRecord(msgspec.Struct, tag_field="kind"):
    """A leaf recorded by its value (or its description): its kind is its tag."""

    path: Path = UNSET
    value: Any = None


class ScalarRecord(ValueRecord, tag=SCALAR):
    value: Any = UNSET  # a scalar without one is damage


class CallableRecord(ValueRecord, tag=CALLABLE):
    pass


class SharedRecord(ValueRecord, tag=SHARED):
    pass


class ObjectRecord(ValueRecord, tag=OBJECT):
    pass


_Values = ScalarRecord | CallableRecord | SharedRecord | ObjectRecord
LeafRecord = Row | ArrayRecord | _Values


class ModuleRecord(msgspec.Struct):
    cls: str = msgspec.field(name="class")
    static: dict[str, Any] = {}
    path: str | msgspec.UnsetType = UNSET


class ModuleType(msgspec.Struct):
    """A module's class and static fields, listed once for every module that
    has them (`compact`), and the index of their node's type in `node_types`
    where it is not written in `nodes`."""

    cls: str = msgspec.field(name="class")
    static: dict[str, Any] = {}
    node: TypeIndex | msgspec.UnsetType = UNSET


class NodeType(msgspec.Struct, omit_defaults=True):
    """An inner node's record without its path and children, listed once for
    every node it describes (`compact`): a list's or tuple's number of
    children is its `length`."""

    type: Literal[_compact.SHARED_TYPES]  # type: ignore[valid-type]
    fields: list[str] = []
    keys: list[str] = []
    cls: str = msgspec.field(name="class", default="")
    length: Size | msgspec.UnsetType = UNSET
    absent: list[str] = []  # as in `NodeRecord`
    wrapper: bool = False
    wiring: dict[str, Any] | msgspec.UnsetType = UNSET


class NodeRecord(msgspec.Struct, omit_defaults=True):
    """An inner node of the tree, checked for shape only (the rebuild checks
    how nodes refer to each other)."""

    type: Literal[_nodes.TYPES]  # type: ignore[valid-type]
    path: str
    children: list[str | None] = []
    fields: list[str] = []
    cls: str = msgspec.field(name="class", default="")
    keys: list[Any] = []
    markers: list[Any] = []
    absent: list[str] = []  # a module's static fields that are not set
    wrapper: bool = False  # a module that wraps a function: not rebuilt
    wiring: dict[str, Any] | msgspec.UnsetType = UNSET  # `eqx.nn.Shared`'s


class Skimmed(msgspec.Struct, Generic[L, M]):
    """A sidecar without its records of inner nodes, which only a rebuild
    without a skeleton reads: read past unchecked (the sidecar's checksum
    still covers them)."""

    format: Literal[FORMAT]  # type: ignore[valid-type]
    format_version: Literal[FORMAT_VERSION]  # type: ignore[valid-type]
    versions: dict[str, str]
    token: Token
    leaves: dict[str, L]
    modules: dict[str, M]
    packs: list[PackRecord] = []
    shard_files: Size = 0
    checksums: bool = True
    module_types: list[ModuleType] = []
    saved_as: SavedAs | None = None
    save: Token | None = None  # a type handler group's: its save's own token
    checksum: Digest | msgspec.UnsetType = UNSET  # checked before decoding


class Sidecar(Skimmed[L, M], Generic[L, M, N], kw_only=True):
    """A whole sidecar."""

    nodes: dict[str, N]
    node_types: list[NodeType] = []


def document(nodes: bool = True) -> Any:
    """A whole sidecar, every record by its schema (without the records of
    inner nodes unless `nodes`)."""
    if not nodes:
        return Skimmed[LeafRecord, TypeIndex | ModuleRecord]
    return Sidecar[LeafRecord, TypeIndex | ModuleRecord, TypeIndex | NodeRecord]


def raw_records(nodes: bool = True) -> Any:
    """A whole sidecar with its leaf and module records undecoded, to decode
    them one by one."""
    if not nodes:
        return Skimmed[msgspec.Raw, msgspec.Raw]
    return Sidecar[msgspec.Raw, msgspec.Raw, msgspec.Raw]


# --- shard packs' indexes (`_storage/sharded/index.py`) ---------------------


class ChunkRow(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One chunk: its box, its byte range in the shard pack, and the XXH3-64
    of every `block` bytes of that range; with dedup, which of the index's
    `files` holds it, and the XXH3-128 of its bytes (its identity)."""

    start: list[Size]
    stop: list[Size]
    offset: Size
    nbytes: Size
    block: Annotated[int, msgspec.Meta(gt=0)]
    xxh3s: list[Hex64]
    file: Size | msgspec.UnsetType = UNSET  # an index into `files`
    xxh3_128: Hex128 | msgspec.UnsetType = UNSET


class ShardFile(msgspec.Struct):
    """A shard pack a dedup index's chunks are in: `file` must be a shard
    pack's name (`sidecar.SHARD_FILE`)."""

    file: str
    nbytes: Size


class ShardIndex(msgspec.Struct):
    """One process's shard-pack index."""

    format: Literal["orbax_eqx.shards"]
    format_version: Literal[FORMAT_VERSION]  # type: ignore[valid-type]
    token: Token
    process: Size
    file: str
    nbytes: Size
    chunks: dict[str, list[ChunkRow]]
    shared: bool = False  # `files` are in the shared directory beside the steps
    files: list[ShardFile] | msgspec.UnsetType = UNSET  # with dedup
    checksum: Digest | msgspec.UnsetType = UNSET  # checked before decoding


class SidecarFile(
    Sidecar[LeafRecord, TypeIndex | ModuleRecord, TypeIndex | NodeRecord]
):
    """A checkpoint's sidecar, `orbax_eqx.json` (docs/guides/format.md), last
    of all its `"checksum"`: `"xxh3:"` and the XXH3-64 of every byte before
    that line."""


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the sidecar and of a shard index (draft 2020-12),
    generated from the structures that decode them."""
    (sidecar, index), components = msgspec.json.schema_components(
        [SidecarFile, ShardIndex], ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "orbax_eqx checkpoint format",
        "$defs": components,
        "oneOf": [sidecar, index],
    }

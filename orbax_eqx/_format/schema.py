"""The sidecar as declarative schemas (msgspec Structs), one per format version.

What each record may hold is said here once, as types, literals and bounds;
anything else fails to decode, and `sidecar_read` words the failure as
damage naming the record and the field. Fields a format does not name are
read past (a later writer's notes): a record is what the schema reads of it.
What depends on other records or on the file itself (the token and the
names derived from it, aliases, packs, checksums per version, the binding of
checksums to records) is checked apart, in `records_read` and
`sidecar_read`.

Leaf records are a tagged union on `kind`; an array record of format 6
records its data checksum as XXH3-64 (`xxh3`, 16 lower-case hexadecimal
digits) and never a CRC-32 (`crc32`), one of formats 1 to 5 the other way
round. `T` is how records arrive: `msgspec.Raw` while decoding bytes (each
record is decoded on its own, so that a failure names it), `Any` for JSON
already decoded by the standard library (a sidecar holding lone surrogates,
which a save before format 6 could write), or the records' own schemas: a
sidecar decodes in one pass, and only one that fails is decoded again,
record by record, to name what failed.
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
from .sidecar import ALIAS, EMPTY, MAX_DIMS, PACKED, SHARDS, STORED

L = TypeVar("L")  # how leaf records arrive
M = TypeVar("M")  # how module records arrive
UNSET: Any = msgspec.UNSET  # a field the record does not have at all

Size = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**62)]  # past it, no numpy array
Shape = Annotated[list[Dim], msgspec.Meta(max_length=MAX_DIMS)]
Crc32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
Container = Literal[JAX, NUMPY, NUMPY_SCALAR]  # type: ignore[valid-type]
Data = Literal[STORED, PACKED, SHARDS, EMPTY, ALIAS]  # type: ignore[valid-type]
Path = str | msgspec.UnsetType  # a leaf's key path as printed; its name if unset


class Versioned(msgspec.Struct):
    """What picks the schema: the format and its version (and the seal)."""

    format: Any = None
    format_version: Any = None
    checksum: Any = UNSET


class PackRecord(msgspec.Struct):
    nbytes: Size
    file: Any = None  # compared with the name derived from the token
    byteorder: Any = UNSET  # compared with this machine's


# Format 6's short records (`compact`): a packed jax array's row, and the
# index of a module's or node's type in its table.
Row = tuple[str, Shape, Size, Hex64 | None]
TypeIndex = Annotated[int, msgspec.Meta(ge=0)]


class Skimmed(msgspec.Struct, Generic[L, M]):
    """A sidecar of any format without its records of inner nodes, which
    only a rebuild without a skeleton reads: read past, unchecked (the
    sidecar's checksum still covers them), they cost a restore into a
    skeleton nothing."""

    leaves: dict[str, L]
    versions: dict[str, str] = {}
    modules: dict[str, M] = {}
    checksums: bool = True
    token: Any = None
    packs: list[PackRecord] = []
    shard_files: Size = 0
    # Format 6: the modules' types (`compact`); read past before.
    module_types: Any = UNSET


class Document(Skimmed[L, M]):
    """A sidecar of any format; the token's form depends on the version."""

    nodes: Any = UNSET
    node_types: Any = UNSET  # format 6: the nodes' types (`compact`)


class ArrayRecord(msgspec.Struct, tag_field="kind", tag=ARRAY):
    """An array leaf of formats 1 to 5."""

    shape: Shape
    dtype: str
    container: Container
    data: Data
    path: Path = UNSET
    # Read where `data` says they matter (`records_read`), as a save wrote them.
    nbytes: Any = 0
    pack: Any = None
    offset: Any = None
    key: Any = None
    alias_of: Any = None
    sharding: Any = UNSET
    crc32: Crc32 | None = None
    sum32: Crc32 | None | msgspec.UnsetType = UNSET
    xxh3: Any = None  # not of these formats: read past


class ArrayRecord6(ArrayRecord, tag=ARRAY):
    """An array leaf of format 6: its data checksum is XXH3-64."""

    crc32: None = None
    xxh3: Hex64 | None = None


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


_OTHERS = ScalarRecord | CallableRecord | SharedRecord | ObjectRecord
LeafRecord = ArrayRecord | _OTHERS
LeafRecord6 = Row | ArrayRecord6 | _OTHERS


def leaf_record(version: int) -> Any:
    """The union a leaf record of format `version` decodes into."""
    return LeafRecord6 if version >= 6 else LeafRecord


def module_record(version: int) -> Any:
    """What a module's entry of format `version` decodes into: from format 6
    on its record, or the index of its type (`compact`)."""
    return TypeIndex | ModuleRecord if version >= 6 else ModuleRecord


def document(version: int, nodes: bool = True) -> Any:
    """A whole sidecar of format `version`, every record by its schema
    (without the records of inner nodes unless `nodes`)."""
    kind = Document if nodes else Skimmed
    return kind[leaf_record(version), module_record(version)]


class ModuleRecord(msgspec.Struct):
    cls: str = msgspec.field(name="class")
    static: dict[str, Any] = {}
    path: str | msgspec.UnsetType = UNSET


class ModuleType(msgspec.Struct):
    """A module's class and static fields, as format 6 lists them once for
    every module that has them (`compact`), and the index of their node's
    type in `node_types` where it is not written in `nodes`."""

    cls: str = msgspec.field(name="class")
    static: dict[str, Any] = {}
    node: TypeIndex | msgspec.UnsetType = UNSET


class NodeType(msgspec.Struct):
    """An inner node's record without its path and children, as format 6
    lists it once for every node it describes (`compact`): a list's or
    tuple's number of children is its `length`."""

    type: Literal[_compact.SHARED_TYPES]  # type: ignore[valid-type]
    fields: list[str] = []
    keys: list[str] = []
    cls: str = msgspec.field(name="class", default="")
    length: Size | msgspec.UnsetType = UNSET


class NodeRecord(msgspec.Struct):
    """An inner node of the tree (format 5 on), checked for shape only."""

    type: Literal[_nodes.TYPES]  # type: ignore[valid-type]
    path: str
    children: list[str | None] = []
    fields: list[str] = []
    cls: str = msgspec.field(name="class", default="")
    keys: list[Any] = []
    markers: list[Any] = []

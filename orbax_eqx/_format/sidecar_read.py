"""Reading the sidecar: its seal, its version, its records by their schemas,
then what holds across records, into `Metadata`.

Pure data: nothing named in the file is imported or called, and every file
name and storage key is derived (from tokens, from leaf names) and only
compared with what the file says. The seal is checked before the JSON is
read, and reading is bounded (docs/guides/format.md, "Bounds"). A document
that fails its schema is decoded again record by record, so that the error
names the record and the field.
"""

import functools
import math
import re
import sys
from typing import Any

import msgspec
import numpy as np
from etils import epath

from .._bytes import route as _route
from .._errors import SidecarError, permission_denied
from .._tree.names import SEPARATOR, storage_key
from .._tree.values import decode_scalar, scalar_type, too_deep
from .._tree.walk import ARRAY, JAX, SCALAR, ModuleInfo, parse_dtype
from . import compact as _compact
from . import schema as _schema
from . import sealed as _sealed
from .paths import Paths
from .sidecar import (
    ALIAS,
    EMPTY,
    FILE_NAME,
    FORMAT,
    FORMAT_VERSION,
    MAX_BYTES,
    PACKED,
    SHARDS,
    STORED,
    LeafMetadata,
    Metadata,
    PackMetadata,
    itemsize,
    leaf_metadata,
)

TOO_DEEP = "nests values deeper than orbax_eqx writes them"
_NODE: Any = _schema.TypeIndex | _schema.NodeRecord
_MODULE: Any = _schema.TypeIndex | _schema.ModuleRecord
PACK_NAME = re.compile(r"orbax_eqx~packed\.[0-9a-f]{16}\.(0|[1-9][0-9]{0,5})\.bin")
SHARD_NAME = re.compile(r"orbax_eqx~shards\.[0-9a-f]{16}\.(0|[1-9][0-9]{0,5})\.bin")
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def read(directory: epath.Path, *, nodes: bool = True) -> Metadata:
    """Reads and validates the sidecar of the checkpoint in `directory`.

    Without `nodes`, the records of the tree's inner nodes (which only a
    rebuild without a skeleton reads) are read past: neither decoded nor
    checked, and `nodes` of the result is None."""
    path = directory / FILE_NAME
    missing = SidecarError(
        f"{path} is missing, so {directory} is not an orbax_eqx checkpoint "
        "or is incomplete. Pass the item directory of a checkpoint saved "
        "with orbax_eqx (for a CheckpointManager: <root>/<step>/<item>)."
    )
    if not path.exists():
        if (directory / "_METADATA").exists():  # Orbax's PyTree handlers wrote it
            raise SidecarError(
                f"{directory} is a plain Orbax checkpoint (saved by Orbax's own "
                "handlers, with no orbax_eqx sidecar): it holds arrays only. "
                "`oeqx.restore(path, skeleton)` restores it into a skeleton; "
                "saving that with `oeqx.save` makes an orbax_eqx checkpoint."
            )
        raise missing
    damaged = functools.partial(_damaged, path)
    try:
        raw = _route.read_bounded(path, MAX_BYTES, damaged)
    except FileNotFoundError:  # deleted since, or a link to nothing
        raise missing from None
    except PermissionError:
        raise permission_denied(path) from None
    sealed = _sealed.check(raw, damaged)
    try:
        head = msgspec.json.decode(raw, type=_schema.Versioned)
    except _DECODE_ERRORS as e:
        raise damaged(f"is not JSON as orbax_eqx writes it ({_short(e)})") from None
    check_version(head, f"The checkpoint in {directory}", _bad(str(directory)))
    if not sealed:
        raise damaged(
            "records no checksum on its last line, where every sidecar has "
            "one: it was edited, or rewritten"
        )
    try:
        return _decode(raw, str(directory), nodes)
    except RecursionError:
        raise _bad(str(directory))(TOO_DEEP) from None


def check_version(head: Any, what: str, bad) -> None:
    """Refuses a file of another format or format version than this release's."""
    if head.format not in (FORMAT, "orbax_eqx.shards"):
        raise bad(f'expected a JSON object with "format": "{FORMAT}"')
    version = head.format_version
    if type(version) is not int:
        raise bad('"format_version" is not an integer')
    if version != FORMAT_VERSION:
        advice = (
            "Upgrade orbax_eqx to restore it."
            if version > FORMAT_VERSION
            else "It was written by an earlier, unreleased orbax_eqx; restore "
            "it with that version and save it again with this one."
        )
        raise SidecarError(
            f"{what} is of format version {version}; this orbax_eqx reads "
            f"format version {FORMAT_VERSION} only. {advice}"
        )


def _decode(raw: bytes, where: str, nodes: bool) -> Metadata:
    bad = _bad(where)
    try:
        document = msgspec.json.decode(raw, type=_schema.document(nodes))
    except msgspec.ValidationError as e:
        if not re.search(r"`\$\.(leaves|modules|nodes)\[", str(e)):
            raise bad(f"its {_field(e)} is malformed ({_short(e)})") from None
        # One record: decoded again one by one, so that the error names it.
        document = msgspec.json.decode(raw, type=_schema.raw_records(nodes))
    except _DECODE_ERRORS as e:
        raise bad(f"it is not JSON as orbax_eqx writes it ({_short(e)})") from None
    return _from_document(document, where, nodes)


def _field(error: msgspec.ValidationError) -> str:
    found = re.search(r"`\$\.?([A-Za-z_]*)", str(error))
    field = found.group(1) if found else ""
    return f'"{field}"' if field else "top level"


def _short(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _bad(where: str):
    def bad(what: str) -> SidecarError:
        return SidecarError(
            f"The sidecar in {where} is damaged: {what}. Restore an earlier step, "
            "or re-save the checkpoint."
        )

    return bad


def _damaged(path, what: str) -> SidecarError:
    return SidecarError(
        f"The sidecar {path} {what}; the checkpoint is damaged (or something "
        "else was put in its place). Restore an earlier step, or re-save it."
    )


def _from_document(document: Any, where: str, nodes: bool) -> Metadata:
    """The `Metadata` of a decoded document: each record read, then the checks
    across records."""
    bad = _bad(where)
    recorded = getattr(document, "nodes", {}) if nodes else {}
    count = len(document.leaves) + len(document.modules) + len(recorded)
    if count > _sealed.MAX_RECORDS:  # before any record is read
        raise bad(
            f"it holds {count} records (leaves, modules and nodes), more than "
            f"any save writes ({_sealed.MAX_RECORDS})"
        )
    packs = _packs(document.packs, where, bad)
    if document.saved_as is None and any(p.shared for p in packs):
        # Read beside the steps of a manager: a checkpoint of its own has none.
        raise bad("it lists shared packs but was not saved as a step of a manager")
    paths = Paths(document.modules)
    leaves = _Leaves(packs, document.checksums, bad, paths).read(document.leaves)
    _check_references(leaves, document.shard_files != 0, bad)
    types = document.module_types
    modules = {
        name: _module(name, rec, bad, types, paths)
        for name, rec in document.modules.items()
    }
    read_nodes = None
    if nodes:
        kinds = [msgspec.to_builtins(kind) for kind in document.node_types]
        for i, kind in enumerate(kinds):
            if _compact.count_of(kind) is None:
                raise bad(
                    f"node type {i} (a {kind['type']}) says no children: a list "
                    'or tuple records its "length", a module or namedtuple its '
                    '"fields", a dict its "keys"'
                )
        carried = _carried(document.modules, types, kinds, bad)
        limit = len(leaves) + len(carried) + len(recorded)
        read_nodes = _nodes(recorded, kinds, paths, limit, bad, carried, modules)
    saved_as = document.saved_as
    return Metadata(
        where,
        FORMAT_VERSION,
        dict(document.versions),
        leaves,
        modules,
        packs,
        document.token,
        document.shard_files,
        document.checksums,
        read_nodes,
        None if saved_as is None else (saved_as.step, saved_as.item),
    )


def _packs(records, where: str, bad) -> tuple[PackMetadata, ...]:
    packs = []
    for i, rec in enumerate(records):
        if not PACK_NAME.fullmatch(rec.file):
            # Like storage keys, file names are never taken from the file as
            # they are: only a pack file's name, in the item directory, is.
            raise bad(f"pack {i} is in file {rec.file[:80]!r}, not a pack file")
        if rec.byteorder != sys.byteorder:
            raise SidecarError(
                f"The arrays of the checkpoint in {where} were packed on a "
                f"{rec.byteorder}-endian machine; this one is {sys.byteorder}-"
                "endian, which orbax_eqx does not convert."
            )
        packs.append(PackMetadata(rec.file, rec.nbytes, rec.shared))
    return tuple(packs)


class _Leaves:
    """Reads the leaf records of one sidecar."""

    def __init__(self, packs, checksums: bool, bad, paths: Paths):
        self.packs, self.checksums, self.bad, self.paths = packs, checksums, bad, paths

    def read(self, records: dict[str, Any]) -> dict[str, LeafMetadata]:
        """Every leaf's record, in order; each dropped from `records` once
        read, so that a huge sidecar costs its records' objects once."""
        out = {}
        take = records.pop
        of = self.paths.of
        for name in list(records):
            record = take(name)
            if type(record) is tuple:  # a row (most leaves: sooner)
                out[name] = self.row(name, of(name), record)
            else:
                out[name] = self.leaf(name, record)
        return out

    def leaf(self, name: str, record: Any) -> LeafMetadata:
        bad = self.bad
        if type(record) is msgspec.Raw:  # after a failed decode
            try:
                record = msgspec.json.decode(record, type=_schema.LeafRecord)
            except msgspec.ValidationError as e:
                raise bad(f"leaf {name!r} is malformed ({_short(e)})") from None
            except RecursionError:
                raise bad(f"leaf {name!r} {TOO_DEEP}") from None
            if type(record) is tuple:
                return self.row(name, self.paths.of(name), record)
        path = record.path
        if path is _schema.UNSET:  # read off the name (`compact`)
            path = self.paths.of(name)
        if not isinstance(record, _schema.ArrayRecord):
            kind = type(record).__struct_config__.tag
            value = None if record.value is _schema.UNSET else record.value
            if too_deep(value):
                raise bad(f"leaf {name!r} {TOO_DEEP}")
            if kind == SCALAR and (
                record.value is _schema.UNSET or not _is_scalar(value)
            ):
                raise bad(f"leaf {name!r} has no valid Python value")
            return leaf_metadata(name, path, kind, value=value)
        return self.array(name, path, record)

    def row(self, name: str, path: str, row: tuple) -> LeafMetadata:
        """A packed jax array's row (`compact`), checked as the array record
        it stands for."""
        text, dims, offset, xxh3 = row
        pack, identity = 0, None
        if type(xxh3) is tuple:  # a dedup save's: `[xxh3, xxh3_128, pack]`
            xxh3, identity, pack = xxh3
        dtype = sys.intern(text)
        why = _dtype_problem(dtype)
        if why is not None:
            raise self.bad(f"leaf {name!r} has {why}")
        size = _compact.row_nbytes(dims, dtype)
        self.place(name, pack, offset, size)
        checksum = self.checksum(name, path, xxh3)
        return leaf_metadata(
            name,
            path,
            ARRAY,
            tuple(dims),
            dtype,
            JAX,
            PACKED,
            None,
            size,
            pack=pack,
            offset=offset,
            checksum=checksum,
            identity=identity,
        )

    def array(self, name: str, path: str, rec) -> LeafMetadata:
        bad = self.bad
        dtype = sys.intern(rec.dtype)
        why = _dtype_problem(dtype)  # every array's: zero-size and sharded too
        if why is not None:
            raise bad(f"leaf {name!r} has {why}")
        shape, data = tuple(rec.shape), rec.data
        packed, stored = data == PACKED, data == STORED
        checksum = None
        if packed:
            checksum = self.packed(name, path, rec, shape, dtype)
        else:
            self.unpacked(name, path, rec, shape)
        sum32 = rec.sum32 if stored and rec.sum32 is not _schema.UNSET else None
        sharding = rec.sharding
        return leaf_metadata(
            name,
            path,
            ARRAY,
            shape,
            dtype,
            rec.container,
            data,
            rec.alias_of,
            rec.nbytes,
            pack=rec.pack if packed else None,
            offset=rec.offset if packed else None,
            checksum=checksum,
            identity=rec.xxh3_128 if packed else None,
            sum32=sum32,
            sharding=None if sharding is _schema.UNSET else sharding,
            key=rec.key if stored else None,
        )

    def packed(self, name: str, path: str, rec, shape: tuple, dtype: str) -> int | None:
        """A packed array record's checksum, its bytes checked."""
        self.place(name, rec.pack, rec.offset, rec.nbytes)
        expected = math.prod(shape) * itemsize(parse_dtype(dtype))
        if rec.nbytes != expected:
            raise self.bad(
                f"leaf {name!r} has {rec.nbytes} bytes in its pack, but a "
                f"{dtype} array of shape {shape} has {expected}"
            )
        return self.checksum(name, path, rec.xxh3)

    def unpacked(self, name: str, path: str, rec, shape: tuple) -> None:
        """Checks an array record that is not packed."""
        data, bad = rec.data, self.bad
        if data == STORED:
            if rec.key != storage_key(name):
                # Keys are derived from names, never read from the file.
                raise bad(
                    f"leaf {name!r} has storage key {str(rec.key)[:80]!r}, "
                    f"expected {storage_key(name)!r}"
                )
            if self.checksums and rec.sum32 is _schema.UNSET:
                raise bad(_no_checksum(name, path, "sum32"))
        elif data == ALIAS and not isinstance(rec.alias_of, str):
            raise bad(f"leaf {name!r} is an alias of nothing")
        elif data == EMPTY and math.prod(shape) != 0:
            # Else a restore would invent zeros for it, as many as it claims.
            raise bad(
                f'leaf `{path}` (leaf name {name!r}) is stored as zero-size ("data":'
                f' "none") but has shape {shape}, which holds '
                f"{math.prod(shape)} elements"
            )

    def place(self, name: str, pack, offset, size: int) -> None:
        """A packed leaf's bytes lie inside its pack."""
        packs = self.packs
        if pack is None or pack >= len(packs):
            raise self.bad(f"leaf {name!r} is in pack {pack!r}, which is not listed")
        if offset is None:
            raise self.bad(f"leaf {name!r} has no offset in its pack")
        if offset + size > packs[pack].nbytes:
            raise self.bad(
                f"leaf {name!r} ends at byte {offset + size} of pack {pack}, which "
                f"holds {packs[pack].nbytes}"
            )

    def checksum(self, name: str, path: str, xxh3: str | None) -> int | None:
        """A packed leaf's XXH3-64, which a save with checksums records."""
        if xxh3 is None and self.checksums:
            raise self.bad(_no_checksum(name, path))
        return None if xxh3 is None else int(xxh3, 16)


def _no_checksum(name: str, path: str, kind: str = "xxh3") -> str:
    where = "is in Orbax's array store" if kind == "sum32" else "is packed"
    return (
        f"leaf `{path}` (leaf name {name!r}) {where} but records no {kind}, "
        "though a save with checksums records one for every such leaf: it was "
        "edited"
    )


@functools.cache
def _dtype_problem(text: str) -> str | None:
    """What is wrong with an array's recorded dtype, or None: it must be
    spelled as a save spells it (`str(dtype)`: `<U2`, not `U2`), and be one a
    save writes (no structured or object dtype)."""
    try:
        dtype = parse_dtype(text)
    except (TypeError, ValueError, OverflowError, MemoryError, SyntaxError):
        return f"unknown dtype {text[:40]!r}"
    if isinstance(dtype, np.dtype) and (
        dtype.fields is not None or dtype.subdtype is not None
    ):
        return f"unknown dtype {text!r}"
    if isinstance(dtype, np.dtype) and dtype.hasobject:
        return f"dtype {text!r}, which no save writes (it refuses arrays of objects)"
    if str(dtype) != text:
        return f"dtype {text!r}, which no save writes (it writes {str(dtype)!r})"
    return None


def _is_scalar(encoded: Any) -> bool:
    if scalar_type(encoded) is None:
        return False
    try:
        decode_scalar(encoded)
    except (TypeError, ValueError):  # `{"complex": 5}`: no pair to unpack
        return False
    return True


def _check_references(leaves: dict, has_shards: bool, bad) -> None:
    """Aliases name stored arrays of their shape and dtype; leaves in shard
    packs have packs listed."""
    for leaf in leaves.values():
        target = leaves.get(leaf.alias_of) if leaf.data == ALIAS else None
        if leaf.data == ALIAS and (
            target is None
            or target.data not in (STORED, PACKED, SHARDS)
            or (target.shape, target.dtype) != (leaf.shape, leaf.dtype)
        ):
            raise bad(
                f"leaf {leaf.name!r} is an alias of {str(leaf.alias_of)[:80]!r}, "
                "which is no stored array of the same shape and dtype"
            )
        if leaf.data == SHARDS and not has_shards:
            raise bad(
                f"leaf {leaf.name!r} is in shard packs, but the sidecar lists "
                'none ("shard_files": 0)'
            )


def _module(name: str, rec: Any, bad, types: list, paths: Paths) -> ModuleInfo:
    """One module's record, or the index of its class and static fields in
    `types` (`compact`)."""
    if type(rec) is msgspec.Raw:  # after a failed decode
        try:
            rec = msgspec.json.decode(rec, type=_MODULE)
        except (msgspec.ValidationError, RecursionError):
            raise bad(f"module {name!r} has no class, path or static fields") from None
    if type(rec) is int:
        if rec >= len(types):
            listed = len(types)
            raise bad(
                f"module {name!r} is of module type {rec}, but the sidecar lists "
                f"{listed} module type{'' if listed == 1 else 's'}"
            )
        shown, path, rec = f"of type {rec}", paths.of(name), types[rec]
    else:
        shown, path = name, paths.of(name) if rec.path is _schema.UNSET else rec.path
    for field, value in rec.static.items():
        if too_deep(value):
            raise bad(f"static field {field!r} of module {shown!r} {TOO_DEEP}")
    return ModuleInfo(path, rec.cls, rec.static)


def _carried(modules: dict[str, Any], types: list, kinds: list, bad) -> dict:
    """`{name: node type}` of the modules whose module type holds their node's
    type (`compact.NODE`): an index into the node types `kinds`, of a module."""
    carried = {}
    for name, rec in modules.items():
        if type(rec) is not int or rec >= len(types):
            continue  # (read as a module, or refused there)
        at = types[rec].node
        if at is _schema.UNSET:
            continue
        if not (at < len(kinds) and kinds[at]["type"] == "module"):
            raise bad(
                f"module type {rec} (of module {name!r}) gives its node type as "
                f"{at}, which is no module's node type among the sidecar's "
                f"{len(kinds)} node type{'' if len(kinds) == 1 else 's'}"
            )
        carried[name] = at
    return carried


def _nodes(recorded, kinds, paths, limit: int, bad, carried, modules) -> dict:
    """The records of the tree's inner nodes, as the plain dicts the rebuild
    reads; a node may be the index of its type in `kinds` (`compact`), which
    names its children: at most `limit` in all (each leaf and node is one
    node's child at most). `carried`: the nodes of modules whose module type
    holds their node type, each recorded there only."""
    twice = next((name for name in carried if name in recorded), None)
    if twice is not None:
        raise bad(
            f'node {twice!r} is recorded twice: in "nodes" and by its module\'s type'
        )
    counts = [_compact.count_of(kind) or 0 for kind in kinds]
    expand = _Expand(kinds, paths)
    out: dict[str, dict[str, Any]] = {}
    named = 0
    for name, rec in recorded.items():
        rec = _node(name, rec, bad)
        if type(rec) is not int:
            out[name] = rec
            continue
        if rec >= len(kinds):
            raise bad(
                f"node {name!r} is of node type {rec}, but the sidecar lists "
                f"{len(kinds)} node type{'' if len(kinds) == 1 else 's'}"
            )
        named += counts[rec]
        if named > limit:  # before any name is made
            raise _too_many(name, limit, bad)
        out[name] = expand(name, rec)
    for name, rec in carried.items():
        named += counts[rec]
        if named > limit:
            raise _too_many(name, limit, bad)
        out[name] = expand(name, rec, modules[name].path)
    return out


def _node(name: str, rec: Any, bad) -> Any:
    """A node's record: the index of its node type, or a plain dict."""
    if type(rec) is msgspec.Raw:  # after a failed decode
        try:
            rec = msgspec.json.decode(rec, type=_NODE)
        except (msgspec.ValidationError, RecursionError) as e:
            raise bad(f"node {name!r} is malformed ({_short(e)})") from None
    if type(rec) is int:
        return rec
    node = msgspec.to_builtins(rec)
    for key in ("keys", "markers"):
        if too_deep(node.get(key)):
            raise bad(f"the {key} of node {name!r} are malformed")
    return node


class _Expand:
    """The whole records of short nodes (`compact`): each node type's record
    (less its `length`) and its children's name parts made once; a node's
    children are named by its name and a separator before each part."""

    def __init__(self, types: list[dict[str, Any]], paths: Paths):
        self.types = types
        self.paths = paths
        self.made: dict[int, tuple[dict[str, Any], list[str]]] = {}

    def __call__(self, name: str, index: int, path: str | None = None):
        made = self.made.get(index)
        if made is None:
            kind = dict(self.types[index])
            parts = _compact.children_of("", kind) or []  # (checked: not None)
            kind.pop(_compact.LENGTH, None)
            made = self.made[index] = (kind, parts)
        kind, parts = made
        prefix = name + SEPARATOR if name else ""
        children = [prefix + part for part in parts]
        node = {"path": path or self.paths.of(name), **kind, "children": children}
        return msgspec.to_builtins(msgspec.convert(node, _schema.NodeRecord))


def _too_many(name: str, limit: int, bad) -> Exception:
    return bad(
        f"its node types name more children than it has leaves and nodes "
        f"({limit}), at node {name!r}"
    )

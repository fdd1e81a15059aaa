"""Reading the sidecar: decoding it by its format's schema and turning it into
`Metadata`.

Pure data: nothing named in the file is imported or called, and every file
name and storage key is derived (from the token, from leaf names) and only
compared with what the file says. The format is described in `sidecar`; what
each record may hold, as declarative schemas (msgspec Structs), in `schema`;
the records are read one by one in `records_read` (leaves) and
`structure_read` (modules, nodes); what holds across records
(aliases, packs, shard packs) is checked here.

From format 6 on, the file's checksum is checked first, before its JSON is
read (see `sidecar.checksum_line`): any changed byte is damage.

Reading is bounded: the file must be a regular file (a FIFO would block the
read forever, a link to `/dev/zero` would never end) of at most `MAX_BYTES`;
its JSON may hold no `NaN`/`Infinity` (which orbax_eqx never writes) and no
integer of more digits than Python converts, and its values may nest at most
`values.MAX_DEPTH` levels deep, so that reading, comparing or printing them
never recurses without bound. Any of these is damage, said in one
`SidecarError`. Bytes msgspec does not decode (text with lone surrogates,
which saves before format 6 could write) are decoded by the standard library
and checked by the same schemas.
"""

import functools
import json
import sys
from typing import Any

import msgspec
from etils import epath
from msgspec import Raw

# The one module of a later stage read here: it imports nothing of ours but
# `_errors`, and opening files safely is the same job for every file.
from .._bytes import route as _route
from .._errors import SidecarError, permission_denied
from .._gc import paused
from .._tree.names import SEPARATOR
from . import compact as _compact
from . import records_read as _records
from . import schema as _schema
from . import sealed as _sealed
from . import structure_read as _structure
from .records_read import TOO_DEEP as _TOO_DEEP
from .sidecar import (
    ALIAS,
    FILE_NAME,
    FORMAT,
    FORMAT_VERSION,
    MAX_BYTES,
    PACKED,
    SHARDS,
    STORED,
    TOKEN,
    Metadata,
    PackMetadata,
    pack_file,
)


class _NotJSON(ValueError):
    """`NaN` or `Infinity`, which Python's reader takes but JSON has not."""


def read(directory: epath.Path, *, nodes: bool = True) -> Metadata:
    """Reads and validates the sidecar of the checkpoint in `directory`.

    Without `nodes`, the records of the tree's inner nodes (which only a
    rebuild without a skeleton reads) are read past: neither decoded nor
    checked, and `nodes` of the result is None. A restore into a skeleton,
    or a flat one, saves their time and memory (a tenth of a large tree's)."""
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
    try:
        raw = _route.read_bounded(path, MAX_BYTES, lambda what: _damaged(path, what))
    except FileNotFoundError:  # deleted since, or a link to nothing
        raise missing from None
    except PermissionError:
        raise permission_denied(path) from None
    try:
        damaged = functools.partial(_damaged, path)
        sealed = _sealed.check(raw, damaged)
        with paused():  # objects per leaf: see `_gc`
            return _decode(raw, path, sealed, str(directory), nodes)
    except RecursionError:  # printing a value in an error, say
        raise _damaged(path, _TOO_DEEP) from None


def _decode(raw: bytes, path, sealed: bool, where: str, nodes: bool) -> Metadata:
    """The sidecar's bytes, decoded by their format version's schema in one
    pass by msgspec; one that fails it, again record by record to name what
    failed; where msgspec cannot decode them, by the standard library (which
    words what is not JSON) and then the same schemas."""
    damaged = functools.partial(_damaged, path)
    try:
        head = msgspec.json.decode(raw, type=_schema.Versioned)
    except (msgspec.DecodeError, ValueError):
        head = None
    if head is not None:
        _sealed.check_sealed(_seal_fields(head), sealed, FORMAT_VERSION, damaged)
        version = _version(head, where, _bad(where))
    try:
        if head is None:
            raise _records.Undecodable
        try:
            document = msgspec.json.decode(raw, type=_schema.document(version, nodes))
        except msgspec.ValidationError:  # which record? one by one, to say
            document = msgspec.json.decode(raw, type=_schema.Document[Raw, Raw])
    except (msgspec.DecodeError, ValueError, _records.Undecodable):
        # Not JSON as msgspec reads it (invalid, NaN, a huge integer, lone
        # surrogates), or a document of the wrong shape: the standard
        # library's reading says which, or reads what a save once wrote.
        content = _loads(raw, path)
        del raw  # held no longer than needed: a sidecar may be 256 MiB
        _sealed.check_sealed(content, sealed, FORMAT_VERSION, damaged)
        return parse(content, where)
    try:
        return _from_document(document, version, where)
    except _records.Undecodable:  # a number msgspec does not take, in a record
        return parse(_loads(raw, path), where)


def _seal_fields(head: _schema.Versioned) -> dict[str, Any]:
    """What `sealed.check_sealed` reads of a sidecar."""
    out = {"format_version": head.format_version}
    if head.checksum is not _schema.UNSET:
        out[_sealed.CHECKSUM] = head.checksum
    return out


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


def _loads(raw: bytes, path) -> Any:
    try:
        # `surrogatepass`: sidecars from before such text was refused at save
        # hold lone surrogates, UTF-8-encoded; they read back exactly.
        return json.loads(
            raw.decode("utf-8", "surrogatepass"), parse_constant=_no_constant
        )
    except RecursionError:
        raise _damaged(path, _TOO_DEEP) from None
    except _NotJSON as e:
        raise _damaged(path, f"holds {e}, which JSON does not have") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SidecarError(
            f"The sidecar {path} is not valid JSON ({e}); the checkpoint is "
            "damaged. Restore an earlier step."
        ) from None
    except ValueError:  # the only other: an int past Python's digit limit
        raise _damaged(
            path,
            "holds an integer of more than "
            f"{sys.get_int_max_str_digits()} digits, which orbax_eqx never "
            "writes (it writes long integers in hexadecimal)",
        ) from None


def _no_constant(name: str) -> Any:
    raise _NotJSON(name)


def parse(content: Any, where: str) -> Metadata:
    """Validates sidecar JSON, as the standard library decoded it, and turns
    it into `Metadata` (by the same schemas as the bytes)."""
    bad = _bad(where)
    head = (
        msgspec.convert(content, _schema.Versioned)
        if isinstance(content, dict)
        else None
    )
    if head is None:
        raise bad(f'expected a JSON object with "format": "{FORMAT}"')
    version = _version(head, where, bad)
    try:
        document = msgspec.convert(content, _schema.Document[Any, Any])
    except msgspec.ValidationError as e:
        raise bad(_document_problem(_records.failed_field(e), content)) from None
    return _from_document(document, version, where)


def _from_document(document: _schema.Document, version: int, where: str) -> Metadata:
    """The `Metadata` of a decoded document: each record read by
    `records_read`, then the checks across records."""
    bad = _bad(where)
    token = document.token
    if version >= 3 and not (isinstance(token, str) and TOKEN.fullmatch(token)):
        raise bad(f"token {token!r} is not 16 hexadecimal digits")
    if version < 3:
        token = None
    packs = _packs(document.packs, token, where, bad)
    recorded = getattr(document, "nodes", _schema.UNSET)  # (not if `Skimmed`)
    count = len(document.leaves) + len(document.modules)
    count += len(recorded) if isinstance(recorded, dict) else 0
    if count > _sealed.MAX_RECORDS:  # before any record is read
        raise bad(
            f"it holds {count} records (leaves, modules and nodes), more than "
            f"any save writes ({_sealed.MAX_RECORDS})"
        )
    sums = _records.Sums(version, document.checksums, token)
    # From format 6 on, paths not written are read off names (`compact`).
    paths = _compact.Paths(document.modules) if version >= 6 else None
    leaves = _records.leaves(document.leaves, packs, sums, bad, paths)
    _check_references(leaves, token is not None and document.shard_files != 0, bad)
    types = _structure.module_types(document.module_types, bad) if version >= 6 else []
    modules = {
        name: _structure.module(name, rec, bad, version, types, paths)
        for name, rec in document.modules.items()
    }
    nodes = None
    if version >= 5 and recorded is not _schema.UNSET:
        node_types = getattr(document, "node_types", _schema.UNSET)
        if version < 6:
            node_types = _schema.UNSET  # (read past: no format 5 has them)
        kinds = _structure.node_types(node_types, bad)
        carried = _structure.carried_nodes(document.modules, types, kinds, bad)
        limit = len(leaves) + len(carried)
        limit += len(recorded) if isinstance(recorded, dict) else 0
        nodes = _nodes(recorded, kinds, paths, limit, bad, carried, modules)
    return Metadata(
        where,
        version,
        dict(document.versions),
        leaves,
        modules,
        packs,
        token,
        document.shard_files,
        document.checksums,
        nodes,
    )


def _document_problem(field: str, content: dict) -> str:
    """What is wrong with a sidecar's top level, by the field that failed."""
    got = content.get(field)
    if field == "versions" and isinstance(got, dict):
        return '"versions" must map package names to version strings'
    if field in ("versions", "leaves"):
        return '"leaves" and "versions" must be JSON objects'
    if field == "modules":
        return '"modules" must be a JSON object'
    if field == "checksums":
        return '"checksums" must be true or false'
    if field == "shard_files":
        return f'"shard_files" is {got!r}, not a count of files'
    if field == "packs" and isinstance(got, list):
        bad = [i for i, p in enumerate(got) if not _is_pack(p)]
        return f"pack {bad[0] if bad else 0} has no size"
    return '"packs" must be a JSON list'


def _is_pack(record: Any) -> bool:
    nbytes = record.get("nbytes") if isinstance(record, dict) else None
    return type(nbytes) is int and nbytes >= 0


def _version(head: _schema.Versioned, where: str, bad) -> int:
    """The sidecar's format version, one this orbax_eqx reads."""
    if head.format != FORMAT:
        raise bad(f'expected a JSON object with "format": "{FORMAT}"')
    version = head.format_version
    if type(version) is not int:
        raise bad('"format_version" is not an integer')
    if version < 1:
        raise bad(
            f'"format_version" is {version}, which no orbax_eqx ever wrote (they '
            f"write 1 to {FORMAT_VERSION})"
        )
    if version > FORMAT_VERSION:
        raise SidecarError(
            f"The checkpoint in {where} has sidecar format version {version}, but "
            f"this orbax_eqx reads versions up to {FORMAT_VERSION}. Upgrade "
            "orbax_eqx to restore it."
        )
    return version


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
                f"leaf {leaf.name!r} is an alias of {leaf.alias_of!r}, "
                "which is no stored array of the same shape and dtype"
            )
        if leaf.data == SHARDS and not has_shards:
            raise bad(
                f"leaf {leaf.name!r} is in shard packs, but the sidecar lists "
                'none (no token, or "shard_files": 0)'
            )


def _nodes(
    nodes_json: Any,
    types: list[dict[str, Any]],
    paths,
    limit: int,
    bad,
    carried: dict[str, int],
    modules: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """The records of the tree's inner nodes, each checked by its schema, kept
    as the plain dicts the rebuild reads; from format 6 on a node may be the
    index of its type in `types` (`compact`), which names its children: at
    most `limit` in all (each leaf and node is one node's child at most).
    `carried`: the nodes of modules whose module type holds their node type,
    each recorded there only."""
    if not isinstance(nodes_json, dict):
        raise bad('"nodes" must be a JSON object')
    twice = next((name for name in carried if name in nodes_json), None)
    if twice is not None:
        raise bad(
            f'node {twice!r} is recorded twice: in "nodes" and by its module\'s type'
        )
    counts = [_compact.count_of(kind) or 0 for kind in types]  # (checked: not None)
    expand = _Expand(types, paths)
    named = 0
    for name, rec in nodes_json.items():
        if types and type(rec) is int and 0 <= rec < len(types):
            named += counts[rec]
            if named > limit:  # before any name is made
                raise _too_many(name, limit, bad)
            # Checked as its type was (`records_read.node_types`).
            nodes_json[name] = expand(name, rec)
            continue
        elif type(rec) is int:
            raise bad(
                f"node {name!r} is of node type {rec}, but the sidecar lists "
                f"{len(types)} node type{'' if len(types) == 1 else 's'}"
            )
        _structure.node(name, rec, bad)
    for name, rec in carried.items():  # (their indices checked by the modules')
        named += counts[rec]
        if named > limit:
            raise _too_many(name, limit, bad)
        path = modules[name].path  # a module's node's path is the module's
        nodes_json[name] = expand(name, rec, path)
    return nodes_json


class _Expand:
    """`compact.expand_node` for the nodes of one sidecar, sooner: each node
    type's record (less its `length`) and its children's name parts (what
    `compact.children_of` names the root's children) made once; a node's
    children are named by its name and a separator before each part."""

    def __init__(self, types: list[dict[str, Any]], paths):
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
        return {"path": path or self.paths.of(name), **kind, "children": children}


def _too_many(name: str, limit: int, bad) -> Exception:
    return bad(
        f"its node types name more children than it has leaves and nodes "
        f"({limit}), at node {name!r}"
    )


def _packs(records, token, where, bad) -> tuple[PackMetadata, ...]:
    packs = []
    for i, rec in enumerate(records):
        if rec.file != pack_file(token, i):
            # Like storage keys, file names are derived, never read from the file.
            raise bad(
                f"pack {i} is in file {rec.file!r}, expected {pack_file(token, i)!r}"
            )
        byteorder = sys.byteorder if rec.byteorder is _schema.UNSET else rec.byteorder
        if byteorder != sys.byteorder:
            raise SidecarError(
                f"The arrays of the checkpoint in {where} were packed on a "
                f"{byteorder}-endian machine; this one is {sys.byteorder}-"
                "endian, which orbax_eqx does not convert."
            )
        packs.append(PackMetadata(rec.file, rec.nbytes))
    return tuple(packs)

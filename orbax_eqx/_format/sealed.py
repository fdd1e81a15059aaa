"""The sidecar's bytes: written one line per record, and sealed.

A sidecar (and a shard index) ends with its checksum (`checksum_line`), which
covers every byte before it: every record a restore trusts. A reader checks
it (`check`) before it reads anything else of the file, so that a flipped bit
or an edit is damage, never another value restored.
"""

import json
import re
from collections.abc import Callable
from typing import Any

import msgspec

from .._errors import UnsupportedLeafError
from .checksum import digest

CHECKSUM = "checksum"  # the sidecar's last member
# The largest sidecar read (or written): a model of 100,000 leaves has one of
# ~30 MB. Reads stop here, so that a sidecar that is a link to an endless
# stream fails at once (no size of it is recorded anywhere to check against).
MAX_BYTES = 256 << 20
# The most records (leaves, modules and inner nodes) a sidecar may hold. A
# reader makes objects for each (~35 us and ~1.6 KB a leaf here), so this
# bounds what any sidecar costs to read, where 256 MiB of short records
# (`compact`) could name ten million. A save of more is refused; a model of
# 2 million arrays is one of far fewer, larger ones (stacked layers).
MAX_RECORDS = 1 << 21


def dumps(
    content: dict[str, Any],
    pause: Callable[[], None] | None = None,
    whole: dict[str, Any] | None = None,
) -> bytes:
    """The sidecar's bytes for its JSON `content`: one line per record, and
    last, the checksum of every byte before it (see `checksum_line`).
    `whole`: the same content with every record whole (`compact`), which an
    error for a sidecar too large describes."""
    _check_count(content if whole is None else whole)
    parts = _dump(content, pause)
    text = "{\n" + ",\n".join(parts) + ",\n"
    _check_size(text, content if whole is None else whole)
    return seal(text.encode("utf-8"))


def seal(body: bytes) -> bytes:
    """`body` (a JSON object's text up to its last member, and `,\n`) with
    its checksum line and closing brace."""
    return body + checksum_line(digest(body))


def checksum_line(recorded: str) -> bytes:
    """How a sidecar ends: its checksum (`digest` of every byte before this
    line, as `"xxh3:9f2c41d07a3be865"`), then the closing brace."""
    return f' "{CHECKSUM}": {json.dumps(recorded)}\n}}\n'.encode("ascii")


# The last line of a sealed sidecar (see `checksum_line`).
_LAST_LINE = re.compile(rb'\n "checksum": "([a-z0-9]{1,16}:[0-9a-f]{1,64})"\n}\n\Z')


def check(raw: bytes, damaged: Callable[[str], Exception]) -> bool:
    """Checks a sidecar's checksum, before its JSON is read; returns whether it
    has one. Raises `damaged(what)` if it does not match."""
    found = _LAST_LINE.search(raw, max(len(raw) - 128, 0))
    if found is None:
        return False
    recorded = found.group(1).decode("ascii")
    # Every byte up to the line's start: the newline before it included.
    computed = digest(memoryview(raw)[: found.start() + 1])
    if not recorded.startswith("xxh3:"):
        raise damaged(f"records a checksum of another algorithm ({recorded[:24]})")
    if computed != recorded:
        raise damaged(
            f"does not match its checksum ({recorded} recorded, {computed} "
            "computed now): it changed after the save (a flipped bit, a damaged "
            "copy, or an edit)"
        )
    return True


def records(content: dict[str, Any]) -> int:
    """How many records (leaves, modules, inner nodes) a sidecar holds."""
    nodes = content.get("nodes")
    count = len(content["leaves"]) + len(content["modules"])
    return count + (len(nodes) if isinstance(nodes, dict) else 0)


def _check_count(content: dict[str, Any]) -> None:
    """Refuses a sidecar of more records than readers read (`MAX_RECORDS`)."""
    count = records(content)
    if count <= MAX_RECORDS:
        return
    leaves = len(content["leaves"])
    raise UnsupportedLeafError(
        f"Cannot save this item: its sidecar would hold {count} records (of "
        f"{leaves} leaves, their modules and the tree's inner nodes), more than "
        f"the {MAX_RECORDS} orbax_eqx reads back. " + _FEWER
    )


_FEWER = (
    "Save fewer, larger arrays (stack repeated layers into one array per "
    "parameter, as `eqx.filter_vmap` builds them and `jax.lax.scan` runs "
    "them), or split the item into several items of one checkpoint "
    "(`ocp.args.Composite`), each with a sidecar of its own."
)


def _check_size(text: str, content: dict[str, Any]) -> None:
    """Refuses a sidecar larger than readers read (`MAX_BYTES`)."""
    room = MAX_BYTES - len(checksum_line("xxh3:" + "0" * 16))  # its last line
    if len(text) * 4 <= room:  # UTF-8 takes at most 4 bytes a character
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= room:
        return
    raise UnsupportedLeafError(_too_large(size, content))


def _too_large(size: int, content: dict[str, Any]) -> str:
    """Why a sidecar is over `MAX_BYTES`, and the fix that fits: one large
    record (a big Python value) or many records (many leaves)."""
    records = [("leaf", n, r) for n, r in content["leaves"].items()]
    records += [("module", n, r) for n, r in content["modules"].items()]
    # A node's record lists its children: large only for a node of many.
    records += [("node", n, r) for n, r in content.get("nodes", {}).items()]
    sizes = [len(json.dumps(r, default=str)) for _, _, r in records]
    largest = max(range(len(records)), key=sizes.__getitem__)
    kind, name, record = records[largest]
    shown = record.get("path", name) if isinstance(record, dict) else name
    leaves, modules = len(content["leaves"]), len(content["modules"])
    said = (
        f"Cannot save this item: its sidecar would be {size} bytes, more than "
        f"the {MAX_BYTES} orbax_eqx reads back. It records {leaves} "
        f"{'leaf' if leaves == 1 else 'leaves'} and {modules} "
        f"{'module' if modules == 1 else 'modules'}; the largest record, that of "
        f"{kind} `{shown}`, is {sizes[largest]} bytes. "
    )
    if kind != "node" and sizes[largest] * 10 >= MAX_BYTES:
        return said + (
            "Keep large Python values (str, bytes, static fields) out of the "
            "item, or store them as arrays (`np.frombuffer(data, np.uint8)`)."
        )
    return said + f"That is about {size // max(leaves, 1)} bytes a leaf. " + _FEWER


# One encoder for every record: `json.dumps` with options makes a new one each
# call (measured: 14 us a leaf record, 6.4 us through one encoder).
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def _encoded(value: Any) -> str:
    """`_ENCODER.encode(value)`, byte for byte, by msgspec where it can (2-3x
    faster: a record of a 50,000-leaf save is written 0.2 s sooner), by the
    standard library where msgspec would differ or cannot: text with lone
    surrogates (which UTF-8 cannot hold), and any `null`, which msgspec also
    writes for a NaN or an infinity that the standard library refuses."""
    try:
        data = msgspec.json.format(_FAST.encode(value), indent=0)
    except (TypeError, ValueError, OverflowError):  # (UnicodeEncodeError too)
        return _ENCODER.encode(value)
    if b"null" in data:
        return _ENCODER.encode(value)
    return data.decode("utf-8")


_FAST = msgspec.json.Encoder()
# Text the encoder writes as it is, between quotes (with `ensure_ascii=False`
# it escapes only quotes, backslashes and control characters).
_PLAIN_KEY = re.compile(r'[^"\\\x00-\x1f]*')


def _dump(
    content: dict[str, Any], pause: Callable[[], None] | None = None
) -> list[str]:
    """JSON members, a line per leaf, module and node: easy to read and diff."""

    def line(value: Any) -> str:
        if pause is not None:
            pause()
        return _encoded(value)

    def named(name: str) -> str:  # a leaf's, module's or node's name
        if _PLAIN_KEY.fullmatch(name):
            return f'"{name}"'  # as the encoder writes it, 10x sooner
        return line(name)

    def entry(value: Any) -> str:  # a record, or a row (see `compact`)
        if type(value) is list and len(value) == 4:
            if pause is not None:
                pause()
            return _row(value) or _encoded(value)
        return line(value)

    parts = []
    for key, value in content.items():
        if key == CHECKSUM:  # the last line, computed anew (see `dumps`)
            continue
        if isinstance(value, dict) and key in _RECORDS and value:
            rows = ",\n".join(f"  {named(k)}: {entry(v)}" for k, v in value.items())
            parts.append(f" {line(key)}: {{\n{rows}\n }}")
        elif isinstance(value, list) and key in _TABLES and value:
            rows = ",\n".join(f"  {line(v)}" for v in value)
            parts.append(f" {line(key)}: [\n{rows}\n ]")
        else:
            parts.append(f" {line(key)}: {line(value)}")
    return parts


_RECORDS = ("leaves", "modules", "nodes")  # a line per record
_TABLES = ("module_types", "node_types")  # a line per type (see `compact`)


def _row(row: list) -> str | None:
    """A leaf's row (`compact`), `[dtype, shape, offset, xxh3]`, as compact
    JSON, written out (4x sooner than the encoder) where every value is of
    the type a save writes; else None."""
    dtype, shape, offset, sum_ = row
    stored = None
    if type(sum_) is list:  # with dedup: `[xxh3, xxh3_128, pack]`
        if not _is_stored(sum_):
            return None
        sum_, stored = sum_[0], f'"{sum_[1]}",{sum_[2]}'
    if not (
        type(dtype) is str
        and _PLAIN_KEY.fullmatch(dtype)
        and type(offset) is int
        and type(shape) is list
        and _INT.issuperset(map(type, shape))
        and (sum_ is None or (type(sum_) is str and _PLAIN_KEY.fullmatch(sum_)))
    ):
        return None
    dims = ",".join(map(str, shape))
    checksum = "null" if sum_ is None else f'"{sum_}"'
    if stored is not None:
        return f'["{dtype}",[{dims}],{offset},[{checksum},{stored}]]'
    return f'["{dtype}",[{dims}],{offset},{checksum}]'


def _is_stored(last: list) -> bool:
    """Whether a dedup row's last value, `[xxh3, xxh3_128, pack]`, holds the
    types a save writes (its `xxh3` is checked with a plain row's)."""
    return (
        len(last) == 3
        and type(last[1]) is str
        and bool(_PLAIN_KEY.fullmatch(last[1]))
        and type(last[2]) is int
    )


_INT = frozenset([int])

"""Reading and checking one safetensors header (attacker input), wherever it is:
the 8-byte length, then the JSON, checked against the file's size before
anything that large is allocated; then allow lists (`_Tensor`: dtype codes,
shapes, offsets), each tensor's bytes back to back, and the file exactly as
long as its last tensor's end."""

import concurrent.futures
import dataclasses
import json
import os
import re
import struct
import unicodedata
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np

from ..._bytes import route as _route
from ..._bytes import store as _store
from ..._bytes.route import is_remote
from ..._errors import BridgeError
from ..._tree.values import is_text
from .dtypes import DTYPES, nbytes_of

METADATA_KEY = "__metadata__"
MAX_HEADER = 100_000_000  # bytes, as the reference implementation
MAX_NAME = 4096  # characters in a tensor name
MAX_RANK = 64  # numpy's own limit
_MAX_DIM = 2**62  # past this, a dimension is no array numpy can make
_READERS = 8  # headers read at once (round trips on an object store)


class SafetensorsError(BridgeError):
    """A safetensors file is damaged, or cannot hold what it was asked to."""


class TensorInfo(NamedTuple):
    """One tensor of a safetensors file: where its bytes are and what they mean
    (a tuple: a header may list a great many)."""

    name: str
    dtype: str  # numpy dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed safetensors header: the file's path (local and absolute, or a
    URL), its tensors in the order of their data, its metadata, its size."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    size: int = 0
    identity: Any = None  # the version of the file read (`Reader.identity`)


def where(path: str | os.PathLike) -> str:
    """How a file is named in messages and headers: absolute if local."""
    text = os.fspath(path)
    return text if is_remote(text) else os.path.abspath(text)


def read_headers(paths: Sequence[str]) -> list[Header]:
    """`read_header` of each path, a few at once; in the order given."""
    if len(paths) <= 1:
        return [read_header(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(min(_READERS, len(paths))) as pool:
        return list(pool.map(read_header, paths))


def read_header(path: str | os.PathLike) -> Header:
    """Reads and checks the header of the safetensors file at `path` (a local
    path, `gs://...` or `s3://...`); raises `SafetensorsError` naming the file
    and what is wrong."""
    path = where(path)

    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(
            f"{path} is not a valid safetensors file: {what}. Re-download or "
            "re-export it."
        )

    store = _route.for_path(path)
    seen: list = []  # the identity of each reader opened: one file throughout
    head = _read(
        seen,
        store,
        path,
        0,
        8,
        lambda what: bad(f"it {what}"),
        short=lambda what: bad(f"it {what}, too short for a header"),
    )
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER:
        raise bad(
            f"the header claims {length} bytes, more than the {MAX_HEADER} a "
            "header may have"
        )
    raw = _read(
        seen,
        store,
        path,
        8,
        8 + length,
        lambda what: bad(f"the header claims {length} bytes, but the file {what}"),
    )
    tensors, metadata = parse(raw, 8 + length, bad)
    end = 8 + length + sum(t.nbytes for t in tensors)
    # The file is exactly as long as its tensors: a longer one holds bytes no
    # header describes, a shorter one tensors that are not there.
    described = lambda what: bad(  # noqa: E731
        f"the header describes {end} bytes of file, but it {what}"
    )
    for nbytes in (None, end):
        try:
            with store.open(path, end, nbytes) as reader:
                seen.append(reader.identity())
        except _store.BadFile as e:
            raise described(_plain(e.what)) from None
    if any(i != seen[0] for i in seen):
        raise SafetensorsError(
            f"{path} was replaced while its header was read. Load it again."
        )
    return Header(path, {t.name: t for t in tensors}, metadata, end, seen[0])


def _read(
    seen: list,
    store: _store.Store,
    path: str,
    start: int,
    stop: int,
    error: Callable[[str], Exception],
    short: Callable[[str], Exception] | None = None,
) -> bytes:
    """Bytes `[start, stop)` of `path`. Unless `short` words a file too short
    for them (then only the read finds out), the file is checked to hold them
    (one small request) before a buffer of that size is made."""
    try:
        reader = store.open(path, 0 if short else stop, None)
    except _store.BadFile as e:
        raise error(_plain(e.what)) from None
    except FileNotFoundError:
        raise error("is missing") from None
    seen.append(reader.identity())
    buffer = np.empty(stop - start, np.uint8)
    with reader:
        try:
            _store_read(reader, [(start, stop)], [buffer])
        except _store.BadFile as e:
            raise (short or error)(e.what) from None
    return buffer.tobytes()


_LENGTH = re.compile(r"has (\d+) bytes where \d+ were written")


def _plain(what: str) -> str:
    """A store's words on a file's length, for a file nobody wrote for us:
    "has 10 bytes where 24 were written" is "has 10"."""
    found = _LENGTH.fullmatch(what)
    return f"has {found.group(1)}" if found else what


def _store_read(reader: _store.Reader, ranges, buffers) -> None:
    """Fills `buffers` with `ranges` of an open reader (a small read may be
    done, or fail, as it starts)."""
    reads = reader.start(ranges, buffers)
    try:
        reads.wait()
    finally:
        reads.cancel()


def parse(raw: bytes, data_start: int, bad) -> tuple[list[TensorInfo], dict]:
    """The tensors (in the order of their data) and metadata of a header's JSON
    `raw`, whose data starts at byte `data_start` of the file."""
    fast = _parse_fast(raw, data_start)
    return fast if fast is not None else _parse_worded(raw, data_start, bad)


_RECORDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_STRINGS = msgspec.json.Decoder(dict[str, str])


def _parse_fast(raw: bytes, data_start: int) -> tuple[list[TensorInfo], dict] | None:
    """`parse` of a header with nothing amiss, in time and memory a few times
    the header's size; None if anything is (`_parse_worded` then says what)."""
    try:
        records = _RECORDS.decode(raw)  # (a name given twice: its last record)
        recorded = records.pop(METADATA_KEY, None)
        metadata = {} if recorded is None else _STRINGS.decode(recorded)
    except msgspec.DecodeError:
        return None
    # Each record has one `"data_offsets"`: more of them than records means
    # a name given twice (or the text in a name or value: told apart by
    # `_parse_worded`, as is a `__metadata__` given twice).
    if raw.count(b'"data_offsets"') != len(records) or raw.count(b'"__metadata__"') > 1:
        return None
    out = []
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one object a shape
    for name, rec in records.items():
        try:
            t = _RECORD.decode(rec)
        except msgspec.DecodeError:
            return None
        if len(name) > MAX_NAME or not (name.isascii() and name.isprintable()):
            if name_problem(name) is not None:
                return None
        shape = shapes.setdefault(tuple(t.shape), tuple(t.shape))
        dtype = DTYPES[t.dtype]
        nbytes = nbytes_of(dtype, shape)
        start, stop = t.data_offsets
        if stop - start != nbytes:
            return None
        out.append(TensorInfo(name, dtype, shape, data_start + start, nbytes))
    del records
    out.sort(key=lambda info: info.start)
    end = data_start
    for info in out:
        if info.start != end:
            return None
        end += info.nbytes
    return out, metadata


def _parse_worded(raw: bytes, data_start: int, bad) -> tuple[list[TensorInfo], dict]:
    """`parse`, saying what is wrong: every object of the JSON is built, to
    name a key given twice."""
    try:
        content = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise bad(f"the header names {_shown(e.name)} twice") from None
    except (ValueError, RecursionError) as e:  # an int too long, nested too deep
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(content, dict):
        raise bad("the header is not a JSON object")
    metadata = content.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not (
        isinstance(metadata, dict)
        and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad(f"{METADATA_KEY} is not a map of strings")
    tensors = [
        _tensor_info(name, rec, data_start, bad) for name, rec in content.items()
    ]
    tensors.sort(key=lambda t: t.start)
    end = data_start
    for t in tensors:
        if t.start != end:
            raise bad(
                f"the data of tensor {_shown(t.name)} is not where the header says"
            )
        end += t.nbytes
    return tensors, dict(metadata)


class _Duplicate(ValueError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def name_problem(name: Any) -> str | None:
    """Why `name` cannot be a tensor name (None if it can)."""
    if not isinstance(name, str):
        return "is not a string"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long, more than the {MAX_NAME} allowed"
    if not is_text(name):
        return "is not valid Unicode (a lone surrogate)"
    if any(unicodedata.category(c) == "Cc" for c in name):
        return "holds control characters"
    return None


def _shown(name: str, limit: int = 80) -> str:
    """A name for a message: quoted, escaped, cut at `limit` characters."""
    shown = repr(name[:limit])
    return shown + (f" (cut; {len(name)} characters)" if len(name) > limit else "")


class _Tensor(msgspec.Struct):
    """A tensor's record, as a header must spell it: the allow list. (Other
    keys are ignored, as the reference reader ignores them.)"""

    dtype: Literal[tuple(DTYPES)]  # type: ignore[valid-type]
    shape: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=_MAX_DIM)]],
        msgspec.Meta(max_length=MAX_RANK),
    ]
    data_offsets: tuple[
        Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]
    ]


_RECORD = msgspec.json.Decoder(_Tensor)

# A schema error's field (`... - at `$.shape[1]``, `... field `dtype``).
_FIELD = re.compile(r"(?:at `\$\.|field `)(\w+)")


def _tensor_info(name: str, rec: Any, data_start: int, bad) -> TensorInfo:
    """One tensor: its record checked against `_Tensor`, then its offsets
    against its size (the checks across tensors are `parse`'s)."""
    problem = name_problem(name)
    if problem is not None:
        raise bad(f"the tensor name {_shown(name)} {problem}")
    if not isinstance(rec, dict):
        raise bad(f"tensor {_shown(name)} is not a JSON object")
    try:
        t = msgspec.convert(rec, _Tensor)
    except msgspec.ValidationError as e:
        raise bad(_refused(name, rec, e)) from None
    dtype = DTYPES[t.dtype]
    nbytes = nbytes_of(dtype, tuple(t.shape))
    start, stop = t.data_offsets
    if stop - start != nbytes:
        raise bad(
            f"tensor {_shown(name)} is {t.dtype}{t.shape} ({nbytes} bytes) but its "
            f"offsets span {stop - start} bytes"
        )
    return TensorInfo(name, dtype, tuple(t.shape), data_start + start, nbytes)


def _refused(name: str, rec: dict, error: msgspec.ValidationError) -> str:
    """What the schema refused in tensor `name`'s record, in words."""
    found = _FIELD.search(str(error))
    field = found.group(1) if found else "dtype"
    value = rec.get(field)
    if field == "dtype":
        shown = _shown(value) if isinstance(value, str) else repr(value)[:80]
        return f"tensor {_shown(name)} has dtype {shown}; this reader knows " + (
            ", ".join(DTYPES)
        )
    return f"tensor {_shown(name)} has {field} {repr(value)[:200]}"

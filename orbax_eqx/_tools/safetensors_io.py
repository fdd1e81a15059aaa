"""The safetensors file format: read and write headers, stream tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header
(`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}`),
then the tensors' bytes, back to back, in the order of their offsets. We
write it ourselves rather than through `safetensors.numpy.save_file` for two
reasons: that function needs every tensor in memory at once, and its numpy
reader cannot give back float8 tensors. Files we write are checked with the
`safetensors` library's own reader (`check_with_library`), and the tests check
both directions against the library.
"""

import dataclasses
import json
import math
import os
import struct
import sys
from typing import Any, BinaryIO

import numpy as np

from .._bytes import files as _files
from .._errors import OrbaxEqxError

# safetensors dtype codes and the numpy dtypes (numpy and ml_dtypes) they hold.
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "C64": "complex64",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
CODES = {v: k for k, v in DTYPES.items()}

METADATA_KEY = "__metadata__"
_MAX_DIM = 2**62  # past this, a dimension is no array numpy can make
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100_000_000  # as the reference implementation
_ALIGN = 8


class SafetensorsError(OrbaxEqxError, ValueError):
    """A safetensors file is damaged, or cannot hold what it was asked to."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are and what they mean."""

    name: str
    dtype: str  # numpy dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed safetensors header."""

    path: str
    tensors: dict[str, TensorInfo]  # in the order of their data
    metadata: dict[str, str]
    size: int = 0  # of the whole file, in bytes


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called `name`, from numpy or ml_dtypes."""
    import jax.numpy as jnp  # knows the ml_dtypes names

    return np.dtype(jnp.dtype(name))


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    # Python integers: numpy's int64 product wraps (2**62 x 4 is 0 bytes).
    return math.prod(shape) * numpy_dtype(dtype).itemsize


def encode_header(entries: list[tuple[str, str, tuple]], metadata: dict) -> bytes:
    """The header bytes for tensors `(name, numpy dtype, shape)`, in data order.

    Padded with spaces to a multiple of 8 bytes, as the reference writer does,
    so that the data starts aligned.
    """
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = metadata
    offset = 0
    for name, dtype, shape in entries:
        size = nbytes_of(dtype, shape)
        header[name] = {
            "dtype": CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_array(f: BinaryIO, array: np.ndarray) -> None:
    """Writes the bytes of `array` (C order, little-endian) to `f`."""
    array = np.ascontiguousarray(array)
    if sys.byteorder == "big" and array.dtype.itemsize > 1:
        array = array.byteswap()
    f.write(array.reshape(-1).view(np.uint8).data)


def read_header(path: str | os.PathLike) -> Header:
    """Reads and validates the header of the safetensors file at `path`."""
    path = os.path.abspath(path)

    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(
            f"{path} is not a valid safetensors file: {what}. Re-download or "
            "re-export it."
        )

    # Only a regular file: a FIFO would block the read, a device never end it.
    fd = _files.open_regular(path, lambda what: bad(f"it {what}"))
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"it is {size} bytes long, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise bad(f"the header claims {length} bytes, but the file has {size}")
        raw = f.read(length)
    try:
        content = json.loads(raw.decode("utf-8"))
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
    data_start = 8 + length
    tensors = []
    for name, rec in content.items():
        tensors.append(_tensor_info(name, rec, data_start, bad))
    tensors.sort(key=lambda t: t.start)
    end = data_start
    for t in tensors:
        if t.start != end:
            raise bad(f"the data of tensor {t.name!r} is not where the header says")
        end += t.nbytes
    if end != size:
        raise bad(f"the header describes {end} bytes of file, but it has {size}")
    return Header(path, {t.name: t for t in tensors}, dict(metadata), size)


def open_data(header: Header) -> BinaryIO:
    """Opens the file of `header` to read its tensors: the same regular file,
    of the size its header was read from."""

    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(
            f"{header.path} {what} (its header was read from a {header.size}-byte "
            "file); it was replaced while being read. Import it again."
        )

    fd = _files.open_regular(header.path, bad)
    try:
        _files.check_size(fd, header.size, bad)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _tensor_info(name: str, rec: Any, data_start: int, bad) -> TensorInfo:
    if not isinstance(rec, dict):
        raise bad(f"tensor {name!r} is not a JSON object")
    code, shape, offsets = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
    if code not in DTYPES:
        known = ", ".join(DTYPES)
        raise bad(f"tensor {name!r} has dtype {code!r}; this reader knows {known}")
    if not (
        isinstance(shape, list)
        and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise bad(f"tensor {name!r} has shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
    dtype = DTYPES[code]
    nbytes = nbytes_of(dtype, tuple(shape))
    if offsets[1] - offsets[0] != nbytes:
        raise bad(
            f"tensor {name!r} is {code}{shape} ({nbytes} bytes) but its offsets "
            f"span {offsets[1] - offsets[0]} bytes"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_tensor(f: BinaryIO, info: TensorInfo) -> np.ndarray:
    """Reads one tensor of an open file into a new numpy array."""
    dtype = numpy_dtype(info.dtype).newbyteorder("<")
    out = np.empty(info.shape, dtype)
    f.seek(info.start)
    view = out.reshape(-1).view(np.uint8)
    if f.readinto(view.data) != info.nbytes:
        raise SafetensorsError(
            f"{f.name}: tensor {info.name!r} ends past the end of the file. "
            "Re-download or re-export it."
        )
    return out.astype(out.dtype.newbyteorder("="), copy=False)


def check_with_library(path: str, names: list[str], metadata: dict) -> None:
    """Opens a file we wrote with the `safetensors` library's reader, as a check."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        found, found_metadata = sorted(f.keys()), f.metadata() or {}
    if found != sorted(names) or found_metadata != metadata:
        raise SafetensorsError(
            f"{path} was written, but the safetensors library reads back other "
            "tensors or metadata than were written. Please report this as a bug "
            "in orbax_eqx."
        )

"""Writing safetensors files: the header, then each tensor at its offset in any
order (`os.pwrite`), so an export keeps its memory bounded, while the file
keeps the reference writer's order (largest items first), and records each
tensor's block checksums (`checksums`) in `__metadata__`. Files are written
under a new random name (`O_EXCL | O_NOFOLLOW`), checked with the
`safetensors` library's reader, then renamed into place by the caller."""

import errno
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._bytes import files as _files
from ..._storage.sharded.index import block_size, block_sums
from . import checksums as _sums
from .dtypes import CODES, itemsize, nbytes_of
from .header import METADATA_KEY, SafetensorsError

_ALIGN = 8


def encode_header(
    entries: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
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
    return len(text).to_bytes(8, "little") + text


def as_bytes(array: np.ndarray) -> memoryview:
    """The bytes of `array` as the format stores them: C order, little-endian."""
    array = np.ascontiguousarray(array)
    if sys.byteorder == "big" and array.dtype.itemsize > 1:
        array = array.byteswap()
    # Through uint8: the buffer protocol knows neither bfloat16 nor float8.
    return array.reshape(-1).view(np.uint8).data


class FileWriter:
    """One new safetensors file, written under a temporary name beside `final`.

    **Arguments:**

    - `final`: the file's name once done (the caller renames `tmp` onto it).
    - `entries`: `(name, numpy dtype name, shape)` of each tensor, any order;
        the file holds them largest items first (stable).
    - `metadata`: the `__metadata__` map of strings; the tensors' checksums
        are added (`self.metadata`, once closed).
    """

    def __init__(
        self,
        final: str,
        entries: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str],
    ):
        order = sorted(entries, key=lambda e: -itemsize(e[1]))
        self.final = final
        self.names = [name for name, _, _ in order]
        self._order = order
        # Zeros until each tensor is put: the header is rewritten on close,
        # of the same length.
        self._sums = {
            name: (block_size(n), [0] * -(-n // block_size(n)))
            for name, dtype, shape in order
            for n in [nbytes_of(dtype, shape)]
        }
        self.metadata = metadata | {_sums.CHECKSUMS: _sums.encode(self._sums)}
        header = encode_header(order, self.metadata)
        self._header = len(header)
        self._at: dict[str, tuple[int, int]] = {}
        offset = len(header)
        for name, dtype, shape in order:
            size = nbytes_of(dtype, shape)
            self._at[name] = (offset, size)
            offset += size
        self.size = offset
        self._left = set(self._at)
        self._fd, self.tmp = _files.create_new(final)
        try:
            self._write(memoryview(header), 0)
        except BaseException:
            self.abandon()
            raise

    def _write(self, data: memoryview, offset: int, sync: bool = False) -> None:
        try:
            _pwrite_all(self._fd, data, offset)
            if sync:
                os.fsync(self._fd)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SafetensorsError(
                f"No space left on the device to write {self.final}: the file "
                f"needs {self.size:,} bytes ({os.strerror(e.errno)}). Free space "
                "there, or choose another output; the files already at the "
                "output are as they were."
            ) from None

    def put(self, name: str, array: np.ndarray) -> None:
        """Writes tensor `name`'s values (of its dtype and shape) in place."""
        offset, size = self._at[name]
        data = as_bytes(array)
        if data.nbytes != size or name not in self._left:
            raise SafetensorsError(
                f"Tensor `{name}` of {self.tmp} was given {data.nbytes} bytes "
                f"where {size} belong, or twice. Please report this as a bug in "
                "orbax_eqx."
            )
        self._write(data, offset)
        block = self._sums[name][0]
        self._sums[name] = (block, block_sums(data, block))
        self._left.discard(name)

    def close(self) -> None:
        """Checks every tensor was written, makes the file durable, closes it."""
        try:
            if self._left or os.fstat(self._fd).st_size != self.size:
                raise SafetensorsError(
                    f"Wrote {os.fstat(self._fd).st_size} bytes to {self.tmp} "
                    f"({len(self._left)} tensors missing), expected {self.size}. "
                    "Please report this as a bug in orbax_eqx."
                )
            self.metadata |= {_sums.CHECKSUMS: _sums.encode(self._sums)}
            header = encode_header(self._order, self.metadata)
            if len(header) != self._header:
                raise SafetensorsError(
                    f"The header of {self.tmp} changed length with its checksums. "
                    "Please report this as a bug in orbax_eqx."
                )
            self._write(memoryview(header), 0, sync=True)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abandon(self) -> None:
        """Closes and removes the temporary file (after a failure); never raises."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if os.path.lexists(self.tmp):
            os.remove(self.tmp)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


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

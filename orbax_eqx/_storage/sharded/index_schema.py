"""The shard index as declarative schemas (msgspec), one per index version.

What a record may hold is said here once, as types and bounds: a chunk row
of version 3 is exactly `[start, stop, offset, nbytes, block, xxh3s]`
(sizes are integers >= 0, a block > 0, each XXH3-64 16 lower-case
hexadecimal digits; booleans and floats are no integers), of version 2 the
same with CRC-32s (integers below 2**32), of version 1 that without `block`. Anything
else fails to decode. What a record must say that depends on other records
or on the sidecar (the token and process, the file name, chunk boxes against
their array, the tiling) is checked apart, in `index_read`.
"""

from typing import Annotated, Any

import msgspec

Size = Annotated[int, msgspec.Meta(ge=0)]
Crc32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]


class Header(msgspec.Struct):
    """An index's fields but its chunks, as written; each one's value is
    checked by `index_read` (against the sidecar and the file name)."""

    format: Any = None
    format_version: Any = None
    token: Any = None
    process: Any = None
    file: Any = None
    nbytes: Any = None
    crc_block: Any = None  # version 1 only
    chunks: dict[str, msgspec.Raw] | None = None  # each leaf's rows, still raw


class RowV1(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    start: list[Size]
    stop: list[Size]
    offset: Size
    nbytes: Size
    crcs: list[Crc32]


class RowV2(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    start: list[Size]
    stop: list[Size]
    offset: Size
    nbytes: Size
    block: Annotated[int, msgspec.Meta(gt=0)]
    crcs: list[Crc32]


class RowV3(RowV2):
    """Version 2's row, its block checksums XXH3-64s."""

    crcs: list[Hex64]  # type: ignore[assignment]


# The rows of one leaf, by version.
ROWS = {1: list[RowV1], 2: list[RowV2], 3: list[RowV3]}
FORMS = {
    1: "[start, stop, offset, nbytes, crc32s]",
    2: "[start, stop, offset, nbytes, block, crc32s]",
    3: "[start, stop, offset, nbytes, block, xxh3s]",
}

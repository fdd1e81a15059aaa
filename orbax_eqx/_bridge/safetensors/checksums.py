"""Per-tensor checksums in `__metadata__[CHECKSUMS]`: `{tensor name: [block,
[the 16 lowercase hexadecimal digits of the XXH3-64 of each `block` bytes of
its data]]}`, blocks sized as a shard pack's chunks are (`block_size`). A
load reads a tensor's bytes widened to whole blocks of it and checks each as
it arrives, through the read engine as a shard pack's chunks are: every byte
read is checked, however little of a tensor a process reads."""

import json
import re

from ..._format.checksum import NAME
from ..._storage.sharded.index import Chunk, check_blocks
from ..._storage.sharded.index import widen as _widen

CHECKSUMS = "orbax_eqx.xxh3"
_SUM = re.compile(r"[0-9a-f]{16}")
_STEP = 16 << 20  # bytes checked at a time, about, while later ones are read


def encode(sums: dict[str, tuple[int, list[int]]]) -> str:
    """The entry's text for `{tensor: (block, sums)}` (of one length for any
    sums: a file's header is written before its data, and again after)."""
    return json.dumps(
        {n: [b, [f"{s:016x}" for s in x]] for n, (b, x) in sums.items()},
        ensure_ascii=False,
        separators=(",", ":"),
    )


def recorded(metadata: dict[str, str]) -> dict[str, tuple[int, list[int]]] | None:
    """The sums a file's `__metadata__` records, `{tensor: (block, sums)}`;
    None if it records none. Raises `ValueError` saying what the entry is, if
    it is there but malformed."""
    text = metadata.get(CHECKSUMS)
    if text is None:
        return None
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(entry, dict) or not all(_sound(v) for v in entry.values()):
        raise ValueError(
            "no JSON object of `[block, [16-digit hexadecimal sums]]` per tensor"
        )
    return {n: (b, [int(s, 16) for s in x]) for n, (b, x) in entry.items()}


def _sound(v) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 2
        and type(v[0]) is int
        and v[0] > 0
        and isinstance(v[1], list)
        and all(isinstance(s, str) and _SUM.fullmatch(s) for s in v[1])
    )


def chunk(name: str, start: int, nbytes: int, entry: tuple[int, list[int]]) -> Chunk:
    """A tensor's data at byte `start` of its file, with its recorded sums, as
    a chunk (`ValueError` if they do not cover its `nbytes` bytes)."""
    block, sums = entry
    if len(sums) != -(-nbytes // block):
        raise ValueError(
            f"records {len(sums)} sums of {block} bytes for tensor `{name}` of "
            f"{nbytes} bytes"
        )
    return Chunk(name, 0, (), (), start, nbytes, block, tuple(sums))


def mismatches(c: Chunk, at: int, data) -> list[str]:
    """Bytes `[at, ...)` of a tensor (whole blocks) against its sums."""
    return [
        f"tensor `{c.name}`, bytes {i * c.block}-{min((i + 1) * c.block, c.nbytes)}: "
        f"{NAME} recorded at export {want:#018x}, computed from the data now "
        f"{found:#018x}"
        for i, want, found in check_blocks(c, at, data)
    ]


class TensorCheck:
    """A tensor's bytes, as the engine reads them, against its block sums."""

    __slots__ = ("chunk", "problems", "step")
    widens = True

    def __init__(self, c: Chunk, problems: list[str]):
        self.chunk, self.problems = c, problems
        self.step = c.block * max(1, _STEP // c.block)

    def widen(self, first: int, last: int) -> tuple[int, int]:
        off = self.chunk.offset
        a, z = _widen(self.chunk, first - off, last - off)
        return a + off, z + off

    def feed(self, at: int, data) -> None:
        self.problems += mismatches(self.chunk, at, data)

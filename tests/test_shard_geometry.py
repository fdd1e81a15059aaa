"""How a target box is made of stored chunks, and when it needs no copy.

Restoring onto the saving mesh hands each chunk's bytes to its device as they
were read. Restoring onto fewer devices along the first dimension makes each
box of several whole chunks; a shard pack holds a process's chunks of a leaf
one after the other, so such a box is one run of the bytes read, and a view of
them must be used too. Any other box is assembled in a buffer of its own.
These cases are worked out here on numpy buffers, as `shard_read` sees them.

Internal modules imported here (`_storage.boxes`, `_storage.sharded.index`,
`_storage.sharded.read`) are the units these tests pin, or the only way to
cause or observe the condition under test; everything else goes through
`orbax_eqx` and the `orbax-eqx` command.
"""

import numpy as np
import pytest

from orbax_eqx._storage.boxes import target
from orbax_eqx._storage.sharded.index import Chunk
from orbax_eqx._storage.sharded.read import _joined

SIZE = 4  # float32


def _chunks(shape, cuts0, cuts1=None, gap=0):
    """Chunks of an array of `shape` cut at `cuts0` (and `cuts1`), stored one
    after the other in that order with `gap` bytes between them."""
    cuts1 = cuts1 or [0, shape[1]]
    chunks, offset = [], 0
    for a, b in zip(cuts0, cuts0[1:], strict=False):
        for c, d in zip(cuts1, cuts1[1:], strict=False):
            nbytes = (b - a) * (d - c) * SIZE
            chunks.append(Chunk("w", 0, (a, c), (b, d), offset, nbytes, nbytes, ()))
            offset += nbytes + gap
    return chunks


def _read(values, chunks):
    """The file's bytes as read into one buffer, and where each chunk lies."""
    end = chunks[-1].offset + chunks[-1].nbytes
    buffer = np.zeros(end, np.uint8)
    wanted, placed = {}, {}
    for k, c in enumerate(chunks):
        part = np.ascontiguousarray(
            values[c.start[0] : c.stop[0], c.start[1] : c.stop[1]]
        )
        buffer[c.offset : c.offset + c.nbytes] = part.view(np.uint8).ravel()
        wanted[("w", k)] = [c, 0, c.nbytes, True]
        placed[("w", k)] = (buffer, c.offset)
    return buffer, wanted, placed


def _box(chunks, start, stop):
    boxes = tuple((c.start, c.stop) for c in chunks)
    return target(start, stop, boxes, SIZE)


VALUES = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)


def test_a_box_of_consecutive_whole_chunks_is_a_view_of_the_bytes_read():
    chunks = _chunks(VALUES.shape, [0, 8, 16, 24, 32, 40, 48, 56, 64])
    buffer, wanted, placed = _read(VALUES, chunks)
    for lo in range(0, 64, 16):  # onto 4 devices: 2 chunks a box
        t = _box(chunks, (lo, 0), (lo + 16, 16))
        got = _joined("w", t, wanted, placed)
        assert got is not None and np.shares_memory(got, buffer)
        np.testing.assert_array_equal(
            got.view(np.float32).reshape(16, 16), VALUES[lo : lo + 16]
        )
    whole = _joined("w", _box(chunks, (0, 0), (64, 16)), wanted, placed)
    np.testing.assert_array_equal(whole.view(np.float32).reshape(64, 16), VALUES)


@pytest.mark.parametrize(
    "case",
    ["gap", "two-dimensional", "part-of-a-chunk", "trimmed-read", "two-buffers"],
)
def test_other_boxes_are_not_views(case):
    cuts0 = [0, 8, 16, 24, 32]
    chunks = _chunks((32, 16), cuts0, gap=64 if case == "gap" else 0)
    if case == "two-dimensional":
        chunks = _chunks((32, 16), cuts0, [0, 8, 16])
    values = VALUES[:32]
    buffer, wanted, placed = _read(values, chunks)
    start, stop = (0, 0), (16, 16)
    if case == "part-of-a-chunk":
        start, stop = (4, 0), (16, 16)
    if case == "trimmed-read":  # the read began after the chunk's start
        wanted[("w", 1)][1] = 64
    if case == "two-buffers":  # read by two reads, not one
        copy = buffer.copy()
        placed[("w", 1)] = (copy, placed[("w", 1)][1])
    assert _joined("w", _box(chunks, start, stop), wanted, placed) is None


@pytest.mark.parametrize(
    "start, stop, contiguous",
    [
        ((0, 0), (8, 16), True),  # the chunk
        ((2, 0), (5, 16), True),  # some of its rows
        ((3, 4), (4, 12), True),  # part of one row
        ((0, 0), (8, 8), False),  # a column strip
    ],
    ids=["whole", "rows", "part-of-a-row", "columns"],
)
def test_a_box_that_is_one_range_of_a_chunk_is_a_view(start, stop, contiguous):
    chunks = _chunks((8, 16), [0, 8])
    t = _box(chunks, start, stop)
    assert t.contiguous is contiguous and t.viewed is contiguous

"""How a large file is stored as several objects, and found again.

An object store writes one object per request, so a pack of gigabytes
written as one object is one slow upload held whole in memory. A file longer
than `PART_BYTES` is stored instead as objects `{name}.part-00000`,
`{name}.part-00001`, ... of `PART_BYTES` each (the last shorter), uploaded
concurrently; a shorter file is one object, `{name}`. The readers of both
stores look for the whole file first and for its parts after, so that a
checkpoint copied between a disk and a bucket (`gsutil cp -r`) reads either
way. The part size is part of the format: a reader knows it without asking.
"""

PART_BYTES = 32 << 20
_PART = "{name}.part-{index:05d}"


def part_name(name: str, index: int) -> str:
    """The object holding bytes `[index * PART_BYTES, ...)` of file `name`."""
    return _PART.format(name=name, index=index)


def count(nbytes: int) -> int:
    """How many parts a file of `nbytes` bytes is stored in (0: one object)."""
    return 0 if nbytes <= PART_BYTES else -(-nbytes // PART_BYTES)


def pieces(start: int, stop: int) -> list[tuple[int, int, int]]:
    """Byte range `[start, stop)` of a file stored in parts, as
    `(part index, start in part, stop in part)`, in order."""
    out = []
    while start < stop:
        index, at = divmod(start, PART_BYTES)
        end = min(stop - start, PART_BYTES - at) + at
        out.append((index, at, end))
        start += end - at
    return out

"""Where an export's files go, as `save_pretrained` writes them:
`model.safetensors`, or `model-0000i-of-0000n.safetensors` files and
`model.safetensors.index.json`; and what is already at the output."""

import json
import os
import re
import secrets

from .._bytes import files as _bytes_files
from .export_source import ExportError
from .safetensors import index as _index

# Hugging Face's shard names, or with an export's token (`.1f0c9a3e`): files
# of a new set beside those of the set it replaces.
_SHARD = re.compile(r"model-\d{5}-of-\d{5}(\.[0-9a-f]{8})?\.safetensors")


def existing(out, out_dir: str, single: bool, overwrite: bool, fix: str) -> list[str]:
    """Safetensors files already at `out`: an error, or (`overwrite`) stale ones."""
    if single:
        found = [os.path.basename(out)] if os.path.lexists(out) else []
    elif os.path.isdir(out_dir):
        found = sorted(
            name
            for name in os.listdir(out_dir)
            if name in (_index.SINGLE_FILE, _index.INDEX_FILE) or _SHARD.fullmatch(name)
        )
    elif os.path.lexists(out_dir):
        raise ExportError(
            f"{out_dir} is a file. Give a directory, or a file name ending in "
            "`.safetensors` for a single file."
        )
    else:
        found = []
    if found and not overwrite:
        if len(found) == 1:
            raise ExportError(
                f"{os.path.join(out_dir, found[0])} already exists. "
                f"{fix} to replace it, or choose another output."
            )
        raise ExportError(
            f"{out_dir} already holds safetensors files ({found[0]} and "
            f"{len(found) - 1} more). {fix} to replace them, or "
            "choose another output."
        )
    return found


def shard(tensors: list[str], sizes: dict[str, int], max_size: int) -> list[list]:
    """Splits tensors, in order, into files of at most `max_size` bytes of data.

    A tensor larger than `max_size` gets a file of its own.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + sizes[t] > max_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += sizes[t]
    return shards


def file_names(n: int, out_dir: str) -> list[str]:
    """The files of `n` shards: Hugging Face's names, or where one of those
    is taken (a set being replaced), with a token of this export in them."""
    if n == 1:
        return [_index.SINGLE_FILE]
    token = ""
    while True:
        names = [
            f"model-{i:05d}-of-{n:05d}{token}.safetensors" for i in range(1, n + 1)
        ]
        if not any(os.path.lexists(os.path.join(out_dir, m)) for m in names):
            return names
        token = f".{secrets.token_hex(4)}"


def check_targets(out_dir: str, names: list[str]) -> None:
    """Refuses a directory where a file of the export goes, or one it removes,
    before anything is written."""
    for name in names:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            raise ExportError(
                f"{path} is a directory, where the export writes or replaces the "
                "file of that name. Remove the directory, or choose another output."
            )


def put_in_place(out_dir, moves, index: bytes | None, stale: list[str]) -> None:
    """Renames the new files (`(tmp, final)`) into place, writes the `index`
    (if any), removes the `stale` files the new set does not name, in an
    order after which, if killed at any point, the directory loads as the
    old set, as the new one, or fails naming files its index lacks; never
    as a mix.

    - An index over an index: the new files first (under names the old
      index does not use: nothing loads them yet), then the index (one
      rename: the commit), then the old files.
    - An index where there was none (a lone `model.safetensors`, or
      nothing): the index first (loads fail: it names files not there yet;
      `transformers`, which prefers a `model.safetensors`, still reads the
      old one), then the new files, then the old one.
    - One file over an index: the file (the index still names the old set),
      then the old shards (the index names missing files), then the index
      (the directory then holds the new file alone).
    """
    path = os.path.join(out_dir, _index.INDEX_FILE)
    had_index = _index.INDEX_FILE in stale
    new = {os.path.basename(final) for _, final in moves}
    old = [n for n in stale if n not in new and n != _index.INDEX_FILE]
    old.sort(key=lambda n: n != _index.SINGLE_FILE)  # which `transformers` prefers
    if index is not None and not had_index:
        _bytes_files.replace_whole(path, index)
    for tmp, final in moves:
        os.replace(tmp, final)
    if index is not None and had_index:
        _bytes_files.replace_whole(path, index)
    for name in old:
        os.remove(os.path.join(out_dir, name))
    if index is None and had_index:
        os.remove(path)


def index_bytes(shards, names, file_names, total) -> bytes:
    index = {
        "metadata": {"total_size": total},
        "weight_map": {
            file_names[t]: name
            for shard, name in zip(shards, names, strict=True)
            for t in shard
        },
    }
    return (json.dumps(index, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

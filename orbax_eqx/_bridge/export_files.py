"""Where an export's files go, as `save_pretrained` writes them:
`model.safetensors`, or `model-0000i-of-0000n.safetensors` files and
`model.safetensors.index.json`; and what is already at the output."""

import json
import os
import re

from .._bytes import files as _bytes_files
from .export_source import ExportError
from .safetensors import index as _index

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


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


def file_names(n: int) -> list[str]:
    if n == 1:
        return [_index.SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(out_dir, shards, names, file_names, total) -> str:
    index = {
        "metadata": {"total_size": total},
        "weight_map": {
            file_names[t]: name
            for shard, name in zip(shards, names, strict=True)
            for t in shard
        },
    }
    final = os.path.join(out_dir, _index.INDEX_FILE)
    text = json.dumps(index, indent=2, ensure_ascii=False) + "\n"
    _bytes_files.replace_whole(final, text.encode("utf-8"))
    return final

"""`export`: an orbax_eqx checkpoint to Hugging Face safetensors, streamed.

Array leaves become tensors named by their leaf names (`layers.0.weight`),
optionally through a rename map. Everything else the sidecar knows (static
fields, Python leaves, class names) goes into the file's `__metadata__`.
Arrays are read a batch at a time and written straight out, so memory stays
near one batch whatever the checkpoint's size. Past `max_shard_size`, the
tensors are split over `model-0000i-of-0000n.safetensors` files with a
`model.safetensors.index.json`, as Hugging Face `save_pretrained` does.

Files are written under fresh random names beside their final ones (created
with `O_EXCL | O_NOFOLLOW`: a symlink planted there is never written through)
and renamed into place once checked.
"""

import dataclasses
import json
import os
import re
from typing import TextIO

import jax

from .._bytes import files as _files
from .._errors import OrbaxEqxError, inline_list
from .._format.locate import find_item
from .._format.sidecar import LeafMetadata, Metadata
from .._format.sidecar_read import read
from .._restore.read import LeafReader
from .._restore.rename_map import RenameMap, identity
from .._tree.names import label
from .._tree.values import is_text
from .._tree.walk import ARRAY, parse_dtype
from . import safetensors_io as st
from .progress import Progress

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # Hugging Face's default, "5GB"
DEFAULT_BUFFER = 256 * 2**20
METADATA_ENTRY = "orbax_eqx"  # the key of our JSON in `__metadata__`

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class ExportError(OrbaxEqxError, ValueError):
    """A checkpoint cannot be exported as asked."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    record: LeafMetadata
    name: str  # in the file
    dtype: str  # numpy dtype name, in the file
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export` wrote: the files (index last); the tensors and their bytes;
    how many modules (their static fields) and non-array leaves went into
    `__metadata__`; how many arrays the rename map left out."""

    files: list[str]
    tensors: int
    nbytes: int
    modules: int
    in_metadata: int
    left_out: int


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    renames: RenameMap | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    buffer: int = DEFAULT_BUFFER,
    overwrite: bool = False,
    progress: TextIO | None = None,
) -> Exported:
    """Writes the arrays of the checkpoint at `path` as safetensors at `out`.

    **Arguments:**

    - `path`: the checkpoint (an item directory, or a step holding one item).
    - `out`: a directory (Hugging Face layout, sharded past `max_shard_size`)
        or a file name ending in `.safetensors` (one file, whatever its size).
    - `renames`: a `RenameMap` from leaf names to tensor names.
    - `max_shard_size`: the most bytes of tensor data per file.
    - `buffer`: about how many bytes of array data to hold at once.
    - `overwrite`: replace safetensors files already at `out`.
    - `progress`: where to draw a progress bar (only if it is a terminal).

    **Returns:** an `Exported`. Needs the `safetensors` package, whose reader
    checks every file before it is moved into place.
    """
    directory = find_item(path)
    saved = read(directory)
    tensors, left_out = _plan(saved, renames or identity())
    in_metadata = sum(leaf.kind != ARRAY for leaf in saved.leaves.values())
    single = os.fspath(out).endswith(".safetensors")
    out_dir = os.path.dirname(os.path.abspath(out)) if single else os.path.abspath(out)
    stale = _existing(out, out_dir, single, overwrite)
    shards = [tensors] if single else _shard(tensors, max_shard_size)
    names = [os.path.basename(out)] if single else _file_names(len(shards))
    metadata = _metadata(saved, tensors)
    os.makedirs(out_dir, exist_ok=True)
    total = sum(t.nbytes for t in tensors)
    finals = [os.path.join(out_dir, name) for name in names]
    temps: list[str] = []
    try:
        with (
            LeafReader(directory, saved) as reader,
            Progress("export", total, progress) as bar,
        ):
            for shard, final in zip(shards, finals):
                fd, tmp = _files.create_new(final)
                temps.append(tmp)
                _write_shard(fd, tmp, shard, metadata, reader, buffer, bar)
        for shard, tmp in zip(shards, temps):
            st.check_with_library(tmp, [t.name for t in shard], metadata)
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
    finally:
        for tmp in temps:
            if os.path.lexists(tmp):
                os.remove(tmp)
    for name in stale:
        old = os.path.join(out_dir, name)
        if old not in finals:
            os.remove(old)
    if not single and len(shards) > 1:
        finals.append(_write_index(out_dir, shards, names, total))
    return Exported(
        finals, len(tensors), total, len(saved.modules), in_metadata, left_out
    )


def _plan(saved: Metadata, renames: RenameMap) -> tuple[list[_Tensor], int]:
    """The tensors to write, in checkpoint order, and how many arrays are left out."""
    arrays = [r for r in saved.leaves.values() if r.kind == ARRAY]
    new_names = renames.apply([r.name for r in arrays])
    tensors, problems = [], []
    for record in arrays:
        name = new_names[record.name]
        if name is None:
            continue
        dtype, shape = record.dtype, tuple(record.shape or ())
        if dtype.startswith("key<"):
            data = jax.eval_shape(
                jax.random.key_data, jax.ShapeDtypeStruct(shape, parse_dtype(dtype))
            )
            dtype, shape = str(data.dtype), tuple(data.shape)
        if not is_text(name):
            raise ExportError(
                f"Leaf {label(record.name, record.path)} would be the tensor "
                f"{name!r}, which is not "
                "valid Unicode (a lone surrogate); safetensors names are UTF-8. "
                "Rename it with a --rename rule whose regex matches it "
                '(`[["<regex>", "<new name>"]]`).'
            )
        if name == st.METADATA_KEY:
            raise ExportError(
                f"Leaf {label(record.name, record.path)} would be the tensor "
                f"`{name}`, a name "
                "safetensors keeps for its metadata. Rename it with --rename "
                f'(`{{"{record.name}": "<another name>"}}`).'
            )
        if dtype not in st.CODES:
            problems.append(f"leaf {label(record.name, record.path)} is {dtype}")
            continue
        tensors.append(_Tensor(record, name, dtype, shape, st.nbytes_of(dtype, shape)))
    if problems:
        raise ExportError(
            f"safetensors has no dtype for {len(problems)} array(s): "
            f"{inline_list(problems)}. It holds {', '.join(st.CODES)}. Leave them "
            'out with a rename map entry `{"<leaf name>": null}`, or cast them '
            "before saving."
        )
    return tensors, len(arrays) - len(tensors)


def _existing(out, out_dir: str, single: bool, overwrite: bool) -> list[str]:
    """Safetensors files already at `out`: an error, or (`overwrite`) stale ones."""
    if single:
        found = [os.path.basename(out)] if os.path.lexists(out) else []
    elif os.path.isdir(out_dir):
        found = sorted(
            name
            for name in os.listdir(out_dir)
            if name in (st.SINGLE_FILE, st.INDEX_FILE) or _SHARD.fullmatch(name)
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
                f"{os.path.join(out_dir, found[0])} already exists. Pass --overwrite "
                "to replace it, or choose another output."
            )
        raise ExportError(
            f"{out_dir} already holds safetensors files ({found[0]} and "
            f"{len(found) - 1} more). Pass --overwrite to replace them, or choose "
            "another output."
        )
    return found


def _shard(tensors: list[_Tensor], max_size: int) -> list[list[_Tensor]]:
    """Splits tensors, in order, into files of at most `max_size` bytes of data.

    A tensor larger than `max_size` gets a file of its own.
    """
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _file_names(n: int) -> list[str]:
    if n == 1:
        return [st.SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _metadata(saved: Metadata, tensors: list[_Tensor]) -> dict[str, str]:
    """`__metadata__`: all the sidecar knows besides the arrays, as JSON text.

    `"format": "pt"` is what Hugging Face loaders ask of a PyTorch checkpoint;
    Equinox layers store weights as PyTorch does (`Linear`: out x in).
    """
    content = {
        "format_version": saved.format_version,
        "source": saved.directory,
        "versions": saved.versions,
        "modules": {
            name: {"path": m.path, "class": m.cls, "static": m.static}
            for name, m in saved.modules.items()
        },
        "leaves": {
            name: {"path": r.path, "kind": r.kind, "value": r.value}
            for name, r in saved.leaves.items()
            if r.kind != ARRAY
        },
        "tensors": {
            t.name: {"leaf": t.record.name, "dtype": t.record.dtype}
            for t in tensors
            if t.name != t.record.name or t.dtype != t.record.dtype
        },
    }
    text = json.dumps(content, ensure_ascii=False, allow_nan=False)
    if not is_text(text):  # lone surrogates, from an old sidecar: escaped
        text = json.dumps(content, allow_nan=False)
    return {"format": "pt", METADATA_ENTRY: text}


def _write_shard(fd, tmp, shard, metadata, reader: LeafReader, buffer, bar) -> None:
    """Writes one file through `fd`, new at `tmp`, and closes it."""
    with os.fdopen(fd, "wb") as f:
        # Largest items first, as the reference writer does, so that every
        # tensor starts at a multiple of its item size.
        order = sorted(shard, key=lambda t: -st.numpy_dtype(t.dtype).itemsize)
        entries = [(t.name, t.dtype, t.shape) for t in order]
        header = st.encode_header(entries, metadata)
        by_leaf = {t.record.name: t for t in order}
        f.write(header)
        for record, array in reader.stream([t.record for t in order], buffer):
            t = by_leaf[record.name]
            if array.shape != t.shape or str(array.dtype) != t.dtype:
                raise ExportError(
                    f"Leaf {label(record.name, record.path)} was read as "
                    f"{array.dtype}"
                    f"{list(array.shape)} but the sidecar says {t.dtype}"
                    f"{list(t.shape)}; the checkpoint is damaged."
                )
            st.write_array(f, array)
            del array
            bar.advance(t.nbytes)
        expected = len(header) + sum(t.nbytes for t in shard)
        if f.tell() != expected:
            raise ExportError(
                f"Wrote {f.tell()} bytes to {tmp}, expected {expected}. Please "
                "report this as a bug in orbax_eqx."
            )


def _write_index(out_dir, shards, names, total) -> str:
    index = {
        "metadata": {"total_size": total},
        "weight_map": {
            t.name: name for shard, name in zip(shards, names) for t in shard
        },
    }
    final = os.path.join(out_dir, st.INDEX_FILE)
    fd, tmp = _files.create_new(final)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, final)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    return final

"""`export_safetensors`: a checkpoint or a tree as Hugging Face safetensors, streamed.

Tensors are named as the mapping says; everything else goes into each file's
`__metadata__` (JSON under `"orbax_eqx"`, beside `"format": "pt"`). Memory
stays near `buffer`: leaves are read a batch at a time, every tensor's leaves
together, and each tensor written at its offset as soon as it is made. One
process writes."""

import dataclasses
import json
import os
from typing import Any

import numpy as np

from .._errors import inline_list
from .._mapping.names import RenameMap
from .._mapping.pieces import slices, to_tensor
from .._mapping.plan import LeafSpec, Plan, plan_export
from .._mapping.stage import whole
from .._restore.read import release_memory
from .._tree.values import is_text
from . import export_files as _files
from . import export_source as _source
from .export_source import ExportError
from .memory import _mapping as as_mapping
from .progress import Progress, Quiet
from .safetensors import index as _index
from .safetensors import write as _write
from .safetensors.dtypes import CODES, nbytes_of, numpy_dtype
from .safetensors.header import METADATA_KEY, name_problem

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # Hugging Face's default, "5GB"
DEFAULT_BUFFER = 256 * 2**20
METADATA_ENTRY = "orbax_eqx"  # the key of our JSON in `__metadata__`
_RENAME = "Rename it through `mapping=`"


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote.

    - `files`: the files written (the index last, if any);
    - `tensors`, `nbytes`: the tensors written and their bytes;
    - `modules`, `in_metadata`: how many modules (their classes and static
        fields) and non-array leaves went into `__metadata__`;
    - `left_out`: how many array leaves the mapping left out.
    """

    files: list[str]
    tensors: int
    nbytes: int
    modules: int
    in_metadata: int
    left_out: int


def export_safetensors(
    checkpoint_or_tree: Any,
    out: str | os.PathLike,
    *,
    mapping: Any = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    buffer: int = DEFAULT_BUFFER,
    overwrite: bool = False,
) -> Exported:
    """Writes the arrays of a checkpoint, or of a tree, as safetensors at `out`.

    Memory stays near `buffer` whatever the model's size: leaves are read and
    written a batch at a time.

    **Arguments:**

    - `checkpoint_or_tree`: a checkpoint's path (an item directory, or a step
        holding one item; local, `gs://` or `s3://`), or a PyTree of arrays
        on this process's devices (one process writes; for a model on the
        devices of several processes, save it and export the checkpoint).
    - `out`: a local directory (Hugging Face layout: `model.safetensors`, or
        past `max_shard_size` `model-0000i-of-0000n.safetensors` files and
        `model.safetensors.index.json`), or a file name ending in
        `.safetensors` (one file, whatever its size).
    - `mapping`: how leaf names map to tensor names; `None` names each tensor
        by its leaf name.
    - `max_shard_size`: the most bytes of tensor data per file.
    - `buffer`: about how many bytes of array data to hold at once.
    - `overwrite`: replace safetensors files already at `out` (others in the
        directory, such as `config.json`, are left alone).

    **Returns:** an `Exported`, listing the files written. Needs the
    `safetensors` package, whose reader checks every file before it is moved
    into place.

    !!! example

        ```python
        oeqx.export_safetensors("ckpts/1000/default", "gpt2-hf/", mapping=GPT2_MAPPING)
        ```
    """
    return export(
        checkpoint_or_tree,
        out,
        mapping=mapping,
        max_shard_size=max_shard_size,
        buffer=buffer,
        overwrite=overwrite,
    )


def export(
    checkpoint_or_tree: Any,
    out: str | os.PathLike,
    *,
    mapping: Any = None,
    renames: RenameMap | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    buffer: int = DEFAULT_BUFFER,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Exported:
    """`export_safetensors`, with the command line's `renames` (a rename map
    from leaf names to tensor names) and `progress` (see `progress.Progress`)."""
    try:
        import safetensors  # noqa: F401  (its reader checks every file written)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "export_safetensors needs the safetensors package, which is not "
            "installed: pip install 'orbax_eqx[safetensors]' (or pip install "
            "safetensors).",
            name="safetensors",
        ) from None
    source = _source.open_source(checkpoint_or_tree)
    try:
        plan, file_names, left_out = _plan(source, mapping, renames)
        return _write_all(
            source,
            plan,
            file_names,
            left_out,
            out,
            max_shard_size,
            buffer,
            overwrite,
            progress,
        )
    finally:
        source.close()


def _plan(source, mapping, renames) -> tuple[Plan, dict[str, str], int]:
    """The plan, each planned tensor's name in the files, and how many array
    leaves are left out."""
    specs: list[LeafSpec] = source.specs
    if mapping is None:
        new = renames.apply([s.name for s in specs]) if renames else {}
        kept = [s for s in specs if new.get(s.name, s.name) is not None]
        plan = plan_export(None, kept)
        file_names = {s.name: new.get(s.name, s.name) for s in kept}
    else:
        mapping = as_mapping(mapping)
        if isinstance(source, _source.TreeSource):
            mapping = mapping.resolve(source.tree)  # its field keys, as renames
        plan = plan_export(mapping, specs)
        file_names = {name: name for name in plan.tensors}
    labels = {s.name: s.label for s in specs}
    _check_names(plan, file_names, labels)
    _check_dtypes(plan, labels)
    return plan, file_names, len(specs) - len(plan.leaves)


def _feeding(plan: Plan, tensor: str) -> list[str]:
    """The leaves whose values tensor `tensor` holds, in order, once each."""
    return list(dict.fromkeys(p.leaf for p in plan.tensor_pieces(tensor)))


def _check_names(plan: Plan, file_names, labels) -> None:
    for tensor in plan.tensors:
        name = file_names[tensor]
        leaf = labels[_feeding(plan, tensor)[0]]
        if not is_text(name):
            raise ExportError(
                f"Leaf {leaf} would be the tensor {name!r}, which is not valid "
                "Unicode (a lone surrogate); safetensors names are UTF-8. "
                f"{_RENAME}."
            )
        if name == METADATA_KEY:
            raise ExportError(
                f"Leaf {leaf} would be the tensor `{name}`, a name safetensors "
                f"keeps for its metadata. {_RENAME}."
            )
        problem = name_problem(name)
        if problem is not None:
            raise ExportError(
                f"Leaf {leaf} would be the tensor {name[:80]!r}, which {problem}; "
                f"a safetensors reader may refuse it. {_RENAME}."
            )


def _check_dtypes(plan: Plan, labels) -> None:
    problems = []
    for tensor, spec in plan.tensors.items():
        if spec.dtype in CODES:
            continue
        leaves = _feeding(plan, tensor)
        if len(leaves) == 1 and leaves[0] == tensor:
            problems.append(f"leaf {labels[leaves[0]]} is {spec.dtype}")
        else:
            shown = ", ".join(labels[n] for n in leaves[:3])
            problems.append(f"tensor `{tensor}` (from {shown}) is {spec.dtype}")
    if problems:
        raise ExportError(
            f"safetensors has no dtype for {len(problems)} array(s): "
            f"{inline_list(problems)}. It holds {', '.join(CODES)}. Leave them "
            "out through `mapping=`, or cast them before saving."
        )


def _write_all(
    source,
    plan,
    file_names,
    left_out,
    out,
    max_size,
    buffer,
    overwrite,
    progress,
) -> Exported:
    # By a mapping, in the plan's order (natural order of the names); by
    # name, in the order of the leaves, as the checkpoint holds them.
    tensors = list(file_names)
    sizes = {
        t: nbytes_of(plan.tensors[t].dtype, plan.tensors[t].shape) for t in tensors
    }
    out_dir, shards, names, stale = _layout(out, tensors, sizes, max_size, overwrite)
    content = source.metadata()
    content["tensors"] = _renamed(plan, file_names)
    metadata = _metadata(content)
    finals = [os.path.join(out_dir, name) for name in names]
    writers: list[_write.FileWriter] = []
    total = sum(sizes.values())
    try:
        file_of = {}
        for shard, final in zip(shards, finals, strict=True):
            entries = [
                (file_names[t], plan.tensors[t].dtype, plan.tensors[t].shape)
                for t in shard
            ]
            writers.append(_write.FileWriter(final, entries, metadata))
            file_of.update({t: writers[-1] for t in shard})
        with (progress or Quiet)(total) as bar:
            for group in _groups(plan, source, buffer):
                _write_group(plan, source, group, file_names, file_of, bar, sizes)
        for writer in writers:
            writer.close()
        for writer in writers:
            _write.check_with_library(writer.tmp, writer.names, writer.metadata)
        index = None
        if len(shards) > 1:
            index = _files.index_bytes(shards, names, file_names, total)
            finals.append(os.path.join(out_dir, _index.INDEX_FILE))
        moves = [(w.tmp, w.final) for w in writers]
        _files.put_in_place(out_dir, moves, index, stale)
    finally:
        for writer in writers:
            writer.abandon()
    return Exported(
        finals, len(tensors), total, source.modules, source.in_metadata, left_out
    )


def _layout(out, tensors, sizes, max_size, overwrite):
    """The directory written to, the tensors of each file and its name, and
    the safetensors files there that the export replaces (checked first)."""
    single = os.fspath(out).endswith(_index.SUFFIX)
    out_dir = os.path.dirname(os.path.abspath(out)) if single else os.path.abspath(out)
    stale = _files.existing(out, out_dir, single, overwrite, "Pass `overwrite=True`")
    shards = [tensors] if single else _files.shard(tensors, sizes, max_size)
    os.makedirs(out_dir, exist_ok=True)
    names = (
        [os.path.basename(out)] if single else _files.file_names(len(shards), out_dir)
    )
    listed = [_index.INDEX_FILE] if len(shards) > 1 else []
    _files.check_targets(out_dir, [*names, *listed, *stale])
    return out_dir, shards, names, stale


def _write_group(plan, source, group, file_names, file_of, bar, sizes) -> None:
    """Reads one batch of leaves and writes the tensors they make."""
    arrays = source.read(group.leaves)
    for leaf, array in arrays.items():
        _check_read(plan.leaves[leaf], array)
    for t in group.tensors:
        file_of[t].put(file_names[t], _tensor(plan, t, arrays))
        bar.advance(sizes[t])
    del arrays
    release_memory()


@dataclasses.dataclass
class _Group:
    leaves: list[str]
    tensors: list[str]


def _groups(plan: Plan, source, buffer: int):
    """Leaves and the tensors they make, in batches of about `buffer` bytes (a
    connected group of leaves and tensors is never split)."""
    parent: dict[Any, Any] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for t in plan.tensors:
        for p in plan.tensor_pieces(t):
            parent[find(("t", t))] = find(("l", p.leaf))
    order: dict[Any, _Group] = {}
    for leaf in plan.leaves:
        order.setdefault(find(("l", leaf)), _Group([], [])).leaves.append(leaf)
    for t in plan.tensors:
        order.setdefault(find(("t", t)), _Group([], [])).tensors.append(t)
    # Reading takes about twice a batch for a moment (see `LeafReader.stream`).
    budget = max(buffer // 2, 1)
    batch, size = _Group([], []), 0
    for group in order.values():
        cost = sum(source.cost(leaf) for leaf in group.leaves)
        if batch.leaves and size + cost > budget:
            yield batch
            batch, size = _Group([], []), 0
        batch.leaves += group.leaves
        batch.tensors += group.tensors
        size += cost
    if batch.leaves or batch.tensors:
        yield batch


def _check_read(spec: LeafSpec, array: np.ndarray) -> None:
    if tuple(array.shape) != spec.shape or str(array.dtype) != spec.dtype:
        raise ExportError(
            f"Leaf {spec.label} was read as {array.dtype}{list(array.shape)} but "
            f"the sidecar says {spec.dtype}{list(spec.shape)}; the checkpoint is "
            "damaged."
        )


def _tensor(plan: Plan, tensor: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Tensor `tensor`'s values, from the leaves read (a view where it can)."""
    spec = plan.tensors[tensor]
    pieces = plan.tensor_pieces(tensor)
    dtype = numpy_dtype(spec.dtype)
    if len(pieces) == 1:
        p = pieces[0]
        leaf = arrays[p.leaf]
        if (
            p.tensor_box == whole(spec.shape)
            and p.leaf_box == whole(leaf.shape)
            and p.perm == tuple(range(len(p.perm)))
            and leaf.dtype == dtype
        ):
            return leaf.reshape(spec.shape)
    out = np.empty(spec.shape, dtype)
    for p in pieces:
        part = arrays[p.leaf][slices(p.leaf_box)]
        out[slices(p.tensor_box)] = to_tensor(p, part)  # casts to the tensor's
    return out


def _renamed(plan: Plan, file_names) -> dict[str, Any]:
    """For `__metadata__`: each tensor that is not simply its leaf, as it was."""
    out: dict[str, dict[str, Any]] = {}
    for t, spec in plan.tensors.items():
        leaves = _feeding(plan, t)
        leaf = plan.leaves[leaves[0]]
        if len(leaves) == 1 and len(plan.tensor_pieces(t)) == 1:
            if file_names[t] != leaf.name or spec.dtype != leaf.dtype:
                out[file_names[t]] = {"leaf": leaf.name, "dtype": leaf.dtype}
        else:
            out[file_names[t]] = {"leaves": leaves}
    return out


def _metadata(content: dict[str, Any]) -> dict[str, str]:
    """`__metadata__`: all the source knows besides the arrays, as JSON text.

    `"format": "pt"` is what Hugging Face loaders ask of a PyTorch checkpoint;
    Equinox layers store weights as PyTorch does (`Linear`: out x in).
    """
    text = json.dumps(content, ensure_ascii=False, allow_nan=False)
    if not is_text(text):  # lone surrogates, from an old sidecar: escaped
        text = json.dumps(content, allow_nan=False)
    return {"format": "pt", METADATA_ENTRY: text}

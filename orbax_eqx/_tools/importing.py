"""`import`: safetensors (a file, or a Hugging Face directory) into a checkpoint.

A skeleton gives the structure, classes, static fields and callables; the
safetensors files give the arrays, matched to leaves by name (through a rename
map when the names differ, as a PyTorch state_dict's do). The whole skeleton
is checked against the files before any tensor data is read, and every
problem is reported at once. Files written by `export` also carry the saved
static fields and Python leaves: static fields are checked against the
skeleton, Python leaves are restored from them.
"""

import dataclasses
import json
import os
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._bytes.files import read_bounded
from .._errors import OrbaxEqxError, inline_list
from .._format.locate import as_path
from .._orbax.api import save
from .._restore.classes import explain
from .._restore.rename_map import RenameMap, identity
from .._save.leftovers import recover
from .._save.replace import check_target
from .._tree.names import label
from .._tree.values import SCALAR_TYPES, decode_scalar, describe, scalar_type
from .._tree.walk import (
    ARRAY,
    JAX,
    NUMPY_SCALAR,
    SCALAR,
    container,
    is_key_dtype,
    key_impl,
    walk,
)
from . import safetensors_io as st
from .progress import Progress

METADATA_ENTRY = "orbax_eqx"


class ImportMismatchError(OrbaxEqxError, ValueError):
    """The safetensors files do not fit the skeleton."""


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `import_` wrote: the checkpoint, its leaves, tensors and bytes read."""

    path: str
    leaves: int
    tensors: int
    nbytes: int
    files: list[str]


def import_(
    source: str | os.PathLike,
    out: str | os.PathLike,
    skeleton: Any,
    *,
    renames: RenameMap | None = None,
    cast: bool = False,
    allow_unused: bool = False,
    ignore_static: bool = False,
    overwrite: bool = False,
    progress: TextIO | None = None,
) -> Imported:
    """Saves an orbax_eqx checkpoint at `out` with the tensors found at `source`.

    **Arguments:**

    - `source`: a `.safetensors` file, or a directory holding them (with a
        `model.safetensors.index.json`, or without one: every file is read).
    - `out`: where to save the checkpoint; must not exist unless `overwrite`.
    - `overwrite`: replace a checkpoint at `out`, atomically (as
        `orbax_eqx.save` does); anything else there is refused.
    - `skeleton`: the PyTree to fill, as for `orbax_eqx.restore`.
    - `renames`: a `RenameMap` from tensor names to leaf names.
    - `cast`: cast tensors to the skeleton's dtypes where they differ.
    - `allow_unused`: let tensors that fill no leaf be left out.
    - `ignore_static`: keep the skeleton's static fields and classes where the
        files (from `export`) record others.
    - `progress`: where to draw a progress bar (only if it is a terminal).

    **Returns:** an `Imported`.
    """
    out_path = as_path(out)
    recover(out_path)  # an earlier save killed mid-swap: its checkpoint counts
    if out_path.exists() and not overwrite:
        raise ImportMismatchError(
            f"{out_path} already exists. Pass --overwrite to replace it, or choose "
            "another output."
        )
    if overwrite:  # refuses a file or a directory of other files, before any read
        check_target(out_path, overwrite)
    headers = _headers(os.fspath(source))
    tensors = {name: (h, t) for h in headers for name, t in h.tensors.items()}
    new_names = (renames or identity()).apply(list(tensors))
    by_leaf = {new: old for old, new in new_names.items() if new is not None}
    ours = _our_metadata(headers)
    walked = walk(skeleton)
    _check(walked, by_leaf, tensors, ours, source, cast, allow_unused, ignore_static)
    wanted = [leaf for leaf in walked.leaves if leaf.kind == ARRAY]
    total = sum(tensors[by_leaf[leaf.name]][1].nbytes for leaf in wanted)
    arrays = {}
    files: dict[str, Any] = {}
    try:
        with Progress("import", total, progress) as bar:
            for leaf in wanted:
                header, info = tensors[by_leaf[leaf.name]]
                if header.path not in files:
                    files[header.path] = st.open_data(header)
                data = st.read_tensor(files[header.path], info)
                arrays[leaf.name] = _to_leaf(data, leaf.value)
                bar.advance(info.nbytes)
    finally:
        for f in files.values():
            f.close()
    saved_leaves = ours.get("leaves", {})
    values = []
    for leaf in walked.leaves:
        if leaf.kind == ARRAY:
            values.append(arrays.pop(leaf.name))
        elif leaf.kind == SCALAR and _same_scalar(leaf.value, saved_leaves, leaf.name):
            values.append(decode_scalar(saved_leaves[leaf.name]["value"]))
        else:
            values.append(leaf.value)
    save(out_path, jtu.tree_unflatten(walked.treedef, values), overwrite=overwrite)
    return Imported(
        os.fspath(out_path),
        len(walked.leaves),
        len(wanted),
        total,
        [h.path for h in headers],
    )


def _headers(source: str) -> list[st.Header]:
    if os.path.lexists(source) and not os.path.isdir(source):
        return [st.read_header(source)]  # which refuses a FIFO, a device...
    if not os.path.isdir(source):
        raise ImportMismatchError(f"{os.path.abspath(source)} does not exist.")
    index = os.path.join(source, st.INDEX_FILE)
    if os.path.lexists(index):  # a FIFO or a link there too: refused, not skipped
        data = _read_index(index)
        try:
            weight_map = json.loads(data.decode("utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ImportMismatchError(
                f"{index} is not a safetensors index (no valid weight_map: {e!r})."
            ) from None
        gone = [n for n in names if not os.path.isfile(os.path.join(source, n))]
        if gone:
            raise ImportMismatchError(
                f"{index} names files that are not there: {', '.join(gone[:3])}"
                + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
                + ". Re-download or re-export the directory."
            )
        headers = [st.read_header(os.path.join(source, n)) for n in names]
        found = {name: h.path for h in headers for name in h.tensors}
        wrong = [
            f"`{t}` is in {found.get(t, 'no file')}, not {n}"
            for t, n in weight_map.items()
            if os.path.basename(found.get(t, "")) != n
        ]
        if wrong:
            raise ImportMismatchError(
                f"{index} does not match its files: {inline_list(wrong)}. "
                "Re-download or re-export the directory."
            )
    else:
        names = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
        if not names:
            raise ImportMismatchError(
                f"{os.path.abspath(source)} holds no .safetensors file."
            )
        headers = [st.read_header(os.path.join(source, n)) for n in names]
    seen: dict[str, str] = {}
    for h in headers:
        for name in h.tensors:
            if name in seen:
                raise ImportMismatchError(
                    f"Tensor `{name}` is in both {seen[name]} and {h.path}; "
                    "import one of them, or remove the duplicate."
                )
            seen[name] = h.path
    return headers


# Far more than any index: a line of JSON per tensor.
_MAX_INDEX_BYTES = 64 << 20


def _read_index(index: str) -> bytes:
    """The index file's bytes: bounded, and never blocking (a FIFO is refused)."""

    def refused(what: str) -> ImportMismatchError:
        return ImportMismatchError(
            f"{index} is not a safetensors index: it {what}. Re-download or "
            "re-export the directory."
        )

    try:
        return read_bounded(index, _MAX_INDEX_BYTES, refused)
    except FileNotFoundError:  # a dangling link
        raise refused("is a link to nothing") from None


def _our_metadata(headers: list[st.Header]) -> dict[str, Any]:
    """What `export` recorded, or `{}` for files written by anything else."""
    for h in headers:
        text = h.metadata.get(METADATA_ENTRY)
        if text is not None:
            try:
                content = json.loads(text)
            except ValueError:
                return {}
            return content if isinstance(content, dict) else {}
    return {}


def _check(walked, by_leaf, tensors, ours, source, cast, allow_unused, ignore_static):
    problems, fixes = [], []
    arrays = [leaf for leaf in walked.leaves if leaf.kind == ARRAY]
    missing = [leaf.name for leaf in arrays if leaf.name not in by_leaf]
    if missing:
        problems.append(f"{len(missing)} leaf(s) have no tensor: {_names(missing)}")
        _add(fixes, "map tensor names to leaf names with --rename")
    names = {leaf.name for leaf in arrays}
    unused = [old for new, old in by_leaf.items() if new not in names]
    if unused and not allow_unused:
        problems.append(f"{len(unused)} tensor(s) fill no leaf: {_names(unused)}")
        _add(fixes, "pass --allow-unused to leave them out")
    for leaf in arrays:
        if leaf.name in by_leaf:
            tensor = by_leaf[leaf.name]
            problem, fix = _compare(leaf, tensor, tensors[tensor][1], cast)
            if problem:
                problems.append(problem)
                _add(fixes, fix)
    if not ignore_static:
        statics = _static_problems(walked, ours.get("modules", {}))
        if statics:
            problems.extend(statics)
            _add(fixes, "pass --ignore-static to keep the skeleton's")
    if problems:
        raise ImportMismatchError(
            f"The skeleton does not fit the safetensors at {os.path.abspath(source)} "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''}): "
            f"{inline_list(problems)}. To fix: {'; '.join(fixes)}."
        )


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _add(fixes: list[str], fix: str) -> None:
    if fix not in fixes:
        fixes.append(fix)


def _compare(leaf, tensor: str, info: st.TensorInfo, cast: bool):
    x = leaf.value
    where = f"leaf {leaf.label}"
    what = f"tensor `{tensor}`" if tensor != leaf.name else "its tensor"
    if is_key_dtype(x.dtype):
        data = jax.eval_shape(jax.random.key_data, x)
        shape, dtype = tuple(data.shape), str(data.dtype)
        if (info.shape, info.dtype) != (shape, dtype):
            return (
                f"{where} is a {key_impl(x.dtype)} key array, whose key data is "
                f"{dtype}{list(shape)}, but {what} is {info.dtype}{list(info.shape)}",
                "export keys with `jax.random.key_data`",
            )
        return None, None
    if info.shape != tuple(x.shape):
        return (
            f"{where} has shape {tuple(x.shape)} in the skeleton but {what} has "
            f"{info.shape}",
            "build the skeleton of the model the tensors are for",
        )
    if info.dtype != str(x.dtype) and not cast:
        return (
            f"{where} is {x.dtype} in the skeleton but {what} is {info.dtype}",
            "pass --cast to cast tensors to the skeleton's dtypes",
        )
    return None, None


def _static_problems(walked, saved_modules: dict) -> list[str]:
    problems = []
    for name, module in walked.modules.items():
        saved = saved_modules.get(name)
        if not isinstance(saved, dict):
            continue
        cls = saved.get("class")  # checked as `restore` checks it
        if isinstance(cls, str) and cls != module.cls:
            problems.append(
                f"module {label(name, module.path)} is `{module.cls}` in the "
                "skeleton but "
                f"`{cls}` in the files{explain(module.cls, cls, 'what they came from')}"
            )
        theirs = saved.get("static", {})
        if not isinstance(theirs, dict):
            continue
        for field in sorted(set(module.static) | set(theirs)):
            mine = (
                describe(module.static[field]) if field in module.static else "absent"
            )
            other = describe(theirs[field]) if field in theirs else "absent"
            if mine != other:
                problems.append(
                    f"static field `{field}` of module {label(name, module.path)} "
                    f"is {mine} in the skeleton but {other} in the files"
                )
    return problems


def _same_scalar(value: Any, saved_leaves: dict, name: str) -> bool:
    record = saved_leaves.get(name)
    if not isinstance(record, dict) or record.get("kind") != SCALAR:
        return False
    return scalar_type(record.get("value", ...)) == SCALAR_TYPES[type(value)]


def _to_leaf(data: np.ndarray, like: Any) -> Any:
    """The tensor `data` as a leaf like the skeleton's `like`."""
    if is_key_dtype(like.dtype):
        return jax.random.wrap_key_data(jnp.asarray(data), impl=key_impl(like.dtype))
    if str(data.dtype) != str(like.dtype):
        data = data.astype(like.dtype)
    kind = container(like)
    if kind == JAX:
        return jnp.asarray(data)
    if kind == NUMPY_SCALAR:
        return data[()]
    return data

"""`load_safetensors`: safetensors files straight into a skeleton, on any sharding.

Every header is read and the whole load planned and checked before any tensor
byte is read; then each process reads only the byte ranges its own devices'
boxes need, through the read engine (`_storage.engine`).
"""

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import bullet_list
from .._mapping.errors import BridgeError
from .._mapping.names import RenameMap
from .._mapping.pieces import shape as box_shape
from .._mapping.plan import TensorSpec, leaf_specs, plan_load
from .._restore.shardings import Shardings, resolve
from .._storage import engine, put
from .._storage.transfer import staging as _staging
from .._tree.values import SCALAR_TYPES, decode_scalar, scalar_type
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
from . import load_check as _check
from .memory import _check_kept as keep_dropped
from .memory import _kept as kept
from .memory import _mapping as as_mapping
from .memory import check_values
from .progress import Progress, Quiet
from .safetensors import checksums as _sums
from .safetensors import index as _index
from .safetensors.dtypes import numpy_dtype
from .safetensors.header import Header, SafetensorsError, TensorInfo

DEFAULT_WINDOW = put.DEFAULT_WINDOW


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a load did: the tree, its files, and the bytes it read and held."""

    tree: Any
    files: list[str]
    leaves: int  # of the skeleton, all kinds
    tensors: int  # tensors read
    nbytes: int  # of the tensors read, whole
    counts: engine.Counts


def load_safetensors(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    skeleton: Any,
    *,
    mapping: Any = None,
    shardings: Shardings = None,
    cast: bool = False,
    allow_unused: bool = False,
    ignore_static: bool = False,
    window: int = DEFAULT_WINDOW,
) -> Any:
    """Loads safetensors files into `skeleton`, straight onto its shardings.

    Each process reads only the bytes its own devices hold (a device's slice
    of a stacked leaf is read from the rows of the per-layer tensors it
    needs), with no collective; host memory stays near the process's share
    plus a bounded window. Everything is checked before any tensor byte is
    read, and every problem is reported at once.

    **Arguments:**

    - `source`: a `.safetensors` file; a directory holding a
        `model.safetensors.index.json` (Hugging Face's sharded layout), or
        without one, its `.safetensors` files; or a list of files. Local
        paths, `gs://...` or `s3://...` (an object-store directory needs an
        index or a `model.safetensors`).
    - `skeleton`: the PyTree to fill, as for `orbax_eqx.restore` (usually from
        `eqx.filter_eval_shape`): its structure, classes, static fields,
        callables and non-array leaves are kept.
    - `mapping`: how leaf names map to tensor names; `None` matches them by
        name.
    - `shardings`: where each array goes, as `orbax_eqx.restore` takes it:
        one `Sharding`, a PyTree of them, or a function of `(name, leaf)`;
        by default the skeleton leaf's own sharding, else one local device.
    - `cast`: cast tensors to the skeleton's dtypes where they differ
        (otherwise a difference is an error).
    - `allow_unused`: let tensors that fill no leaf be left out (otherwise
        an error).
    - `ignore_static`: keep the skeleton's classes and static fields where the
        files (from `export_safetensors`) record others.
    - `window`: about how many bytes to read at once.

    **Returns:** the skeleton with every array leaf read from the files, and
    Python leaves that files from `export_safetensors` record.

    Raises `SafetensorsError` for a damaged file or index, and for a skeleton
    that does not fit the files (naming every leaf and tensor concerned).

    !!! example

        ```python
        skeleton = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
        model = oeqx.load_safetensors("gpt2/", skeleton, mapping=GPT2_MAPPING)
        ```
    """
    return load(
        source,
        skeleton,
        mapping=mapping,
        shardings=shardings,
        cast=cast,
        allow_unused=allow_unused,
        ignore_static=ignore_static,
        window=window,
    ).tree


def load(
    source,
    skeleton: Any,
    *,
    mapping: Any = None,
    renames: RenameMap | None = None,
    shardings: Shardings = None,
    cast: bool = False,
    allow_unused: bool = False,
    ignore_static: bool = False,
    window: int = DEFAULT_WINDOW,
    progress: Progress | None = None,
) -> Loaded:
    """`load_safetensors`, telling what it read; for the command line,
    `renames` (a rename map from tensor names to leaf names, `--rename`)
    and `progress` (see `progress.Progress`)."""
    checks = (mapping, renames, cast, allow_unused, ignore_static)
    headers, where, saved, walked, plan, named = _checked(source, skeleton, *checks)
    resolved = resolve(shardings, walked)
    targets = _targets(walked, plan, resolved)
    # A tied copy (a head tied to the embedding) is checked by shape and
    # dtype, not read: the leaf it shares is read from its source.
    read = {t: named[t] for t in plan.tensors if t not in plan.ties}
    nbytes = sum(info.nbytes for _, info in read.values())
    made, found, counts = _read(plan, read, targets, window, progress, nbytes)
    _check_values(made, targets, read, where)
    filled = dict(zip(targets, found, strict=True))
    recorded = saved.get("leaves")
    recorded = recorded if isinstance(recorded, dict) else {}
    values = [_value(leaf, filled, resolved, recorded) for leaf in walked.leaves]
    tree = jtu.tree_unflatten(walked.treedef, values)
    headers_read = [h.path for h in headers]
    return Loaded(tree, headers_read, len(walked.leaves), len(read), nbytes, counts)


def _targets(walked, plan, resolved) -> dict:
    """`{leaf: (spec, sharding or None)}` of the array leaves the plan fills
    (one the mapping drops keeps the skeleton's value)."""
    return {
        leaf.name: (
            plan.leaves[leaf.name],
            resolved.get(leaf.name) if container(leaf.value) == JAX else None,
        )
        for leaf in walked.leaves
        if leaf.kind == ARRAY and leaf.name in plan.leaves
    }


def _read(plan, read: dict, targets: dict, window: int, progress, nbytes: int):
    """The engine's leaves, the arrays they make and the engine's counts;
    raises for tensors unlike their recorded sums."""
    damage: dict[str, list[str]] = {}  # by file: tensors unlike their sums
    made = leaves(plan, read, targets, damage)
    counts = engine.Counts()
    counts.held = sum(
        math.prod(u.shape) * u.dtype.itemsize for leaf in made for _, _, u in leaf.units
    )
    staging = _staging.for_restore(None, [s for _, s in targets.values()])
    with (progress or Quiet)(nbytes) as bar:
        found = put.arrays(
            made, staging, window=window, counts=counts, advance=bar.advance
        )
    if any(damage.values()):
        raise _damaged(damage)
    return made, found, counts


def leaves(plan, tensors: dict, targets: dict, damage: dict) -> list[put.Leaf]:
    """The engine's leaves of `targets` (`{leaf: (spec, sharding or None)}`):
    a unit per distinct box on this process's devices, a piece per box of a
    tensor (`{name: (header, info)}`) that the plan says fills part of it,
    checked against the tensor's block sums where its file records them
    (what differs goes into `damage[path]`)."""
    files: dict[str, engine.File] = {}
    sums: dict[str, dict | None] = {}
    sources: dict[str, engine.Source] = {}
    for name, (header, info) in tensors.items():
        if header.path not in files:  # tensors end to end: merged where they touch
            sums[header.path] = _recorded(header)
            files[header.path] = engine.File(
                header.path,
                header.size,
                _replaced(header),
                0,
                exact=True,
                identity=header.identity,
            )
        dtype = numpy_dtype(info.dtype).newbyteorder("<")
        check = None
        entry = (sums[header.path] or {}).get(info.name)
        if entry is not None:
            try:
                c = _sums.chunk(info.name, info.start, info.nbytes, entry)
            except ValueError as e:
                raise _malformed(header, str(e)) from None
            check = _sums.TensorCheck(c, damage.setdefault(header.path, []))
        sources[name] = engine.Source(
            files[header.path], info.start, info.shape, dtype, check
        )
    out = []
    for leaf, (spec, sharding) in targets.items():
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        if sharding is None:
            held: tuple = (((0,) * len(shape), shape, ()),)
        else:
            held = engine.held(sharding, shape)
        units: list = []
        for start, stop, devices in held:
            box = tuple(zip(start, stop, strict=True))
            empty = any(a >= z for a, z in box)
            pieces = [] if empty else plan.leaf_pieces(leaf, box)
            mine = [
                engine.Piece(
                    sources[p.tensor],
                    p.tensor_box,
                    tuple(
                        (a - s, z - s)
                        for (a, z), (s, _) in zip(p.leaf_box, box, strict=True)
                    ),
                    None if p.perm == tuple(range(len(p.perm))) else p.perm,
                )
                for p in pieces
            ]
            units.append(
                (start, tuple(devices), engine.Unit(box_shape(box), dtype, mine))
            )
        out.append(put.Leaf(shape, dtype, sharding, units, len(shape)))
    return out


def _recorded(header: Header) -> dict | None:
    try:
        return _sums.recorded(header.metadata)
    except ValueError as e:
        raise _malformed(header, f"is {e}") from None


def _malformed(header: Header, what: str) -> SafetensorsError:
    return SafetensorsError(
        f"{header.path} is damaged: the `{_sums.CHECKSUMS}` entry of its "
        f"__metadata__ {what}. Re-export it, or download it again."
    )


def _damaged(damage: dict[str, list[str]]) -> SafetensorsError:
    """The error for tensors whose bytes differ from their block sums."""
    lines = [
        f"{path}: {line}"
        for path, found in damage.items()
        for line in dict.fromkeys(found)  # (a block read for two units: once)
    ]
    files = [path for path, found in damage.items() if found]
    return SafetensorsError(
        f"{len(files)} safetensors file(s) are damaged: their data changed after "
        "export (a flipped bit on disk, or a damaged copy):\n"
        + bullet_list(lines)
        + "\nRe-export them, or download them again; `python -m orbax_eqx verify "
        "PATH` checks every tensor."
    )


def _check_values(made: list[put.Leaf], targets: dict, read: dict, where) -> None:
    """Raises for values the read did not place (`engine.Refused`), naming
    each tensor and leaf."""
    tensor_of = {(h.path, info.start): name for name, (h, info) in read.items()}
    found: dict[tuple[str, str, Any], list[engine.Refused]] = {}
    for (spec, _), leaf in zip(targets.values(), made, strict=True):
        for _, _, u in leaf.units:
            for piece, what in u.refused or ():
                tensor = tensor_of[piece.source.file.path, piece.source.offset]
                found.setdefault((tensor, spec.label, leaf.dtype), []).append(what)
    stored = f" of the safetensors at {where}"
    check_values(found, stored, (SafetensorsError, _check.MismatchError))


def _replaced(header: Header):
    def error(what: str) -> SafetensorsError:
        return SafetensorsError(
            f"{header.path} {what} (its header was read from a {header.size}-byte "
            "file); it was replaced while being read. Load it again."
        )

    return error


def _by_name(walked, specs, tensors, renames, checks, problems):
    """`(plan, tensors by leaf name)` of a load without a mapping: tensors
    matched to leaves by name (through `renames`), every difference listed
    with `problems` (the skeleton's static fields) as one error."""
    cast, allow_unused, where = checks
    new = renames.apply(list(tensors)) if renames else {t: t for t in tensors}
    by_leaf = {n: old for old, n in new.items() if n is not None}
    infos = {name: info for name, (_, info) in tensors.items()}
    checked = _check.Problems()
    _check.by_name(walked, by_leaf, infos, cast, allow_unused, checked)
    checked.problems += problems.problems
    checked.fixes += [f for f in problems.fixes if f not in checked.fixes]
    checked.raise_if_any(where)
    wanted = {leaf.name for leaf in walked.leaves if leaf.kind == ARRAY}
    named = {n: tensors[old] for n, old in by_leaf.items() if n in wanted}
    return plan_load(None, specs, _tensor_specs(named), cast=cast), named


def _by_mapping(mapping, specs, tensors, cast, allow_unused, problems, where):
    """The plan of a load through `mapping`; its problems and `problems` (the
    skeleton's static fields) as one error."""
    try:
        plan = plan_load(
            mapping, specs, _tensor_specs(tensors), cast=cast, allow_unused=allow_unused
        )
    except BridgeError as e:
        raise _check.MismatchError(
            f"{e}" + problems.also(where) if problems.problems else str(e)
        ) from None
    problems.raise_if_any(where)
    return plan


def _value(leaf, filled: dict, resolved: dict, recorded: dict) -> Any:
    """A leaf of the loaded tree: filled from the files, or the skeleton's."""
    if leaf.name in filled:
        return _as_leaf(filled.pop(leaf.name), leaf)
    if leaf.kind == ARRAY:  # dropped
        return kept(leaf.value, resolved.get(leaf.name))
    if leaf.kind == SCALAR:
        return _scalar(leaf, recorded.get(leaf.name))
    return leaf.value  # callables, objects, shared markers: the skeleton's own


def _tensor_specs(tensors: dict[str, tuple[Header, TensorInfo]]) -> list[TensorSpec]:
    return [
        TensorSpec(name, info.shape, info.dtype) for name, (_, info) in tensors.items()
    ]


def _as_leaf(data: Any, leaf) -> Any:
    """What `fill` made, as the skeleton leaf holds it."""
    if is_key_dtype(leaf.value.dtype):
        return jax.random.wrap_key_data(data, impl=key_impl(leaf.value.dtype))
    if container(leaf.value) == NUMPY_SCALAR:
        return data[()]
    return data


def _scalar(leaf, record: Any) -> Any:
    """A Python leaf: the files' (from `export`), if of the skeleton's type."""
    if not isinstance(record, dict) or record.get("kind") != SCALAR:
        return leaf.value
    encoded = record.get("value", ...)
    if scalar_type(encoded) != SCALAR_TYPES[type(leaf.value)]:
        return leaf.value
    try:
        return decode_scalar(encoded)
    except ValueError:  # damaged: the skeleton's own
        return leaf.value


def check_load(
    source,
    skeleton: Any,
    *,
    mapping: Any = None,
    renames: RenameMap | None = None,
    cast: bool = False,
    allow_unused: bool = False,
    ignore_static: bool = False,
) -> tuple[list[Header], Any]:
    """The checks and the plan of `load`, with no tensor read: the files'
    headers and the plan (which tensors fill which leaf), or the error `load`
    would raise. For the command line's dry run (`inspect --skeleton`)."""
    checks = (mapping, renames, cast, allow_unused, ignore_static)
    headers, _, _, _, plan, _ = _checked(source, skeleton, *checks)
    return headers, plan


def _checked(source, skeleton, mapping, renames, cast, allow_unused, ignore_static):
    """Every check of a load, before any tensor is read: the headers, where
    they are (for messages), what `export` recorded, the walked skeleton, the
    plan and the tensors it reads by name."""
    headers = _index.find(source)
    where = _index.describe(source)
    tensors = {name: (h, t) for h in headers for name, t in h.tensors.items()}
    walked = walk(skeleton)
    specs = leaf_specs(walked)  # one per array leaf, in order
    saved = _check.ours(headers)
    problems = _check.Problems()
    if not ignore_static:
        _check.statics(walked, saved.get("modules"), problems)
    if mapping is None:
        # Matched by name (through renames): checked here as a restore checks.
        checks = (cast, allow_unused, where)
        plan, named = _by_name(walked, specs, tensors, renames, checks, problems)
    else:
        mapping = as_mapping(mapping).resolve(skeleton)
        plan = _by_mapping(mapping, specs, tensors, cast, allow_unused, problems, where)
        keep_dropped(walked, plan)
        named = tensors
    return headers, where, saved, walked, plan, named

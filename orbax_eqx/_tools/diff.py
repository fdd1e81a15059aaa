"""`diff`: how two checkpoints (or a checkpoint and a skeleton) differ.

The structure (leaves added and removed; kinds, shapes, dtypes, Python values,
tied weights; modules' classes and static fields) comes from the sidecars
alone. Against a skeleton, Python values are compared by type only, as
restore does: a skeleton's `step=0` is a placeholder.

With `values=True`, arrays held by both sides with the same shape are read a
batch at a time and compared element by element, as `numpy.isclose` does with
B as the reference, reporting the largest absolute and relative difference of
each leaf; typed PRNG keys are compared as keys (equal or not).

A plain Orbax checkpoint (arrays only) is compared by its arrays: the other
side's leaves it could not hold (callables, strings, None) and its modules
are left out, and a Python number is the 0-d array Orbax stores it as.
"""

import dataclasses
import math
from typing import Any, TextIO

import numpy as np

from .._format.locate import find_item
from .._format.sidecar import ALIAS, EMPTY, LeafMetadata, Metadata
from .._restore.read import LeafReader, read_cost
from .._tree.values import describe, scalar_type
from .._tree.walk import ARRAY, SCALAR
from . import skeleton as _skeleton
from . import step_items as _items
from .plain_items import PlainMetadata
from .plain_read import StoreReader
from .progress import Progress

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8
DEFAULT_BUFFER = 256 * 2**20
_CHUNK = 1 << 20  # elements compared at once, to bound the float64 temporaries


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a diff: a checkpoint (with its directory) or a skeleton."""

    label: str  # what the user typed
    saved: Metadata
    directory: Any = None  # the item directory; None for a skeleton


@dataclasses.dataclass(frozen=True)
class Difference:
    """One difference in structure. `what`: added, removed, kind, shape, dtype,
    value, tied, class, static, module added, module removed."""

    what: str
    name: str  # leaf or module name
    a: str  # as A has it ("" if absent)
    b: str  # as B has it


@dataclasses.dataclass(frozen=True)
class ValueDiff:
    """How the values of one array leaf differ."""

    name: str
    max_abs: float
    max_rel: float
    mismatched: int  # elements (keys) outside the tolerances (not equal)
    size: int
    # Typed PRNG keys, compared as keys: `size` keys, `mismatched` of them
    # not equal; `max_abs` and `max_rel` are nan (a key has no magnitude).
    keys: bool = False

    @property
    def equal(self) -> bool:
        return self.mismatched == 0


def open_side(text: str, item: Any = None) -> Side:
    """A checkpoint path, or a skeleton given as `module:function`; `item`, if
    given, the item directory to read (found from `text` by `diff_items`)."""
    if _skeleton.looks_like_spec(text):
        tree = _skeleton.load(text)
        return Side(text, _skeleton.metadata(tree, f"skeleton {text}"))
    directory = item if item is not None else find_item(text)
    return Side(text, _items.read(directory), directory)


def is_plain(side: Side) -> bool:
    """Whether `side` is a plain Orbax item: arrays only, no modules."""
    return isinstance(side.saved, PlainMetadata)


def structure(a: Side, b: Side) -> list[Difference]:
    """Every difference between the sidecars of `a` and `b`, in A's leaf order."""
    diffs = []
    la, lb = a.saved.leaves, b.saved.leaves
    both_saved = a.directory is not None and b.directory is not None
    plain = is_plain(a) or is_plain(b)
    if plain:
        # Orbax recorded arrays only: the other side's leaves it cannot hold
        # are not missing from it, and its Python scalars are 0-d arrays.
        la = {n: r for n, r in la.items() if n in lb or _plain_holds(r)}
        lb = {n: r for n, r in lb.items() if n in la or _plain_holds(r)}
    for name, ra in la.items():
        rb = lb.get(name)
        if rb is None:
            diffs.append(Difference("removed", name, ra.describe(), ""))
            continue
        if plain and ARRAY in (ra.kind, rb.kind) and ra.kind != rb.kind:
            ra, rb = _as_array(ra), _as_array(rb)
        diff = _leaf(ra, rb, both_saved and not plain)
        if diff is not None and ra.kind == SCALAR and not both_saved:
            # A skeleton's Python values are placeholders, as restore treats
            # them: only their types must match.
            if scalar_type(ra.value) == scalar_type(rb.value):
                diff = None
        if diff is not None:
            diffs.append(diff)
    diffs += [
        Difference("added", name, "", rb.describe())
        for name, rb in lb.items()
        if name not in la
    ]
    ma, mb = a.saved.modules, b.saved.modules
    if plain:  # a plain Orbax checkpoint records no modules to compare
        return diffs
    for name, m in ma.items():
        other = mb.get(name)
        if other is None:
            diffs.append(Difference("module removed", name, m.cls, ""))
            continue
        if m.cls != other.cls:
            diffs.append(Difference("class", name, m.cls, other.cls))
        for field in sorted(set(m.static) | set(other.static)):
            da, db = _field(m.static, field), _field(other.static, field)
            if da != db:
                diffs.append(Difference("static", f"{name}:{field}", da, db))
    diffs += [
        Difference("module added", name, "", m.cls)
        for name, m in mb.items()
        if name not in ma
    ]
    return diffs


def _plain_holds(record: LeafMetadata) -> bool:
    """Whether a plain Orbax checkpoint of the same tree would hold the leaf:
    arrays, and Python numbers (as 0-d arrays)."""
    if record.kind == ARRAY:
        return record.data != EMPTY
    return record.kind == SCALAR and scalar_type(record.value) in _NUMBERS


_NUMBERS = ("int", "float", "bool")


def _as_array(record: LeafMetadata) -> LeafMetadata:
    """A Python number's record as the 0-d array Orbax stores it as: its
    dtype is Orbax's choice, so it is compared by shape only."""
    if record.kind == ARRAY:
        return dataclasses.replace(record, dtype=None) if record.shape == () else record
    return dataclasses.replace(record, kind=ARRAY, shape=(), dtype=None)


def _field(static: dict, field: str) -> str:
    return describe(static[field]) if field in static else "absent"


def _leaf(ra: LeafMetadata, rb: LeafMetadata, both_saved: bool):
    name = ra.name
    if ra.kind != rb.kind:
        return Difference("kind", name, ra.describe(), rb.describe())
    if ra.kind == ARRAY:
        if ra.shape != rb.shape:
            return Difference("shape", name, str(ra.shape), str(rb.shape))
        if ra.dtype != rb.dtype and None not in (ra.dtype, rb.dtype):
            return Difference("dtype", name, str(ra.dtype), str(rb.dtype))
        if both_saved and (ra.alias_of if ra.data == ALIAS else None) != (
            rb.alias_of if rb.data == ALIAS else None
        ):
            return Difference("tied", name, _tie(ra), _tie(rb))
        return None
    if ra.value != rb.value:
        return Difference("value", name, ra.describe(), rb.describe())
    return None


def _tie(record: LeafMetadata) -> str:
    return f"tied to {record.alias_of}" if record.data == ALIAS else "its own array"


def comparable(a: Side, b: Side) -> list[tuple[LeafMetadata, LeafMetadata]]:
    """Array leaves both sides hold with the same shape: those `values` compares."""
    pairs = []
    for name, ra in a.saved.leaves.items():
        rb = b.saved.leaves.get(name)
        if ra.kind == ARRAY and rb is not None and rb.kind == ARRAY:
            if ra.shape == rb.shape and (ra.dtype or "").startswith("key<") == (
                (rb.dtype or "").startswith("key<")
            ):
                pairs.append((ra, rb))
    return pairs


def values(
    a: Side,
    b: Side,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    buffer: int = DEFAULT_BUFFER,
    progress: TextIO | None = None,
):
    """Yields a `ValueDiff` for each leaf of `comparable(a, b)`, reading as it goes.

    At most about `buffer` bytes of array data (half from each side) are held.
    """
    if a.directory is None or b.directory is None:
        skeleton = a if a.directory is None else b
        raise _skeleton.SkeletonError(
            f"--values compares the data of two checkpoints, but {skeleton.label} "
            "is a skeleton, which has none. Give two checkpoints, or leave out "
            "--values."
        )
    pairs = comparable(a, b)
    total = sum(read_cost(ra) + read_cost(rb) for ra, rb in pairs)
    with (
        _reader(a) as reader_a,
        _reader(b) as reader_b,
        Progress("diff --values", total, progress) as bar,
    ):
        stream_b = reader_b.stream((rb for _, rb in pairs), buffer // 2)
        for ra, xa in reader_a.stream((ra for ra, _ in pairs), buffer // 2):
            rb, xb = next(stream_b)  # both streams follow `pairs`
            if ra.dtype.startswith("key<"):
                yield compare_keys(ra.name, ra.dtype, rb.dtype, xa, xb)
            else:
                yield compare(ra.name, xa, xb, rtol, atol)
            bar.advance(read_cost(ra) + read_cost(rb))
            del xa, xb


def _reader(side: Side):
    """Reads a side's arrays: through the sidecar, or for a plain Orbax item
    from Orbax's array store."""
    if isinstance(side.saved, PlainMetadata):
        return StoreReader(side.directory, side.saved.ocdbt, side.saved.zarr3)
    return LeafReader(side.directory, side.saved)


def compare_keys(name: str, dtype_a: str, dtype_b: str, a, b) -> "ValueDiff":
    """Compares typed PRNG keys as keys: each key equal (all of its key data)
    or not, and both of one implementation. `a`, `b`: their key data (uint32,
    one trailing axis of words per key)."""
    size = int(np.prod(a.shape[:-1])) if a.ndim else 0
    if dtype_a != dtype_b or a.shape != b.shape:
        return ValueDiff(name, math.nan, math.nan, size, size, keys=True)
    same = np.all(a.reshape(size, -1) == b.reshape(size, -1), axis=1)
    mismatched = int(size - np.count_nonzero(same))
    return ValueDiff(name, math.nan, math.nan, mismatched, size, keys=True)


def compare(name: str, a: np.ndarray, b: np.ndarray, rtol: float, atol: float):
    """Compares two arrays of one shape, a chunk of elements at a time.

    Integers and booleans must be equal; floats (and complex) as
    `numpy.isclose(a, b, rtol, atol, equal_nan=True)`. The relative difference
    of an element is `|a - b| / max(|a|, |b|)`. Elements where one side is nan
    and the other not count as mismatched but add nothing to the maxima.
    """
    fa, fb = a.reshape(-1), b.reshape(-1)
    exact = _is_exact(a.dtype) and _is_exact(b.dtype)
    max_abs = max_rel = 0.0
    mismatched = 0
    for start in range(0, fa.size, _CHUNK):
        ra, rb = fa[start : start + _CHUNK], fb[start : start + _CHUNK]
        ca, cb = _wide(ra), _wide(rb)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if exact:
                # Exactly, even for int64 values that float64 would round.
                same = ra == rb
                close = same
            else:
                same = (ca == cb) | (np.isnan(ca) & np.isnan(cb))
                close = np.isclose(ca, cb, rtol=rtol, atol=atol, equal_nan=True)
            if exact:
                diff = np.where(same, 0.0, _int_distance(ra, rb))
            else:
                diff = np.where(same, 0.0, np.abs(ca - cb))
            # A nan facing a number counts as mismatched; it has no size.
            diff = np.where(np.isnan(diff), 0.0, diff)
            scale = np.maximum(np.abs(ca), np.abs(cb))
            rel = np.where(np.isinf(diff), np.inf, diff / np.where(diff, scale, 1))
        mismatched += int(close.size - np.count_nonzero(close))
        max_abs = max(max_abs, float(np.max(diff)))
        max_rel = max(max_rel, float(np.max(rel)))
    return ValueDiff(name, max_abs, max_rel, mismatched, int(fa.size))


def _int_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`|a - b|` of integers, exactly as uint64 (modulo 2**64 is exact here)."""
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    return (hi.astype(np.uint64) - lo.astype(np.uint64)).astype(np.float64)


def _is_exact(dtype: np.dtype) -> bool:
    # ml_dtypes floats (bfloat16, float8...) are kind "V", like int4: tell them
    # apart by whether they have a float info.
    if dtype.kind in "biu":
        return True
    if dtype.kind == "V":
        try:
            import ml_dtypes

            ml_dtypes.finfo(dtype)
            return False
        except ValueError:
            return True
    return False


def _wide(x: np.ndarray) -> np.ndarray:
    """float64 (complex128 for complex), for arithmetic that cannot overflow."""
    if np.issubdtype(x.dtype, np.complexfloating):
        return x.astype(np.complex128)
    return x.astype(np.float64)

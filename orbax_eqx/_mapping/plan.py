"""The planner: a mapping and both sides' shapes, turned into pieces.

Each `plan_*` runs the rules from the leaves towards the tensors, checks
everything at once, and returns a `Plan`: for any box of a leaf or a tensor,
the pieces that hold its values. Planning never costs anything per element.
"""

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._tree.walk import ARRAY, Walked, is_key_dtype, key_data_struct, key_impl
from .errors import BridgeError
from .mapping import StateDictMapping
from .pieces import Box, Piece, clip, size
from .rules.drop import Ignore
from .rules.tie import Tie
from .stage import Context, Virtual, examples, label, natural, whole
from .templates import MAX_NAME
from .wording import (
    planned,
    report_dtypes,
    report_missing,
    report_shapes,
    report_unexpected,
)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """An array leaf as the planner sees it."""

    name: str  # leaf name, `blocks.attn.query.weight`
    label: str  # how messages show it (the leaf name, and its path where it helps)
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    key: str | None = None  # a typed PRNG key's implementation: stored as key data


class TensorSpec(NamedTuple):
    """A tensor of the other layout (or a checkpoint's leaf) as the planner sees
    it (a named tuple: a stack of a million layers makes a million)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name (`bfloat16` for safetensors' BF16)


def data_of(dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name an array of `dtype` is stored as in a tensor: a
    typed PRNG key as its key data (`jax.random.key_data`)."""
    if is_key_dtype(dtype):
        data = key_data_struct(dtype)
        return tuple(shape) + tuple(data.shape), str(data.dtype)
    return tuple(shape), str(np.dtype(dtype))


def leaf_specs(walked: Walked) -> list[LeafSpec]:
    """One `LeafSpec` per array leaf of `walked`, in the tree's order."""
    specs = []
    for leaf in walked.leaves:
        if leaf.kind == ARRAY:
            x = leaf.value
            shape, dtype = data_of(x.dtype, tuple(x.shape))
            key = key_impl(x.dtype) if is_key_dtype(x.dtype) else None
            specs.append(LeafSpec(leaf.name, leaf.label, shape, dtype, key))
    return specs


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which boxes of which tensors hold each leaf's values, and back: `leaves`
    filled or read, `tensors` read or written, `dropped` leaves the mapping
    leaves out (a load keeps the skeleton's), `ties` each tied copy's source
    (a load checks present copies equal; an export writes them)."""

    leaves: dict[str, LeafSpec]
    tensors: Mapping[str, TensorSpec]
    _by_leaf: dict[str, list[Piece]]  # whole-leaf pieces, covering each leaf once
    # The same pieces, by tensor: one as itself (a million layers of a stack
    # are a million of these), several as a tuple.
    _by_tensor: dict[str, Piece | tuple[Piece, ...]]
    dropped: dict[str, LeafSpec] = dataclasses.field(default_factory=dict)
    ties: dict[str, str] = dataclasses.field(default_factory=dict)

    def leaf_pieces(self, leaf: str, box: Box | None = None) -> list[Piece]:
        """Pieces covering `box` of `leaf` (default: all of it) exactly once."""
        return _clip(self._by_leaf[leaf], box, leaf_side=True)

    def tensor_pieces(self, tensor: str, box: Box | None = None) -> list[Piece]:
        """Pieces covering `box` of `tensor` (default: all of it) exactly once."""
        held = self._by_tensor[tensor]
        pieces = (held,) if isinstance(held, Piece) else held
        return _clip(pieces, box, leaf_side=False)

    def piece(self, tensor: str) -> Piece | None:
        """The one piece that holds all of `tensor`, if one does."""
        held = self._by_tensor[tensor]
        return held if isinstance(held, Piece) else None


class _Specs(Mapping[str, TensorSpec]):
    """An export's tensors by name, kept as `(shape, dtype)` (no object the
    collector follows: a stack of a million layers makes a million)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], str]]):
        self._specs = specs

    def __getitem__(self, name: str) -> TensorSpec:
        return TensorSpec(name, *self._specs[name])

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _clip(pieces: Sequence[Piece], box: Box | None, leaf_side: bool) -> list[Piece]:
    if box is None:
        return list(pieces)
    out = []
    for p in pieces:
        part = clip(p, box, leaf_side=leaf_side)
        if part is not None:
            out.append(part)
    return out


def plan_load(
    mapping: StateDictMapping | None,
    leaves: Sequence[LeafSpec],
    tensors: Sequence[TensorSpec],
    *,
    cast: bool,
    allow_unused: bool = False,
) -> Plan:
    """Plans filling `leaves` from `tensors` through `mapping` (resolved; None:
    by name); raises `BridgeError` listing every problem at once. `cast` casts
    other dtypes to the leaves'; `allow_unused` leaves alone tensors no leaf
    maps to (else each is a problem, unless an `ignore` rule matches it)."""
    plan, ctx = checked_load(
        mapping, leaves, tensors, cast=cast, allow_unused=allow_unused
    )
    if ctx.problems:
        raise BridgeError(
            planned("The tensors do not fit the skeleton through the mapping", ctx)
        )
    assert plan is not None
    return plan


def checked_load(
    mapping: StateDictMapping | None,
    leaves: Sequence[LeafSpec],
    tensors: Sequence[TensorSpec],
    *,
    cast: bool,
    allow_unused: bool,
    leave: Collection[str] = (),
    restore: bool = False,
) -> tuple[Plan | None, Context]:
    """`plan_load` without raising: the plan (None if there are problems) and
    the context holding the problems. Tensors in `leave` are no problem when
    nothing maps to them; `restore` words what is stored as a checkpoint."""
    mapping = mapping or StateDictMapping()
    virtuals, ctx = _run(mapping, leaves, restore)
    ctx.mapped = bool(mapping.rules)
    expected = {v.name: v for v in virtuals}
    given = _named(tensors, ctx)
    present_ties = _present_ties(mapping, expected, given, ctx, cast)
    unexpected: list[str] = []
    if not allow_unused:
        ignored = [r for r in mapping.rules if isinstance(r, Ignore)]
        unexpected = [
            name
            for name in given
            if name not in expected
            and name not in present_ties
            and name not in ctx.explained
            and name not in leave
            and not any(r.ignores(name) for r in ignored)
        ]
    paired = _compare(virtuals, given, unexpected, ctx, cast)
    report_unexpected(unexpected, paired, mapping, virtuals, ctx)
    dropped = _coverage(leaves, virtuals, ctx, load=True)
    if ctx.problems:
        return None, ctx
    specs = {n: given[n] for n in [*expected, *present_ties]}
    return _plan(leaves, virtuals, dropped, specs, present_ties), ctx


def plan_restore(
    mapping: StateDictMapping,
    leaves: Sequence[LeafSpec],
    stored: Sequence[TensorSpec],
    *,
    cast: bool,
    strict: bool,
    leave: Collection[str] = (),
) -> tuple[Plan | None, Context]:
    """`checked_load` of a restore: `leaves` are the skeleton's array leaves
    (named under `prefix=`), `stored` the checkpoint's array leaves (its
    tensors); checkpoint leaves in `leave` (outside `prefix=`) are no
    problem when nothing reads them."""
    return checked_load(
        mapping,
        leaves,
        stored,
        cast=cast,
        allow_unused=not strict,
        leave=leave,
        restore=True,
    )


def _named(tensors: Sequence[TensorSpec], ctx) -> dict[str, TensorSpec]:
    """The tensors by name; a name too long to match a rule is a problem."""
    given: dict[str, TensorSpec] = {}
    for spec in tensors:
        if len(spec.name) > MAX_NAME:  # never matched against a rule
            ctx.problem(
                f"Tensor `{spec.name[:60]}...` has a name of {len(spec.name)} "
                f"characters, more than the {MAX_NAME} a name may have.",
                "Give tensors names of at most that length.",
                kind="unexpected",
            )
        else:
            given[spec.name] = spec
    return given


def _present_ties(mapping, expected, given, ctx, cast: bool) -> dict[str, str]:
    """`{tied copy: its source}` of the copies given; one unlike it is a problem."""
    present: dict[str, str] = {}
    for tie in _ties(mapping, expected, ctx):
        copy = given.get(tie.tensor)
        source = expected.get(tie.to)
        if copy is None or source is None:
            continue
        if copy.shape != source.shape or (copy.dtype != source.dtype and not cast):
            ctx.problem(
                f"Tensor `{copy.name}` is tied to `{tie.to}` ({ctx.origin(source)}) "
                f"but is {copy.dtype}{list(copy.shape)} where `{tie.to}` is "
                f"{source.dtype}{list(source.shape)}.",
                _FIX_TIE,
                kind="differs",
            )
        present[copy.name] = tie.to
    return present


def _compare(virtuals: list[Virtual], given, unexpected, ctx, cast: bool) -> set:
    """Every expected tensor against the one given (dtypes, shapes, missing);
    returns the unexpected tensors paired with a missing one."""
    missing: list[Virtual] = []
    shapes: list[tuple[Virtual, TensorSpec]] = []
    dtypes: list[tuple[Virtual, TensorSpec]] = []
    for v in virtuals:
        t = given.get(v.name)
        if t is None:
            if v.name not in ctx.explained:
                missing.append(v)
        elif t.shape != v.shape:
            shapes.append((v, t))
        elif t.dtype != v.dtype and (not cast or ctx.key_of(v)):  # keys: never cast
            dtypes.append((v, t))
    report_dtypes(dtypes, len(virtuals), ctx)
    report_shapes(shapes, virtuals, ctx)
    return report_missing(missing, virtuals, unexpected, given, ctx)


def plan_export(
    mapping: StateDictMapping | None,
    leaves: Sequence[LeafSpec],
) -> Plan:
    """Plans writing `leaves` as tensors, in natural order of their names (`h.2`
    before `h.10`); raises `BridgeError` listing every problem at once."""
    mapping = mapping or StateDictMapping()
    virtuals, ctx = _run(mapping, leaves, False)
    expected = {v.name: v for v in virtuals}
    ties = {t.tensor: t.to for t in _ties(mapping, expected, ctx) if t.export}
    dropped = _coverage(leaves, virtuals, ctx, load=False)
    if ctx.problems:
        raise BridgeError(
            planned("The mapping cannot turn the leaves into tensors", ctx)
        )
    keys = {v.name: v.key or natural(v.name) for v in virtuals}
    keys.update((name, natural(name)) for name in ties)
    order = sorted(keys, key=keys.__getitem__)
    del keys
    specs = {}
    for name in order:
        v = expected[ties.get(name, name)]
        specs[name] = (v.shape, v.dtype)
    return _plan(leaves, virtuals, dropped, _Specs(specs), ties)


def _run(mapping: StateDictMapping, leaves: Sequence[LeafSpec], restore: bool):
    ctx = Context({leaf.name: leaf.label for leaf in leaves}, restore)
    ctx.keys = {leaf.name: leaf.key for leaf in leaves if leaf.key is not None}
    virtuals = []
    for leaf in leaves:
        if len(leaf.name) > MAX_NAME:  # never matched against a rule
            ctx.problem(
                f"Leaf `{leaf.name[:60]}...` has a name of {len(leaf.name)} "
                f"characters, more than the {MAX_NAME} a mapping may match.",
                "Give dict keys in the tree shorter names.",
            )
            continue
        box = whole(leaf.shape)
        piece = Piece(leaf.name, box, leaf.name, box, tuple(range(len(box))))
        virtuals.append(
            Virtual(leaf.name, leaf.shape, leaf.dtype, (piece,), (leaf.name,))
        )
    for i, rule in enumerate(mapping.rules):
        ctx.at(i, rule)
        virtuals = _unique(rule.apply(virtuals, ctx), ctx)
    return virtuals, ctx


def _unique(virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
    """Names two virtuals would share, each a problem; the first is kept."""
    names = {v.name for v in virtuals}
    if len(names) == len(virtuals) and max(map(len, names), default=0) <= MAX_NAME:
        return virtuals  # the usual case, told at once
    first: dict[str, Virtual] = {}
    out = []
    for v in virtuals:
        other = first.get(v.name)
        if len(v.name) > MAX_NAME:
            ctx.problem(
                f"{ctx.at_rule()} makes a name of {len(v.name)} characters "
                f"(`{v.name[:60]}...`, {ctx.origin(v)}), more than the {MAX_NAME} "
                "allowed."
            )
        elif other is None:
            first[v.name] = v
            out.append(v)
        else:
            ctx.problem(
                f"{ctx.origin(other).capitalize()} and {ctx.origin(v)} both become "
                f"`{v.name}` at {ctx.at_rule()}.",
                "Give every tensor its own name: a rename or split that makes one "
                "name twice needs another name for one of them.",
            )
    return out


def _ties(mapping, expected, ctx: Context) -> list[Tie]:
    ties = [r for r in mapping.rules if isinstance(r, Tie)]
    for tie in ties:
        shown = label(tie)
        if tie.to not in expected:
            ctx.problem(
                f"`{tie.to}`, to which `{shown}` ties `{tie.tensor}`, is no "
                f"tensor the mapping makes (they look like {examples(expected)}).",
                _FIX_TIE,
            )
        if tie.tensor in expected:
            ctx.problem(
                f"`{tie.tensor}`, which `{shown}` ties to `{tie.to}`, is also "
                f"made from {ctx.origin(expected[tie.tensor])}.",
                _FIX_TIE,
            )
    return ties


_FIX_TIE = (
    "Tie a tensor that no leaf makes to one that a leaf makes, of the same shape "
    'and dtype (`.tie("lm_head.weight", "wte.weight")`).'
)


def _coverage(leaves, virtuals, ctx: Context, load: bool) -> dict[str, LeafSpec]:
    """Leaves the mapping leaves out; on a load, one left out in part is a
    problem."""
    covered = {leaf.name: 0 for leaf in leaves}
    for v in virtuals:
        for p in v.pieces:
            covered[p.leaf] += size(p.leaf_box)
    dropped = {}
    for leaf in leaves:
        total = math.prod(leaf.shape)
        if covered[leaf.name] == 0 and total:
            dropped[leaf.name] = leaf
        elif covered[leaf.name] != total and load:
            held = [v.name for v in ctx.dropped if leaf.name in v.leaves]
            ctx.problem(
                f"Leaf {leaf.label} is left out in part by the mapping (as "
                f"{examples(held)}): a load would fill only part of it.",
                "Drop whole leaves only (`drop` every tensor they make, or none).",
            )
    return dropped


def _plan(leaves, virtuals, dropped, tensors, ties) -> Plan:
    by_tensor: dict[str, Piece | tuple[Piece, ...]] = {}
    by_leaf: dict[str, list[Piece]] = {
        leaf.name: [] for leaf in leaves if leaf.name not in dropped
    }
    for v in virtuals:
        name = v.name
        held = v.held
        # (A million layers are a million of these: a new piece only where a
        # rule renamed the tensor after making it.)
        if isinstance(held, Piece):
            if held.tensor != name:
                held = Piece(held.leaf, held.leaf_box, name, held.tensor_box, held.perm)
            by_tensor[name] = held
            by_leaf[held.leaf].append(held)
            continue
        pieces = tuple(p._replace(tensor=name) for p in v.pieces)
        by_tensor[name] = pieces
        for p in pieces:
            by_leaf[p.leaf].append(p)
    for copy, source in ties.items():  # a copy: its source's pieces
        copied = by_tensor[source]
        by_tensor[copy] = (
            copied._replace(tensor=copy)
            if isinstance(copied, Piece)
            else tuple(p._replace(tensor=copy) for p in copied)
        )
    return Plan(
        {leaf.name: leaf for leaf in leaves if leaf.name not in dropped},
        tensors,
        by_leaf,
        by_tensor,
        dropped,
        dict(ties),
    )

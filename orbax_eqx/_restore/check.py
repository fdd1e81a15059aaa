"""Compares a skeleton with a checkpoint's sidecar, before any array is read:
every difference collected first (`compare`, as `Difference`s), then worded
at once, by leaf path (`judge`: an error, a warning, or nothing; a fix is
offered only when it works for every difference listed).
"""

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import jax

from .._errors import CheckpointMismatchError, OrbaxEqxWarning, bullet_list, warn_user
from .._format.sidecar import Metadata
from .._mapping.stage import Problem
from .._mapping.wording import closest
from .._tree.names import label
from .._tree.values import SCALAR_TYPES, describe, encode, scalar_type
from .._tree.walk import (
    ARRAY,
    CALLABLE,
    JAX,
    OBJECT,
    SCALAR,
    SHARED,
    Leaf,
    Walked,
    is_key_dtype,
)
from . import wide
from .classes import explain
from .select import suggest_prefix

StaticPolicy = Literal["error", "warn"]

FIX_INSPECT = (
    "If you changed hyperparameters, rebuild the skeleton with the saved ones "
    "(see `python -m orbax_eqx inspect {where}`)."
)
FIX_KIND = (
    "Give each such skeleton leaf the kind the checkpoint holds there: a Python "
    "value of the saved type for a Python value (any value: the saved one is "
    "restored), an array of the saved shape and dtype for an array (see `python -m "
    "orbax_eqx inspect {where}`)."
)
FIX_KEY = (
    "PRNG keys are never cast: build those skeleton leaves with the saved key "
    'type, e.g. `jax.random.key(0, impl="rbg")` for key<rbg> (key<fry> is the '
    "default, threefry2x32)."
)
FIX_NONE = (
    "The skeleton has None where the checkpoint has arrays: a skeleton needs each "
    "array's shape and dtype. Pass the whole model, or "
    "`eqx.filter_eval_shape(make_model, key)`, not the static half of "
    "`eqx.partition(model, eqx.is_array)`."
)
FIX_FILTERED = (
    "The checkpoint looks like `eqx.filter(model, eqx.is_array)` of this "
    "skeleton: it holds None wherever the skeleton has a value that is no array "
    "(a callable, a Python value). Restore its arrays into the skeleton's arrays, "
    "then put the rest back: `arrays, rest = eqx.partition(skeleton, lambda x: "
    "eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))`, then "
    "`model = eqx.combine(oeqx.restore(path, arrays), rest)` (under a manager, "
    "`args=oeqx.EqxRestore(arrays)`)."
)
FIX_CAST = "To cast arrays to the skeleton's dtypes, pass `EqxRestore(..., cast=True)`."
FIX_STATIC = (
    "To restore into the skeleton as it is (the same class under another module "
    "name, a deliberate change of a static field or callable), pass "
    '`EqxRestore(..., on_static_mismatch="warn")`: the skeleton\'s classes, static '
    "fields and callables are kept."
)
FIX_STRICT = (
    "To leave out checkpoint leaves that the skeleton lacks, pass "
    "`EqxRestore(..., strict=False)`; to restore one part of the checkpoint, give "
    "a skeleton of that part and its leaf name as `prefix=` (e.g. "
    '`prefix="model.encoder"`).'
)
FIX_PREFIX = (
    "The skeleton matches the checkpoint's leaves under a prefix: pass "
    "`EqxRestore(..., prefix={prefix})`."
)
FIX_MISSING = (
    "The skeleton has leaves that the checkpoint never saved: build the skeleton "
    "of the model that was saved, map renamed leaves with `renames=`, or, to keep "
    "the skeleton's own values for new leaves (a fresh head for fine-tuning), "
    'pass `EqxRestore(..., missing="keep")`.'
)
FIX_ABSTRACT = (
    "A leaf kept from the skeleton needs a value: build those parts of the "
    "skeleton as concrete arrays (e.g. with a real key instead of "
    "`eqx.filter_eval_shape`), or map a checkpoint leaf to them with `renames=`."
)
FIX_WIDE = wide.FIX
FIX_EVAL_SHAPE = wide.FIX_EVAL_SHAPE
# Fixes of differences that only a new skeleton mends: while one of those is
# listed, no option makes the restore work, so `on_static_mismatch="warn"` is
# not offered.
_REBUILD = (FIX_INSPECT, FIX_KIND, FIX_KEY, FIX_NONE, FIX_FILTERED, FIX_ABSTRACT)


Difference = Problem  # (text, fixes, static, kind), as the planner's


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a check says: an error to raise, a warning to give, or neither."""

    error: str | None = None
    warning: str | None = None


def judge(
    differences: Sequence[Difference],
    where: str,
    policy: StaticPolicy,
    prefix: str | None = None,
) -> Verdict:
    """The message for `differences` of the checkpoint at `where`; `prefix`, a
    leaf name under which the skeleton matches, is offered first."""
    errors = [d for d in differences if not d.static or policy == "error"]
    statics = [d.text for d in differences if d.static]
    if not errors:
        if statics:  # under "warn" only: else they would be errors
            return Verdict(warning=_message(statics, where, [], "restoring anyway"))
        return Verdict()
    fixes = _fixes(differences, errors, prefix)
    texts = [d.text for d in errors if not d.static] + [
        d.text for d in errors if d.static
    ]
    return Verdict(error=_message(texts, where, [f.format(where=where) for f in fixes]))


def _fixes(differences, errors, prefix) -> list[str]:
    """The fixes to offer, in the order their differences were found."""
    fixes = [f for d in differences for f in d.fixes if f is not FIX_STATIC]
    if prefix is not None:  # then the skeleton is fine as it is
        literal = repr(prefix) if "\\" in prefix else f'"{prefix}"'
        braced = literal.replace("{", "{{").replace("}", "}}")
        fixes = [FIX_PREFIX.replace("{prefix}", braced)] + [
            f for f in fixes if f is not FIX_MISSING
        ]
    if _static_fix(errors):
        fixes.append(FIX_STATIC)
    fixes = list(dict.fromkeys(fixes))
    if FIX_FILTERED in fixes and len(fixes) > 1:  # then no filter explains it
        fixes[fixes.index(FIX_FILTERED)] = FIX_KIND
        fixes = list(dict.fromkeys(fixes))
    return fixes


def _static_fix(errors) -> bool:
    """Whether static fields differ and no other error's fix (a rebuild of
    the skeleton) fixes them too."""
    rebuild = any(f in _REBUILD for d in errors if not d.static for f in d.fixes)
    return any(d.static for d in errors) and not rebuild


def _message(problems, where, fixes, verdict=None) -> str:
    n = len(problems)
    head = (
        f"The skeleton does not match the checkpoint at {where} "
        f"({n} difference{'s' if n != 1 else ''}"
        + (f"; {verdict}" if verdict else "")
        + "):"
    )
    return "\n".join([head, bullet_list(problems), *fixes])


MissingPolicy = Literal["error", "keep"]
MovedPolicy = Literal["warn", "error", "ignore"]


def check_place(directory, saved: Metadata, on_moved: MovedPolicy) -> None:
    """Warns (or raises `CheckpointMismatchError`) if `directory` is another
    step directory or item than the one the sidecar says a manager saved it
    as: a step copied over another, or items swapped, would restore the wrong
    values silently."""
    if saved.saved_as is None or on_moved == "ignore":
        return
    here = (directory.parent.name, directory.name)
    if here == saved.saved_as:
        return
    (step, item), (step_here, item_here) = saved.saved_as, here
    text = (
        f"The checkpoint at {directory} was saved as step {step}, item "
        f"'{item}', but is restored from step {step_here}, item '{item_here}': "
        "the step directory was copied or renamed, or items swapped."
    )
    if on_moved == "error":
        raise CheckpointMismatchError(
            f"{text} Restore the step and item it was saved as, or pass "
            '`on_moved="warn"` to restore it from here anyway.'
        )
    warn_user(
        f'{text} If it was moved on purpose, pass `on_moved="ignore"`; '
        '`on_moved="error"` makes this an error.',
        OrbaxEqxWarning,
    )


class StaticMismatchWarning(OrbaxEqxWarning):
    """Static fields, callables or classes differ, and the user chose to go on."""


def check(
    walked: Walked,
    saved: Metadata,
    *,
    cast: bool,
    strict: bool,
    on_static_mismatch: StaticPolicy,
    missing: MissingPolicy = "error",
    target: Callable[[str], str] | None = None,
    planned: Collection[str] = (),
) -> list[Leaf]:
    """Raises `CheckpointMismatchError` listing every difference; returns the
    skeleton leaves to keep as they are (`missing="keep"`). `saved` is keyed
    by `target(skeleton name)`; leaves whose target is in `planned` were
    checked by a mapping's plan."""
    differences, kept = compare(
        walked,
        saved,
        cast=cast,
        strict=strict,
        missing=missing,
        target=target,
        planned=planned,
    )
    prefix = None
    kinds = {d.kind for d in differences}
    if {"absent", "unexpected"} <= kinds and target is None:
        prefix = suggest_prefix(walked, list(saved.leaves))
    verdict = judge(differences, saved.directory, on_static_mismatch, prefix)
    if verdict.warning is not None:
        warn_user(verdict.warning, StaticMismatchWarning)
    if verdict.error is not None:
        raise CheckpointMismatchError(verdict.error)
    return kept


def compare(
    walked: Walked,
    saved: Metadata,
    *,
    cast: bool,
    strict: bool,
    missing: MissingPolicy,
    target: Callable[[str], str] | None,
    planned: Collection[str] = (),
) -> tuple[list[Difference], list[Leaf]]:
    """Every difference of `walked` from `saved`: leaves in order, then the
    checkpoint's leaves the skeleton lacks (if `strict`), then modules; and the
    skeleton leaves to keep (`missing="keep"`)."""
    differences, kept, absent, names = _compare_leaves(
        walked, saved.leaves, cast, missing, target, planned
    )
    unexpected = [r for n, r in saved.leaves.items() if n not in names]
    paired = _absent_all(absent, unexpected if strict else [], missing, differences)
    if strict:
        for record in unexpected:
            if record.name in paired:
                continue
            text = f"Leaf {label(record.name, record.path)} is in the checkpoint but "
            text += "not in the skeleton."
            differences.append(Difference(text, (FIX_STRICT,), kind="unexpected"))
    target = target or _same
    for name, module in walked.modules.items():
        differences.extend(
            compare_module(name, module, saved.modules.get(target(name)))
        )
    return differences, kept


def _compare_leaves(walked, records, cast, missing, target, planned):
    """`compare`'s differences of the skeleton's leaves from their records;
    the leaves to keep; those the checkpoint lacks, with the names looked
    for; and the names of the records compared or `planned`."""
    differences: list[Difference] = []
    kept: list[Leaf] = []
    absent: list[tuple[Leaf, str]] = []
    names = set(planned)
    for leaf in walked.leaves:
        # (No call per leaf where no `prefix=` or `renames=` renames them.)
        name = leaf.name if target is None else target(leaf.name)
        if name in planned:
            continue
        names.add(name)
        record = records.get(name)
        if record is None:
            if missing == "keep" and not isinstance(leaf.value, jax.ShapeDtypeStruct):
                kept.append(leaf)
            else:
                absent.append((leaf, name))
            continue
        found = _compare_leaf(leaf, record, cast)
        if found is not None:
            differences.append(found)
    return differences, kept, absent, names


def _same(name: str) -> str:
    return name


def _absent_all(absent, unexpected, missing, differences) -> set[str]:
    """The skeleton leaves the checkpoint lacks, each paired with a checkpoint
    leaf of its shape and dtype that the skeleton lacks, if there is one;
    returns the checkpoint leaves so paired."""
    paired: set[str] = set()
    records = {r.name: r for r in unexpected if r.kind == ARRAY}
    for leaf, name in absent:
        x = leaf.value
        alike = [
            n
            for n, r in records.items()
            if leaf.kind == ARRAY
            and r.shape == tuple(x.shape)
            and r.dtype == str(x.dtype)
        ]
        guess = closest(name, alike, paired)
        shown = None if guess is None else label(guess, records[guess].path)
        differences.append(_absent(leaf, name, missing, shown))
    return paired


def _absent(leaf: Leaf, name: str, missing: MissingPolicy, guess) -> Difference:
    """A skeleton leaf that the checkpoint lacks, and that cannot be kept."""
    sought = f" (looked for leaf name `{name}`)" if name != leaf.name else ""
    where = f"Leaf {leaf.label} is in the skeleton but not in the checkpoint{sought}"
    if guess is not None:
        where += (
            f"; did you mean the checkpoint's {guess}, of that shape and dtype, "
            "which the skeleton lacks? (map it with `renames=`)"
        )
    if missing == "keep":  # then a jax.ShapeDtypeStruct: nothing to keep
        return Difference(
            f"{where}, and is a jax.ShapeDtypeStruct: it has no value to keep "
            'with `missing="keep"`.',
            (FIX_ABSTRACT,),
        )
    return Difference(f"{where}.", (FIX_MISSING,), kind="absent")


def compare_module(
    name: str, module, other, stored: str = "the checkpoint"
) -> list[Difference]:
    """A skeleton module against its record (in `stored`: a checkpoint's
    sidecar, or what `export_safetensors` wrote in its files): its class, then
    its static fields."""
    if other is None or (module.cls == other.cls and module.static == other.static):
        return []  # the usual case, decided without describing every field
    where = label(name, module.path)
    found = []
    if module.cls != other.cls:
        found.append(
            Difference(
                f"Module {where} is `{module.cls}` in the skeleton but `{other.cls}` "
                f"in {stored}{explain(module.cls, other.cls, stored)}.",
                static=True,
            )
        )
    for field in sorted(set(module.static) | set(other.static)):
        mine = _describe_field(module.static, field)
        theirs = _describe_field(other.static, field)
        if mine != theirs:
            found.append(
                Difference(
                    f"Static field `{field}` of module {where} is {mine} in the "
                    f"skeleton but {theirs} in {stored}.",
                    (FIX_INSPECT,),
                    static=True,
                )
            )
    return found


def _describe_field(static: dict, field: str) -> str:
    if field not in static:
        return "absent"
    return describe(static[field])


_DTYPE_NAMES: dict = {}  # dtype -> str(dtype): numpy's `__str__` is slow


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype)
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dtype] = name
    return name


def _compare_leaf(leaf: Leaf, record, cast: bool) -> Difference | None:
    """One leaf against its record."""
    if leaf.kind == ARRAY and record.kind == ARRAY:
        # The common case first, without building the leaf's label.
        x = leaf.value
        if (
            tuple(x.shape) == record.shape
            and _dtype_name(x.dtype) == record.dtype
            and wide.wanted_container(x, record) is not None
        ):
            return None
    where = f"Leaf {leaf.label}"
    if record.name != leaf.name:  # found through `prefix=` or `renames=`
        where += f" (checkpoint leaf `{record.name}`)"
    if leaf.kind != record.kind:
        return _other_kind(where, leaf, record)
    if leaf.kind == ARRAY:
        return _compare_array(where, leaf.value, record, cast)
    if leaf.kind == SCALAR:
        mine = SCALAR_TYPES[type(leaf.value)]
        theirs = scalar_type(record.value)
        if mine == theirs:
            return None
        return Difference(
            f"{where} is a Python {mine} in the skeleton but a Python {theirs} in "
            "the checkpoint.",
            (FIX_KIND,),
        )
    if leaf.kind in (CALLABLE, OBJECT):
        return _compare_callable(where, leaf, record)
    return None


def _other_kind(where: str, leaf: Leaf, record) -> Difference:
    # A None for an array is a filtered skeleton far more often than a change of
    # hyperparameters.
    none = leaf.kind == SCALAR and leaf.value is None and record.kind == ARRAY
    # ... and a None for a callable or Python value, a checkpoint of
    # `eqx.filter(model, eqx.is_array)` (see `FIX_FILTERED`).
    filtered = record.kind == SCALAR and record.value is None and leaf.kind != ARRAY
    return Difference(
        f"{where} is {_describe_mine(leaf)} in the skeleton but "
        f"{record.describe()} in the checkpoint.",
        (FIX_NONE,) if none else (FIX_FILTERED,) if filtered else (FIX_KIND,),
    )


def _compare_array(where: str, x, record, cast: bool) -> Difference | None:
    shape = tuple(x.shape)
    if shape != record.shape:
        return Difference(
            f"{where} has shape {shape} in the skeleton but {record.shape} in the "
            "checkpoint.",
            (FIX_INSPECT,),
        )
    dtype = str(x.dtype)
    if dtype != record.dtype and (
        is_key_dtype(x.dtype) or record.dtype.startswith("key<")
    ):
        return Difference(
            f"{where} has dtype {dtype} in the skeleton but {record.dtype} in the "
            "checkpoint.",
            (FIX_KEY,),
        )
    if wide.wanted_container(x, record) is None:
        return _too_wide(where, dtype, record)
    if dtype == record.dtype or cast:
        return None
    theirs: str = record.dtype
    fixes: tuple[str, ...] = (FIX_CAST,)
    if wide.narrowed_stand_in(x.dtype, record.dtype):
        fixes = (FIX_CAST, FIX_EVAL_SHAPE)
        if record.container != JAX:  # else only x64 restores it as it was
            theirs = f"{record.dtype} (a numpy array)"
    return Difference(
        f"{where} has dtype {dtype} in the skeleton but {theirs} in the checkpoint.",
        fixes,
    )


def _compare_callable(where: str, leaf: Leaf, record) -> Difference | None:
    mine = encode(leaf.value)
    if mine == record.value:
        return None
    moved = ""
    if isinstance(mine, dict) and isinstance(record.value, dict):
        a, b = mine.get("callable"), record.value.get("callable")
        if isinstance(a, str) and isinstance(b, str):
            moved = explain(a, b)
    return Difference(
        f"{where} is {leaf.kind} {describe(mine)} in the skeleton but "
        f"{describe(record.value)} in the checkpoint{moved}.",
        (FIX_STATIC,) if moved else (FIX_STATIC, FIX_INSPECT),
        static=True,
    )


def _too_wide(where: str, dtype: str, record) -> Difference:
    """A skeleton leaf that asks for a 64-bit jax array while x64 is off."""
    saved = "a jax" if record.container == JAX else "a numpy"
    return Difference(
        f"{where} is a {dtype} jax.ShapeDtypeStruct in the skeleton, and {saved} "
        f"{record.dtype} array in the checkpoint, but JAX makes no {dtype} "
        "arrays while `jax_enable_x64` is off (it would narrow them).",
        (FIX_WIDE,),
    )


def _describe_mine(leaf: Leaf) -> str:
    x = leaf.value
    if leaf.kind == ARRAY:
        return f"array {x.dtype}{list(x.shape)}"
    if leaf.kind == SCALAR:
        return "None" if x is None else f"{SCALAR_TYPES[type(x)]} {x!r}"
    if leaf.kind == SHARED:
        return "shared-node marker"
    return f"{leaf.kind} {describe(encode(x))}"

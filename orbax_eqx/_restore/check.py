"""Compares a skeleton with a checkpoint's sidecar, before any array is read.

Every difference is collected and reported at once, by leaf path.
"""

import warnings
from collections.abc import Callable
from typing import Literal

import jax

from .._errors import CheckpointMismatchError, bullet_list
from .._format.sidecar import Metadata
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
MissingPolicy = Literal["error", "keep"]


class StaticMismatchWarning(UserWarning):
    """Static fields, callables or classes differ, and the user chose to go on."""


_FIX_INSPECT = (
    "If you changed hyperparameters, rebuild the skeleton with the saved ones "
    "(see `python -m orbax_eqx inspect {where}`)."
)
_FIX_KIND = (
    "Give each such skeleton leaf the kind the checkpoint holds there: a Python "
    "value of the saved type for a Python value (any value: the saved one is "
    "restored), an array of the saved shape and dtype for an array (see `python -m "
    "orbax_eqx inspect {where}`)."
)
_FIX_KEY = (
    "PRNG keys are never cast: build those skeleton leaves with the saved key "
    'type, e.g. `jax.random.key(0, impl="rbg")` for key<rbg> (key<fry> is the '
    "default, threefry2x32)."
)
_FIX_NONE = (
    "The skeleton has None where the checkpoint has arrays: a skeleton needs each "
    "array's shape and dtype. Pass the whole model, or "
    "`eqx.filter_eval_shape(make_model, key)`, not the static half of "
    "`eqx.partition(model, eqx.is_array)`."
)
_FIX_FILTERED = (
    "The checkpoint looks like `eqx.filter(model, eqx.is_array)` of this "
    "skeleton: it holds None wherever the skeleton has a value that is no array "
    "(a callable, a Python value). Restore its arrays into the skeleton's arrays, "
    "then put the rest back: `arrays, rest = eqx.partition(skeleton, lambda x: "
    "eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))`, then "
    "`model = eqx.combine(oeqx.restore(path, arrays), rest)` (under a manager, "
    "`args=oeqx.EqxRestore(arrays)`)."
)
_FIX_CAST = (
    "To cast arrays to the skeleton's dtypes, pass `EqxRestore(..., cast=True)`."
)
_FIX_STATIC = (
    "To restore into the skeleton as it is (the same class under another module "
    "name, a deliberate change of a static field or callable), pass "
    '`EqxRestore(..., on_static_mismatch="warn")`: the skeleton\'s classes, static '
    "fields and callables are kept."
)
_FIX_STRICT = (
    "To leave out checkpoint leaves that the skeleton lacks, pass "
    "`EqxRestore(..., strict=False)`; to restore one part of the checkpoint, give "
    "a skeleton of that part and its leaf name as `prefix=` (e.g. "
    '`prefix="model.encoder"`).'
)
_FIX_PREFIX = (
    "The skeleton matches the checkpoint's leaves under a prefix: pass "
    "`EqxRestore(..., prefix={prefix})`."
)
_FIX_MISSING = (
    "The skeleton has leaves that the checkpoint never saved: build the skeleton "
    "of the model that was saved, map renamed leaves with `renames=`, or, to keep "
    "the skeleton's own values for new leaves (a fresh head for fine-tuning), "
    'pass `EqxRestore(..., missing="keep")`.'
)
_FIX_ABSTRACT = (
    "A leaf kept from the skeleton needs a value: build those parts of the "
    "skeleton as concrete arrays (e.g. with a real key instead of "
    "`eqx.filter_eval_shape`), or map a checkpoint leaf to them with `renames=`."
)
# Fixes of differences that only a new skeleton mends: while one of those is
# listed, no option makes the restore work, so `on_static_mismatch="warn"` is
# not offered.
_REBUILD = (_FIX_INSPECT, _FIX_KIND, _FIX_KEY, _FIX_NONE, _FIX_FILTERED)


def check(
    walked: Walked,
    saved: Metadata,
    *,
    cast: bool,
    strict: bool,
    on_static_mismatch: StaticPolicy,
    missing: MissingPolicy = "error",
    target: Callable[[str], str] | None = None,
) -> list[Leaf]:
    """Raises `CheckpointMismatchError` listing every difference.

    `saved.leaves` and `saved.modules` are keyed by the name `target(skeleton
    name)` (`select.Selection`). Returns the skeleton leaves to keep as they
    are: those that the checkpoint lacks, with `missing="keep"`.

    Each fix offered is one that works: `on_static_mismatch="warn"` only when
    no difference that needs a new skeleton (a shape, a kind) is listed.
    """
    target = target or _same
    errors: list[str] = []
    statics: list[str] = []
    fixes: list[str] = []

    def fix(text: str) -> None:
        if text not in fixes:
            fixes.append(text)

    rebuild = False  # whether only a new skeleton mends some difference
    names = set()
    kept: list[Leaf] = []
    absent: list[Leaf] = []
    for leaf in walked.leaves:
        name = target(leaf.name)
        names.add(name)
        record = saved.leaves.get(name)
        if record is None:
            sought = f" (looked for leaf name `{name}`)" if name != leaf.name else ""
            abstract = isinstance(leaf.value, jax.ShapeDtypeStruct)
            if missing == "keep" and not abstract:
                kept.append(leaf)
            elif missing == "keep":
                errors.append(
                    f"Leaf {leaf.label} is in the skeleton but not in the "
                    f"checkpoint{sought}, and is a jax.ShapeDtypeStruct: it has no "
                    'value to keep with `missing="keep"`.'
                )
                fix(_FIX_ABSTRACT)
                rebuild = True
            else:
                errors.append(
                    f"Leaf {leaf.label} is in the skeleton but not in the "
                    f"checkpoint{sought}."
                )
                absent.append(leaf)
                fix(_FIX_MISSING)
            continue
        problem, fixers = _compare_leaf(leaf, record, cast)
        if problem is None:
            continue
        if _FIX_STATIC in fixers:
            statics.append(problem)
        else:
            errors.append(problem)
            rebuild = rebuild or any(text in _REBUILD for text in fixers)
        for text in fixers:
            if text is not _FIX_STATIC:
                fix(text)
    if strict:
        unexpected = [(n, r) for n, r in saved.leaves.items() if n not in names]
        for name, record in unexpected:
            renamed = f" (renamed to `{name}`)" if name != record.name else ""
            errors.append(
                f"Leaf {label(record.name, record.path)}{renamed} is in the "
                "checkpoint but not in the skeleton."
            )
        if unexpected:
            if absent and target is _same:
                found = suggest_prefix(walked, list(saved.leaves))
                if found is not None:  # then the skeleton is fine as it is
                    literal = repr(found) if "\\" in found else f'"{found}"'
                    braced = literal.replace("{", "{{").replace("}", "}}")
                    fixes.remove(_FIX_MISSING)
                    fixes.insert(0, _FIX_PREFIX.replace("{prefix}", braced))
            fix(_FIX_STRICT)
    for name, module in walked.modules.items():
        other = saved.modules.get(target(name))
        if other is None or (module.cls == other.cls and module.static == other.static):
            continue  # the usual case, decided without describing every field
        if module.cls != other.cls:
            statics.append(
                f"Module {label(name, module.path)} is `{module.cls}` in the skeleton "
                f"but `{other.cls}` in the checkpoint{explain(module.cls, other.cls)}."
            )
        for field in sorted(set(module.static) | set(other.static)):
            mine = _describe_field(module.static, field)
            theirs = _describe_field(other.static, field)
            if mine != theirs:
                statics.append(
                    f"Static field `{field}` of module {label(name, module.path)} is "
                    f"{mine} in the skeleton but {theirs} in the checkpoint."
                )
                fix(_FIX_INSPECT)
    if statics and on_static_mismatch == "warn":
        if not errors:  # else nothing is restored, and the errors say why
            warnings.warn(
                _message(statics, saved.directory, [], "restoring anyway"),
                StaticMismatchWarning,
                stacklevel=4,
            )
    elif statics:
        errors.extend(statics)
        if not rebuild:
            fix(_FIX_STATIC)
    if _FIX_FILTERED in fixes and len(fixes) > 1:  # then no filter explains it
        fixes[fixes.index(_FIX_FILTERED)] = _FIX_KIND
        fixes = list(dict.fromkeys(fixes))
    if errors:
        fixes = [f.format(where=saved.directory) for f in fixes]
        raise CheckpointMismatchError(_message(errors, saved.directory, fixes))
    return kept


def _same(name: str) -> str:
    return name


def _message(problems, where, fixes, verdict=None) -> str:
    n = len(problems)
    head = (
        f"The skeleton does not match the checkpoint at {where} "
        f"({n} difference{'s' if n != 1 else ''}"
        + (f"; {verdict}" if verdict else "")
        + "):"
    )
    return "\n".join([head, bullet_list(problems), *fixes])


def _describe_field(static: dict, field: str) -> str:
    if field not in static:
        return "absent"
    return describe(static[field])


def _compare_leaf(leaf: Leaf, record, cast: bool):
    """One leaf against its record: (problem or None, the fixes to suggest)."""
    where = f"Leaf {leaf.label}"
    if record.name != leaf.name:  # found through `prefix=` or `renames=`
        where += f" (checkpoint leaf `{record.name}`)"
    if leaf.kind != record.kind:
        # A None for an array is a filtered skeleton far more often than a change
        # of hyperparameters.
        none = leaf.kind == SCALAR and leaf.value is None and record.kind == ARRAY
        # ... and a None for a callable or Python value, a checkpoint of
        # `eqx.filter(model, eqx.is_array)` (see `_FIX_FILTERED`).
        filtered = record.kind == SCALAR and record.value is None and leaf.kind != ARRAY
        return (
            f"{where} is {_describe_mine(leaf)} in the skeleton but "
            f"{record.describe()} in the checkpoint.",
            (_FIX_NONE,) if none else (_FIX_FILTERED,) if filtered else (_FIX_KIND,),
        )
    if leaf.kind == ARRAY:
        shape = tuple(leaf.value.shape)
        if shape != record.shape:
            return (
                f"{where} has shape {shape} in the skeleton but {record.shape} "
                "in the checkpoint.",
                (_FIX_INSPECT,),
            )
        dtype = str(leaf.value.dtype)
        if dtype != record.dtype:
            keys = is_key_dtype(leaf.value.dtype) or record.dtype.startswith("key<")
            if keys:
                return (
                    f"{where} has dtype {dtype} in the skeleton but {record.dtype} "
                    "in the checkpoint.",
                    (_FIX_KEY,),
                )
            if wide.wanted_container(leaf.value, record) is None:
                return _too_wide(where, dtype, record)
            if cast:
                return None, ()
            theirs, fixers = record.dtype, (_FIX_CAST,)
            if wide.narrowed_stand_in(leaf.value.dtype, record.dtype):
                fixers = (_FIX_CAST, wide.FIX_EVAL_SHAPE)
                if record.container != JAX:  # else only x64 restores it as it was
                    theirs = f"{record.dtype} (a numpy array)"
            return (
                f"{where} has dtype {dtype} in the skeleton but {theirs} in the "
                "checkpoint.",
                fixers,
            )
        if wide.wanted_container(leaf.value, record) is None:
            return _too_wide(where, dtype, record)
        return None, ()
    if leaf.kind == SCALAR:
        mine = SCALAR_TYPES[type(leaf.value)]
        theirs = scalar_type(record.value)
        if mine != theirs:
            return (
                f"{where} is a Python {mine} in the skeleton but a Python "
                f"{theirs} in the checkpoint.",
                (_FIX_KIND,),
            )
        return None, ()
    if leaf.kind in (CALLABLE, OBJECT):
        mine = encode(leaf.value)
        if mine != record.value:
            moved = ""
            if isinstance(mine, dict) and isinstance(record.value, dict):
                a, b = mine.get("callable"), record.value.get("callable")
                if isinstance(a, str) and isinstance(b, str):
                    moved = explain(a, b)
            return (
                f"{where} is {leaf.kind} {describe(mine)} in the skeleton but "
                f"{describe(record.value)} in the checkpoint{moved}.",
                (_FIX_STATIC,) if moved else (_FIX_STATIC, _FIX_INSPECT),
            )
    return None, ()


def _too_wide(where: str, dtype: str, record):
    """A skeleton leaf that asks for a 64-bit jax array while x64 is off."""
    saved = "a jax" if record.container == JAX else "a numpy"
    return (
        f"{where} is a {dtype} jax.ShapeDtypeStruct in the skeleton, and {saved} "
        f"{record.dtype} array in the checkpoint, but JAX makes no {dtype} "
        "arrays while `jax_enable_x64` is off (it would narrow them).",
        (wide.FIX,),
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

"""How the differences between a skeleton and a checkpoint are worded.

`check` collects `Difference`s; `judge` (pure: no I/O, no warnings) turns them
into what to say: an error, a warning, or nothing. Each difference names the
fixes that mend it (texts of this module's table); a fix is offered only when
it works for every listed difference.
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal

from .._errors import bullet_list
from .._mapping.stage import Problem
from . import wide

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


# One difference: the wording layer's problem (text, fixes, static, kind).
Difference = Problem


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
    """The message for `differences` of the checkpoint at `where`.

    `prefix` is a leaf name under which the skeleton matches the checkpoint's
    leaves: offered first, instead of `FIX_MISSING`.
    """
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
    rebuild = any(f in _REBUILD for d in errors if not d.static for f in d.fixes)
    if any(d.static for d in errors) and not rebuild:
        fixes.append(FIX_STATIC)
    fixes = list(dict.fromkeys(fixes))
    if FIX_FILTERED in fixes and len(fixes) > 1:  # then no filter explains it
        fixes[fixes.index(FIX_FILTERED)] = FIX_KIND
        fixes = list(dict.fromkeys(fixes))
    return fixes


def _message(problems, where, fixes, verdict=None) -> str:
    n = len(problems)
    head = (
        f"The skeleton does not match the checkpoint at {where} "
        f"({n} difference{'s' if n != 1 else ''}"
        + (f"; {verdict}" if verdict else "")
        + "):"
    )
    return "\n".join([head, bullet_list(problems), *fixes])

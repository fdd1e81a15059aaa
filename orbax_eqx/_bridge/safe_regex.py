"""Regular expressions from a mapping's JSON, refused where they could run away.

Python's `re` backtracks: a pattern like `(a+)+b` takes exponential time on
a name of a few dozen characters, and `.*a.*a.*a.*a.*a.*b` polynomial time of
a high degree. Patterns come from files anyone may have written, so they are
checked before use: no repetition of anything that itself repeats or
alternates, no backreferences or lookarounds, at most `MAX_REPEATS`
repetitions, at most `MAX_LENGTH` characters. What remains (the
patterns renames are made of: `layers\\.(\\d+)\\.(.*)`) matches a name in time
about linear in its length.
"""

import re
import re._parser as _parser  # the stdlib's own parse of a pattern (3.11+)

MAX_LENGTH = 1024
MAX_REPEATS = 4

_BAD = {
    _parser.GROUPREF: "a backreference",
    _parser.GROUPREF_EXISTS: "a conditional group",
    _parser.ASSERT: "a lookaround",
    _parser.ASSERT_NOT: "a lookaround",
}
_REPEATS = {_parser.MAX_REPEAT, _parser.MIN_REPEAT}
_POSSESSIVE = getattr(_parser, "POSSESSIVE_REPEAT", None)
if _POSSESSIVE is not None:
    _REPEATS.add(_POSSESSIVE)


def compile_safe(pattern: object) -> tuple[re.Pattern | None, str | None]:
    """The compiled pattern, or None and why it is refused."""
    if not isinstance(pattern, str):
        return None, f"is {type(pattern).__name__}, not a string"
    if len(pattern) > MAX_LENGTH:
        return None, (
            f"is {len(pattern)} characters long, more than the {MAX_LENGTH} allowed"
        )
    try:
        compiled = re.compile(pattern)
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return None, f"is not a valid regular expression ({e})"
    counts = [0]
    why = _check(parsed, counts, inside_repeat=False)
    if why is None and counts[0] > MAX_REPEATS:
        why = (
            f"has {counts[0]} repetitions (`*`, `+`, `{{n,m}}`), more than the "
            f"{MAX_REPEATS} allowed"
        )
    return (None, why) if why else (compiled, None)


def _check(items, counts, inside_repeat) -> str | None:
    for op, av in items:
        if op in _BAD:
            return f"has {_BAD[op]}, which renames do not take"
        if op in _REPEATS:
            low, high, sub = av
            many = high is _parser.MAXREPEAT or high > 1
            if many:
                counts[0] += 1
            if many and inside_repeat:
                return "repeats something that itself repeats (like `(a+)+`)"
            if many and _alternates(sub):
                return "repeats a choice of alternatives (like `(a|ab)*`)"
            why = _check(sub, counts, inside_repeat or many)
        elif op is _parser.SUBPATTERN:
            why = _check(av[-1], counts, inside_repeat)
        elif op is _parser.BRANCH:
            why = None
            for branch in av[1]:
                why = why or _check(branch, counts, inside_repeat)
        elif op is getattr(_parser, "ATOMIC_GROUP", None):
            why = _check(av, counts, inside_repeat)
        else:
            why = None
        if why:
            return why
    return None


def _alternates(items) -> bool:
    for op, av in items:
        if op is _parser.BRANCH:
            return True
        if op is _parser.SUBPATTERN and _alternates(av[-1]):
            return True
    return False

"""Reading a rule from JSON: every key and value checked against an allow list.

A mapping's JSON may come from anyone: each rule is an object with an `"op"`
and exactly the keys that op takes, each of the type it must have, numbers
in bounds. Anything else is a `MappingError` naming the rule and the key.
"""

from collections.abc import Mapping
from typing import Any

from .. import templates
from ..errors import MappingError

MAX_RANK = 64  # axes of a tensor, entries of a permutation
MAX_PARTS = 4096  # tensors a split makes or a fuse takes, entries of a rename
MAX_SIZE = 2**62  # a split's part size


def keys(
    data: Any,
    where: str,
    required: set[str],
    optional: frozenset[str] | set[str] = frozenset(),
) -> None:
    if not isinstance(data, Mapping):
        raise MappingError(f"{where} must be a JSON object, not {_kind(data)}.")
    unknown = sorted(set(data) - required - optional - {"op"}, key=str)
    if unknown:
        allowed = ", ".join(f'"{k}"' for k in sorted(required | optional))
        raise MappingError(
            f"{where} has the unknown key {unknown[0]!r}: a `{data.get('op')}` "
            f"rule takes {allowed}."
        )
    missing = sorted(required - set(data))
    if missing:
        raise MappingError(f'{where} lacks the key "{missing[0]}".')


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MappingError(f"{where} must be a string, not {_kind(value)}.")
    if len(value) > templates.MAX_LENGTH:
        raise MappingError(
            f"{where} is {len(value)} characters long, more than the "
            f"{templates.MAX_LENGTH} allowed."
        )
    return value


def integer(value: Any, where: str, low: int, high: int) -> int:
    # `bool` is an `int` in Python, and `true` is no axis.
    if not isinstance(value, int) or isinstance(value, bool):
        raise MappingError(f"{where} must be an integer, not {_kind(value)}.")
    if not low <= value <= high:
        raise MappingError(f"{where} is {value}: it must be from {low} to {high}.")
    return value


def sequence(value: Any, where: str, limit: int = MAX_PARTS) -> list:
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise MappingError(f"{where} must be a list, not {_kind(value)}.")
    value = list(value)
    if len(value) > limit:
        raise MappingError(
            f"{where} has {len(value)} entries, more than the {limit} allowed."
        )
    return value


def strings(value: Any, where: str) -> tuple[str, ...]:
    """One string, or a non-empty list of them."""
    if isinstance(value, str):
        return (string(value, where),)
    items = sequence(value, where)
    if not items:
        raise MappingError(f"{where} is empty: give at least one name.")
    return tuple(string(v, f"{where}[{i}]") for i, v in enumerate(items))


def template(value: Any, where: str, *, wildcards: bool) -> templates.Template:
    try:
        return templates.parse(value, wildcards=wildcards, what=where)
    except templates.TemplateError as e:
        raise MappingError(f"{e}.") from None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value!r}"[:80]
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"

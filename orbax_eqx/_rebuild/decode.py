"""Recorded values made real for a rebuild: static fields, dict keys, `State`
markers, callable leaves, and stand-ins for saved arrays.

Literals are decoded exactly (`_tree/values.py`); classes, callables and
enums are looked up under `allow` (`allow.py`); numpy scalars and dtypes are
checked before anything is made (`values.decode_numpy`); sets of literals
are read back with `ast.literal_eval`, which calls nothing. What a save
writes but a rebuild cannot make is refused (listed in one `RebuildError`);
what no save writes is damage.
"""

import ast
import enum
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._format.sidecar import ALIAS, EMPTY, PACKED, LeafMetadata, Metadata
from .._restore.wide import flat_container
from .._tree.names import label
from .._tree.values import (
    Unrebuildable,
    decode_numpy,
    decode_scalar,
    describe,
    scalar_type,
)
from .._tree.walk import JAX, NUMPY_SCALAR, parse_dtype

# `(leaf name, leaf path)` of a value, or of the dict a key is of.
At = tuple[str, str]


class Decoder:
    """Decodes encoded values, looking names up with `find(at, what, name)`
    (None if refused: `refuse(at, text)` has been told why) and raising
    `damaged(what)` for what no save writes."""

    def __init__(
        self,
        find: Callable[[At, str, str], Any],
        refuse: Callable[[At, str], None],
        damaged: Callable[[str], Exception],
    ):
        self.find = find
        self.refuse = refuse
        self.damaged = damaged

    def value(self, at: At, encoded: Any) -> Any:
        """A static field's value, a dict key, a callable leaf: decoded."""
        if scalar_type(encoded) is not None:
            try:
                return decode_scalar(encoded)
            except (ValueError, TypeError) as e:
                raise self.damaged(
                    f"the value at {label(*at)} is malformed ({e})"
                ) from None
        if not (isinstance(encoded, dict) and len(encoded) >= 1):
            raise self.damaged(f"the value at {label(*at)} is malformed")
        tag, body = next(iter(encoded.items()))
        if tag in ("tuple", "list", "dict") and not isinstance(body, list):
            raise self.damaged(f"the value at {label(*at)} is malformed")
        decode = {
            "tuple": self._tuple,
            "list": self._list,
            "dict": self._dict,
            "numpy": self._numpy,
            "dtype": self._dtype,
            "enum": self._enum,
            "callable": self._callable,
        }.get(tag)
        if decode is not None:
            return decode(at, body)
        if tag == "object" and encoded.get("repr") is not None:
            found = _literal_set(body, encoded["repr"])
            if found is not None:
                return found
        self.refuse(
            at,
            f"an object recorded only as its text `{describe(encoded)}` "
            "cannot be rebuilt",
        )
        return None

    def _numpy(self, at: At, body: Any) -> Any:
        try:
            return decode_numpy(body)
        except Unrebuildable as e:
            self.refuse(at, f"{e} cannot be rebuilt")
            return None
        except ValueError as e:
            raise self.damaged(
                f"the numpy scalar at {label(*at)} is none a save writes: {e}"
            ) from None

    def _tuple(self, at: At, body: list) -> tuple:
        return tuple(self.value(at, v) for v in body)

    def _list(self, at: At, body: list) -> list:
        return [self.value(at, v) for v in body]

    def _callable(self, at: At, body: Any) -> Any:
        text = str(body)
        if text.startswith("functools.partial("):
            self.refuse(
                at,
                f"`{text}` cannot be rebuilt: a partial's arguments are recorded "
                "as text",
            )
            return None
        return self.find(at, "callable", text)

    def key(self, at: At, encoded: Any) -> Any:
        """A dict key or `State` marker: a value that must be hashable."""
        found = self.value(at, encoded)
        try:
            hash(found)
        except TypeError:
            raise self.damaged(
                f"the dict at {label(*at)} has a key {describe(encoded)} that is "
                f"not hashable (a {type(found).__name__}), which no save records"
            ) from None
        return found

    def _dict(self, at: At, body: list) -> dict:
        result = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise self.damaged(f"the value at {label(*at)} is malformed")
            result[self.key(at, pair[0])] = self.value(at, pair[1])
        return result

    def _dtype(self, at: At, body: Any) -> Any:
        text = str(body)
        if text.startswith(("[", "(")):
            self.refuse(at, f"a structured dtype {describe(text)} cannot be rebuilt")
            return None
        try:
            dtype = np.dtype(text)
        except (TypeError, ValueError, OverflowError, MemoryError, SyntaxError):
            raise self.damaged(
                f"the value at {label(*at)} is unknown dtype {text!r}"
            ) from None
        if str(dtype) != text:
            raise self.damaged(
                f"the value at {label(*at)} is dtype {text!r}, which a save "
                f"writes as {str(dtype)!r}"
            )
        return dtype

    def _enum(self, at: At, body: Any) -> Any:
        cls_name, _, member = str(body).rpartition(".")
        cls = self.find(at, "enum", cls_name)
        if cls is None or cls is DRY:
            return None
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            self.refuse(at, f"`{cls_name}` is not an enum")
            return None
        if member not in cls.__members__:
            self.refuse(at, f"enum `{cls_name}` has no member `{member}` now")
            return None
        return cls.__members__[member]


DRY = object()  # what a dry run (importing nothing) finds for a name


def _literal_set(cls_name: Any, text: Any) -> Any:
    """A set or frozenset of literals, from its repr (static fields such as
    lineax's `tags=frozenset()`); None if it is anything else. `literal_eval`
    reads literals only: nothing is called."""
    kinds = {"builtins.frozenset": frozenset, "builtins.set": set}
    kind = kinds.get(cls_name)
    if kind is None or not isinstance(text, str):
        return None
    prefix = "frozenset(" if kind is frozenset else ""
    if text in ("frozenset()", "set()"):
        return kind()
    if not (text.startswith(prefix) and text.endswith(")" if prefix else "}")):
        return None
    inner = text[len(prefix) : len(text) - (1 if prefix else 0)]
    try:
        value = ast.literal_eval(inner)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return kind(value) if isinstance(value, set) else None


_SMALL = 64  # bytes an element of any numeric dtype fits in


def stand_in(saved: Metadata, leaf: LeafMetadata) -> tuple[Any, str | None]:
    """`(stand-in, None)`: a skeleton leaf for a saved array, with its shape
    and dtype and no data, in the container a restore without a skeleton
    gives back (`_restore/wide.py`); or `(None, why not)`. A numpy stand-in
    holds one element, whatever the shape: nothing is allocated for what
    only the record claims (`_orbax.rebuilt` checked that packed leaves'
    bytes are in their files)."""
    dtype = parse_dtype(leaf.dtype)
    shape = tuple(leaf.shape or ())
    kind = flat_container(leaf)
    if kind == JAX:
        return jax.ShapeDtypeStruct(shape, dtype), None
    source = (
        saved.source(leaf)
        if leaf.data != ALIAS or (leaf.alias_of in saved.leaves)
        else None
    )
    if (
        leaf.data != EMPTY
        and np.dtype(dtype).itemsize > _SMALL
        and (source is None or source.data != PACKED)
    ):
        return None, (
            f"an array of dtype {leaf.dtype} stored other than packed cannot "
            "be rebuilt (a save packs such arrays)"
        )
    if leaf.data == EMPTY:
        return np.empty(shape, dtype), None  # zero elements: nothing allocated
    one = _one(np.dtype(dtype))
    if kind == NUMPY_SCALAR:
        return one, None
    return np.broadcast_to(np.asarray(one), shape), None


def _one(dtype: np.dtype) -> Any:
    """A numpy scalar of `dtype`: strings and bytes of their full size (numpy
    gives an empty string the dtype `<U0`)."""
    if dtype.kind == "U":
        return np.str_("\x01" * (dtype.itemsize // 4))
    if dtype.kind == "S":
        return np.bytes_(b"\x01" * dtype.itemsize)
    if dtype.type is np.void:
        return np.void(bytes(dtype.itemsize))
    return np.zeros((), dtype)[()]

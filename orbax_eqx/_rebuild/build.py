"""A skeleton rebuilt from the sidecar: the saved tree's real classes, arrays as
shapes, for a restore to fill.

Modules are made the way Equinox unflattens them: `object.__new__(cls)`, then
each field set with `object.__setattr__`. No `__init__` or `__post_init__`
runs (the fields are those the saved module had), and no converter or check.
Containers are made as JAX unflattens them; namedtuples with `tuple.__new__`,
so that no method of theirs runs either. Classes, callables and enums are
looked up under `allow` (see `allow`); everything else comes from the sidecar
as data. Every leaf or module that cannot be rebuilt is collected, and all of
them are reported in one `RebuildError`.
"""

import ast
import dataclasses
import enum
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._errors import OrbaxEqxError, RebuildError, SidecarError, bullet_list
from .._format.sidecar import LeafMetadata, Metadata
from .._restore.wide import flat_container
from .._tree import nodes as _nodes
from .._tree.names import join, label
from .._tree.values import decode_scalar, describe, scalar_type
from .._tree.walk import (
    ARRAY,
    CALLABLE,
    NUMPY,
    NUMPY_SCALAR,
    SCALAR,
    SHARED,
    display_path,
    parse_dtype,
)
from .allow import Refused, look_up, suggestion, unnameable
from .shared import Selector, is_path


@dataclasses.dataclass
class _Problem:
    name: str  # the leaf name, what the message shows
    path: str  # the leaf path (`keystr`), what `RebuildError.problems` holds
    text: str
    allow: str | None = None


class _Refusing:
    """A look-up that imports nothing: for saying what a rebuild would need."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, name: str) -> Any:
        why = unnameable(name)
        if why is not None:
            return Refused(why)
        self.names.append(name)
        return _DRY


_DRY = object()  # what a dry run finds


def skeleton(saved: Metadata, allow: tuple[str, ...], prefix: str | None = None):
    """The saved tree (or its part under leaf name `prefix`) as a skeleton."""
    builder = _Builder(saved, lambda name: look_up(name, allow))
    tree = builder.build(prefix or "")
    if builder.problems:
        raise _error(saved, allow, builder.problems)
    return tree


def needs(saved: Metadata) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Without importing anything: the qualified names a rebuild would look up,
    and `(leaf name, leaf path, why)` for what cannot be rebuilt whatever
    `allow` says.

    Raises `RebuildError` if the sidecar records no tree structure."""
    look = _Refusing()
    builder = _Builder(saved, look)
    builder.build("")
    return look.names, [
        (p.name, display_path(p.path), p.text) for p in builder.problems
    ]


def modules_to_allow(names: list[str]) -> list[str]:
    """The top-level packages of qualified names, sorted, once each."""
    return sorted({suggestion(n) for n in names})


def _error(saved: Metadata, allow: tuple[str, ...], problems) -> RebuildError:
    needed = sorted({p.allow for p in problems if p.allow is not None})
    lines = [f"{label(p.name, p.path)}: {p.text}" for p in problems]
    fix = []
    if needed:
        wanted = sorted(set(allow) | set(needed))
        fix.append(
            f"If you trust them, pass `allow={wanted!r}` (a name allows that "
            "module and its submodules)."
        )
    if any(p.allow is None for p in problems):
        fix.append(
            "What cannot be rebuilt needs a skeleton: restore into one "
            "(`oeqx.restore(path, skeleton)`)."
        )
    fix.append(f"`python -m orbax_eqx inspect {saved.directory}` lists what to allow.")
    return RebuildError(
        f"Cannot rebuild the checkpoint at {saved.directory} without a skeleton "
        f"under `allow={list(allow)!r}`: {len(problems)} "
        f"{'leaf or module' if len(problems) == 1 else 'leaves or modules'} "
        f"cannot be rebuilt:\n{bullet_list(lines)}\n" + " ".join(fix),
        [(display_path(p.path), p.text) for p in problems],
        needed,
    )


class _Builder:
    def __init__(self, saved: Metadata, look):
        if saved.nodes is None:
            raise RebuildError(
                f"The checkpoint at {saved.directory} has sidecar format "
                f"{saved.format_version}, which does not record the structure of "
                "the saved tree (from format 5 on it does), so it cannot be rebuilt "
                "without a skeleton. Restore it into a skeleton, or re-save it "
                "with this orbax_eqx (restore it into a skeleton, or flat, and "
                "`oeqx.save` it again)."
            )
        self.saved = saved
        self.nodes = saved.nodes
        self.look = look
        self.problems: list[_Problem] = []
        self.used: set[str] = set()

    def damaged(self, what: str) -> SidecarError:
        return SidecarError(
            f"The sidecar in {self.saved.directory} is damaged: {what}. Restore "
            "an earlier step, or re-save the checkpoint."
        )

    def build(self, name: str) -> Any:
        if name not in self.nodes and name not in self.saved.leaves:
            raise RebuildError(
                f"The checkpoint at {self.saved.directory} has no leaf or module "
                f"named `{name}`; `python -m orbax_eqx inspect "
                f"{self.saved.directory}` shows the names it has."
            )
        try:
            return self.child(name)
        except OrbaxEqxError:
            raise
        except RecursionError:
            raise self.damaged("its tree nests deeper than Python recurses") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # Malformed records (a value of the wrong shape): pure data, so damage.
            raise self.damaged(f"its records of the tree are malformed ({e})") from None

    def child(self, name: str | None) -> Any:
        if name is None:
            return _MISSING
        if name in self.used:
            raise self.damaged(f"node {name!r} is reached twice")
        self.used.add(name)
        rec = self.nodes.get(name)
        if rec is not None:
            return self.node(name, rec)
        leaf = self.saved.leaves.get(name)
        if leaf is None:
            raise self.damaged(f"node or leaf {name!r} is named but not recorded")
        return self.leaf(leaf)

    def refuse(self, at: tuple[str, str], text: str, allow: str | None = None):
        """Records what cannot be rebuilt at `at`, `(leaf name, leaf path)`."""
        self.problems.append(_Problem(*at, text, allow))

    def find(self, at: tuple[str, str], what: str, name: str) -> Any:
        found = self.look(name)
        if isinstance(found, Refused):
            self.refuse(at, f"{what} `{name}` {found.reason}", found.allow)
            return None
        return found

    def node(self, name: str, rec: dict[str, Any]) -> Any:
        kind, at = rec["type"], (name, rec["path"])
        if kind == _nodes.OTHER:
            self.refuse(
                at,
                f"a `{rec.get('class')}` container cannot be rebuilt (orbax_eqx "
                "rebuilds Equinox modules, dicts, lists, tuples, namedtuples and "
                "`eqx.nn.State`)",
            )
            return None
        if kind == _nodes.MODULE and rec.get("wrapper"):
            self.refuse(at, "a module wrapping a function cannot be rebuilt")
            return None
        if kind == _nodes.MODULE:
            return self.module(name, rec)
        children = [self.child(c) for c in rec.get("children", [])]
        if kind == _nodes.LIST:
            return children
        if kind == _nodes.TUPLE:
            return tuple(children)
        if kind == _nodes.DICT:
            keys = rec.get("keys", [])
            if len(keys) != len(children):
                raise self.damaged(f"dict node {name!r} has {len(keys)} keys")
            return {self.value(at, k): v for k, v in zip(keys, children)}
        if kind == _nodes.STATE:
            markers = [self.value(at, m) for m in rec.get("markers", [])]
            if len(markers) != len(children):
                raise self.damaged(f"State node {name!r} has {len(markers)} markers")
            if not all(isinstance(m, (str, int)) for m in markers):
                self.refuse(at, "an `eqx.nn.State` not made by `make_with_state`")
                return None
            return eqx.nn.State.tree_unflatten(tuple(markers), tuple(children))
        fields = rec.get("fields", [])
        if len(fields) != len(children):
            raise self.damaged(f"node {name!r} has {len(fields)} fields")
        if kind == _nodes.NAMEDTUPLE:
            cls = self.find(at, "class", rec.get("class", ""))
            if cls is None or cls is _DRY:
                return None
            if not (isinstance(cls, type) and issubclass(cls, tuple)) or tuple(
                getattr(cls, "_fields", ())
            ) != tuple(fields):
                self.refuse(
                    at,
                    f"`{rec.get('class')}` is no longer a namedtuple of fields "
                    f"{tuple(fields)}",
                )
                return None
            return tuple.__new__(cls, children)

    def module(self, name: str, rec: dict[str, Any]) -> Any:
        at = (name, rec["path"])
        fields, absent = rec.get("fields", []), rec.get("absent", [])
        info = self.saved.modules.get(name)
        if info is None:
            raise self.damaged(f"module node {name!r} has no module record")
        # The class first, so that problems are listed parents first.
        cls = self.find(at, "class", info.cls)
        static = {f: self.value(_field(at, f), v) for f, v in info.static.items()}
        names = rec.get("children", [])
        if len(fields) != len(names):
            raise self.damaged(f"node {name!r} has {len(fields)} fields")
        wiring = _wiring(rec) if info.cls == _SHARED_CLASS else None
        children = []
        for field, child in zip(fields, names):
            if wiring is not None and field in wiring and child in self.saved.leaves:
                self.used.add(child)
                many, paths = wiring[field]
                named = self.saved.leaves[child].value
                text = named.get("callable") if isinstance(named, dict) else None
                children.append(Selector(str(text), many, paths))
            else:
                children.append(self.child(child))
        if cls is None or cls is _DRY:
            return None
        if not (isinstance(cls, type) and issubclass(cls, eqx.Module)):
            self.refuse(at, f"`{info.cls}` is not an Equinox module class")
            return None
        dynamic, static_names = _nodes.fields_of(cls)
        if tuple(fields) != dynamic or set(static_names) != set(info.static) | set(
            absent
        ):
            self.refuse(
                at,
                f"class `{info.cls}` has changed since the save: it has fields "
                f"{dynamic} and static fields {static_names}, the checkpoint "
                f"{tuple(fields)} and {tuple(sorted(set(info.static) | set(absent)))}",
            )
            return None
        # As Equinox unflattens a module (`equinox/_module/_flatten.py`).
        module = object.__new__(cls)
        for field, value in zip(fields, children):
            if value is not _MISSING:
                object.__setattr__(module, field, value)
        for field, value in static.items():
            if field not in absent:
                object.__setattr__(module, field, value)
        return module

    def leaf(self, leaf: LeafMetadata) -> Any:
        if leaf.kind == ARRAY:
            return _array(leaf)
        if leaf.kind == SCALAR:
            return decode_scalar(leaf.value)
        if leaf.kind == SHARED:
            return _shared_node()
        if leaf.kind == CALLABLE:
            return self.value((leaf.name, leaf.path), leaf.value)
        self.refuse(
            (leaf.name, leaf.path),
            f"an object recorded only as its text `{describe(leaf.value)}` "
            "cannot be rebuilt",
        )
        return None

    def value(self, at: tuple[str, str], encoded: Any) -> Any:
        """A static field's value, a dict key, a callable leaf: decoded, with
        classes, callables and enums looked up under `allow`. `at` is
        `(leaf name, leaf path)` of the value, or of the dict a key is of."""
        if scalar_type(encoded) is not None:
            return decode_scalar(encoded)
        if not (isinstance(encoded, dict) and len(encoded) >= 1):
            raise self.damaged(f"the value at {label(*at)} is malformed")
        tag, body = next(iter(encoded.items()))
        if tag == "tuple":
            return tuple(self.value(at, v) for v in body)
        if tag == "list":
            return [self.value(at, v) for v in body]
        if tag == "dict":
            return {self.value(at, k): self.value(at, v) for k, v in body}
        if tag in ("dtype", "numpy"):
            try:
                if tag == "dtype":
                    return np.dtype(parse_dtype(str(body)))
                dtype, value = body
                return np.dtype(parse_dtype(str(dtype))).type(decode_scalar(value))
            except (TypeError, ValueError) as e:
                raise self.damaged(
                    f"the value at {label(*at)} is malformed ({e})"
                ) from None
        if tag == "enum":
            cls_name, _, member = str(body).rpartition(".")
            cls = self.find(at, "enum", cls_name)
            if cls is None or cls is _DRY:
                return None
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                self.refuse(at, f"`{cls_name}` is not an enum")
                return None
            if member not in cls.__members__:
                self.refuse(at, f"enum `{cls_name}` has no member `{member}` now")
                return None
            return cls.__members__[member]
        if tag == "callable":
            text = str(body)
            if text.startswith("functools.partial("):
                self.refuse(
                    at,
                    f"`{text}` cannot be rebuilt: a partial's arguments are "
                    "recorded as text",
                )
                return None
            return self.find(at, "callable", text)
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


def _field(at: tuple[str, str], field: str) -> tuple[str, str]:
    """`(leaf name, leaf path)` of a module's static field, from the module's."""
    name, path = at
    path = "" if path == "<root>" else path  # as the sidecar records the root
    return (join([name, field]) if name else field), f"{path}.{field}"


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


_MISSING = object()  # a module field that was not set
_SHARED_CLASS = "equinox.nn._shared.Shared"


def _wiring(rec: dict[str, Any]) -> dict[str, tuple[bool, list]] | None:
    """`eqx.nn.Shared`'s recorded `where` and `get` selections, if well formed."""
    wiring = rec.get("wiring")
    if not isinstance(wiring, dict):
        return None
    found = {}
    for field in ("where", "get"):
        entry = wiring.get(field)
        if not (
            isinstance(entry, dict)
            and type(entry.get("many")) is bool
            and isinstance(entry.get("paths"), list)
            and entry["paths"]
            and all(is_path(p) for p in entry["paths"])
        ):
            return None
        found[field] = (entry["many"], entry["paths"])
    return found


def _array(leaf: LeafMetadata) -> Any:
    """A skeleton leaf for a saved array, in the container a restore without a
    skeleton gives back (numpy for numpy arrays and for 64-bit arrays while
    JAX is 32-bit: see `_restore/wide.py`)."""
    dtype = parse_dtype(leaf.dtype)
    shape = tuple(leaf.shape or ())
    container = flat_container(leaf)
    if container == NUMPY:
        return np.empty(shape, dtype)
    if container == NUMPY_SCALAR:
        return np.empty((), dtype)[()]
    return jax.ShapeDtypeStruct(shape, dtype)


def _shared_node() -> Any:
    from equinox.nn._shared import SharedNode  # not exported by Equinox

    return SharedNode()

"""A skeleton rebuilt from the sidecar: the saved tree's real classes, arrays as
shapes, for a restore to fill.

Modules are made the way Equinox unflattens them: `object.__new__(cls)`, then
each field set with `object.__setattr__`. No `__init__` or `__post_init__`
runs (the fields are those the saved module had), and no converter or check.
Containers are made as JAX unflattens them; namedtuples with `tuple.__new__`,
so that no method of theirs runs either. Classes, callables and enums are
looked up under `allow` (see `allow`); everything else comes from the sidecar
as data (see `decode`), and only what it records is built: each node once,
reached from the root, `eqx.nn.Shared`'s selectors through recorded nodes
only (see `shared`). The tree is built in a loop, not by recursion, so a tree
as deep as JAX flattens rebuilds. Every leaf or module that cannot be rebuilt
is collected, and all of them are reported in one `RebuildError`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import msgspec

from .._errors import (
    EARLIER_STEP,
    OrbaxEqxError,
    RebuildError,
    SidecarError,
    bullet_list,
    problem,
)
from .._format.sidecar import LeafMetadata, Metadata
from .._restore.wide import flat_container
from .._tree import nodes as _nodes
from .._tree.names import join, label
from .._tree.values import describe
from .._tree.walk import (
    ARRAY,
    CALLABLE,
    JAX,
    SCALAR,
    SHARED,
    display_path,
    fields_of,
)
from .allow import Refused, Resolver, suggestion, unnameable
from .decode import DRY, At, Decoder, stand_in
from .shared import selectors

# Deeper than any tree JAX flattens (saves flatten with JAX): a rebuild makes
# no deeper one, so that a sidecar of a 100,000-node chain costs nothing.
MAX_DEPTH = 10_000


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a rebuild of a sidecar would need, told without importing anything."""

    names: list[str]  # every qualified name it would look up, once each
    callables: list[str]  # of those, the callables it would install, once each
    cannot: list[tuple[str, str, str]]  # (leaf name, leaf path, why) whatever allow


class _Refusing:
    """A look-up that imports nothing: for saying what a rebuild would need."""

    def __init__(self):
        self.names: list[str] = []
        self._answers: dict[str, Any] = {}  # a class is asked for per module

    def __call__(self, name: str) -> Any:
        answer = self._answers.get(name)
        if answer is None:
            why = unnameable(name)
            answer = self._answers[name] = DRY if why is None else Refused(why)
            if answer is DRY:
                self.names.append(name)  # (once each)
        return answer


@dataclasses.dataclass
class Problem:
    """One leaf or module that cannot be rebuilt, and why."""

    name: str  # the leaf name, what the message shows
    path: str  # the leaf path (`keystr`), what `RebuildError.problems` holds
    text: str
    allow: str | None = None


def error(saved: Metadata, allow: tuple[str, ...], problems) -> RebuildError:
    """The error of a rebuild under `allow` that met `problems`."""
    needed = sorted({p.allow for p in problems if p.allow is not None})
    lines = [f"{label(p.name, p.path)}: {p.text}" for p in problems]
    fix = []
    if needed:
        wanted = sorted(set(allow) | set(needed))
        fix.append(
            f"If you trust them, pass `allow={wanted!r}` (a rebuild imports "
            "exactly these modules, and finds names in them and in what they "
            "import themselves)."
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


def skeleton(saved: Metadata, allow: tuple[str, ...], prefix: str | None = None):
    """The saved tree (or its part under leaf name `prefix`) as a skeleton."""
    builder = _Builder(saved, Resolver(allow))
    try:
        tree = builder.build(prefix or "")
    finally:
        builder.close()
    if builder.problems:
        raise error(saved, allow, builder.problems)
    return tree


def needs(saved: Metadata) -> Needs:
    """Without importing anything: what a rebuild would look up and install,
    and what cannot be rebuilt whatever `allow` says.

    Raises `RebuildError` if the sidecar records no tree structure, and
    `SidecarError` if its records of the tree are damaged."""
    look = _Refusing()
    builder = _Builder(saved, look, dry=True)
    try:
        builder.build("")
    finally:
        builder.close()
    return Needs(
        look.names,
        list(dict.fromkeys(builder.callables)),
        [(p.name, display_path(p.path), p.text) for p in builder.problems],
    )


def modules_to_allow(names: list[str]) -> list[str]:
    """The modules to allow for qualified names (see `allow.suggestion`),
    sorted, once each."""
    return sorted({suggestion(n) for n in names})


# Makes a node from the values built for its children, in order.
_Make = Callable[[list[Any]], Any]


class _Builder:
    def __init__(self, saved: Metadata, look: Callable[[str], Any], dry=False):
        # `dry`: for `needs`, which keeps no value: jax arrays get no stand-in.
        self.dry = dry
        if saved.nodes is None:  # arrays of the type handler: no tree recorded
            raise RebuildError(
                f"The checkpoint at {saved.directory} records no tree structure "
                "(its arrays were saved through Orbax's own handlers), so it "
                "cannot be rebuilt without a skeleton. Restore it into a skeleton."
            )
        self.saved = saved
        self.nodes = saved.nodes
        self.look = look
        self.problems: list[Problem] = []
        self.callables: list[str] = []
        self.used: set[str] = set()
        self.decoder = Decoder(self.find, self.refuse, self.damaged)
        self._decoded_alike: set[bytes] = set()  # static fields, for a dry run
        self._jax: dict[tuple[Any, Any, bool], bool] = {}  # see `_jax_array`
        # A dry run's modules of a class and static fields (the same record,
        # shared by `compact`) that looked up and decoded without a word: the
        # next ones would again, with nothing to add (see `_static`).
        self._clean: dict[tuple[str, int], Any] = {}

    def close(self) -> None:
        """Breaks the cycle through the decoder (it holds our methods), which
        would keep the sidecar alive until a collection."""
        del self.decoder

    def damaged(self, what: str) -> SidecarError:
        return problem(
            SidecarError,
            f"The sidecar in {self.saved.directory} is damaged: {what}.",
            file=self.saved.directory,
            remedy=EARLIER_STEP,
        )

    def build(self, name: str) -> Any:
        if name not in self.nodes and name not in self.saved.leaves:
            raise RebuildError(
                f"The checkpoint at {self.saved.directory} has no leaf or module "
                f"named `{name}`; `python -m orbax_eqx inspect "
                f"{self.saved.directory}` shows the names it has."
            )
        try:
            return self._build(name)
        except OrbaxEqxError:
            raise
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            OverflowError,
            RecursionError,
        ) as e:
            # Malformed records (a value of the wrong shape): pure data, so damage.
            raise self.damaged(
                f"its records of the tree are malformed ({type(e).__name__}: {e})"
            ) from None

    def _build(self, root: str) -> Any:
        """Every node from `root` down, parents first (so are their problems
        listed), then made children first: a loop, as deep as the tree."""
        makes: list[tuple[str, list[str | None], _Make]] = []
        built: dict[str, Any] = {}
        todo: list[tuple[str, int]] = [(root, 0)]
        while todo:
            name, depth = todo.pop()
            if depth > MAX_DEPTH:
                raise problem(
                    RebuildError,
                    f"The checkpoint at {self.saved.directory} records a tree "
                    f"nesting more than {MAX_DEPTH} levels deep (at node {name!r}): "
                    "deeper than JAX flattens, so no save wrote it, and a rebuild "
                    "does not make it.",
                    file=self.saved.directory,
                    remedy=EARLIER_STEP,
                )
            if name in self.used:
                raise self.damaged(f"node {name!r} is reached twice")
            self.used.add(name)
            rec = self.nodes.get(name)
            if rec is None:
                leaf = self.saved.leaves.get(name)
                if leaf is None:
                    raise self.damaged(
                        f"node or leaf {name!r} is named but not recorded"
                    )
                if not (self.dry and self._jax_array(leaf)):  # (a dry run:
                    built[name] = self.leaf(leaf)  # nothing to say of those)
                continue
            children, make, ready = self.node(name, rec)
            makes.append((name, children, make))
            built.update(ready)
            for child in reversed(children):
                if child is not None and child not in ready:
                    todo.append((child, depth + 1))
        if self.dry:  # keeps no value; making them cannot fail (parts checked)
            return None
        for name, children, make in reversed(makes):
            built[name] = make([_MISSING if c is None else built[c] for c in children])
        return built[root]

    def refuse(self, at: At, text: str, allow: str | None = None) -> None:
        """Records what cannot be rebuilt at `at`, `(leaf name, leaf path)`."""
        self.problems.append(Problem(*at, text, allow))

    def find(self, at: At, what: str, name: str) -> Any:
        if what == "callable":
            self.callables.append(name)
        found = self.look(name)
        if isinstance(found, Refused):
            self.refuse(at, f"{what} `{name}` {found.reason}", found.allow)
            return None
        return found

    def node(self, name: str, rec: dict[str, Any]):
        """`(children, make, built)`: the node's children to build, how to make
        it from them, and children already made (`Shared`'s selectors)."""
        kind, at = rec["type"], (name, rec["path"])
        children = rec.get("children", [])
        if kind == _nodes.OTHER:
            self.refuse(
                at,
                f"a `{rec.get('class')}` container cannot be rebuilt (orbax_eqx "
                "rebuilds Equinox modules, dicts, lists, tuples, namedtuples and "
                "`eqx.nn.State`)",
            )
            return [], _none, {}
        if kind == _nodes.MODULE and rec.get("wrapper"):
            self.refuse(at, "a module wrapping a function cannot be rebuilt")
            return [], _none, {}
        if kind == _nodes.MODULE:
            return self.module(name, rec)
        if kind in (_nodes.LIST, _nodes.TUPLE):
            return children, list if kind == _nodes.LIST else tuple, {}
        make = {_nodes.DICT: self._dict, _nodes.STATE: self._state}.get(
            kind, self._namedtuple
        )
        return children, make(name, rec, at, children), {}

    def _dict(self, name: str, rec: dict[str, Any], at: At, children: list):
        keys = rec.get("keys", [])
        if len(keys) != len(children):
            raise self.damaged(f"dict node {name!r} has {len(keys)} keys")
        decoded = [self.decoder.key(at, k) for k in keys]
        if len(set(map(_hashed, decoded))) != len(decoded):
            raise self.damaged(f"dict node {name!r} has a key twice")
        return lambda values: dict(zip(decoded, values, strict=True))

    def _state(self, name: str, rec: dict[str, Any], at: At, children: list):
        markers = [self.decoder.key(at, m) for m in rec.get("markers", [])]
        if len(markers) != len(children):
            raise self.damaged(f"State node {name!r} has {len(markers)} markers")
        if not all(type(m) in (str, int) for m in markers):
            self.refuse(at, "an `eqx.nn.State` not made by `make_with_state`")
            return _none
        return lambda values: eqx.nn.State.tree_unflatten(tuple(markers), tuple(values))

    def _namedtuple(self, name: str, rec: dict[str, Any], at: At, children: list):
        fields = rec.get("fields", [])
        if len(fields) != len(children):
            raise self.damaged(f"node {name!r} has {len(fields)} fields")
        cls = self.find(at, "class", rec.get("class", ""))
        if cls is None or cls is DRY:
            return _none
        if not (isinstance(cls, type) and issubclass(cls, tuple)) or tuple(
            getattr(cls, "_fields", ())
        ) != tuple(fields):
            self.refuse(
                at,
                f"`{rec.get('class')}` is no longer a namedtuple of fields "
                f"{tuple(fields)}",
            )
            return _none
        return lambda values: tuple.__new__(cls, values)

    def module(self, name: str, rec: dict[str, Any]):
        at = (name, rec["path"])
        fields, absent = rec.get("fields", []), rec.get("absent", [])
        info = self.saved.modules.get(name)
        if info is None:
            raise self.damaged(f"module node {name!r} has no module record")
        # The class first, so that problems are listed parents first.
        alike = (info.cls, id(info.static))
        if self.dry and alike in self._clean:  # said nothing, looked up once
            cls, static = DRY, {}
        else:
            before = len(self.problems)
            cls = self.find(at, "class", info.cls)
            static = self._static(at, info.static)
            if self.dry and cls is DRY and len(self.problems) == before:
                self._clean[alike] = info.static  # (held: its id stays its)
        names = rec.get("children", [])
        if len(fields) != len(names):
            raise self.damaged(f"node {name!r} has {len(fields)} fields")
        ready = {}
        if info.cls == _SHARED:
            ready = selectors(self.saved.leaves, self.nodes, name, rec, self.damaged)
            self.used.update(ready)
        if cls is None or cls is DRY:
            return names, _none, ready
        if not (isinstance(cls, type) and issubclass(cls, eqx.Module)):
            self.refuse(at, f"`{info.cls}` is not an Equinox module class")
            return names, _none, ready
        dynamic, static_names = fields_of(cls)
        if tuple(fields) != dynamic or set(static_names) != set(info.static) | set(
            absent
        ):
            self.refuse(
                at,
                f"class `{info.cls}` has changed since the save: it has fields "
                f"{dynamic} and static fields {static_names}, the checkpoint "
                f"{tuple(fields)} and {tuple(sorted(set(info.static) | set(absent)))}",
            )
            return names, _none, ready

        def make(values: list[Any]) -> Any:
            # As Equinox unflattens a module (`equinox/_module/_flatten.py`).
            module = object.__new__(cls)
            for field, value in zip(fields, values, strict=True):
                if value is not _MISSING:
                    object.__setattr__(module, field, value)
            for field, value in static.items():
                if field not in absent:
                    object.__setattr__(module, field, value)
            return module

        return names, make, ready

    def _static(self, at: At, recorded: dict[str, Any]) -> dict[str, Any]:
        """A module's static fields, decoded. A dry run keeps no value, so
        fields recorded alike (every layer of a model) are decoded once, for
        what they would look up: unless that refused something, which is
        said of each module that records it."""
        key = None
        if self.dry:
            try:
                key = msgspec.json.encode(recorded)
            except (TypeError, ValueError, OverflowError):  # (lone surrogates)
                key = None
            if key is not None and key in self._decoded_alike:
                return {}
        before = len(self.problems)
        static = {f: self.decoder.value(_field(at, f), v) for f, v in recorded.items()}
        if key is not None and len(self.problems) == before:
            self._decoded_alike.add(key)
        return static

    def leaf(self, leaf: LeafMetadata) -> Any:
        at = (leaf.name, leaf.path)
        if leaf.kind == ARRAY:
            return self.array(leaf)
        if leaf.kind == SCALAR or leaf.kind == CALLABLE:
            return self.decoder.value(at, leaf.value)
        if leaf.kind == SHARED:
            return _shared_node()
        self.refuse(
            at,
            f"an object recorded only as its text `{describe(leaf.value)}` "
            "cannot be rebuilt",
        )
        return None

    def _jax_array(self, leaf: LeafMetadata) -> bool:
        """Whether `leaf` is an array a rebuild without a skeleton gives back
        as a jax array (`flat_container`): asked once per container and dtype
        (most leaves of a model share a few), for as long as this build."""
        if leaf.kind != ARRAY:
            return False
        key = (leaf.container, leaf.dtype, leaf.shape == ())
        found = self._jax.get(key)
        if found is None:
            found = self._jax[key] = flat_container(leaf) == JAX
        return found

    def array(self, leaf: LeafMetadata) -> Any:
        """A skeleton leaf for a saved array (see `stand_in.array`), or None
        and a refusal."""
        if self.dry and self._jax_array(leaf):
            return None  # refused never: only numpy stand-ins can be
        value, refusal = stand_in(self.saved, leaf)
        if refusal is not None:
            self.refuse((leaf.name, leaf.path), refusal)
        return value


_MISSING = object()  # a module field that was not set
_SHARED = "equinox.nn._shared.Shared"


def _none(values: list[Any]) -> None:
    return None


def _hashed(key: Any) -> tuple[type, Any]:
    # `True == 1 == 1.0`, but they are three keys of a saved dict.
    return (type(key), key)


def _field(at: At, field: str) -> At:
    """`(leaf name, leaf path)` of a module's static field, from the module's."""
    name, path = at
    path = "" if path == "<root>" else path  # as the sidecar records the root
    return (join([name, field]) if name else field), f"{path}.{field}"


def _shared_node() -> Any:
    from equinox.nn._shared import SharedNode  # not exported by Equinox

    return SharedNode()

"""`allow=`: the modules a rebuild may import, and looking names up under it.

The rule (see the rebuild guide):

- `allow` names modules. A rebuild imports exactly those (each once, all of
  them before any name is looked up), and so whatever they import themselves.
- It never imports a `__main__` module, and never a submodule that an allowed
  module does not import on its own: after the allowed modules are imported,
  a recorded `module.qualname` is looked up only through modules already in
  `sys.modules`, reading their namespaces as they are (`vars`, never a
  module's `__getattr__`, which may import).
- The object found must carry exactly the recorded name (`__module__` +
  `__qualname__`), so that an allowed module cannot be used to reach
  something imported into it under another name (`mypkg.os.system`).
- It must be in a module inside `allow` (that module or a submodule of it),
  or be the very object an allowed module holds in its namespace (`jax.nn`
  holds `jax._src.nn.functions.gelu` as `jax.nn.gelu`): so any callable an
  allowed module holds can be wired in, and nothing else.

Anything else is `Refused`, naming the module that `allow` would need. Nothing
found is called here.
"""

import dataclasses
import importlib
import inspect
import keyword
import sys
import types
from collections.abc import Iterable
from typing import Any

from .._errors import RebuildError
from .._tree.values import qualified_name


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why a name cannot be looked up, and which name `allow` would need."""

    reason: str
    allow: str | None = None  # the module to add to `allow`, if that helps


MAIN = "__main__"


def check_allow(allow: Any) -> tuple[str, ...]:
    """`allow` as a tuple of module names; raises on anything else."""
    if isinstance(allow, str) or not isinstance(allow, Iterable):
        raise TypeError(
            f"allow={allow!r}: expected a list of module names, such as "
            "`allow=['equinox', 'my_models']`."
        )
    names = tuple(allow)
    for name in names:
        if not (isinstance(name, str) and is_module_name(name)):
            raise ValueError(
                f"allow: {name!r} is not a module name (dotted identifiers, such "
                "as `equinox` or `my_models.layers`)."
            )
        if MAIN in name.split("."):
            raise ValueError(
                f"allow: {name!r} is a `__main__` module (a script, or a package's "
                "command line), which a rebuild never imports: importing one runs "
                "a program. Define the classes in a module and allow that."
            )
    return names


def is_module_name(text: str) -> bool:
    parts = text.split(".")
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)


def allowed(module: str, allow: tuple[str, ...]) -> bool:
    """Whether `module` is in `allow` or a submodule of a module there."""
    return any(module == a or module.startswith(a + ".") for a in allow)


def suggestion(name: str) -> str:
    """The module to allow for a qualified name, importing nothing: its public
    module, the parts before the first private (`_linear`) or capitalized
    (`Block`) one, never the name's own last part. `equinox.nn._linear.Linear`
    gives `equinox.nn`, `jax._src.nn.functions.gelu` gives `jax`,
    `my_pkg.models.make` gives `my_pkg.models`: packages import their private
    submodules, so these work under the rule."""
    parts = name.split(".")[:-1] or name.split(".")
    kept = [parts[0]]
    for part in parts[1:]:
        if part.startswith("_") or part[:1].isupper() or part.startswith("<"):
            break
        kept.append(part)
    return ".".join(kept)


def unnameable(name: str) -> str | None:
    """Why `name` cannot be looked up whatever `allow` says, or None."""
    if "<locals>" in name:
        return "is defined inside a function, so it cannot be imported by name"
    if name.endswith(_LAMBDA) and is_module_name(name[: -len(_LAMBDA)]):
        return _in_main(name)  # a module-level lambda: see `_only_lambda`
    if "<lambda>" in name:
        return "is a lambda, which cannot be imported by name"
    if not is_module_name(name) or "." not in name:
        return "is not a `module.name` that can be imported"
    return _in_main(name)


def _in_main(name: str) -> str | None:
    if MAIN in name.split("."):
        return (
            "is in a `__main__` module (a script, or a package's command line), "
            "which a rebuild never imports: define it in a module"
        )
    return None


class Resolver:
    """Looks names up under one `allow`, for one rebuild: imports the allowed
    modules once, on the first look-up, then only reads what is imported."""

    def __init__(self, allow: tuple[str, ...]):
        self.allow = allow
        self._modules: dict[str, Any] | None = None  # allowed name -> module...
        self._held_ids: set[int] | None = None  # what allowed modules hold

    def modules(self) -> dict[str, Any]:
        """Each allowed module: the module, None if it is not installed, or
        `Refused` if importing it failed."""
        if self._modules is None:
            self._modules = {name: _import(name) for name in self.allow}
        return self._modules

    def __call__(self, name: str) -> Any:
        """The object named `name`, or `Refused`."""
        why = unnameable(name)
        if why is not None:
            return Refused(why)
        modules = self.modules()
        covering = [a for a in self.allow if name.startswith(a + ".")]
        for a in covering:  # an allowed module that failed covers the name
            if isinstance(modules[a], Refused):
                return modules[a]
            if modules[a] is None:
                return Refused(f"cannot be imported: no module `{a}` is installed")
        if name.endswith(_LAMBDA):
            return self._only_lambda(name[: -len(_LAMBDA)])
        parts = name.split(".")
        at = _imported_prefix(parts)
        if at is None:
            return _outside(name)
        module_name = ".".join(parts[:at])
        inside = allowed(module_name, self.allow)
        found = _walk(sys.modules[module_name], parts[at:], dynamic=inside)
        if found is _ABSENT:
            return self._not_found(name, parts, at, inside)
        if qualified_name(found) != name:
            if not inside:
                return _outside(name)
            return Refused(
                f"is not what `{name}` names now: that is `{qualified_name(found)}`"
            )
        if inside or self._held(found):
            return found
        return _outside(name)

    def _held(self, found: Any) -> bool:
        """Whether an allowed module holds `found` in its namespace."""
        if self._held_ids is None:
            self._held_ids = {
                id(value)
                for module in self.modules().values()
                if isinstance(module, types.ModuleType)
                for value in vars(module).values()
            }
        return id(found) in self._held_ids

    def _not_found(self, name: str, parts: list[str], at: int, inside: bool) -> Any:
        module_name = ".".join(parts[:at])
        submodule = f"{module_name}.{parts[at]}"
        # `vars`, not `hasattr`: a module's `__getattr__` may import.
        if "__path__" in vars(sys.modules[module_name]) and (
            inside or allowed(submodule, self.allow)
        ):
            # A package without this attribute: a submodule nothing imported.
            return Refused(
                f"is in module `{submodule}`, which no allowed module imports "
                f"(a rebuild imports only what `allow` names; to allow it: "
                f"`{submodule}`)",
                submodule,
            )
        if not inside:
            return _outside(name)
        return Refused(
            f"is not in module `{module_name}` (there is no "
            f"`{'.'.join(parts[at:])}` there now)"
        )

    def _only_lambda(self, module_name: str) -> Any:
        """A lambda bound at the top level of `module_name` (as Equinox's
        `_identity = lambda x: x`), found if it is the only one there."""
        module = sys.modules.get(module_name)
        if not allowed(module_name, self.allow):
            return _outside(module_name + _LAMBDA)
        if not isinstance(module, types.ModuleType):
            return Refused(
                f"is in module `{module_name}`, which no allowed module imports "
                f"(to allow it: `{module_name}`)",
                module_name,
            )
        found = {
            id(v): v
            for v in vars(module).values()
            if isinstance(v, types.FunctionType)
            and v.__qualname__ == "<lambda>"
            and v.__module__ == module_name
        }
        if len(found) != 1:
            return Refused(
                f"is a lambda, and `{module_name}` binds {len(found)} lambdas at its "
                "top level: which one cannot be told"
            )
        return next(iter(found.values()))


_ABSENT = object()
_LAMBDA = ".<lambda>"


def _outside(name: str) -> Refused:
    module = suggestion(name)
    return Refused(f"is outside `allow` (to allow it: `{module}`)", module)


def _imported_prefix(parts: list[str]) -> int | None:
    """How many parts of a name make the longest module in `sys.modules` (the
    name's own last part never does), or None."""
    for i in range(len(parts) - 1, 0, -1):
        if isinstance(sys.modules.get(".".join(parts[:i])), types.ModuleType):
            return i
    return None


def _walk(found: Any, parts: list[str], dynamic: bool) -> Any:
    """`found.a.b...`, or `_ABSENT`. A module's attributes are read from its
    namespace (a module's `__getattr__` may import); a class's only if they
    are there without running anything (`getattr_static`), then, if
    `dynamic` (the class is in an allowed module), through `getattr`, which
    binds a classmethod as the save recorded it."""
    for part in parts:
        if isinstance(found, types.ModuleType):
            found = vars(found).get(part, _ABSENT)
        else:
            static = inspect.getattr_static(found, part, _ABSENT)
            if static is _ABSENT or not dynamic:
                found = static
            else:
                try:
                    found = getattr(found, part)
                except Exception:
                    found = _ABSENT
        if found is _ABSENT:
            return _ABSENT
    return found


def _import(module_name: str) -> Any:
    """An allowed module, imported: the module, None if there is no such
    module, or `Refused` if importing it failed. A module that exits or is
    interrupted while imported stops the rebuild with a `RebuildError`."""
    module = sys.modules.get(module_name)
    if isinstance(module, types.ModuleType):
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (
            module_name == e.name or module_name.startswith(e.name + ".")
        ):
            return None
        return Refused(f"cannot be imported: importing `{module_name}` failed ({e})")
    except (SystemExit, KeyboardInterrupt) as e:
        what = (
            f"exited (SystemExit({e.code!r}))"
            if isinstance(e, SystemExit)
            else "was interrupted (KeyboardInterrupt)"
        )
        raise RebuildError(
            f"Importing `{module_name}`, which `allow` names, {what}: it runs a "
            "program when imported instead of only defining names (a script, or "
            "a package's command line). Remove it from `allow`, and allow the "
            "module that defines the classes instead."
        ) from e
    except Exception as e:
        return Refused(
            f"cannot be imported: importing `{module_name}` failed "
            f"({type(e).__name__}: {e})"
        )

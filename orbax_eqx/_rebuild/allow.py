"""`allow=`: the modules a rebuild may import, and looking names up under it.

A checkpoint names classes and functions as `module.qualname`. A name is
looked up only if some prefix of it is a module inside `allow` (a name there
allows that module and its submodules); nothing else is imported, whatever
the sidecar says. The object found must carry exactly the recorded name
(`__module__` + `__qualname__`), so that an allowed module cannot be used as
a way to reach something imported into it (`mypkg.os.system` is refused).
Nothing found is called here.
"""

import dataclasses
import importlib
import keyword
import sys
import types
from collections.abc import Iterable
from typing import Any

from .._tree.values import qualified_name


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why a name cannot be looked up, and which name `allow` would need."""

    reason: str
    allow: str | None = None  # the module to add to `allow`, if that helps


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
    return names


def is_module_name(text: str) -> bool:
    parts = text.split(".")
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)


def allowed(module: str, allow: tuple[str, ...]) -> bool:
    """Whether `module` is in `allow` or a submodule of a module there."""
    return any(module == a or module.startswith(a + ".") for a in allow)


def suggestion(name: str) -> str:
    """The module to allow for a qualified name: its top-level package."""
    return name.split(".", 1)[0]


def unnameable(name: str) -> str | None:
    """Why `name` cannot be looked up whatever `allow` says, or None."""
    if "<locals>" in name:
        return "is defined inside a function, so it cannot be imported by name"
    if name.endswith(_LAMBDA) and is_module_name(name[: -len(_LAMBDA)]):
        return None  # a module-level lambda: see `_only_lambda`
    if "<lambda>" in name:
        return "is a lambda, which cannot be imported by name"
    if not is_module_name(name) or "." not in name:
        return "is not a `module.name` that can be imported"
    return None


def look_up(name: str, allow: tuple[str, ...]) -> Any:
    """The object named `name`, importing only modules inside `allow`.

    Returns a `Refused` instead if it is outside `allow` or cannot be found.
    """
    why = unnameable(name)
    if why is not None:
        return Refused(why)
    if name.endswith(_LAMBDA):
        return _only_lambda(name[: -len(_LAMBDA)], allow)
    parts = name.split(".")
    tried = False
    # The longest module first: `pkg.models.Block` is `Block` of `pkg.models`
    # unless there is no module `pkg.models`.
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        if not allowed(module_name, allow):
            continue
        tried = True
        module = _import(module_name)
        if module is None:
            continue
        if isinstance(module, Refused):
            return module
        found: Any = module
        for part in parts[i:]:
            found = getattr(found, part, _ABSENT)
            if found is _ABSENT:
                return Refused(
                    f"is not in module `{module_name}` (there is no "
                    f"`{'.'.join(parts[i:])}` there now)"
                )
        if qualified_name(found) != name:
            return Refused(
                f"is not what `{name}` names now: that is `{qualified_name(found)}`"
            )
        return found
    if not tried:
        return _outside(suggestion(name))
    return Refused("cannot be imported: no module of it is installed")


_ABSENT = object()


def _outside(module: str) -> Refused:
    return Refused(f"is outside `allow` (to allow it: `{module}`)", module)


_LAMBDA = ".<lambda>"


def _only_lambda(module_name: str, allow: tuple[str, ...]) -> Any:
    """A lambda bound at the top level of `module_name` (as Equinox's
    `_identity = lambda x: x`), found if it is the only one there."""
    if not allowed(module_name, allow):
        return _outside(suggestion(module_name))
    module = _import(module_name)
    if module is None:
        return Refused("cannot be imported: no module of it is installed")
    if isinstance(module, Refused):
        return module
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


def _import(module_name: str) -> Any:
    """The module, None if there is no such module, or `Refused` if importing
    it failed."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (
            module_name == e.name or module_name.startswith(e.name + ".")
        ):
            return None
        return Refused(f"cannot be imported: importing `{module_name}` failed ({e})")
    except Exception as e:
        return Refused(
            f"cannot be imported: importing `{module_name}` failed "
            f"({type(e).__name__}: {e})"
        )

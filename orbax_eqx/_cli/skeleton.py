"""Skeletons named on the command line as `module:function`.

`module:function` (or `path/to/file.py:function`) names a function of no
arguments that returns the skeleton, usually `eqx.filter_eval_shape(make,
key)`: unlike a checkpoint, this runs the user's code, which is the point.
A file is imported under the name the user's own code imports it by
(`path/to/tmodel.py` as `tmodel`; in a package, as `package.tmodel`), since a
checkpoint records classes by that name; a file no name imports is refused.
"""

import importlib
import os
import sys
from typing import Any

from .._bytes.route import is_remote
from .._errors import OrbaxEqxError, first_line


class SkeletonError(OrbaxEqxError, ValueError):
    """A `module:function` skeleton cannot be imported or built."""


def looks_like_spec(text: str) -> bool:
    """Whether `text` names a skeleton (`module:function`) rather than a path."""
    if is_remote(text) or os.path.exists(text):
        return False
    module, sep, function = text.rpartition(":")
    return bool(sep and module and function)


def load(spec: str) -> Any:
    """Imports `module:function` (or `file.py:function`) and returns `function()`."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise SkeletonError(
            f"{spec!r} is not a skeleton: expected `module:function`, such as "
            "`my_model:skeleton`, naming a function of no arguments."
        )
    if module_name.endswith(".py"):
        module = _import_file(spec, module_name)
    else:
        module = _import(spec, module_name)
    target: Any = module
    for part in function_name.split("."):
        if not hasattr(target, part):
            raise SkeletonError(
                f"Module `{module_name}` ({getattr(module, '__file__', '?')}) has no "
                f"`{function_name}`, asked for by the skeleton {spec!r}. Check the "
                "name after the colon."
            )
        target = getattr(target, part)
    if not callable(target):
        raise SkeletonError(
            f"`{spec}` names a value of type {type(target).__name__}, not a "
            "function; the skeleton must be given by a function of no arguments "
            "that returns it."
        )
    try:
        return target()
    except Exception as e:
        raise _failed(f"Calling `{spec}()`", e) from e


def _import(spec: str, module_name: str):
    # As `python -m` does, so that `module:function` finds modules in the
    # current directory under the `orbax-eqx` script too.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise SkeletonError(
                f"Cannot import module `{module_name}` for the skeleton {spec!r} (no "
                f"module named {e.name!r}). Run from the directory that holds it, "
                "add that directory to PYTHONPATH, or give a file: "
                "`path/to/file.py:function`."
            ) from None
        raise _failed(f"Importing `{module_name}`", e) from e
    except Exception as e:
        raise _failed(f"Importing `{module_name}`", e) from e


# Skeleton files this process imported, by module name.
_ours: dict[str, Any] = {}


def _import_file(spec: str, file: str):
    """Imports `path/to/name.py` as `import name` (or `import package.name`)
    would, so that a checkpoint saved from its classes restores into
    `name.skeleton()` imported normally."""
    path = os.path.abspath(file)
    if not os.path.isfile(path):
        raise SkeletonError(f"{path}, named by the skeleton {spec!r}, does not exist.")
    root, dotted = _module_name(spec, path)
    loaded = sys.modules.get(dotted)
    same = loaded is not None and _same_file(getattr(loaded, "__file__", None), path)
    if loaded is not None and _ours.get(dotted) is loaded and not same:
        # A skeleton file of this name that the command line loaded before
        # (`diff dir1/model.py:f dir2/model.py:f`): the name now means this one.
        del sys.modules[dotted]
    was_imported = dotted in sys.modules
    if root in sys.path:  # first, so that this file is the one found
        sys.path.remove(root)
    sys.path.insert(0, root)
    importlib.invalidate_caches()  # a file written since the last import
    try:
        module = importlib.import_module(dotted)
    except Exception as e:
        raise _failed(f"Importing {path}", e) from e
    found = getattr(module, "__file__", None)
    if not _same_file(found, path):
        imports = "is already imported from" if was_imported else "imports"
        raise SkeletonError(
            f"{path}, named by the skeleton {spec!r}, would be imported as "
            f"`{dotted}`, but `{dotted}` {imports} {found or 'a built-in module'}: "
            "its classes would be recorded under another module's name. Rename the "
            "file, or give the skeleton as `module:function` with its directory on "
            "PYTHONPATH."
        )
    _ours[dotted] = module
    return module


def _module_name(spec: str, path: str) -> tuple[str, str]:
    """The directory to import the file from, and its dotted module name
    there (with the packages it is in)."""
    root, parts = os.path.split(path)[0], [os.path.basename(path)[:-3]]
    while os.path.isfile(os.path.join(root, "__init__.py")):  # in a package
        parent, name = os.path.split(root)
        if not name.isidentifier() or parent == root:
            break
        parts.insert(0, name)
        root = parent
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if not parts or not all(p.isidentifier() for p in parts):
        stem = os.path.basename(path)[:-3]
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
        raise SkeletonError(
            f"{path}, named by the skeleton {spec!r}, cannot be imported by name: "
            f"{stem!r} is not a Python module name, and the classes in it would be "
            "recorded under a name that no `import` finds, so the checkpoint would "
            "not restore into the same skeleton imported normally. Rename the file "
            f"to a valid module name (such as "
            f"{name if name.isidentifier() else '_' + name}.py)."
        )
    return root, ".".join(parts)


def _same_file(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _failed(what: str, error: BaseException) -> SkeletonError:
    return SkeletonError(
        f"{what} for the skeleton failed: {type(error).__name__}: "
        f"{first_line(error, '')} (--debug shows where)."
    )


def load_mapping(path: str | None, skeleton: str | None) -> Any:
    """The `--mapping` file, resolved against the `--skeleton` if given."""
    if path is None:
        return None
    from .._mapping.mapping import StateDictMapping

    found = StateDictMapping.from_file(path)
    return found if skeleton is None else found.resolve(load(skeleton))

"""One spelling of each set of options: a function that passes its keyword
options on to the class that holds them (`oeqx.restore` to `EqxRestore`) is
typed, for editors and `mypy --strict`, with that class's parameters."""

import inspect
import os
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
Directory = str | os.PathLike[str]


def typed_like(
    options: Callable[P, Any],
) -> Callable[[Callable[..., R]], Callable[Concatenate[Directory, P], R]]:
    """Types the decorated `f(directory, ...)` as taking `directory`, then
    `options`' own parameters; `f` passes them on to `options` itself.

    Type checkers then catch a misspelt option (naming `f`), and
    `inspect.signature` and `help()` show every parameter; the function is
    otherwise unchanged.
    """

    def wrap(f: Callable[..., R]) -> Callable[Concatenate[Directory, P], R]:
        first = next(iter(inspect.signature(f).parameters.values()))
        rest = inspect.signature(options).parameters.values()
        f.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [first, *rest], return_annotation=inspect.signature(f).return_annotation
        )
        return f

    return wrap

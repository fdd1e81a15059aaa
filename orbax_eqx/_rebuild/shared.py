"""Stand-ins for `eqx.nn.Shared`'s `where` and `get`, from recorded key paths.

`Shared` ties nodes with two functions, usually lambdas, which cannot be
imported by name. A save records which nodes of `Shared.pytree` each one
selects (`_tree/nodes.py`); a rebuild puts in their place a `Selector` that
selects the same nodes. It carries the recorded function's name, so that it
compares equal to the checkpoint's record, and selects by attribute, index
and key only: it runs no code of the checkpoint's.
"""

from typing import Any


class Selector:
    """Selects the nodes at recorded key paths, as the saved `where`/`get` did."""

    def __init__(self, name: str, many: bool, paths: list[list[list[Any]]]):
        module, _, qualname = name.partition(".")
        # What `qualified_name` reads: the record's name, unchanged.
        self.__module__ = module
        self.__qualname__ = qualname
        self._many = many
        self._paths = [[(kind, key) for kind, key in path] for path in paths]

    def __call__(self, tree: Any) -> Any:
        found = [_select(tree, path) for path in self._paths]
        return tuple(found) if self._many else found[0]

    def __repr__(self) -> str:
        paths = ["".join(_show(step) for step in path) for path in self._paths]
        return f"<selects {', '.join(paths)}: stands in for {self.__module__}." + (
            f"{self.__qualname__}>"
        )


def is_path(path: Any) -> bool:
    """Whether `path` is a recorded key path: `[[kind, key], ...]`."""
    return isinstance(path, list) and all(
        isinstance(step, list)
        and len(step) == 2
        and (
            (step[0] == "attr" and isinstance(step[1], str))
            or (step[0] in ("index", "key") and type(step[1]) in (int, str))
        )
        for step in path
    )


def _select(tree: Any, path) -> Any:
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def _show(step) -> str:
    kind, key = step
    return f".{key}" if kind == "attr" else f"[{key!r}]"

"""The checks of a load, all before any tensor byte is read: every leaf of the
skeleton against the tensors, every problem at once, each with its fix.

As a restore checks a skeleton against a sidecar: leaves with no tensor,
tensors that fill no leaf (unless `allow_unused`), shapes, dtypes (unless
`cast`), typed PRNG keys' data, and, for files written by `export` (which
record them in `__metadata__`), module classes and static fields (unless
`ignore_static`). The fixes are worded for who asked: the Python API names
its arguments (`cast=True`), the command line its flags (`--cast`).
"""

import json
from typing import Any

from .._errors import inline_list, some
from .._mapping.errors import BridgeError
from .._mapping.wording import API as API
from .._mapping.wording import CLI as CLI
from .._mapping.wording import Words
from .._restore.classes import explain
from .._tree.names import label
from .._tree.values import describe, too_deep
from .._tree.walk import ARRAY, Walked, key_impl
from .safetensors.header import Header, SafetensorsError, TensorInfo
from .specs import data_of, is_key

METADATA_ENTRY = "orbax_eqx"  # the key of our JSON in `__metadata__`


class MismatchError(SafetensorsError, BridgeError):
    """The safetensors files do not fit the skeleton (or the mapping); `head`,
    `problems` and `fixes` say it in parts (where the checks here found it)."""

    head: str | None = None
    problems: list[str] | None = None
    fixes: list[str] | None = None


class Problems:
    """Problems and their fixes, each fix once, in the order first needed."""

    def __init__(self):
        self.problems: list[str] = []
        self.fixes: list[str] = []

    def add(self, problem: str, fix: str | None = None) -> None:
        self.problems.append(problem)
        if fix is not None and fix not in self.fixes:
            self.fixes.append(fix)

    def also(self, source: str) -> str:
        """These problems, after a mapping's own (`BridgeError`)."""
        return (
            f"\nAnd the skeleton does not fit what the safetensors at {source} "
            f"record of the model: {inline_list(self.problems)}. To fix: "
            f"{'; '.join(self.fixes)}."
        )

    def raise_if_any(self, source: str) -> None:
        if not self.problems:
            return
        n = len(self.problems)
        head = (
            f"The skeleton does not fit the safetensors at {source} "
            f"({n} problem{'s' if n > 1 else ''})"
        )
        fixes = f" To fix: {'; '.join(self.fixes)}." if self.fixes else ""
        error = MismatchError(f"{head}: {inline_list(self.problems)}.{fixes}")
        # The same, as fields: for the command line, one problem a line.
        error.head, error.problems, error.fixes = head, self.problems, self.fixes
        raise error


def names(items: list[str], limit: int = 3) -> str:
    return some([f"`{n}`" for n in items], limit)


def by_name(
    walked: Walked,
    by_leaf: dict[str, str],
    tensors: dict[str, TensorInfo],
    cast: bool,
    allow_unused: bool,
    words: Words,
    out: Problems,
) -> None:
    """Leaves matched to tensors one to one by name (`by_leaf`: leaf name ->
    tensor name), as without a mapping or through renames."""
    arrays = [leaf for leaf in walked.leaves if leaf.kind == ARRAY]
    missing = [leaf.name for leaf in arrays if leaf.name not in by_leaf]
    if missing:
        out.add(
            f"{len(missing)} leaf(s) have no tensor: {names(missing)}", words.rename
        )
    wanted = {leaf.name for leaf in arrays}
    unused = [old for new, old in by_leaf.items() if new not in wanted]
    if unused and not allow_unused:
        out.add(
            f"{len(unused)} tensor(s) fill no leaf: {names(unused)}",
            words.allow_unused,
        )
    for leaf in arrays:
        if leaf.name in by_leaf:
            tensor = by_leaf[leaf.name]
            problem, fix = compare(leaf, tensor, tensors[tensor], cast, words)
            if problem:
                out.add(problem, fix)


def compare(leaf, tensor: str, info: TensorInfo, cast: bool, words: Words):
    """`(problem, fix)` if tensor `tensor` cannot fill `leaf`; else Nones."""
    x = leaf.value
    where = f"leaf {leaf.label}"
    what = f"tensor `{tensor}`" if tensor != leaf.name else "its tensor"
    if is_key(leaf):
        shape, dtype = data_of(x.dtype, ())
        shape = tuple(x.shape) + shape
        if (info.shape, info.dtype) != (shape, dtype):
            return (
                f"{where} is a {key_impl(x.dtype)} key array, whose key data is "
                f"{dtype}{list(shape)}, but {what} is {info.dtype}{list(info.shape)}",
                "export keys with `jax.random.key_data`",
            )
        return None, None
    if info.shape != tuple(x.shape):
        return (
            f"{where} has shape {tuple(x.shape)} in the skeleton but {what} has "
            f"{info.shape}",
            "build the skeleton of the model the tensors are for",
        )
    if info.dtype != str(x.dtype) and not cast:
        return f"{where} is {x.dtype} in the skeleton but {what} is {info.dtype}", (
            words.cast
        )
    return None, None


def ours(headers: list[Header]) -> dict[str, Any]:
    """What `export` recorded in `__metadata__`, or `{}` for files written by
    anything else (or damaged: it only ever adds checks and Python leaves)."""
    for h in headers:
        text = h.metadata.get(METADATA_ENTRY)
        if text is not None:
            try:
                content = json.loads(text)
            except (ValueError, RecursionError):
                return {}
            # Nested deeper than `export` writes: its descriptions would recurse.
            if not isinstance(content, dict) or too_deep(content):
                return {}
            return content
    return {}


def statics(walked: Walked, saved_modules: Any, words: Words, out: Problems) -> None:
    """Module classes and static fields against those `export` recorded."""
    if not isinstance(saved_modules, dict):
        return
    for name, module in walked.modules.items():
        saved = saved_modules.get(name)
        if not isinstance(saved, dict):
            continue
        cls = saved.get("class")  # checked as `restore` checks it
        if isinstance(cls, str) and cls != module.cls:
            why = explain(module.cls, cls, "what they came from")
            out.add(
                f"module {label(name, module.path)} is `{module.cls}` in the "
                f"skeleton but `{cls}` in the files{why}",
                words.ignore_static,
            )
        theirs = saved.get("static", {})
        if not isinstance(theirs, dict):
            continue
        for field in sorted(set(module.static) | set(theirs)):
            mine = (
                describe(module.static[field]) if field in module.static else "absent"
            )
            other = describe(theirs[field]) if field in theirs else "absent"
            if mine != other:
                out.add(
                    f"static field `{field}` of module {label(name, module.path)} "
                    f"is {mine} in the skeleton but {other} in the files",
                    words.ignore_static,
                )

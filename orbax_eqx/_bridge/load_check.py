"""The checks of a load, before any tensor byte is read: leaves matched by name
planned as through a mapping (`_mapping.plan`), and for files `export` wrote,
module classes and static fields compared as a restore compares them."""

import json
import types
from typing import Any

from .._mapping.errors import BridgeError
from .._mapping.plan import LeafSpec, TensorSpec, checked_load, leaf_specs
from .._mapping.stage import Problem
from .._mapping.wording import message
from .._restore.check import compare_module
from .._tree.values import too_deep
from .._tree.walk import Walked
from .safetensors.header import Header, SafetensorsError, TensorInfo

METADATA_ENTRY = "orbax_eqx"  # the key of our JSON in `__metadata__`
STORED = "the files"  # what holds the modules `export` records, in messages
_FIX_STATIC = "Pass `ignore_static=True` to keep the skeleton's."


class MismatchError(SafetensorsError, BridgeError):
    """The safetensors files do not fit the skeleton (or the mapping)."""


class Problems:
    """Problems found and their fixes, each fix once, in the order first needed."""

    def __init__(self):
        self.problems: list[Problem] = []
        self.fixes: list[str] = []

    def add(self, problem: Problem) -> None:
        self.problems.append(problem)
        self.fixes.extend(f for f in problem.fixes if f not in self.fixes)

    def also(self, source: str) -> str:
        """These problems, after a mapping's own (`BridgeError`)."""
        head = (
            f"And the skeleton does not fit what the safetensors at {source} "
            "record of the model"
        )
        return "\n" + message(head, self.problems, self.fixes)

    def raise_if_any(self, source: str) -> None:
        if self.problems:
            head = f"The skeleton does not fit the safetensors at {source}"
            raise MismatchError(message(head, self.problems, self.fixes))


def by_name(
    walked: Walked,
    by_leaf: dict[str, str],
    tensors: dict[str, TensorInfo],
    cast: bool,
    allow_unused: bool,
    out: Problems,
) -> None:
    """Leaves matched to tensors one to one by name (`by_leaf`: leaf name ->
    tensor name), planned with each leaf named as the tensor it reads."""
    leaves = [
        LeafSpec(by_leaf.get(s.name, s.name), s.label, s.shape, s.dtype, s.key)
        for s in leaf_specs(walked)
    ]
    given = [
        TensorSpec(name, tensors[name].shape, tensors[name].dtype)
        for name in dict.fromkeys(by_leaf.values())
    ]
    _, ctx = checked_load(None, leaves, given, cast=cast, allow_unused=allow_unused)
    for problem in ctx.problems:
        out.add(problem)


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


def statics(walked: Walked, saved_modules: Any, out: Problems) -> None:
    """Module classes and static fields against those `export` recorded."""
    if not isinstance(saved_modules, dict):
        return
    for name, module in walked.modules.items():
        saved = saved_modules.get(name)
        if not isinstance(saved, dict):
            continue
        cls, static = saved.get("class"), saved.get("static", {})
        record = types.SimpleNamespace(
            cls=cls if isinstance(cls, str) else module.cls,
            static=static if isinstance(static, dict) else module.static,
        )
        for problem in compare_module(name, module, record, stored=STORED):
            out.add(Problem(problem.text, (_FIX_STATIC,), static=True))

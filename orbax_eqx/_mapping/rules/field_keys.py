"""`field_keys`: a field declared `eqx.field(metadata={"state_dict_key": "c_attn"})`
is called `c_attn` in the tensors' names (`""` leaves its part out). Read
from the tree; `StateDictMapping.resolve` writes them out as a plain `rename`."""

import dataclasses
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ..._tree.names import join, key_part
from ..._tree.walk import Walked
from ..errors import MappingError
from ..stage import Context, Virtual
from ..templates import escape
from .base import Rule, Text
from .rename import Rename


class FieldKeys(Rule, frozen=True, tag="field_keys"):
    key: Text = "state_dict_key"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        ctx.problem(
            f"{ctx.at_rule()} reads field metadata from a tree, but the mapping was "
            "applied to names only.",
            "Resolve the mapping against the model first: "
            "`mapping.resolve(model_or_skeleton)` turns field keys into renames.",
        )
        return virtuals

    def resolve(self, tree: Any, walked: Walked) -> Rename:
        """The renames the tree's fields ask for, as a plain `rename` rule."""
        renames: dict[str, str] = {}
        problems: list[str] = []
        for leaf in walked.leaves:
            parts = [key_part(entry) for entry in leaf.path]
            if join(parts) != leaf.name:
                continue  # inside an `eqx.nn.State`: no fields there
            node: Any = tree
            new: list[str] = []
            for k, entry in enumerate(leaf.path):
                part = parts[k]
                if isinstance(entry, jtu.GetAttrKey) and isinstance(node, eqx.Module):
                    value = _field_key(type(node), entry.name, self.key, problems)
                    if value is not None:
                        new = new + ([value] if value else [])
                        old_prefix = join(parts[: k + 1])
                        renames.setdefault(old_prefix, join(new))
                        node = _child(node, entry)
                        continue
                new = new + [part]
                node = _child(node, entry)
                if node is _MISSING:
                    break
        if problems:
            raise MappingError(
                "Some field keys are not names:\n  - "
                + "\n  - ".join(dict.fromkeys(problems))
                + f'\nGive `metadata={{"{self.key}": ...}}` a string: the part that '
                'names the field in the tensors, or "" to leave the part out.'
            )
        if not renames:
            raise MappingError(
                f"The `field_keys` rule of key {self.key!r} finds no field declared "
                f'with `eqx.field(metadata={{"{self.key}": ...}})` in the tree. '
                "Declare the keys on the model's fields, or leave the rule out."
            )
        # Entries are exact names (escaped as templates), longest prefix first
        # wins in `rename`, so nested keys compose.
        return Rename({escape(old): escape(new) for old, new in renames.items()})


_MISSING = object()


def _child(node: Any, entry: Any) -> Any:
    try:
        if isinstance(entry, jtu.GetAttrKey):
            return getattr(node, entry.name)
        if isinstance(entry, jtu.SequenceKey):
            return node[entry.idx]
        if isinstance(entry, jtu.DictKey):
            return node[entry.key]
    except (AttributeError, IndexError, KeyError, TypeError):
        pass
    return _MISSING


def _field_key(cls: type, field: str, key: str, problems: list[str]) -> str | None:
    for f in dataclasses.fields(cls):
        if f.name == field:
            if key not in f.metadata:
                return None
            value = f.metadata[key]
            if not isinstance(value, str):
                problems.append(
                    f"Field `{field}` of `{cls.__qualname__}` has "
                    f"{key}={value!r}, not a string."
                )
                return None
            return value
    return None

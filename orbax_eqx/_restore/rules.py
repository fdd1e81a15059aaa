"""`shardings_from_rules`: target shardings from `(regex, PartitionSpec)` rules
on leaf names, every rule checked against the mesh when built, every leaf
against its rule before any array is read."""

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._errors import ShardingRuleError

_CATCH_ALL_FIX = (
    "Add a rule that matches it, or end the rules with a catch-all "
    '`(r".*", P())` to replicate every other leaf.'
)


class _Rule:
    def __init__(self, index: int, pattern: re.Pattern, spec: PartitionSpec, mesh):
        self.index = index
        self.pattern = pattern
        self.spec = spec
        self.sharding = NamedSharding(mesh, spec)

    def __str__(self) -> str:
        return f"rule {self.index} ({_literal(self.pattern)}, {self.spec})"


def shardings_from_rules(
    mesh: Mesh, rules: Sequence[tuple[str | re.Pattern, PartitionSpec]]
) -> Callable[[str, Any], jax.sharding.Sharding]:
    """Turns rules on leaf names into the target sharding of every array.

    **Arguments:**

    - `mesh`: the `jax.sharding.Mesh` to restore onto (e.g. `jax.make_mesh`).
    - `rules`: `(pattern, PartitionSpec)` pairs. A pattern is a regular
        expression searched (`re.search`) in each leaf's *name*, such as
        `blocks.0.attn.q_proj.weight` (`python -m orbax_eqx inspect` lists
        them; no leading dot, so `(^|\\.)attn\\.` also matches a top-level
        `attn`). The first rule that matches a leaf gives its sharding,
        `NamedSharding(mesh, spec)`.

    **Returns:** a function `(leaf name, leaf) -> Sharding`, to pass as
    `EqxRestore(skeleton, shardings=...)` or `oeqx.restore(..., shardings=...)`.

    Malformed rules, and rules naming an axis the mesh lacks or one axis
    twice, are an error here. A leaf that no rule matches, a spec with more
    entries than the leaf has dimensions, and a dimension that does not divide
    evenly over its mesh axes (JAX shards only evenly) are errors on restore,
    before any array is read, naming every such leaf.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((2, 4), ("data", "model"))
        shardings = oeqx.shardings_from_rules(mesh, [
            (r"\\.attn\\..*\\.weight$", P(None, "model")),
            (r"embed", P("model", None)),
            (r".*", P()),  # everything else: replicated
        ])
        model = mngr.restore(step, args=oeqx.EqxRestore(skeleton, shardings=shardings))
        ```
    """
    if not isinstance(mesh, Mesh):
        raise ShardingRuleError(
            [f"`mesh` is a {type(mesh).__name__}, not a jax.sharding.Mesh."],
            "Pass a concrete mesh of devices, e.g. "
            '`jax.make_mesh((2, 4), ("data", "model"))`.',
        )
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ShardingRuleError(
            [f"`rules` is a {type(rules).__name__}, not a list of pairs."],
            'Pass a list of `(pattern, PartitionSpec)` pairs, e.g. `[(r".*", P())]`.',
        )
    checked = [_check_rule(i, rule, mesh) for i, rule in enumerate(rules)]

    def sharding(name: str, leaf: Any) -> jax.sharding.Sharding:
        for rule in checked:
            if rule.pattern.search(name):
                _check_leaf(name, tuple(leaf.shape), rule, mesh)
                return rule.sharding
        raise ShardingRuleError(
            [f"Leaf `{name}` matches no sharding rule."], _CATCH_ALL_FIX
        )

    return sharding


def _check_rule(index: int, rule: Any, mesh: Mesh) -> _Rule:
    fix = (
        "Each rule is a `(pattern, PartitionSpec)` pair, e.g. "
        '`(r"\\.attn\\..*\\.weight$", P(None, "model"))`.'
    )
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
        raise ShardingRuleError([f"Rule {index} is {rule!r}, not a pair."], fix)
    pattern, spec = rule
    if not isinstance(pattern, (str, re.Pattern)):
        raise ShardingRuleError(
            [f"Rule {index}: the pattern is a {type(pattern).__name__}, not a str."],
            fix,
        )
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ShardingRuleError(
            [
                f"Rule {index}: the pattern {pattern!r} is not a regular "
                f"expression: {e}."
            ],
            fix,
        ) from None
    if not isinstance(spec, PartitionSpec):
        raise ShardingRuleError(
            [
                f"Rule {index} ({_literal(compiled)}): the spec is a "
                f"{type(spec).__name__}, not a jax.sharding.PartitionSpec."
            ],
            fix,
        )
    _check_axes(f"Rule {index} ({_literal(compiled)}, {spec})", spec, mesh)
    return _Rule(index, compiled, spec, mesh)


def _check_axes(rule: str, spec: PartitionSpec, mesh: Mesh) -> None:
    """Raises unless `spec` (of `rule`, as a message names it) names axes of
    `mesh`, each once."""
    axes = [axis for entry in spec for axis in _axes(entry)]
    unknown = [axis for axis in axes if axis not in mesh.shape]
    if unknown:
        raise ShardingRuleError(
            [
                f"{rule} names mesh axis "
                f"{', '.join(repr(a) for a in unknown)}, but the mesh has axes "
                f"{tuple(mesh.axis_names)}."
            ],
            "Use the mesh's axis names in the PartitionSpec, or build the mesh "
            "with the axes the rules name.",
        )
    repeated = sorted({axis for axis in axes if axes.count(axis) > 1})
    if repeated:
        raise ShardingRuleError(
            [
                f"{rule} uses mesh axis "
                f"{', '.join(repr(a) for a in repeated)} for more than one dimension."
            ],
            "Shard each mesh axis over at most one dimension of a leaf.",
        )


def _check_leaf(name: str, shape: tuple[int, ...], rule: _Rule, mesh: Mesh) -> None:
    if len(rule.spec) > len(shape):
        raise ShardingRuleError(
            [
                f"Leaf `{name}` has shape {shape} (rank {len(shape)}), but {rule} "
                f"that matches it has {len(rule.spec)} entries."
            ],
            "Put an earlier rule for such a leaf, with at most one entry per "
            'dimension (e.g. `(r"^leaf\\.name$", P())`), or narrow the pattern '
            "so that it does not match it.",
        )
    for dim, entry in enumerate(rule.spec):
        axes = _axes(entry)
        ways = math.prod(mesh.shape[axis] for axis in axes)
        if ways > 1 and shape[dim] % ways:
            over = " x ".join(f"{a!r} ({mesh.shape[a]})" for a in axes)
            raise ShardingRuleError(
                [
                    f"Leaf `{name}` has shape {shape}: dimension {dim} (size "
                    f"{shape[dim]}) does not divide evenly over mesh axis {over}, "
                    f"as {rule} asks."
                ],
                "JAX shards a dimension only into equal parts: replicate such a "
                "dimension (None in the PartitionSpec) with an earlier rule for "
                "the leaf, or pad it to a multiple of its mesh axes' size.",
            )


def _literal(pattern: re.Pattern) -> str:
    """The pattern as the user would have written it, a raw string if it can be."""
    text = pattern.pattern
    return f"r'{text}'" if "'" not in text and not text.endswith("\\") else repr(text)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)

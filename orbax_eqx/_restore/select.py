"""Which checkpoint leaves a restore reads, and under which skeleton names.

`prefix=` puts a leaf name before every skeleton leaf name (`layers.0.weight`
with `prefix="model.encoder"` is the checkpoint's
`model.encoder.layers.0.weight`); `renames=` then maps those names to the
checkpoint's, through a `StateDictMapping` (`renames`). What comes out is a
*view* of the sidecar, keyed by the names the skeleton asks for; its records
keep their checkpoint names, which is what the arrays are stored under. A
mapping that changes arrays (a split, a fuse) also gives a plan: the pieces
of checkpoint leaves that fill each skeleton leaf (`Selection.plan`).

Under a prefix, the skeleton's names are those it would have had inside the
saved tree, found by walking it wrapped in one dict per part of the prefix.
"""

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu

from .._errors import (
    CheckpointMismatchError,
    OrbaxEqxWarning,
    bullet_list,
    warn_user,
)
from .._format.sidecar import Metadata
from .._mapping.mapping import StateDictMapping
from .._mapping.names import ignores, through
from .._mapping.plan import LeafSpec, Plan, TensorSpec, data_of, plan_restore
from .._mapping.rules.field_keys import FieldKeys
from .._mapping.rules.rename import Rename
from .._mapping.rules.rename_regex import RenameRegex
from .._mapping.stage import Context, examples
from .._mapping.wording import planned
from .._tree.names import ESCAPE, SEPARATOR, join, label
from .._tree.walk import ARRAY, Leaf, Walked, parse_dtype, walk
from .renames import (
    RenameError,
    Renames,
    as_mapping,
    raise_rule_problems,
    unused_targets,
)


class KeptLeavesWarning(OrbaxEqxWarning):
    """A restore with `missing="keep"` kept some skeleton leaves as they were."""


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What a restore did besides reading arrays; see `EqxRestore(report=True)`.

    **Attributes:**

    - `kept`: leaf names of the skeleton leaves that no checkpoint leaf
        filled, kept from the skeleton (`missing="keep"`), e.g. `head.weight`.
    - `unread`: leaf names of the checkpoint leaves that were not restored:
        outside `prefix=`, ignored by `renames=`, or absent from the skeleton
        (`strict=False`).
    - `renamed`: `{checkpoint leaf name: skeleton leaf name}` for every leaf
        that `renames=` renamed (`None`: left unread).
    """

    kept: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()
    renamed: dict[str, str | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The checkpoint as the skeleton sees it.

    With a `plan` (a mapping that changes arrays), the skeleton's array leaves
    it fills (`planned`, by target name) have no record in `saved`: a reader
    fills each from `plan.leaf_pieces(target name, box)`, pieces of the
    checkpoint leaves `piece.tensor` (names of `Metadata.leaves`), and the
    check skips them (`check(..., planned=selection.planned)`): the planner
    checked them already.
    """

    saved: Metadata  # leaves and modules keyed by target names, under the prefix
    prefix: str | None
    renamed: dict[str, str | None]  # checkpoint name -> skeleton name, if changed
    targets: dict[str, str]  # skeleton leaf or module name -> target name
    everything: tuple[str, ...]  # every checkpoint leaf name
    plan: Plan | None = None
    planned: frozenset[str] = frozenset()

    def target(self, name: str) -> str:
        """The name a skeleton leaf or module is looked for under."""
        return self.targets.get(name, name)

    def report(self, walked: Walked, kept: list[Leaf]) -> RestoreReport:
        """What a restore of `walked` did, once `kept` leaves were kept."""
        skipped = {leaf.name for leaf in kept}
        restored: set[str] = set()
        for leaf in walked.leaves:
            name = self.target(leaf.name)
            if leaf.name in skipped:
                continue
            if name in self.planned and self.plan is not None:
                restored.update(p.tensor for p in self.plan.leaf_pieces(name))
            elif name in self.saved.leaves:
                restored.add(self.saved.leaves[name].name)
        return RestoreReport(
            kept=tuple(leaf.name for leaf in kept),
            unread=tuple(n for n in self.everything if n not in restored),
            renamed=dict(self.renamed),
        )


def warn_kept(report: RestoreReport, where: str) -> None:
    """Says which leaves were kept from the skeleton.

    They were asked for, but worth a word: a mistyped rename would otherwise
    leave a layer at its fresh initialisation without any other sign.
    """
    n = len(report.kept)
    warn_user(
        f"{n} skeleton {'leaf is' if n == 1 else 'leaves are'} not in the "
        f'checkpoint at {where}, so kept from the skeleton (missing="keep"):\n'
        + bullet_list([label(name) for name in report.kept])
        + "\nPass `report=True` to get this list as a `RestoreReport` instead of "
        "this warning.",
        KeptLeavesWarning,
    )


def targets(prefix: str | None, walked: Walked) -> dict[str, str]:
    """Maps the skeleton's leaf and module names to their names under `prefix`."""
    if not prefix:
        return {}
    keys = [_key(part) for part in split(prefix)]
    plain = {
        name: prefix if name == "" else prefix + SEPARATOR + name
        for name in [leaf.name for leaf in walked.leaves] + list(walked.modules)
    }
    if any(key is None for key in keys):
        return plain  # a part no dict key spells: as if saved there, unwrapped
    tree = jtu.tree_unflatten(walked.treedef, [leaf.value for leaf in walked.leaves])
    for key in reversed(keys):
        tree = {key: tree}
    inside = walk(tree)
    if len(inside.leaves) != len(walked.leaves) or len(inside.modules) != len(
        walked.modules
    ):
        return plain
    result = {a.name: b.name for a, b in zip(walked.leaves, inside.leaves, strict=True)}
    result.update(zip(walked.modules, inside.modules, strict=True))
    return result


def _key(part: str) -> str | int | None:
    """The dict key whose name part is `part` (`_tree.names.key_part` reversed)."""
    if part.startswith(ESCAPE + "("):
        return None  # a key that is neither str nor int
    if re.fullmatch(r"-?[0-9]+", part):
        return int(part)
    return re.sub(r"\\(.?)", r"\1", part, flags=re.DOTALL)


def _under(prefix: str | None, name: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + SEPARATOR)


def check_options(prefix: Any, renames: Any) -> None:
    """Fails early, when `EqxRestore` is made, on options of the wrong form."""
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(
            f"EqxRestore(prefix={prefix!r}): expected a leaf name such as "
            '"model.encoder" (a str), or None.'
        )
    if isinstance(prefix, str) and (
        prefix.startswith(SEPARATOR) or prefix.endswith(SEPARATOR)
    ):
        raise ValueError(
            f"EqxRestore(prefix={prefix!r}): a prefix is a leaf name such as "
            f'"model.encoder", without a leading or trailing `{SEPARATOR}`.'
        )
    as_mapping(renames)


def select(
    saved: Metadata,
    walked: Walked,
    *,
    prefix: str | None,
    renames: Renames | None,
    renames_must_match: bool,
    pieces: bool = False,
    cast: bool = False,
    strict: bool = True,
) -> Selection:
    """Maps the skeleton's names (under `prefix`) to the checkpoint's.

    `pieces` says the caller reads a plan's pieces (`Selection.plan`); without
    it, a mapping that changes arrays is refused. `cast` and `strict` are the
    restore's, for the plan's checks. Raises `RenameError` or
    `CheckpointMismatchError` before any array is read.
    """
    target = targets(prefix, walked)
    mapping = as_mapping(renames)
    if mapping is None and not prefix:
        # The usual restore: every name stays, so the view is the sidecar itself
        # (decided without a rename call and three tables per leaf).
        return Selection(saved, None, {}, target, tuple(saved.leaves))
    mapping = mapping or StateDictMapping()
    if any(isinstance(r, FieldKeys) for r in mapping.rules):
        mapping = mapping.resolve(walked_tree(walked))
    if mapping.names_only:
        return _by_names(saved, walked, target, mapping, prefix, renames_must_match)
    if not pieces:
        raise RenameError(
            "`renames=` changes arrays (its rules split, fuse, stack, transpose, "
            "reshape or cast), which this restore's reader does not take."
        )
    return _by_plan(
        saved, walked, target, mapping, prefix, renames_must_match, cast, strict
    )


def walked_tree(walked: Walked) -> Any:
    return jtu.tree_unflatten(walked.treedef, [leaf.value for leaf in walked.leaves])


def _by_names(saved, walked, target, mapping, prefix, must_match) -> Selection:
    """The view through a mapping of renames only: names in, names out."""
    names = [target.get(leaf.name, leaf.name) for leaf in walked.leaves]
    ctx = Context({}, restore=True)
    trace: dict = {}
    stored = through(mapping, names, ctx, trace)
    if must_match:
        pairs = {
            key: [(names[k], stored[k]) for k in found] for key, found in trace.items()
        }
        unused_targets(mapping, pairs, saved.leaves, ctx)
    raise_rule_problems(ctx, must_match, saved.directory)
    stored_of = dict(zip(names, stored, strict=True))
    view, renamed = _view(saved, walked, target, mapping, prefix, stored_of)
    return Selection(view, prefix or None, renamed, target, tuple(saved.leaves))


def _view(saved, walked, target, mapping, prefix, stored_of, planned=frozenset()):
    """The sidecar keyed by target names: each skeleton leaf's record under its
    name, then the checkpoint's leaves no skeleton leaf reads, under their own
    (within the prefix, unless ignored)."""
    leaves: dict[str, Any] = {}
    read = {}
    for name, stored in stored_of.items():
        if stored in saved.leaves and not ignores(mapping, stored):
            leaves[name] = saved.leaves[stored]
            read[stored] = name
    renamed = {old: new for old, new in read.items() if old != new}
    _add_unread(saved, mapping, prefix, leaves, renamed, read, planned)
    if prefix and not leaves and not planned:
        raise _nothing_under(prefix, saved)
    pairs = [(name, stored) for stored, name in read.items()]
    modules = _modules(saved, walked, target, pairs)
    view = dataclasses.replace(saved, leaves=leaves, modules=modules)
    return view, renamed


def _add_unread(saved, mapping, prefix, leaves, renamed, read, planned) -> None:
    """Adds to `_view`'s `leaves` the checkpoint's leaves that are not `read`
    or `planned`, under their own names (within the prefix, unless ignored:
    those go to `renamed` as None)."""
    clashes = []
    for name, record in saved.leaves.items():
        if name in read or name in planned:
            continue
        if ignores(mapping, name):
            renamed[name] = None
        elif _under(prefix, name) or not prefix:
            if name in leaves:
                clashes.append(
                    f"Checkpoint leaves `{leaves[name].name}` and `{name}` both "
                    f"become `{name}`."
                )
            else:
                leaves[name] = record
    if clashes:
        raise RenameError(
            "With `renames=`, checkpoint leaves would share a name:\n"
            + bullet_list(clashes)
            + "\nRename them to distinct names, or ignore one of them (a dict maps "
            "it to None) to leave it unread."
        )


def _modules(saved, walked, target, pairs) -> dict[str, Any]:
    """The checkpoint's modules by target name: each skeleton module moves with
    its leaves (`layers.0` is the checkpoint's `blocks.0` when
    `layers.0.weight` is read from `blocks.0.weight` and `layers.0.bias` from
    `blocks.0.bias`); one whose leaves disagree is not compared."""
    wanted = {target.get(m, m) for m in walked.modules}
    with_leaves = {
        join(parts[:k])
        for name in (target.get(leaf.name, leaf.name) for leaf in walked.leaves)
        for parts in [split(name)]
        for k in range(len(parts))
    }
    seen: dict[str, set[str | None]] = {}
    for name, stored in pairs:
        parts, stored_parts = split(name), split(stored)
        for k in range(len(parts)):
            module = join(parts[:k])
            if module not in wanted:
                continue
            suffix = parts[k:]
            cut = len(stored_parts) - len(suffix)
            place = join(stored_parts[:cut]) if stored_parts[cut:] == suffix else None
            seen.setdefault(module, set()).add(place)
    out = {}
    for module in wanted:
        # A module without leaves stays put; one none of whose leaves is read
        # (ignored, absent) is not compared.
        places = seen.get(module, {None} if module in with_leaves else {module})
        place = places.pop() if len(places) == 1 else None
        if place is not None and place in saved.modules:
            out[module] = saved.modules[place]
    return out


def _by_plan(saved, walked, target, mapping, prefix, must_match, cast, strict):
    """The view and the plan through a mapping that changes arrays."""
    specs, others = [], []
    for leaf in walked.leaves:
        name = target.get(leaf.name, leaf.name)
        if leaf.kind == ARRAY:
            shape, dtype = data_of(leaf.value.dtype, tuple(leaf.value.shape))
            specs.append(LeafSpec(name, leaf.label, shape, dtype))
        else:
            others.append(name)
    stored = [
        TensorSpec(n, *data_of(parse_dtype(r.dtype), tuple(r.shape or ())))
        for n, r in saved.leaves.items()
        if r.kind == ARRAY
    ]
    outside = {t.name for t in stored if not _under(prefix, t.name)}
    plan, ctx = plan_restore(
        mapping, specs, stored, cast=cast, strict=strict, leave=outside
    )
    raise_rule_problems(ctx, must_match, saved.directory)
    if plan is None:
        raise CheckpointMismatchError(
            planned(
                f"The skeleton does not match the checkpoint at {saved.directory} "
                "through `renames=`",
                ctx,
            )
        )
    # Non-array leaves (Python values, callables) follow the renames alone.
    renames = StateDictMapping(
        tuple(r for r in mapping.rules if isinstance(r, Rename | RenameRegex))
    )
    quiet = Context({}, restore=True)  # (the plan reported the rules' problems)
    stored_of = dict(zip(others, through(renames, others, quiet), strict=True))
    read = frozenset(p.tensor for leaf in plan.leaves for p in plan.leaf_pieces(leaf))
    view, renamed = _view(saved, walked, target, mapping, prefix, stored_of, read)
    _add_pieces(plan, renamed)
    return Selection(
        view,
        prefix or None,
        renamed,
        target,
        tuple(saved.leaves),
        plan,
        frozenset(plan.leaves),
    )


def _add_pieces(plan, renamed: dict[str, str | None]) -> None:
    """Adds to `renamed` each checkpoint leaf a plan reads into a leaf of
    another name."""
    for leaf in plan.leaves:
        for p in plan.leaf_pieces(leaf):
            if p.tensor != leaf:
                renamed.setdefault(p.tensor, leaf)


def _nothing_under(prefix: str, saved: Metadata) -> Exception:
    known: set[str] = set()
    for name in saved.leaves:
        parts = split(name)
        known.update(join(parts[:i]) for i in range(1, len(parts) + 1))
    depth = len(split(prefix))
    same_depth = sorted(k for k in known if len(split(k)) == depth)
    close = difflib.get_close_matches(prefix, same_depth, n=3, cutoff=0.6)
    tops = sorted({split(n)[0] for n in saved.leaves})
    hint = (
        f"Did you mean {' or '.join(f'`{c}`' for c in close)}? "
        if close
        else f"Its leaf names start with {examples(tops, 8)}. "
    )
    return CheckpointMismatchError(
        f"No leaf of the checkpoint at {saved.directory} is under "
        f'`prefix="{prefix}"`. {hint}A prefix is a leaf name, parts joined by '
        f"`{SEPARATOR}`, as `python -m orbax_eqx inspect {saved.directory}` shows "
        "them."
    )


def split(name: str) -> list[str]:
    """The parts of a leaf name, escapes kept: `a\\.b.c` -> [`a\\.b`, `c`]."""
    parts, current, i = [], [], 0
    while i < len(name):
        c = name[i]
        if c == ESCAPE and i + 1 < len(name):
            current.append(name[i : i + 2])
            i += 2
            continue
        if c == SEPARATOR:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    parts.append("".join(current))
    return parts


def suggest_prefix(walked: Walked, saved_names: Sequence[str]) -> str | None:
    """A prefix under which every skeleton leaf is a checkpoint leaf, if one is."""
    names = [leaf.name for leaf in walked.leaves if leaf.name]
    if not names:
        return None
    available = set(saved_names)
    first = split(names[0])
    candidates = sorted(
        {
            join(parts[: -len(first)])
            for parts in map(split, available)
            if len(parts) > len(first) and parts[-len(first) :] == first
        }
    )
    for candidate in candidates:
        found = targets(candidate, walked)
        if all(found[leaf.name] in available for leaf in walked.leaves):
            return candidate
    return None

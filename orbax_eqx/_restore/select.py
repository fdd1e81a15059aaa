"""Which checkpoint leaves a restore reads, and under which skeleton names.

`EqxRestore(..., renames=...)` first renames checkpoint leaves, as if the
checkpoint had been saved with the new names; `prefix=` then picks the part of
the (renamed) checkpoint that the skeleton describes: a skeleton leaf named
`layers.0.weight` with `prefix="model.encoder"` is matched with the checkpoint
leaf `model.encoder.layers.0.weight`. What comes out is a *view* of the
sidecar, keyed by the names the skeleton asks for; its records keep their
checkpoint names, which is what the arrays are stored under.

Under a prefix, the skeleton's names are those it would have had inside the
saved tree, found by walking it wrapped in one dict per part of the prefix.
"""

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu

from .._errors import CheckpointMismatchError, bullet_list, warn_user
from .._format.sidecar import Metadata
from .._tree.names import ESCAPE, SEPARATOR, join, label
from .._tree.walk import Leaf, Walked, walk
from .renames import (
    Renames,
    check_unique,
    check_used,
    compile_renames,
    examples,
)


class KeptLeavesWarning(UserWarning):
    """A restore with `missing="keep"` kept some skeleton leaves as they were."""


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What a restore did besides reading arrays; see `EqxRestore(report=True)`.

    **Attributes:**

    - `kept`: leaf names of the skeleton leaves that no checkpoint leaf
        filled, kept from the skeleton (`missing="keep"`), e.g. `head.weight`.
    - `unread`: leaf names of the checkpoint leaves that were not restored:
        outside `prefix=`, renamed to `None`, or absent from the skeleton
        (`strict=False`).
    - `renamed`: `{checkpoint leaf name: new name}` for every leaf that
        `renames=` renamed (`None`: left out).
    """

    kept: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()
    renamed: dict[str, str | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The checkpoint as the skeleton sees it."""

    saved: Metadata  # leaves and modules keyed by target names, under the prefix
    prefix: str | None
    renamed: dict[str, str | None]  # checkpoint name -> new name, where changed
    targets: dict[str, str]  # skeleton leaf or module name -> target name
    everything: tuple[str, ...]  # every checkpoint leaf name

    def target(self, name: str) -> str:
        """The name a skeleton leaf or module is looked for under."""
        return self.targets.get(name, name)

    def report(self, walked: Walked, kept: list[Leaf]) -> RestoreReport:
        """What a restore of `walked` did, once `kept` leaves were kept."""
        skipped = {leaf.name for leaf in kept}
        restored = {
            self.saved.leaves[self.target(leaf.name)].name
            for leaf in walked.leaves
            if leaf.name not in skipped
        }
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
    compile_renames(renames)


def select(
    saved: Metadata,
    walked: Walked,
    *,
    prefix: str | None,
    renames: Renames | None,
    renames_must_match: bool,
) -> Selection:
    """Renames the checkpoint's leaves, then keeps those under `prefix`.

    Raises `RenameError` or `CheckpointMismatchError` before any array is read.
    """
    target = targets(prefix, walked)
    rename, labels = compile_renames(renames)
    if renames is None and not prefix:
        # The usual restore: every name stays, so the view is the sidecar itself
        # (decided without a rename call and three tables per leaf).
        return Selection(saved, None, {}, target, tuple(saved.leaves))
    new_names: dict[str, str | None] = {}
    hits: dict[str, list[tuple[str, str | None]]] = {label: [] for label in labels}
    for name in saved.leaves:
        new, label = rename(name)
        new_names[name] = new
        if label is not None:
            hits.setdefault(label, []).append((name, new))
    check_unique(new_names)
    if renames_must_match:
        wanted = {target.get(leaf.name, leaf.name) for leaf in walked.leaves}
        check_used(hits, wanted, saved, walked)
    leaves = {
        new: record
        for name, record in saved.leaves.items()
        if (new := new_names[name]) is not None and _under(prefix, new)
    }
    if prefix and not leaves:
        raise _nothing_under(prefix, saved, new_names)
    modules: dict[str, Any] = {}
    for name, new in _module_names(saved, new_names).items():
        if new is not None and _under(prefix, new):
            modules.setdefault(new, saved.modules[name])
    view = dataclasses.replace(saved, leaves=leaves, modules=modules)
    renamed = {old: new for old, new in new_names.items() if new != old}
    return Selection(view, prefix or None, renamed, target, tuple(saved.leaves))


def _module_names(saved: Metadata, new_names) -> dict[str, str | None]:
    """Where renames move each module, judged by the leaves inside it.

    A module moves to `new` when every leaf inside it keeps its place relative
    to the module: `blocks.0` moves to `layers.0` when `blocks.0.weight` became
    `layers.0.weight` and `blocks.0.bias` `layers.0.bias`. A module whose leaves
    were all left out, or disagree, is not compared with the skeleton's.
    """
    if all(new == old for old, new in new_names.items()):
        return {name: name for name in saved.modules}
    seen: dict[str, set[str | None]] = {}
    for old, new in new_names.items():
        parts = split(old)
        new_parts = None if new is None else split(new)
        for k in range(len(parts)):
            module = join(parts[:k])
            if module not in saved.modules:
                continue
            suffix = parts[k:]
            place = None
            if new_parts is not None and new_parts[len(new_parts) - len(suffix) :] == (
                suffix
            ):
                place = join(new_parts[: len(new_parts) - len(suffix)])
            seen.setdefault(module, set()).add(place)
    result = {}
    for name in saved.modules:
        places = seen.get(name, {name})  # a module without leaves stays put
        result[name] = places.pop() if len(places) == 1 else None
    return result


def _nothing_under(prefix: str, saved: Metadata, new_names) -> Exception:
    known: set[str] = set()
    for new in new_names.values():
        if new is not None:
            parts = split(new)
            known.update(join(parts[:i]) for i in range(1, len(parts) + 1))
    depth = len(split(prefix))
    same_depth = sorted(k for k in known if len(split(k)) == depth)
    close = difflib.get_close_matches(prefix, same_depth, n=3, cutoff=0.6)
    tops = sorted({split(n)[0] for n in new_names.values() if n is not None})
    hint = (
        f"Did you mean {' or '.join(f'`{c}`' for c in close)}? "
        if close
        else f"Its leaf names start with {examples(tops, 8)}. "
    )
    return CheckpointMismatchError(
        f"No leaf of the checkpoint at {saved.directory} is under "
        f'`prefix="{prefix}"`. {hint}A prefix is a leaf name, parts joined by '
        f"`{SEPARATOR}`, as `python -m orbax_eqx inspect {saved.directory}` shows "
        "them (after `renames=`, if given)."
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

"""What a rebuild cannot make, collected as it goes and said in one
`RebuildError`: each leaf or module by name, what to allow, what needs a
skeleton."""

import dataclasses

from .._errors import RebuildError, bullet_list
from .._format.sidecar import Metadata
from .._tree.names import label
from .._tree.walk import display_path


@dataclasses.dataclass
class Problem:
    """One leaf or module that cannot be rebuilt, and why."""

    name: str  # the leaf name, what the message shows
    path: str  # the leaf path (`keystr`), what `RebuildError.problems` holds
    text: str
    allow: str | None = None


def error(saved: Metadata, allow: tuple[str, ...], problems) -> RebuildError:
    """The error of a rebuild under `allow` that met `problems`."""
    needed = sorted({p.allow for p in problems if p.allow is not None})
    lines = [f"{label(p.name, p.path)}: {p.text}" for p in problems]
    fix = []
    if needed:
        wanted = sorted(set(allow) | set(needed))
        fix.append(
            f"If you trust them, pass `allow={wanted!r}` (a rebuild imports "
            "exactly these modules, and finds names in them and in what they "
            "import themselves)."
        )
    if any(p.allow is None for p in problems):
        fix.append(
            "What cannot be rebuilt needs a skeleton: restore into one "
            "(`oeqx.restore(path, skeleton)`)."
        )
    fix.append(f"`python -m orbax_eqx inspect {saved.directory}` lists what to allow.")
    return RebuildError(
        f"Cannot rebuild the checkpoint at {saved.directory} without a skeleton "
        f"under `allow={list(allow)!r}`: {len(problems)} "
        f"{'leaf or module' if len(problems) == 1 else 'leaves or modules'} "
        f"cannot be rebuilt:\n{bullet_list(lines)}\n" + " ".join(fix),
        [(display_path(p.path), p.text) for p in problems],
        needed,
    )

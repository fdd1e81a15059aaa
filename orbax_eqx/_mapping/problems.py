"""A problem of "the skeleton does not fit what is stored", and the message of
many: one wording for checkpoints and safetensors alike.

Each problem names the leaf or tensor first, then expected against found;
the message lists every problem at once (capped: "... and N more"), then
each fix once, in the order first needed.
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal

from .._errors import bullet_list

Kind = Literal["absent", "unexpected", "differs", "rule"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One way the skeleton and what is stored differ.

    `text` names the leaf or tensor first; `fixes` are the texts that mend
    it; `static` is true for a class, static field or callable (which
    `on_static_mismatch="warn"` lets pass); `kind` says whether a leaf of the
    skeleton is `"absent"` from what is stored, a stored one `"unexpected"`,
    both hold something that `"differs"`, or a mapping's rule is at fault
    (`"rule"`).
    """

    text: str
    fixes: tuple[str, ...] = ()
    static: bool = False
    kind: Kind = "differs"


def message(head: str, problems: Sequence[Problem], fixes: Sequence[str]) -> str:
    """`head (N problems):`, the problems as a list, then the fixes."""
    n = len(problems)
    return "\n".join(
        [
            f"{head} ({n} problem{'s' if n != 1 else ''}):",
            bullet_list([p.text for p in problems]),
            *dict.fromkeys(fixes),
        ]
    )

"""The shared directory beside a manager's steps (`EqxHandler(dedup=True)`).

A save with `dedup` writes its pack into `<root>/orbax_eqx~shared/`, beside
the step directories, and records each packed leaf's XXH3-128. The next save
reads the sidecar of the newest committed step of its item (the *base*): a
leaf of the same name, dtype, shape and XXH3-128 is recorded as a reference to
the base's bytes, wherever they lie, instead of being written again. So every
reference points at a shared pack directly, never through another step, and
deleting any step (Orbax's retention, `rm -r`) breaks no other.

A shared pack is deleted only by `collect`, which a save runs once its own
files are written: it keeps every pack that a committed step or the step being
saved refers to, and deletes the others (those of steps deleted since, and
of saves killed before their commit). Whatever it cannot read, it keeps.
Pack names are checked against the format's pattern; nothing else in the
directory is touched.

`plan`: the identities of a save's arrays, its base step and what it writes;
`steps`: which committed steps refer to which shared files, and the
clean-up; `copy`: a step copied out with every byte it needs.
"""

from .copy import copy_step
from .plan import Known, apply, base, ensure_dir, fields, plan
from .steps import Busy, Unreadable, collect, saves_under_way, sharing

__all__ = [
    "Busy",
    "Known",
    "Unreadable",
    "apply",
    "base",
    "collect",
    "copy_step",
    "ensure_dir",
    "fields",
    "plan",
    "saves_under_way",
    "sharing",
]

"""The shared directory beside a manager's steps (`EqxHandler(dedup=True)`).

A leaf whose name, dtype, shape and XXH3-128 match the base step's is
recorded as a reference to the shared pack holding its bytes, never through
another step, so deleting any step breaks no other. Only `collect` deletes a
shared pack: one no committed step or the step being saved refers to, and
never what it cannot read.
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

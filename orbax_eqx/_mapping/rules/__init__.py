"""The rules a mapping is made of, one transformation a file with its inverse
beside it, and `Rule`, their msgspec tagged union (`{"op": "stack", ...}`)."""

from .cast import Cast
from .drop import Drop, Ignore
from .field_keys import FieldKeys
from .fuse import Fuse
from .rename import Rename
from .rename_regex import RenameRegex
from .reshape import ExpandDims, Reshape, Squeeze
from .split import Split
from .stack import Stack
from .tie import Tie
from .transpose import Transpose

Rule = (
    Rename
    | RenameRegex
    | FieldKeys
    | Stack
    | Transpose
    | Reshape
    | Squeeze
    | ExpandDims
    | Split
    | Fuse
    | Cast
    | Drop
    | Ignore
    | Tie
)
# Rules that change names only: a restore through them alone stays on its
# fast path (names in, names out, nothing planned per leaf).
NAMES_ONLY = (Rename, RenameRegex, Ignore)

"""The rules a mapping is made of, one transformation a file, each with its
inverse beside it (see `base.Rule`), and `Rule`, their tagged union: JSON
`{"op": "stack", ...}` decodes to the rule of that op, checked by msgspec.

May import: `.._tree` (field keys read a tree), the mapping's `templates`,
`regex`, `stage`, `pieces`, `errors`.
"""

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

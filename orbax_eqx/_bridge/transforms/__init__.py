"""The rules a mapping is made of, one transformation a file, each with its
inverse beside it (see `base.Rule`).

May import: `.._tree` (field keys read a tree), the bridge's `templates`,
`safe_regex`, `stage`, `pieces`, `errors`.
"""

from .base import Rule
from .cast import Cast
from .drop import Drop, Ignore
from .field_keys import FieldKeys
from .permute import Transpose
from .rename import Rename
from .rename_regex import RenameRegex
from .split import Fuse, Split
from .stack import Stack
from .tie import Tie

RULES: dict[str, type[Rule]] = {
    rule.op: rule
    for rule in (
        Rename,
        RenameRegex,
        FieldKeys,
        Stack,
        Transpose,
        Split,
        Fuse,
        Cast,
        Drop,
        Ignore,
        Tie,
    )
}

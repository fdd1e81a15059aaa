"""Checks that what the sidecar records of an item can be read back, before saving.

Two things would make a checkpoint that saves but never restores: text that
is not valid Unicode (a lone surrogate, as `os.fsdecode` makes of a file name
that is not UTF-8), which a UTF-8 sidecar cannot hold, in a dict key, a str
leaf or a static field; and a static field nested deeper than readers read
(`values.MAX_DEPTH`). Both are refused here, naming the leaf or field.
"""

import jax.tree_util as jtu

from .._errors import UnsupportedLeafError, bullet_list
from .._tree.names import label
from .._tree.values import MAX_DEPTH, bad_text, is_text, too_deep
from .._tree.walk import Walked

_SURROGATE = (
    "holds a lone surrogate, as `os.fsdecode` makes of a file name that is not UTF-8"
)
_TEXT_FIX = (
    "The sidecar (UTF-8 JSON) cannot hold text that is not valid Unicode: store "
    "it as bytes (`os.fsencode(text)`: bytes leaves, static fields and dict keys "
    "are saved exactly), or decode it first "
    "(`os.fsencode(text).decode('utf-8', 'replace')`)."
)
_DEPTH_FIX = (
    f"A recorded value may nest {MAX_DEPTH} JSON levels deep (each tuple, list "
    "or dict takes two): make it shallower, or keep it out of the saved item."
)


def check(walked: Walked) -> None:
    """Raises `UnsupportedLeafError` listing every leaf or field that cannot be
    recorded so that it reads back."""
    text, deep = [], []
    for leaf in walked.leaves:
        if not is_text(leaf.name):
            text.append(f"Leaf {leaf.label} {_key(leaf)}.")
        # Other leaves are recorded as descriptions, which escape such text.
        if type(leaf.value) is str and not is_text(leaf.value):
            text.append(
                f"Leaf {leaf.label} is a str that is not valid Unicode: "
                f"{leaf.value!r} {_SURROGATE}."
            )
    for name, module in walked.modules.items():
        if not is_text(name):
            text.append(
                f"Module `{module.path}` is under a dict key that is not valid Unicode."
            )
        for field, value in module.static.items():
            found, nested = bad_text(value), too_deep(value)
            if found is None and not nested:
                continue  # (the usual case: no message to word)
            where = (
                f"Static field `{field}` of module {label(name, module.path)} "
                f"({module.cls})"
            )
            if found is not None:
                text.append(
                    f"{where} holds text that is not valid Unicode: "
                    f"{found!r} {_SURROGATE}."
                )
            if nested:
                deep.append(f"{where} nests more than {MAX_DEPTH} levels deep.")
    if text or deep:
        fixes = ([_TEXT_FIX] if text else []) + ([_DEPTH_FIX] if deep else [])
        raise UnsupportedLeafError(
            "Cannot save this item: its sidecar would not read back.\n"
            + bullet_list(text + deep)
            + "\n"
            + " ".join(fixes)
        )


def _key(leaf) -> str:
    for entry in leaf.path:
        key = getattr(entry, "key", None)
        if isinstance(entry, jtu.DictKey) and isinstance(key, str) and not is_text(key):
            return (
                f"is under a dict key that is not valid Unicode: {key!r} {_SURROGATE}"
            )
    return f"has a name that is not valid Unicode: {leaf.name!r} {_SURROGATE}"

"""What `diff` compares: two items, or two steps (or manager roots) item by item.

Each side is a skeleton (`module:function`), an item, a step directory (its
items by name) or a CheckpointManager root (its latest step's items). Two
steps are paired by item name; an item only one side holds is a difference,
and so is another kind of item (a JSON item, a data loader's state) that only
one side has; those both have are named, not compared. `--item NAME` picks
one item of each side that is a step or a root.
"""

import dataclasses
import os

from etils import epath

from .._errors import OrbaxEqxError
from .._format.locate import as_path
from . import skeleton as _skeleton
from . import step_items as _items
from .plain_items import handler_text


class ItemNotFoundError(OrbaxEqxError, FileNotFoundError):
    """`--item NAME` names no item of a step, or a step needs `--item`."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One side, as the user named it: a skeleton spec, one item, or the
    items (and other items) of one step."""

    text: str
    what: str  # "skeleton", "item", "step" or "root"
    items: dict[str, epath.Path]  # by item name; one entry for an item
    others: dict[str, str | None]  # other items of the step: name -> handler
    step: int | None = None  # the latest step, for a root


def resolve(text: str, item: str | None = None) -> Resolved:
    """What `text` names, for `diff` (see the module's doc)."""
    if _skeleton.looks_like_spec(text):
        return Resolved(text, "skeleton", {}, {})
    path = as_path(text)
    found = _items.items_under(path)  # raises if it names nothing
    numbers = sorted({n for n, _ in found if n is not None})
    if numbers:
        step = numbers[-1]
        items = {p.name: p for n, p in found if n == step}
        step_dir = next(iter(items.values())).parent
        resolved = Resolved(text, "root", items, _others(step_dir), step)
    elif len(found) == 1 and found[0][1] == path:
        resolved = Resolved(text, "item", {path.name: path}, {})
    else:
        items = {p.name: p for _, p in found}
        resolved = Resolved(text, "step", items, _others(path))
    if item is None or resolved.what == "item":  # --item picks in steps only
        return resolved
    if item not in resolved.items:
        raise ItemNotFoundError(
            f"{path} holds no item named {item!r} (--item); it holds "
            f"{_names(resolved.items)}. Pass one of those."
        )
    return dataclasses.replace(
        resolved, what="item", items={item: resolved.items[item]}, others={}
    )


def _others(step: epath.Path) -> dict[str, str | None]:
    return {o.name: o.handler for o in _items.others_in(step)}


def _names(items) -> str:
    return ", ".join(sorted(items)) or "no items"


def describe(side: Resolved) -> str:
    """What a side is, for the header: `/run/7 (a step: 2 items)`."""
    if side.what == "root":
        step_dir = next(iter(side.items.values())).parent
        return (
            f"{step_dir} (the latest step of the CheckpointManager root "
            f"{as_path(side.text)})"
        )
    return os.fspath(as_path(side.text))


def pairs(a: Resolved, b: Resolved):
    """`[(name, item in A, item in B)]` to compare, and the differences in
    which items the two sides hold: `[(what, name, in A, in B)]`.

    Two single items (or an item and a skeleton) make one pair, named by B's
    item (or A's). Otherwise both sides must be steps or roots, paired by
    name.
    """
    singles = [s for s in (a, b) if s.what in ("item", "skeleton")]
    if singles:
        if len(singles) == 1:
            several = b if singles[0] is a else a
            if len(several.items) == 1:
                several = dataclasses.replace(several, what="item")
            else:
                raise ItemNotFoundError(
                    f"{describe(several)} holds several items "
                    f"({_names(several.items)}), and {singles[0].text} is one "
                    "item: pass --item NAME to compare that item of it, or give "
                    "two steps to compare them item by item."
                )
            a, b = (singles[0], several) if singles[0] is a else (several, singles[0])
        name = next(iter(b.items or a.items), "")
        return [(name, _one(a), _one(b))], []
    found = []
    changes = []
    for name in sorted(set(a.items) | set(b.items)):
        ia, ib = a.items.get(name), b.items.get(name)
        if ia is not None and ib is not None:
            found.append((name, ia, ib))
        else:
            where = ia or ib
            changes.append(
                (
                    "item removed" if ib is None else "item added",
                    name,
                    _kind_text(where) if ia else "",
                    _kind_text(where) if ib else "",
                )
            )
    for name in sorted(set(a.others) | set(b.others)):
        if name in a.items or name in b.items:
            continue  # an item on one side, another kind on the other: above
        if (name in a.others) != (name in b.others):
            text = handler_text((a.others | b.others)[name])
            changes.append(
                (
                    "item removed" if name in a.others else "item added",
                    name,
                    text if name in a.others else "",
                    text if name in b.others else "",
                )
            )
    return found, changes


def _one(side: Resolved):
    return side.text if side.what == "skeleton" else next(iter(side.items.values()))


def _kind_text(item: epath.Path) -> str:
    return f"{_items.kind_of(item)} item"


def not_compared(a: Resolved, b: Resolved) -> list[str]:
    """Other items both steps hold: named, not compared."""
    return sorted(set(a.others) & set(b.others))

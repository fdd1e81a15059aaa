"""`inspect`'s output for plain Orbax items, and for the other items of a step.

A plain item is shown as an orbax_eqx one is (a tree by key path, or one row
per array with `flat=True`), headed by the handler that wrote it and how its
arrays are stored, and followed by what Orbax did not record.
"""

from typing import Any

from .._tree.walk import display_path
from .plain_items import PlainMetadata, handler_text
from .step_items import OtherItem
from .text import cut, human_bytes, table
from .tree_view import build as build_tree
from .tree_view import left_out_line, rows_of, value_text


def layout(saved: PlainMetadata) -> str:
    """`OCDBT, zarr v2`: how the item's arrays are stored."""
    return f"{'OCDBT' if saved.ocdbt else 'no OCDBT'}, zarr v{3 if saved.zarr3 else 2}"


def item_text(
    saved: PlainMetadata, shardings: dict[str, str], flat: bool, every: bool = False
) -> str:
    """A plain Orbax item, for a person."""
    left_out = ""
    if flat:
        rows = [
            [
                display_path(name),
                str(tuple(leaf.shape or ())),
                str(leaf.dtype),
                human_bytes(leaf.nbytes),
                shardings.get(name, ""),
                value_text(leaf),
            ]
            for name, leaf in saved.leaves.items()
        ]
        header = ["name", "shape", "dtype", "bytes", "sharding", "value"]
    else:
        tree = build_tree(saved)
        rows = rows_of(tree, saved, shardings, every)
        left_out = left_out_line(tree.left_out)
        header = ["name", "type", "shape", "bytes", "stored in", "sharding", "value"]
    # Every array is in Orbax's store, so "stored in" says nothing; a column
    # with nothing in it (no sharding recorded: numpy arrays) goes too.
    empty = [
        i
        for i, h in enumerate(header)
        if h == "stored in" or (h == "sharding" and not any(r[i] for r in rows))
    ]
    header = [h for i, h in enumerate(header) if i not in empty]
    rows = [[c for i, c in enumerate(r) if i not in empty] for r in rows]
    nbytes = sum(leaf.nbytes for leaf in saved.leaves.values())
    lines = [
        f"Plain Orbax checkpoint {saved.directory}",
        f"Written by {handler_text(saved.handler)}; arrays stored with "
        f"{layout(saved)}.",
        "",
        table(header, rows, right=(3,)) if rows else "  (no arrays)",
        *([left_out] if left_out else []),
        "",
        f"Total: {len(saved.leaves)} array{'' if len(saved.leaves) == 1 else 's'}, "
        f"{human_bytes(nbytes)}.",
    ]
    if saved.unread:
        listed = [f"{display_path(n)} ({why})" for n, why in saved.unread.items()]
        more = len(listed) - 5
        lines.append(
            f"Not shown ({len(listed)}): "
            + "; ".join(cut(x) for x in listed[:5])
            + (f"; and {more} more" if more > 0 else "")
            + "."
        )
    lines.append(
        "Orbax recorded arrays only: no classes, static fields or Python values. "
        "`oeqx.restore(path, skeleton)` restores it into a skeleton."
    )
    return "\n".join(lines) + "\n"


def item_json(saved: PlainMetadata) -> dict[str, Any]:
    """What a plain item adds to `inspect --json`'s record of an item."""
    return {
        "kind": "plain Orbax",
        "handler": saved.handler,
        "ocdbt": saved.ocdbt,
        "zarr3": saved.zarr3,
        "unread": dict(saved.unread),
    }


def others_text(others: list[OtherItem], step: Any) -> str:
    """The step's items that are none of ours: named, with their handlers."""
    listed = ", ".join(f"{o.name} ({handler_text(o.handler)})" for o in others)
    where = f"step {step}" if step is not None else "this step"
    return (
        f"Other items of {where}, not read (neither orbax_eqx nor plain Orbax "
        f"PyTree items): {listed}.\n"
    )


def others_json(others: list[OtherItem]) -> list[dict[str, Any]]:
    return [{"name": o.name, "path": str(o.path), "handler": o.handler} for o in others]

"""`inspect`'s tree for names no save writes as well as for those it does:
each leaf at the node its name's parts say (escaped separators kept, empty
parts their own nodes), nodes in the order of the leaves, each module at the
node its name says, its bytes counted in every node above it."""

import re

import equinox as eqx
import numpy as np
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx


def _split(name: str) -> list[str]:
    """The parts of a leaf name: split at each `.` that no `\\` escapes."""
    if not name:
        return []
    parts, current, chars = [], "", iter(name)
    for c in chars:
        if c == "\\":
            current += c + next(chars, "")
        elif c == ".":
            parts, current = [*parts, current], ""
        else:
            current += c
    return [*parts, current]


def _path(name: str) -> str:
    parts = [p.replace("\\.", ".").replace("\\\\", "\\") for p in _split(name)]
    return "".join(f"[{p!r}]" for p in parts)


class _Holder(eqx.Module):
    x: np.ndarray


def _saved(tmp_path, names: list[str], modules=()) -> str:
    """A checkpoint whose sidecar names leaves `names` (4-byte arrays, in
    order) and modules `modules` (each a `_Holder`), as no save writes it."""
    path = tmp_path / "ckpt"
    oeqx.save(path, _Holder(np.zeros(4, np.uint8)))

    def change(content):
        (record,) = content["leaves"].values()
        content["leaves"] = {n: {**record, "path": _path(n)} for n in names}
        (module,) = content["modules"].values()
        content["modules"] = {m: {**module, "path": _path(m)} for m in modules}

    sidecars.edit(path, change)
    return str(path)


def _expected(names: list[str], modules=()) -> list[tuple[int, str, str, str]]:
    """`(depth, part, class, bytes)` of each row, depth first: what going
    down from the root for every leaf makes."""
    tree: dict = {}
    size: dict[tuple, int] = {}
    for name in names:
        node, parts = tree, tuple(_split(name))
        for depth in range(len(parts) + 1):
            size[parts[:depth]] = size.get(parts[:depth], 0) + 4
        for part in parts:
            node = node.setdefault(part, {})
    classes = {tuple(_split(m)): "_Holder" for m in modules}
    rows = []

    def visit(node: dict, parts: tuple) -> None:
        for part, child in node.items():
            here = (*parts, part)
            cls = classes.get(here, "") if child else ""  # a leaf's row is the leaf's
            rows.append((len(parts), part, cls, f"{size[here]} B"))
            visit(child, here)

    visit(tree, ())
    return rows


def _rows(out: str) -> list[tuple[int | None, str, str, str]]:
    """The rows of the tree, as `_expected` gives them (an empty part's depth
    cannot be read from its row: it is None)."""
    header, *table = out.split("\n\n")[1].splitlines()
    width = header.index("type") - 2
    rows = []
    for line in table:
        cell, rest = line[2 : 2 + width], line[2 + width :]
        part = cell.strip()
        depth = (len(cell) - len(cell.lstrip())) // 2 if part else None
        cls = "_Holder" if "_Holder" in rest else ""
        size = re.search(r"\d+ B", rest)[0]
        rows.append((depth, part, cls, size))
    return rows


def _shown(rows):
    return [(d if part else None, part, c, b) for d, part, c, b in rows]


@pytest.mark.parametrize(
    "names",
    [
        ["a.b", "a.c", "a.d.e", "a.d.f", "g"],
        ["x", ".y", ".z", "y", "..w", "..v"],  # empty parts: `.y`'s parent is ""
        ["a\\.b.c", "a\\.b.d", "a.b.e", "a.b.f", "a\\.b.g"],  # escaped separators
        ["p.q", "r.s", "p.t", "r.u"],  # siblings apart
    ],
    ids=["siblings", "empty-parts", "escaped", "interleaved"],
)
def test_the_view_lays_out_what_each_name_says(tmp_path, capsys, names):
    assert main(["inspect", "--all", _saved(tmp_path, names)]) == 0
    assert _rows(capsys.readouterr().out) == _shown(_expected(names))


@pytest.mark.parametrize(
    "names, modules",
    [
        (["a.b.c", "a.b.d", "a.e"], ["a", "a.b", "a.x", "q"]),
        ([".x.y", "x.y", ".z"], [".x", "x", "x.y"]),  # `.x` is not under `x`
        (["a\\.b.c", "a.b.c"], ["a\\.b", "a", "a.b"]),
    ],
    ids=["nested", "empty-parts", "escaped"],
)
def test_each_module_names_the_node_its_parts_say(tmp_path, capsys, names, modules):
    assert main(["inspect", "--all", _saved(tmp_path, names, modules)]) == 0
    assert _rows(capsys.readouterr().out) == _shown(_expected(names, modules))

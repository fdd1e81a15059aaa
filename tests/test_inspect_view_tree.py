"""The tree view's tree (`tree_view.build`) for names no save writes as well
as for those it does: each leaf at the node its name's parts say, made in the
order of the leaves, its bytes counted in every node above it. `build` puts a
leaf whose parent is the last leaf's straight there: this pins that it lays
out what going down from the root for every leaf lays out."""

import pytest

from orbax_eqx._format.sidecar import Metadata, leaf_metadata
from orbax_eqx._tools import tree_view
from orbax_eqx._tree.walk import ModuleInfo


def _metadata(names: list[str], modules=()) -> Metadata:
    leaves = {
        name: leaf_metadata(
            name, name, "array", (i + 1,), "uint8", "jax", "packed", nbytes=i + 1
        )
        for i, name in enumerate(names)
    }
    infos = {m: ModuleInfo(m, f"m.C{i}", {}) for i, m in enumerate(modules)}
    return Metadata("/nowhere", 6, {}, leaves, infos)


def _expected(names: list[str]):
    """What going down from the root for every leaf makes: `(parts made, in
    order; {parts: (leaf name, bytes)})`."""
    made: list[tuple[str, ...]] = [()]
    nodes: dict[tuple[str, ...], list] = {(): [None, 0]}
    for i, name in enumerate(names):
        parts = tuple(tree_view.split(name)) if name else ()
        for depth in range(len(parts) + 1):
            if parts[:depth] not in nodes:
                nodes[parts[:depth]] = [None, 0]
                made.append(parts[:depth])
            nodes[parts[:depth]][1] += i + 1
        nodes[parts][0] = name
    return made, {k: tuple(v) for k, v in nodes.items()}


def _found(tree: tree_view.Tree):
    where: dict[int, tuple[str, ...]] = {id(tree.root): ()}
    nodes = {}
    for node in tree.nodes:  # parents first
        for part, child in node.children.items():
            where[id(child)] = (*where[id(node)], part)
        leaf = None if node.leaf is None else node.leaf.name
        nodes[where[id(node)]] = (leaf, node.nbytes)
    return [where[id(n)] for n in tree.nodes], nodes


@pytest.mark.parametrize(
    "names",
    [
        ["a.b", "a.c", "a.d.e", "a.d.f", "g"],
        ["x", ".y", ".z", "y", "..w", "..v"],  # empty parts: `.y`'s parent is ""
        ["a.b", "a.c", "a", "a.b.c", "a.e"],  # a leaf where a node is, and below
        ["a\\.b.c", "a\\.b.d", "a.b.e", "a.b.f", "a\\.b.g"],  # escaped separators
        ["p.q", "r.s", "p.t", "r.u", "p.q.v"],  # siblings apart
    ],
    ids=["siblings", "empty-parts", "leaf-and-node", "escaped", "interleaved"],
)
def test_the_view_lays_out_what_each_name_says(names):
    made, nodes = _expected(names)
    tree = tree_view.build(_metadata(names))
    assert tree.left_out == []
    assert _found(tree) == (made, nodes)


@pytest.mark.parametrize(
    "names, modules",
    [
        (["a.b.c", "a.b.d", "a.e"], ["", "a", "a.b", "a.x", "q"]),
        ([".x.y", "x.y", ".z"], ["", ".x", "x", "x.y"]),  # `.x` is not under ""
        (["a\\.b.c", "a.b.c"], ["a\\.b", "a", "a.b", "a\\"]),
    ],
    ids=["nested", "empty-parts", "escaped"],
)
def test_each_module_names_the_node_its_parts_say(names, modules):
    tree = tree_view.build(_metadata(names, modules))
    _, nodes = _expected(names)
    at = dict(zip(_found(tree)[0], tree.nodes, strict=True))
    expected = {
        tuple(tree_view.split(m)) if m else (): m
        for m in modules
        if (tuple(tree_view.split(m)) if m else ()) in nodes
    }
    assert {k: n.module for k, n in at.items() if n.module is not None} == expected

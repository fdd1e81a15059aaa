"""Plans made by hand: the readers and writers tested on stacked, transposed
and split layouts, apart from the mapping's planner.

A `HandPlan` answers `leaf_pieces` / `tensor_pieces` for any box, as
`orbax_eqx._mapping.plan.Plan` does, from whole pieces each given with `axes`:
for each of the tensor box's axes in the leaf's order (`perm`), the leaf axis
it is; the leaf's other axes have length 1 in the piece (a stacked layer).
"""

import dataclasses

from orbax_eqx._mapping.pieces import Piece
from orbax_eqx._mapping.plan import LeafSpec, TensorSpec, whole


@dataclasses.dataclass
class HandPlan:
    leaves: dict[str, LeafSpec]
    tensors: dict[str, TensorSpec]
    pieces: list[tuple[Piece, tuple[int, ...]]]  # (whole piece, its axes)

    def leaf_pieces(self, leaf, box=None):
        return self._clip([pa for pa in self.pieces if pa[0].leaf == leaf], box, True)

    def tensor_pieces(self, tensor, box=None):
        mine = [pa for pa in self.pieces if pa[0].tensor == tensor]
        return self._clip(mine, box, False)

    @staticmethod
    def _clip(pieces, box, leaf_side):
        out = []
        for p, axes in pieces:
            if box is None:
                out.append(p)
                continue
            mine = p.leaf_box if leaf_side else p.tensor_box
            cut = tuple(
                (max(a, c), min(b, d)) for (a, b), (c, d) in zip(mine, box, strict=True)
            )
            if any(a >= b for a, b in cut):
                continue
            other = list(p.tensor_box if leaf_side else p.leaf_box)
            for k, la in enumerate(axes):
                ta = p.perm[k]
                src, dst = (la, ta) if leaf_side else (ta, la)
                shift = other[dst][0] - mine[src][0]
                other[dst] = (cut[src][0] + shift, cut[src][1] + shift)
            if leaf_side:
                out.append(Piece(p.leaf, cut, p.tensor, tuple(other), p.perm))
            else:
                out.append(Piece(p.leaf, tuple(other), p.tensor, cut, p.perm))
        return out


def leaf(name, shape, dtype="float32"):
    return LeafSpec(name, f"`{name}`", tuple(shape), dtype)


def tensor(name, shape, dtype="float32"):
    return TensorSpec(name, tuple(shape), dtype)


def stacked(name, layers, inner, fmt, dtype="float32", transpose=False):
    """Leaf `name` (layers, *inner) <-> tensors `fmt.format(i)`, each `inner`
    (its two axes swapped if `transpose`: PyTorch's Conv1D against Linear)."""
    lf = leaf(name, (layers, *inner), dtype)
    shape = tuple(reversed(inner)) if transpose else tuple(inner)
    perm = (1, 0) if transpose else tuple(range(len(inner)))
    tensors, pieces = [], []
    for i in range(layers):
        t = tensor(fmt.format(i), shape, dtype)
        tensors.append(t)
        box = ((i, i + 1), *whole(inner))
        piece = Piece(name, box, t.name, whole(shape), perm)
        pieces.append((piece, tuple(range(1, len(inner) + 1))))
    return [lf], tensors, pieces


def fused(names, layers, out, inp, fmt, dtype="float32"):
    """Leaves `names` (layers, out, inp) each <-> a column block of tensors
    `fmt.format(i)` of shape (inp, len(names) * out): GPT-2's `c_attn`."""
    leaves = [leaf(n, (layers, out, inp), dtype) for n in names]
    tensors, pieces = [], []
    for i in range(layers):
        t = tensor(fmt.format(i), (inp, len(names) * out), dtype)
        tensors.append(t)
        for j, n in enumerate(names):
            piece = Piece(
                n,
                ((i, i + 1), (0, out), (0, inp)),
                t.name,
                ((0, inp), (j * out, (j + 1) * out)),
                (1, 0),
            )
            pieces.append((piece, (1, 2)))
    return leaves, tensors, pieces


def plan_of(*parts) -> HandPlan:
    leaves, tensors, pieces = {}, {}, []
    for ls, ts, ps in parts:
        leaves.update({x.name: x for x in ls})
        tensors.update({x.name: x for x in ts})
        pieces += ps
    return HandPlan(leaves, tensors, pieces)

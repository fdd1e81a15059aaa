"""`inspect --params` (metadata only) and `inspect --stats` (every array read
in `verify`'s one pass): parameter counts, and each leaf's numbers."""

import dataclasses
import json
import math
import os

import numpy as np
from etils import epath

from .._errors import some
from .._format.sidecar import ALIAS, LeafMetadata
from .._orbax.items import metadata_kind
from .._orbax.verify import check
from .._tree.walk import ARRAY, display_path, is_key_dtype, parse_dtype
from .render import Progress, Tree, count, human_bytes, number, table

_STEP = 1 << 20  # elements widened to float64 at once
_NUMBERS = ("min", "max", "mean", "std", "l2")


@dataclasses.dataclass
class LeafStats:
    """The numbers in one array leaf (None where there are none to take)."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    size: int
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    l2: float | None = None
    keys: bool = False  # typed PRNG keys: counted, no numbers
    error: str | None = None  # why the leaf is damaged, or cannot be read
    # Running sums, merged piece by piece in any order (Chan et al.).
    _n: int = dataclasses.field(default=0, repr=False)
    _m2: float = dataclasses.field(default=0.0, repr=False)
    _sq: float = dataclasses.field(default=0.0, repr=False)

    def add(self, piece: np.ndarray) -> None:
        flat = piece.reshape(-1)
        for at in range(0, flat.size, _STEP):
            self._add(flat[at : at + _STEP])

    def _add(self, piece: np.ndarray) -> None:
        complex_ = np.issubdtype(piece.dtype, np.complexfloating)
        wide = piece.astype(np.complex128 if complex_ else np.float64)
        nan, inf = np.isnan(wide), np.isinf(wide) & ~np.isnan(wide)
        self.nan += int(np.count_nonzero(nan))
        self.inf += int(np.count_nonzero(inf))
        self.zeros += int(np.count_nonzero(wide == 0))
        finite = wide[~(nan | inf)]
        finite = np.abs(finite) if complex_ else finite
        n = int(finite.size)
        if n == 0:
            return
        self._sq += float(np.sum(np.square(finite)))
        self.l2 = math.sqrt(self._sq)
        if complex_:  # the L2 norm of the moduli, no more
            return
        mean, total = float(np.mean(finite)), self._n + n
        delta = mean - (self.mean or 0.0)
        self.mean = (self.mean or 0.0) + delta * n / total
        m2 = float(np.sum(np.square(finite - mean)))
        self._m2 += m2 + delta * delta * self._n * n / total
        self._n = total
        self.std = math.sqrt(max(self._m2, 0.0) / total)
        low, high = float(finite.min()), float(finite.max())
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)

    def as_json(self) -> dict:
        doc = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        for k in _NUMBERS:  # strict JSON: no nan or inf
            doc[k] = doc[k] if doc[k] is None or math.isfinite(doc[k]) else None
        return doc | {"shape": list(self.shape)}


def leaf_stats(item: epath.Path, saved, progress=None) -> list[LeafStats]:
    """The numbers of each array leaf of the item, in the metadata's order,
    from one `verify` pass: a damaged or unreadable leaf has its `error`."""

    def fresh(r: LeafMetadata, error: str | None = None) -> LeafStats:
        shape, keys = tuple(r.shape or ()), is_key_dtype(parse_dtype(r.dtype))
        about = (r.name, r.path, str(r.dtype), shape, math.prod(shape))
        return LeafStats(*about, keys=keys, error=error)

    found = {r.name: fresh(r) for r in saved.leaves.values() if r.kind == ARRAY}

    def piece(record: LeafMetadata, data: np.ndarray) -> None:
        if not found[record.name].keys:
            dtype = np.dtype(parse_dtype(record.dtype))
            found[record.name].add(data if data.dtype == dtype else data.view(dtype))

    for damaged in check(item, saved, progress, piece).damaged:
        found[damaged.name] = fresh(saved.leaves[damaged.name], damaged.problem)
    for r in saved.leaves.values():
        if r.kind == ARRAY and r.data == ALIAS:  # the same array, read once
            found[r.name] = dataclasses.replace(
                found[r.alias_of], name=r.name, path=r.path
            )
    return list(found.values())


def counts(saved, depth: int | None) -> tuple[dict, Tree]:
    """`{"total", "arrays", "nbytes", "nodes": [{"name", "depth", "class",
    "params", "nbytes"}], "dtypes": [{"dtype", "arrays", "params", "nbytes"}]}`
    of the item (inner nodes down to `depth` below the root), and the tree."""
    tree = Tree(saved)
    dtypes = _dtype_counts(saved)
    return {
        "total": sum(d["params"] for d in dtypes),
        "arrays": sum(d["arrays"] for d in dtypes),
        "nbytes": sum(d["nbytes"] for d in dtypes),
        "nodes": _node_counts(saved, tree, depth),
        "dtypes": dtypes,
    }, tree


def _node_counts(saved, tree: Tree, depth: int | None) -> list[dict]:
    nodes = []
    stack = [(tree.root, "", 0)]
    while stack:  # depth first without recursion: models nest deep
        node, name, level = stack.pop()
        module = saved.modules[node.module] if node.module is not None else None
        cls = module.cls.rsplit(".", 1)[-1] if module else None
        nodes.append(dict(name=name, depth=level, **{"class": cls}))
        nodes[-1] |= {"params": node.params, "nbytes": node.nbytes}
        if depth is None or level < depth:
            inner = [
                (c, f"{name}.{p}" if name else p, level + 1)
                for p, c in node.children.items()
                if c.children
            ]
            stack.extend(reversed(inner))
    return nodes


def _dtype_counts(saved) -> list[dict]:
    dtypes: dict[str, dict] = {}
    for r in saved.leaves.values():
        if r.kind == ARRAY and r.data != ALIAS:
            d = dtypes.setdefault(str(r.dtype), dict(arrays=0, params=0, nbytes=0))
            d["arrays"] += 1
            d["params"] += math.prod(r.shape or ())
            d["nbytes"] += r.nbytes
    return sorted(
        ({"dtype": k} | d for k, d in dtypes.items()),
        key=lambda d: (-d["nbytes"], d["dtype"]),
    )


def run(args, report) -> int:
    """`--params` (and with `--stats` the values) of every item of `report`
    (`inspect.gather`'s); exit status 1 if a leaf is damaged."""
    found = []
    for saved in report.items:
        stats = None
        if args.stats:
            with Progress("inspect --stats", saved.nbytes) as bar:
                stats = leaf_stats(epath.Path(saved.directory), saved, bar.advance)
        found.append((saved, *counts(saved, args.depth), stats))
    if args.json:
        items = [
            {"path": saved.directory, "kind": metadata_kind(saved), "params": c}
            | {"stats": None if s is None else [x.as_json() for x in s]}
            for saved, c, _, s in found
        ]
        doc = {"path": os.fspath(report.path), "step": report.step, "items": items}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        parts = []
        if report.step is not None:
            where = f"CheckpointManager root {report.path}"
            parts.append(f"{where}: showing the latest step, {report.step}.")
        for saved, c, tree, stats in found:
            lines = [f"Checkpoint {saved.directory} ({metadata_kind(saved)} item)", ""]
            lines += [*_stats_lines(stats), ""] if stats is not None else []
            parts.append("\n".join(lines + _count_lines(c, tree)))
        print("\n\n".join(parts))
    return 1 if any(x.error for *_, s in found for x in s or []) else 0


def _stats_lines(stats: list[LeafStats]) -> list[str]:
    header = ["min", "max", "mean", "std", "L2", "zeros", "nan", "inf", "dtype"]
    rows = []
    for s in stats:
        tally = (
            ["-"] * 3 if s.keys or s.error else [str(s.zeros), str(s.nan), str(s.inf)]
        )
        rows.append(
            [
                *(number(getattr(s, k)) for k in _NUMBERS),
                *tally,
                s.dtype,
                display_path(s.name),
            ]
        )
    lines = [
        f"Values of {count(len(stats), 'array')} (over their finite elements):",
        # The name last: the numbers line up whatever its length.
        table([*header, "name"], rows, right=tuple(range(8))),
    ]
    odd = [display_path(s.name) for s in stats if s.nan or s.inf]
    if odd:
        lines.append(
            f"Not finite: {len(odd)} array(s) hold NaN or Inf: {some(odd, 10)}."
        )
    keys = sum(s.keys for s in stats)
    if keys:
        lines.append(
            f"Typed PRNG keys ({keys} array(s)) hold no numbers: counted only."
        )
    return lines + [
        f"DAMAGED {display_path(s.name)}: {s.error}" for s in stats if s.error
    ]


def _count_lines(c: dict, tree: Tree) -> list[str]:
    total, nbytes = c["total"] or 1, c["nbytes"] or 1
    rows = [
        [
            "  " * n["depth"]
            + (display_path(n["name"]).rsplit(".", 1)[-1] if n["name"] else "<root>"),
            n["class"] or "",
            f"{n['params']:,}",
            human_bytes(n["nbytes"]),
            f"{100 * n['params'] / total:.1f}%",
        ]
        for n in c["nodes"]
    ]
    dtypes = [
        [
            d["dtype"],
            str(d["arrays"]),
            f"{d['params']:,}",
            human_bytes(d["nbytes"]),
            f"{100 * d['nbytes'] / nbytes:.1f}%",
        ]
        for d in c["dtypes"]
    ]
    return [
        f"Parameters: {c['total']:,} in {count(c['arrays'], 'array')} "
        f"({human_bytes(c['nbytes'])}; tied weights once).",
        table(["subtree", "class", "params", "bytes", "share"], rows, right=(2, 3, 4)),
        *tree.left_out_line(),
        "",
        "By dtype:",
        table(
            ["dtype", "arrays", "params", "bytes", "share"], dtypes, right=(1, 2, 3, 4)
        )
        if dtypes
        else "  (no arrays)",
    ]

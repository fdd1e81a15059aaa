"""`inspect --params` and `inspect --stats` (or `stats`): the numbers.

`--params` reads metadata only: parameters (elements of stored arrays; a
typed PRNG key counts once; tied weights once) per module subtree, then per
dtype. `--stats` reads every array in `verify`'s one pass (`_orbax.verify`:
pieces of 64 MiB, checked as they are read), and gives per leaf its NaN, Inf
and zero counts and, over its finite elements in float64, its minimum,
maximum, mean, standard deviation and L2 norm (complex numbers: the L2 norm
of their moduli only).
"""

import argparse
import dataclasses
import json
import math
import os

import numpy as np
from etils import epath

from .._errors import some
from .._format.sidecar import ALIAS, PACKED, SHARDS, STORED, LeafMetadata
from .._orbax.items import metadata_kind
from .._orbax.verify import check
from .._tree.walk import ARRAY, display_path, is_key_dtype, parse_dtype
from .render import Progress, Tree, count, human_bytes, table

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
    _finite: int = dataclasses.field(default=0, repr=False)
    _m2: float = dataclasses.field(default=0.0, repr=False)
    _sumsq: float = dataclasses.field(default=0.0, repr=False)

    def add(self, piece: np.ndarray) -> None:
        """Counts `piece` in, in order-free running sums (Chan et al.)."""
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
        finite = np.abs(wide[~(nan | inf)]) if complex_ else wide[~(nan | inf)]
        n = int(finite.size)
        if n == 0:
            return
        self._sumsq += float(np.sum(np.square(finite)))
        self.l2 = math.sqrt(self._sumsq)
        if complex_:  # the L2 norm of the moduli, no more
            return
        mean, total = float(np.mean(finite)), self._finite + n
        delta = mean - (self.mean or 0.0)
        self.mean = (self.mean or 0.0) + delta * n / total
        m2 = float(np.sum(np.square(finite - mean)))
        self._m2 += m2 + delta * delta * self._finite * n / total
        self._finite = total
        self.std = math.sqrt(max(self._m2, 0.0) / total)
        low, high = float(finite.min()), float(finite.max())
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)

    def as_json(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc = {k: v for k, v in doc.items() if not k.startswith("_")}
        numbers = {k: _finite(doc[k]) for k in _NUMBERS}
        return doc | {"shape": list(self.shape)} | numbers


def leaf_stats(item: epath.Path, saved, progress=None) -> list[LeafStats]:
    """The statistics of each array leaf of the item, in the metadata's order,
    from one `verify` pass; a damaged or unreadable leaf has its `error`."""
    found: dict[str, LeafStats] = {}
    for r in saved.leaves.values():
        if r.kind == ARRAY:
            shape = tuple(r.shape or ())
            found[r.name] = LeafStats(
                r.name, r.path, str(r.dtype), shape, math.prod(shape)
            )
            found[r.name].keys = is_key_dtype(parse_dtype(r.dtype))

    def piece(record: LeafMetadata, data: np.ndarray) -> None:
        stats = found[record.name]
        if not stats.keys:
            dtype = np.dtype(parse_dtype(record.dtype))
            stats.add(data if data.dtype == dtype else data.view(dtype))

    report = check(item, saved, progress, piece)
    for damaged in report.damaged:
        found[damaged.name] = dataclasses.replace(
            _empty(found[damaged.name]), error=damaged.problem
        )
    for r in saved.leaves.values():
        if r.kind == ARRAY and r.data == ALIAS:  # the same array: read once
            found[r.name] = dataclasses.replace(
                found[r.alias_of], name=r.name, path=r.path
            )
    return list(found.values())


def _empty(stats: LeafStats) -> LeafStats:
    base = LeafStats(stats.name, stats.path, stats.dtype, stats.shape, stats.size)
    return dataclasses.replace(base, keys=stats.keys)


def counts(saved, depth: int | None) -> dict:
    """`{"total", "arrays", "nbytes", "nodes": [{"name", "depth", "class",
    "params", "nbytes"}], "dtypes": [...], "left_out"}` of the item."""
    stored = {
        r.name: r for r in saved.leaves.values() if r.kind == ARRAY and r.data != ALIAS
    }
    tree = Tree(saved)
    nodes = []
    stack = [(tree.root, "", 0)]
    while stack:  # depth first without recursion: models nest deep
        node, name, level = stack.pop()
        params = nbytes = 0
        todo = [node]
        while todo:
            current = todo.pop()
            leaf = current.leaf
            if leaf is not None and leaf.name in stored:
                params += math.prod(leaf.shape or ())
                nbytes += leaf.nbytes
            todo.extend(current.children.values())
        cls = (
            saved.modules[node.module].cls.rsplit(".", 1)[-1]
            if node.module is not None
            else ""
        )
        if node.children or node is tree.root:
            nodes.append(
                {
                    "name": name,
                    "depth": level,
                    "class": cls or None,
                    "params": params,
                    "nbytes": nbytes,
                }
            )
        if depth is None or level < depth:
            inner = [
                (child, f"{name}.{part}" if name else part, level + 1)
                for part, child in node.children.items()
                if child.children
            ]
            stack.extend(reversed(inner))
    dtypes: dict[str, dict] = {}
    for r in stored.values():
        d = dtypes.setdefault(
            str(r.dtype), {"dtype": str(r.dtype), "arrays": 0, "params": 0, "nbytes": 0}
        )
        d["arrays"] += 1
        d["params"] += math.prod(r.shape or ())
        d["nbytes"] += r.nbytes
    return {
        "total": sum(math.prod(r.shape or ()) for r in stored.values()),
        "arrays": len(stored),
        "nbytes": sum(r.nbytes for r in stored.values()),
        "nodes": nodes,
        "dtypes": sorted(dtypes.values(), key=lambda d: (-d["nbytes"], d["dtype"])),
        "left_out": tree.left_out_line(),
    }


def run(args: argparse.Namespace, report) -> int:
    """Prints `--params` (and with `--stats`, the values) of every item of
    `report` (`inspect.gather`'s); exit status 1 if a leaf is damaged."""
    found = []
    for saved in report.items:
        stats = None
        if args.stats:
            total = sum(
                r.nbytes
                for r in saved.leaves.values()
                if r.data in (PACKED, SHARDS, STORED)
            )
            with Progress("inspect --stats", total) as bar:
                stats = leaf_stats(epath.Path(saved.directory), saved, bar.advance)
        found.append((saved, counts(saved, args.depth), stats))
    if args.json:
        items = [
            {
                "path": saved.directory,
                "kind": metadata_kind(saved),
                "params": {k: v for k, v in c.items() if k != "left_out"},
                "stats": None if s is None else [x.as_json() for x in s],
            }
            for saved, c, s in found
        ]
        doc = {"path": os.fspath(report.path), "step": report.step, "items": items}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        parts = []
        if report.step is not None:
            parts.append(
                f"CheckpointManager root {report.path}: showing the latest step, "
                f"{report.step}.\n"
            )
        for saved, c, s in found:
            lines = [f"Checkpoint {saved.directory} ({metadata_kind(saved)} item)", ""]
            lines += [*_stats_lines(s), ""] if s is not None else []
            parts.append("\n".join(lines + _count_lines(c)) + "\n")
        print("\n".join(parts), end="")
    return 1 if any(x.error for _, _, s in found for x in s or []) else 0


def _num(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.4g}"


def _stats_lines(stats: list[LeafStats]) -> list[str]:
    rows = [
        [_num(getattr(s, k)) for k in _NUMBERS]
        + (["-"] * 3 if s.keys or s.error else [str(s.zeros), str(s.nan), str(s.inf)])
        + [s.dtype, display_path(s.name)]
        for s in stats
    ]
    header = ["min", "max", "mean", "std", "L2", "zeros", "nan", "inf", "dtype", "name"]
    lines = [
        f"Values of {count(len(stats), 'array')} (over their finite elements):",
        # The name last: the numbers line up whatever its length.
        table(header, rows, right=tuple(range(8))),
    ]
    nonfinite = [display_path(s.name) for s in stats if s.nan or s.inf]
    if nonfinite:
        lines.append(
            f"Not finite: {len(nonfinite)} array(s) hold NaN or Inf: {some(nonfinite, 10)}."
        )
    keys = sum(s.keys for s in stats)
    if keys:
        lines.append(
            f"Typed PRNG keys ({keys} array(s)) hold no numbers: counted only."
        )
    return lines + [
        f"DAMAGED {display_path(s.name)}: {s.error}" for s in stats if s.error
    ]


def _count_lines(c: dict) -> list[str]:
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
    header = ["dtype", "arrays", "params", "bytes", "share"]
    return [
        f"Parameters: {c['total']:,} in {count(c['arrays'], 'array')} "
        f"({human_bytes(c['nbytes'])}; tied weights once).",
        table(["subtree", "class", "params", "bytes", "share"], rows, right=(2, 3, 4)),
        *c["left_out"],
        "",
        "By dtype:",
        table(header, dtypes, right=(1, 2, 3, 4)) if dtypes else "  (no arrays)",
    ]


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None

"""`inspect` and `verify` of safetensors: a file, a directory of them, or an
index (`model.safetensors.index.json`), local or on an object store.

`inspect` lists every tensor from the headers alone (runs of per-layer
tensors alike fold into one row: `layers.{0..31}.attn.q.weight`); with
`--skeleton` (and `--mapping`) it lines the tensors up with the skeleton as
`import` would, through the bridge's checks and planner, reading no tensor.
`verify` says which files carry orbax_eqx's per-tensor checksums and checks
those.
"""

import argparse
import json
import os
import re

from etils import epath

from .._bridge.load import check_load
from .._bridge.safetensors.checksums import CHECKSUMS, recorded
from .._bridge.safetensors.header import Header, where
from .._bridge.safetensors.index import INDEX_FILE, SUFFIX, find, read_index
from .._bytes.paths import is_remote
from .._errors import OrbaxEqxError, some
from .._format.checksum import NAME, Running
from .._format.locate import as_path
from .._mapping.errors import BridgeError
from .._orbax import items as _items
from .._storage import ranges as _ranges
from . import skeleton as _skeleton
from .render import Progress, count, error_lines, human_bytes, printable, table

_INDEX = ".index.json"
_PIECE = 64 << 20  # bytes of a tensor read at a time by `verify`
_SHOWN = 6  # indices of a folded name listed, at most, when not a range


def names_safetensors(text: str) -> bool:
    """Whether `text` names safetensors rather than a checkpoint."""
    if text.endswith((SUFFIX, _INDEX)):
        return True
    if is_remote(text) or not os.path.isdir(text):
        return False
    path = as_path(text)
    names = os.listdir(text)
    found = INDEX_FILE in names or any(n.endswith(SUFFIX) for n in names)
    return found and _items.kind_of(path) is None and not _items.items_in(path)


def _headers(text: str) -> list[Header]:
    if not text.endswith(_INDEX):
        return find(text)
    directory, _, name = where(text).rpartition("/")
    if name == INDEX_FILE:
        return find(directory)
    return find(
        [f"{directory}/{f}" for f in sorted(set(read_index(where(text)).values()))]
    )


def inspect(args: argparse.Namespace) -> int:
    headers = _headers(args.path)
    if args.skeleton:
        return _dry_run(args, headers)
    if args.mapping:
        raise OrbaxEqxError(
            "--mapping lines the tensors up with a skeleton: give --skeleton "
            "MODULE:FUNCTION too."
        )
    tensors = [(h, t) for h in headers for t in h.tensors.values()]
    total = sum(t.nbytes for _, t in tensors)
    rows = _folded([(t.name, t.shape, t.dtype, t.nbytes) for _, t in tensors])
    if args.json:
        doc = {
            "path": where(args.path),
            "kind": "safetensors",
            "files": [_file_json(h) for h in headers],
            "tensors": {
                t.name: {
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "nbytes": t.nbytes,
                    "file": h.path,
                }
                for h, t in tensors
            },
            "folded": [
                {"name": n, "shape": list(s), "dtype": d, "nbytes": b, "tensors": k}
                for n, s, d, b, k in rows
            ],
            "totals": {"files": len(headers), "tensors": len(tensors), "nbytes": total},
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return 0
    lines = [
        f"Safetensors at {where(args.path)}: {count(len(headers), 'file')}, "
        f"{count(len(tensors), 'tensor')}, {human_bytes(total)}",
        table(
            ["file", "tensors", "bytes", "__metadata__"],
            [_file_row(h) for h in headers],
            right=(1, 2),
        ),
        "",
    ]
    if args.flat or args.every:
        body = [
            [t.name, str(t.shape), t.dtype, human_bytes(t.nbytes), _base(h)]
            for h, t in tensors
        ]
        lines.append(
            table(["name", "shape", "dtype", "bytes", "file"], body, right=(3,))
        )
    else:
        body = [[n, str(s), d, human_bytes(b)] for n, s, d, b, _ in rows]
        lines.append(table(["name", "shape", "dtype", "bytes"], body, right=(3,)))
        if len(rows) < len(tensors):
            lines.append(
                f"Rows with {{...}} stand for tensors alike but for those indices "
                f"({len(tensors)} tensors in {len(rows)} rows; --flat lists each)."
            )
    print("\n".join(lines))
    return 0


def _base(h: Header) -> str:
    return h.path.rpartition("/")[2]


def _file_row(h: Header) -> list[str]:
    keys = sorted(h.metadata)
    return [_base(h), str(len(h.tensors)), human_bytes(h.size), some(keys) or "-"]


def _file_json(h: Header) -> dict:
    return {
        "path": h.path,
        "tensors": len(h.tensors),
        "nbytes": h.size,
        "metadata": sorted(h.metadata),
        "checksums": CHECKSUMS in h.metadata,
    }


def _key(name: str) -> tuple:
    """`layers.10.w` after `layers.9.w`: numbers as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _folded(tensors) -> list[tuple[str, tuple, str, int, int]]:
    """`(name, shape, dtype, bytes, tensors)` rows: tensors whose names differ
    only in numeric parts, of one shape and dtype, as one row when their
    indices make a full grid (`h.{0..11}.attn.w`); the others one a row."""
    groups: dict[tuple, list] = {}
    for name, shape, dtype, nbytes in sorted(tensors, key=lambda t: _key(t[0])):
        parts = name.split(".")
        template = tuple(None if _is_index(p) else p for p in parts)
        groups.setdefault((template, tuple(shape), dtype), []).append((parts, nbytes))
    rows = []
    for (template, shape, dtype), members in groups.items():
        holes = [i for i, p in enumerate(template) if p is None]
        values = [sorted({int(m[0][i]) for m in members}) for i in holes]
        grid = 1
        for v in values:
            grid *= len(v)
        if len(members) > 1 and grid == len(members):
            parts = list(template)
            for i, v in zip(holes, values, strict=True):
                parts[i] = _indices(v)
            rows.append(
                (
                    ".".join(parts),
                    shape,
                    dtype,
                    sum(b for _, b in members),
                    len(members),
                )
            )
        else:
            rows += [(".".join(p), shape, dtype, b, 1) for p, b in members]
    return sorted(rows, key=lambda r: _key(re.sub(r"\{(\d+).*?\}", r"\1", r[0])))


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit() and len(part) <= 9


def _indices(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    shown = ",".join(map(str, values[:_SHOWN]))
    return f"{{{shown}{',...' if len(values) > _SHOWN else ''}}}"


def _dry_run(args: argparse.Namespace, headers: list[Header]) -> int:
    """The tensors lined up with the skeleton, or every problem: exit status 0
    if they fit, 1 if not."""
    how = f" through the mapping {args.mapping}" if args.mapping else " by name"
    head = f"Safetensors at {where(args.path)}, lined up with {args.skeleton}{how} (no tensor read)"
    try:
        _, plan = check_load(
            args.path if not args.path.endswith(_INDEX) else [h.path for h in headers],
            _skeleton.load(args.skeleton),
            mapping=_skeleton.load_mapping(args.mapping, None),
            cast=args.cast,
            allow_unused=args.allow_unused,
            ignore_static=args.ignore_static,
        )
    except BridgeError as e:
        print("\n".join([f"{head}: they do not fit.", *error_lines(e)]))
        return 1
    given = {t.name: t for h in headers for t in h.tensors.values()}
    rows = []
    for name, leaf in plan.leaves.items():
        names = sorted({p.tensor for p in plan.leaf_pieces(name)}, key=_key)
        found = [(n, given[n].shape, given[n].dtype, given[n].nbytes) for n in names]
        sources = ", ".join(f"{r[0]} {r[1]}" for r in _folded(found))
        dtypes = sorted({t[2] for t in found} - {leaf.dtype})
        cast = f" (cast from {', '.join(dtypes)})" if dtypes else ""
        rows.append(
            [printable(leaf.label), str(leaf.shape), leaf.dtype, sources + cast]
        )
    read = [t for t in plan.tensors if t not in plan.ties]
    unused = [n for n in given if n not in plan.tensors]
    nbytes = sum(given[t].nbytes for t in read if t in given)
    lines = [
        f"{head}:",
        table(["leaf", "shape", "dtype", "from tensors"], rows),
        "",
        f"They fit: {count(len(plan.leaves), 'leaf', 'leaves')} from {count(len(read), 'tensor')} "
        f"({human_bytes(nbytes)}) would be read.",
    ]
    if plan.dropped:
        lines.append(
            f"Kept from the skeleton (the mapping drops them): {some(sorted(plan.dropped))}."
        )
    if plan.ties:
        lines.append(f"Tied, checked and not read: {some(sorted(plan.ties))}.")
    if unused:
        lines.append(f"Left out: {count(len(unused), 'tensor')} ({some(unused)}).")
    print("\n".join(lines))
    return 0


def verify(args: argparse.Namespace) -> int:
    """Checks the tensors of every file that records checksums; exit status 1
    if one does not match."""
    headers = _headers(args.path)
    total = sum(
        t.nbytes for h in headers if CHECKSUMS in h.metadata for t in h.tensors.values()
    )
    files = []
    with Progress("verify", total) as bar:
        for h in headers:
            files.append(_check_file(h, bar.advance))
    ok = all(not f["damaged"] for f in files)
    if args.json:
        print(
            json.dumps(
                {
                    "path": where(args.path),
                    "kind": "safetensors",
                    "files": files,
                    "ok": ok,
                },
                indent=2,
            )
        )
        return 0 if ok else 1
    lines = []
    for f in files:
        base = f["path"].rpartition("/")[2]
        lines += [
            f"DAMAGED {base} `{printable(d['name'])}`: {d['problem']}"
            for d in f["damaged"]
        ]
        if not f["checksums"]:
            lines.append(
                f"{base}: no checksums ({count(f['tensors'], 'tensor')}): not written by "
                "orbax_eqx's export, or before it recorded them; its header is sound, "
                "its values cannot be checked."
            )
        elif not f["damaged"]:
            lines.append(
                f"{base}: {len(f['checked'])} of {f['tensors']} tensors "
                f"({human_bytes(f['nbytes'])}) match their checksums."
            )
    summed = sum(f["checksums"] for f in files)
    verdict = (
        f"{count(len(files), 'file')} of {where(args.path)}: {summed} with checksums"
        + (", every tensor matching" if ok else "")
        + f", {len(files) - summed} with none."
    )
    print(
        "\n".join(
            [
                *lines,
                verdict if ok else f"Damaged: {verdict} Re-download or re-export them.",
            ]
        )
    )
    return 0 if ok else 1


def _check_file(h: Header, advance) -> dict:
    doc = {
        "path": h.path,
        "tensors": len(h.tensors),
        "checksums": False,
        "checked": [],
        "damaged": [],
        "unchecked": [],
        "nbytes": 0,
    }
    try:
        sums = recorded(h.metadata)
    except ValueError as e:
        doc["damaged"].append({"name": CHECKSUMS, "problem": f"the file's {e}"})
        return doc
    if sums is None:
        doc["unchecked"] = list(h.tensors)
        return doc
    doc["checksums"] = True
    for name in sums.keys() - h.tensors.keys():
        doc["damaged"].append(
            {"name": name, "problem": "has a checksum but is not in the file"}
        )
    for t in h.tensors.values():
        if t.name not in sums:
            doc["unchecked"].append(t.name)
            continue
        running = Running()
        for at in range(t.start, t.start + t.nbytes, _PIECE):
            span = [(at, min(at + _PIECE, t.start + t.nbytes))]
            (data,) = _ranges.read(epath.Path(h.path), span, nbytes=h.size)
            running.update(data)
            advance(data.nbytes)
            doc["nbytes"] += data.nbytes
        if running.value() == sums[t.name]:
            doc["checked"].append(t.name)
        else:
            doc["damaged"].append(
                {
                    "name": t.name,
                    "problem": f"data does not match its {NAME}: {sums[t.name]:#018x} recorded, "
                    f"{running.value():#018x} computed now",
                }
            )
    return doc

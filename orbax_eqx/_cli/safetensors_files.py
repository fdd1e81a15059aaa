"""`inspect` and `verify` of safetensors: a file, a directory of them, or an
index (`model.safetensors.index.json`), local or on an object store.

`inspect` lists every tensor from the headers alone (per-layer tensors alike
fold into one row: `layers.{0..31}.attn.q.weight`); with `--skeleton` (and
`--mapping`) it lines them up with the skeleton as `import` would, through
the bridge's checks and planner, reading no tensor. `verify` says which files
carry orbax_eqx's per-tensor checksums, and checks those.
"""

import json
import math
import os
from typing import Any

from etils import epath

from .._bridge.load import check_load
from .._bridge.safetensors.checksums import CHECKSUMS, chunk, mismatches, recorded
from .._bridge.safetensors.header import Header, where
from .._bridge.safetensors.index import INDEX_FILE, SUFFIX, find, read_index
from .._bytes.route import is_remote
from .._errors import OrbaxEqxError, some
from .._format.locate import as_path
from .._mapping.errors import BridgeError
from .._orbax import items as _items
from .._storage import ranges as _ranges
from . import skeleton as _skeleton
from .render import FOLD, Progress, count, error_lines, human_bytes, printable, table

_INDEX = ".index.json"
_PIECE = 64 << 20  # bytes of a tensor read at a time by `verify`
_SHOWN = 6  # indices of a folded name listed, at most, when not a range


def names_safetensors(text: str) -> bool:
    """Whether `text` names safetensors rather than a checkpoint."""
    if text.endswith((SUFFIX, _INDEX)):
        return True
    if is_remote(text) or not os.path.isdir(text):
        return False
    names = os.listdir(text)
    if INDEX_FILE not in names and not any(n.endswith(SUFFIX) for n in names):
        return False
    path = as_path(text)
    return _items.kind_of(path) is None and not _items.items_in(path)


def _headers(text: str) -> list[Header]:
    if not text.endswith(_INDEX):
        return find(text)
    directory, _, name = where(text).rpartition("/")
    if name == INDEX_FILE:
        return find(directory)
    files = sorted(set(read_index(where(text)).values()))
    return find([f"{directory}/{f}" for f in files])


def run(args) -> int:
    return verify(args) if args.command == "verify" else inspect(args)


def inspect(args) -> int:
    headers = _headers(args.path)
    if args.skeleton:
        return _dry_run(args, headers)
    if args.mapping:
        raise OrbaxEqxError(
            "--mapping lines the tensors up with a skeleton: give --skeleton "
            "MODULE:FUNCTION too."
        )
    tensors = [(h, t) for h in headers for t in h.tensors.values()]
    rows = folded([(t.name, t.shape, t.dtype, t.nbytes) for _, t in tensors])
    total = sum(t.nbytes for _, t in tensors)
    if args.json:
        print(json.dumps(_json(args.path, headers, rows, total), indent=2))
        return 0
    print("\n".join(_listing(args, headers, tensors, rows, total)))
    return 0


def _listing(args, headers, tensors, rows, total: int) -> list[str]:
    files = [_file_row(h) for h in headers]
    lines = [
        f"Safetensors at {where(args.path)}: {count(len(headers), 'file')}, "
        f"{count(len(tensors), 'tensor')}, {human_bytes(total)}",
        table(["file", "tensors", "bytes", "__metadata__"], files, right=(1, 2)),
        "",
    ]
    if args.flat or args.every:
        header = ["name", "shape", "dtype", "bytes", "file"]
        each = [
            [t.name, str(t.shape), t.dtype, human_bytes(t.nbytes), _base(h.path)]
            for h, t in tensors
        ]
        return [*lines, table(header, each, right=(3,))]
    shown = [[n, str(s), d, human_bytes(b)] for n, s, d, b, _ in rows]
    lines.append(table(["name", "shape", "dtype", "bytes"], shown, right=(3,)))
    if len(rows) < len(tensors):
        lines.append(
            f"A name with {{...}} is a row of tensors alike but for those indices "
            f"({len(tensors)} tensors in {len(rows)} rows; --flat lists each)."
        )
    return lines


def _base(path: str) -> str:
    return path.rpartition("/")[2]


def _file_row(h: Header) -> list[str]:
    size = human_bytes(h.size)
    return [_base(h.path), str(len(h.tensors)), size, some(sorted(h.metadata)) or "-"]


def _json(path: str, headers: list[Header], rows, total: int) -> dict:
    tensors = {
        t.name: {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "nbytes": t.nbytes,
            "file": h.path,
        }
        for h in headers
        for t in h.tensors.values()
    }
    files = [
        {"path": h.path, "tensors": len(h.tensors), "nbytes": h.size}
        | {"metadata": sorted(h.metadata), "checksums": CHECKSUMS in h.metadata}
        for h in headers
    ]
    keys = ("name", "shape", "dtype", "nbytes", "tensors")
    return {
        "path": where(path),
        "kind": "safetensors",
        "files": files,
        "tensors": tensors,
        "folded": [
            dict(zip(keys, (n, list(s), *rest), strict=True)) for n, s, *rest in rows
        ],
        "totals": {"files": len(headers), "tensors": len(tensors), "nbytes": total},
    }


def _key(name: str) -> tuple:
    """`layers.10.w` after `layers.9.w`: numbers as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def folded(tensors) -> list[tuple[str, tuple, str, int, int]]:
    """`(name, shape, dtype, bytes, tensors)` rows: `FOLD` or more tensors
    whose names differ only in numeric parts, of one shape and dtype, as one
    row when their indices make a full grid (`h.{0..11}.attn.w`); the others
    one a row."""
    groups: dict[tuple, list] = {}
    for name, shape, dtype, nbytes in sorted(tensors, key=lambda t: _key(t[0])):
        parts = name.split(".")
        template = tuple(None if _is_index(p) else p for p in parts)
        groups.setdefault((template, tuple(shape), dtype), []).append((parts, nbytes))
    rows = []
    for (template, shape, dtype), members in groups.items():
        holes = [i for i, p in enumerate(template) if p is None]
        values = [sorted({int(m[0][i]) for m in members}) for i in holes]
        if len(members) < FOLD or len(members) != math.prod(len(v) for v in values):
            rows += [(".".join(p), shape, dtype, b, 1) for p, b in members]
            continue
        parts = list(template)
        for i, v in zip(holes, values, strict=True):
            parts[i] = _indices(v)
        nbytes = sum(b for _, b in members)
        rows.append((".".join(parts), shape, dtype, nbytes, len(members)))
    return rows  # in the order of each row's first tensor


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit() and len(part) <= 9


def _indices(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    shown = ",".join(map(str, values[:_SHOWN]))
    return f"{{{shown}{',...' if len(values) > _SHOWN else ''}}}"


def _dry_run(args, headers: list[Header]) -> int:
    """The tensors lined up with the skeleton, or every problem: exit status 0
    if they fit, 1 if not."""
    how = f"through the mapping {args.mapping}" if args.mapping else "by name"
    head = f"Safetensors at {where(args.path)}, lined up with {args.skeleton} {how}"
    try:
        _, plan = check_load(
            [h.path for h in headers] if args.path.endswith(_INDEX) else args.path,
            _skeleton.load(args.skeleton),
            mapping=_skeleton.load_mapping(args.mapping, None),
            cast=args.cast,
            allow_unused=args.allow_unused,
            ignore_static=args.ignore_static,
        )
    except BridgeError as e:
        print(
            "\n".join([f"{head} (no tensor read): they do not fit.", *error_lines(e)])
        )
        return 1
    print("\n".join([f"{head} (no tensor read):", *_plan_lines(plan, headers)]))
    return 0


def _plan_lines(plan, headers: list[Header]) -> list[str]:
    """Each leaf the plan fills, from which tensors; what it reads, and what
    it leaves to the skeleton, checks only, or leaves out."""
    given = {t.name: t for h in headers for t in h.tensors.values()}
    rows = [
        _leaf_row(leaf, plan.leaf_pieces(name), given)
        for name, leaf in plan.leaves.items()
    ]
    read = [given[t] for t in plan.tensors if t not in plan.ties and t in given]
    unused = [n for n in given if n not in plan.tensors]
    lines = [
        table(["leaf", "shape", "dtype", "from tensors"], rows),
        "",
        f"They fit: {count(len(plan.leaves), 'leaf', 'leaves')} from "
        f"{count(len(read), 'tensor')} ({human_bytes(sum(t.nbytes for t in read))}).",
    ]
    notes = [
        ("Kept from the skeleton (the mapping drops them)", sorted(plan.dropped)),
        ("Tied, checked and not read", sorted(plan.ties)),
        ("Left out (--allow-unused)", unused),
    ]
    return lines + [f"{what}: {some(names)}." for what, names in notes if names]


def _leaf_row(leaf, pieces, given) -> list[str]:
    """A leaf of the plan, and the tensors that fill it (folded)."""
    names = sorted({p.tensor for p in pieces}, key=_key)
    found = [(n, given[n].shape, given[n].dtype, given[n].nbytes) for n in names]
    sources = ", ".join(f"{n} {s}" for n, s, *_ in folded(found))
    dtypes = sorted({t[2] for t in found} - {leaf.dtype})
    cast = f" (cast from {', '.join(dtypes)})" if dtypes else ""
    return [printable(leaf.name), str(leaf.shape), leaf.dtype, sources + cast]


def verify(args) -> int:
    """Checks the tensors of every file that records checksums; exit status 1
    if one does not match."""
    headers = _headers(args.path)
    summed = [h for h in headers if CHECKSUMS in h.metadata]
    with Progress(
        "verify", sum(t.nbytes for h in summed for t in h.tensors.values())
    ) as bar:
        files = [_check(h, bar.advance) for h in headers]
    ok = not any(f["damaged"] for f in files)
    if args.json:
        doc = {"path": where(args.path), "kind": "safetensors", "files": files}
        print(json.dumps(doc | {"ok": ok}, indent=2))
        return 0 if ok else 1
    lines = [line for f in files for line in _file_lines(f)]
    with_sums = sum(f["checksums"] for f in files)
    verdict = (
        f"{count(len(files), 'file')} of {where(args.path)}: {with_sums} with "
        f"orbax_eqx's checksums, {len(files) - with_sums} with none."
    )
    if not ok:
        verdict = f"Damaged: {verdict} Re-download or re-export the damaged files."
    print("\n".join([*lines, verdict]))
    return 0 if ok else 1


def _file_lines(f: dict) -> list[str]:
    base = _base(f["path"])
    lines = [
        f"DAMAGED {base} `{printable(d['name'])}`: {d['problem']}" for d in f["damaged"]
    ]
    if not f["checksums"]:
        lines.append(
            f"{base}: no checksums ({count(f['tensors'], 'tensor')}): written by "
            "something other than orbax_eqx's export; its header is sound, its "
            "values cannot be checked."
        )
    elif not f["damaged"]:
        size = human_bytes(f["nbytes"])
        matched = f"{len(f['checked'])} of {f['tensors']} tensors ({size})"
        lines.append(f"{base}: {matched} match their checksums.")
    return lines


def _check(h: Header, advance) -> dict:
    """A file's tensors against the checksums it records, if it does."""
    checked: list[str] = []
    damaged: list[dict[str, str]] = []
    unchecked: list[str] = []
    doc: dict[str, Any] = {"path": h.path, "tensors": len(h.tensors), "nbytes": 0}
    doc |= {"checksums": False, "checked": checked, "damaged": damaged}
    doc["unchecked"] = unchecked
    try:
        sums = recorded(h.metadata)
    except ValueError as e:
        damaged.append({"name": CHECKSUMS, "problem": f"the __metadata__ entry is {e}"})
        return doc
    doc["checksums"] = sums is not None
    for name in sorted((sums or {}).keys() - h.tensors.keys()):
        damaged.append(
            {"name": name, "problem": "has a checksum, but is no tensor of the file"}
        )
    for t in h.tensors.values():
        if sums is None or t.name not in sums:
            unchecked.append(t.name)
            continue
        try:
            c = chunk(t.name, t.start, t.nbytes, sums[t.name])
        except ValueError as e:
            damaged.append({"name": t.name, "problem": f"its checksum entry {e}"})
            continue
        found = []
        step = c.block * max(1, _PIECE // c.block)
        for at in range(0, t.nbytes, step):
            span = [(t.start + at, t.start + min(at + step, t.nbytes))]
            (data,) = _ranges.read(epath.Path(h.path), span, nbytes=h.size)
            found += mismatches(c, at, data)
            advance(data.nbytes)
            doc["nbytes"] += data.nbytes
        if not found:
            checked.append(t.name)
        damaged += [
            {"name": t.name, "problem": f"data does not match its sums: {line}"}
            for line in found
        ]
    return doc

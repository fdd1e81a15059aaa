"""Editing a checkpoint's sidecar in tests, as an attacker would.

Reaches inside: it writes short records and seals exactly as a save's writer does.

From format 6 on a sidecar carries a checksum of its own bytes, which any
edit breaks. An attacker recomputes it; so do these helpers (`edit`,
`replace`), so that a test probes the reader's rules, not the checksum.
`tests/test_sidecar_seal.py` edits without resealing: damage.

From format 6 on a save also writes its common records short (rows, module
and node types: `orbax_eqx/_format/compact.py`). `read` gives every record
whole (`expand`, the inverse of what the save does), and `write` writes short
what a save would write short: a test edits whole records, and what it
changed is written whole. `tests/test_sidecar_encoding.py` edits the short forms
themselves.
"""

import hashlib
import json
import re
from typing import Any

from orbax_eqx._format.checksum import digest
from orbax_eqx._format.compact import LENGTH, NODE, Paths, children_of
from orbax_eqx._format.sidecar import FILE_NAME, checksum_line, itemsize
from orbax_eqx._format.sidecar_write import to_bytes
from orbax_eqx._tree.walk import parse_dtype

_LAST = re.compile(rb'\n "checksum": "[^"]*"\n}\n\Z')


def read(path) -> dict:
    """The JSON of the sidecar of the item directory `path`, every record
    whole, without its checksum (which `write` computes anew, and sidecars
    before format 6 lack)."""
    content = json.loads((path / FILE_NAME).read_text())
    content.pop("checksum", None)
    if content.get("format_version") == 7:
        content = expand(content)
    return content


def write(path, content: dict) -> None:
    """Writes `content` as the sidecar, as a save writes it: from format 6
    on with short records where they say the same, and sealed."""
    (path / FILE_NAME).write_bytes(to_bytes(content))


def edit(path, change) -> None:
    """Applies `change(content)` to the sidecar's JSON, in place, and reseals it."""
    content = read(path)
    change(content)
    write(path, content)


def reseal(data: bytes) -> bytes:
    """The sidecar's bytes with the checksum of what precedes its last line
    recomputed (bytes without a checksum line are returned as they are)."""
    found = _LAST.search(data)
    if found is None:
        return data
    body = data[: found.start() + 1]
    return body + checksum_line(digest(body))


def replace(path, old: str, new: str) -> None:
    """Replaces the first `old` in the sidecar's text by `new`, and reseals it
    (for JSON that Python cannot write back: NaN, deep nesting, long ints)."""
    text = (path / FILE_NAME).read_text()
    assert old in text
    data = text.replace(old, new, 1).encode("utf-8", "surrogatepass")
    (path / FILE_NAME).write_bytes(reseal(data))


def seal_text(text: str) -> bytes:
    """A sidecar's JSON text (one object, as compact as you like) with the
    checksum a save puts last: for sidecars written without `write`."""
    body = (text.rstrip().removesuffix("}") + ",\n").encode("utf-8", "surrogatepass")
    return body + checksum_line(digest(body))


def write_json(path, content: dict) -> None:
    """Writes `content` (a shard index, say) as JSON at `path`, sealed as a
    save seals it (the old checksum member dropped, a new one last)."""
    body = {k: v for k, v in content.items() if k != "checksum"}
    path.write_bytes(seal_text(json.dumps(body)))


def expand_leaf(name: str, entry: Any, paths: Paths) -> Any:
    """The whole record of a leaf's entry: a row (`[dtype, shape, offset,
    xxh3]`) or a record without its path, as the save writes them short."""
    if isinstance(entry, list) and len(entry) == 4:
        dtype, shape, offset, sum_ = entry
        nbytes = itemsize(parse_dtype(dtype))
        for n in shape:
            nbytes *= n
        record = {
            "path": paths.of(name),
            "kind": "array",
            "shape": shape,
            "dtype": dtype,
            "container": "jax",
            "nbytes": nbytes,
            "data": "packed",
            "pack": 0,
            "offset": offset,
        }
        if sum_ is not None:
            record["xxh3"] = sum_
        return record
    if isinstance(entry, dict) and "path" not in entry:
        return {"path": paths.of(name), **entry}
    return entry


def _expand_node(name, entry, types, paths, path=None) -> Any:
    if type(entry) is not int:
        return entry
    kind = dict(types[entry])
    children = children_of(name, kind)
    kind.pop(LENGTH, None)
    return {"path": path or paths.of(name), **kind, "children": children}


def expand(content: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's content with every record whole (the tables dropped):
    what the save makes short, back."""
    out = dict(content)
    module_types = out.pop("module_types", [])
    node_types = out.pop("node_types", [])
    paths = Paths(content["modules"])
    out["leaves"] = {n: expand_leaf(n, e, paths) for n, e in content["leaves"].items()}
    out["modules"] = {
        n: e
        if type(e) is not int
        else {
            "path": paths.of(n),
            "class": module_types[e]["class"],
            "static": module_types[e]["static"],
        }
        for n, e in content["modules"].items()
    }
    if isinstance(content.get("nodes"), dict):
        out["nodes"] = {
            n: _expand_node(n, e, node_types, paths)
            for n, e in content["nodes"].items()
        }
        for n, e in content["modules"].items():  # nodes in their module's type
            if type(e) is int and NODE in module_types[e]:
                out["nodes"][n] = _expand_node(
                    n, module_types[e][NODE], node_types, paths
                )
    return out


# Names Orbax and TensorStore give their own files beside stored arrays, and
# the sidecar's: a leaf of such a name is stored under a stand-in key.
_ORBAX_FILES = {"_metadata", "_sharding", "array_metadatas", "checkpoint"}
_ORBAX_FILES |= {"manifest.ocdbt", "d", "descriptor", "_checkpoint_metadata"}
_ORBAX_FILES |= {"_root_metadata", "metadata", "commit_success.txt", "zarr.json"}
_ORBAX_FILES |= {"orbax_eqx.json"}
_ORBAX_PATTERN = re.compile(
    r"ocdbt\.process_.*|.*\.__lock|.*\.orbax-checkpoint-tmp", re.IGNORECASE
)


def storage_key(name: str) -> str:
    """The key Orbax's store holds the leaf `name` under, as
    docs/guides/format.md derives it (what a save of an attacker's name
    would use)."""
    if (
        len(name) <= 120
        and re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name)
        and name.casefold() not in _ORBAX_FILES
        and not _ORBAX_PATTERN.fullmatch(name)
    ):
        return name
    digest16 = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:103] + "~" + digest16

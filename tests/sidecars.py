"""Editing a checkpoint's sidecar in tests, as an attacker would.

From format 6 on a sidecar carries a checksum of its own bytes, which any
edit breaks. An attacker recomputes it; so do these helpers (`edit`,
`replace`), so that a test probes the reader's rules, not the checksum.
`tests/test_sidecar_seal.py` edits without resealing: damage.

From format 6 on a save also writes its common records short (rows, module
and node types: `orbax_eqx/_format/compact.py`). `read` gives every record
whole, and `write` writes short what a save would write short: a test edits
records as format 5 spells them, and what it changed is written whole.
`tests/test_compact.py` edits the short forms themselves.
"""

import json
import re

from orbax_eqx._format.checksum import digest
from orbax_eqx._format.compact import expand
from orbax_eqx._format.sidecar import FILE_NAME, checksum_line
from orbax_eqx._format.sidecar_write import to_bytes

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

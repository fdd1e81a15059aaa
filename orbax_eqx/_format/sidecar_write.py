"""Writing the sidecar: its bytes (from format 6 on with short records where
they say the same, `compact`, and sealed, `sealed`), written atomically."""

from collections.abc import Callable
from typing import Any

from etils import epath

# The one module of a later stage read here: it imports nothing of ours but
# `_errors`, and writing files safely is the same job for every file.
from .._bytes import route as _route
from . import compact as _compact
from .sealed import dumps
from .sidecar import FILE_NAME


def write(
    directory: epath.Path,
    content: dict[str, Any],
    pause: Callable[[], None] | None = None,
) -> None:
    """Writes the sidecar atomically and only if there is none yet.

    A reader sees no sidecar, or all of it. If another save put one there
    first, this raises `FileExistsError` and leaves that one alone: the
    sidecar is how a save claims its directory (see `_save.claim`). `pause` is
    called once per line of JSON (see `walk`).
    """
    data = to_bytes(content, pause)
    path = directory / FILE_NAME
    _route.write_new(path, data)


def to_bytes(content: dict[str, Any], pause: Callable[[], None] | None = None) -> bytes:
    """The sidecar's bytes for its JSON `content`: from format 6 on with short
    records where they say the same (`compact`), sealed by its checksum."""
    version = content.get("format_version")
    if type(version) is int and version < 6:
        return dumps(content, pause)
    return dumps(_compact.compact(content), pause, whole=content)

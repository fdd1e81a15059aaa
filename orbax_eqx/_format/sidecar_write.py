"""Writing the sidecar: its bytes, with short records where they say the same
(`compact`) and sealed (`sealed`), written atomically."""

from collections.abc import Callable
from typing import Any

from etils import epath

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
    called once per line of JSON.
    """
    _route.write_new(directory / FILE_NAME, to_bytes(content, pause))


def to_bytes(content: dict[str, Any], pause: Callable[[], None] | None = None) -> bytes:
    """The sidecar's bytes for its JSON `content`, short records where they say
    the same (`compact`), sealed by its checksum."""
    return dumps(_compact.compact(content), pause, whole=content)

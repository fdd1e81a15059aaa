"""Which side of the store interface a path is on: a local file, or an object.

The one place that asks (`is_remote`): the byte layer picks its store with it
(`route.for_path`), and the few steps that exist only on a local disk (a
rename, a link, a directory's permissions, leftovers of a killed save) ask it
rather than looking at the path themselves.
"""

import os
from typing import Any


def is_remote(path: Any) -> bool:
    """Whether `path` names an object (`gs://...`, `s3://...`), not a local file."""
    return "://" in os.fspath(path)

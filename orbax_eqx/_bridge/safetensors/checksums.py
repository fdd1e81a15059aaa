"""Per-tensor checksums in `__metadata__[CHECKSUMS]`: `{tensor name: the 16
lowercase hexadecimal digits of the XXH3-64 of its bytes}`."""

import json
import re

CHECKSUMS = "orbax_eqx.xxh3"
_SUM = re.compile(r"[0-9a-f]{16}")


def recorded(metadata: dict[str, str]) -> dict[str, int] | None:
    """The sums a file's `__metadata__` records, by tensor name; None if it
    records none. Raises `ValueError` saying what the entry is, if it is there
    but malformed."""
    text = metadata.get(CHECKSUMS)
    if text is None:
        return None
    try:
        sums = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(sums, dict) or not all(
        isinstance(v, str) and _SUM.fullmatch(v) for v in sums.values()
    ):
        raise ValueError("no JSON object of 16-digit hexadecimal sums")
    return {name: int(v, 16) for name, v in sums.items()}

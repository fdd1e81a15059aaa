"""How long a request to an object store may go without progress, and how
often a failed one is tried again.

- A request that sends or receives nothing for `stall_seconds()` (the
  environment variable `ORBAX_EQX_STALL_SECONDS`, default 60) is abandoned:
  an answer that never starts, an upload the server stops taking, a body that
  stops halfway. It is tried once more (`STALL_TRIES`): a second stall is an
  error, so a store that stops answering surfaces in about twice that.
- A request that fails quickly (a 5xx answer, throttling, a dropped or reset
  connection, a body cut short, an answer of the wrong range) is tried again
  up to `RETRIES` times, waiting `backoff(attempt)` between tries.
- TensorStore's requests (writes, and reads on `gs://`) follow the same rules
  through its own settings (`tensorstore_retries`, `configure_tensorstore`),
  and every wait on one is bounded by `operation_seconds()` as well.

The variable is read when a store is opened; TensorStore reads its own copy
once per process, at its first request.
"""

import math
import os

from .._errors import OrbaxEqxError

ENV = "ORBAX_EQX_STALL_SECONDS"
DEFAULT_STALL_S = 60.0
RETRIES = 6  # tries after the first, for failures that come quickly
STALL_TRIES = 2  # tries of a request that stalls
FIRST_DELAY_S = 0.2
MAX_DELAY_S = 4.0
_MARGIN_S = 5.0  # for TensorStore's own queueing, on top of its tries


class StallSettingError(OrbaxEqxError, ValueError):
    """`ORBAX_EQX_STALL_SECONDS` is set to something that is not a time."""


def stall_seconds() -> float:
    """Seconds a request may go without sending or receiving a byte."""
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return DEFAULT_STALL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise StallSettingError(
            f"{ENV} is {text!r}: expected the seconds a request to an object "
            f"store may go without progress, a number above 0 and at most "
            f"86400 (default {DEFAULT_STALL_S:.0f}). Set it to, say, `{ENV}=60`, "
            "or unset it."
        )
    return value


def backoff(attempt: int) -> float:
    """Seconds to wait before try `attempt + 2` (after `attempt + 1` failed)."""
    return min(FIRST_DELAY_S * 2**attempt, MAX_DELAY_S)


def operation_seconds() -> float:
    """The longest wait on one TensorStore request, its tries included: two
    stalls, and the backoff between all its tries."""
    waits = sum(backoff(attempt) for attempt in range(RETRIES))
    return STALL_TRIES * stall_seconds() + waits + _MARGIN_S


def tensorstore_retries() -> dict:
    """TensorStore's retry settings (`gcs_request_retries`, ...) for these rules."""
    return {
        "max_retries": RETRIES,
        "initial_delay": f"{FIRST_DELAY_S}s",
        "max_delay": f"{MAX_DELAY_S}s",
    }


def configure_tensorstore() -> None:
    """Has TensorStore abandon a request after `stall_seconds()` without a
    byte moved (its `TENSORSTORE_CURL_LOW_SPEED_*` variables, unless set),
    before its first request in this process."""
    seconds = max(1, math.ceil(stall_seconds()))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(seconds))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")

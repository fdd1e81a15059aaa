"""Orbax's record of an array's sharding, as `inspect` shows it."""

from typing import Any


def sharding_text(sharding: Any) -> str:
    """Orbax's sharding metadata as text: `single device (cpu:0)`,
    `P('data', None) over data=8`, `replicated over data=8`; "" for None."""
    if sharding is None:
        return ""
    device = getattr(sharding, "device_str", None)
    if device is not None:
        return f"single device ({device})"
    spec = getattr(sharding, "partition_spec", None)
    axes = getattr(sharding, "axis_names", None)
    shape = getattr(sharding, "shape", None)
    if spec is not None and axes is not None and shape is not None:
        mesh = ", ".join(
            f"{a}={int(n)}" for a, n in zip(axes, list(shape), strict=False)
        )
        if all(p is None or p == [] for p in spec):
            return f"replicated over {mesh}"
        parts = ", ".join(
            repr(p) if not isinstance(p, list) else repr(tuple(p)) for p in spec
        )
        return f"P({parts}) over {mesh}"
    return type(sharding).__name__

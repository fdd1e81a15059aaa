"""What the kernel says of this process (`/proc/self/status`), for the
benchmarks' memory figures. Linux only; the standard library only, so that a
probe may import it before it sets up JAX."""


def status(field: str) -> int:
    """A `/proc/self/status` field given in kB (`VmRSS`, `VmHWM`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")

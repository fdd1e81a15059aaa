"""The start of every worker script that `_procs.run` launches.

Sets the tests' warning policy (pyproject's `filterwarnings`) before JAX is
imported, reads the `jax.distributed` arguments `_procs.run` appends, and
joins the process group on 127.0.0.1.
"""

import argparse
import warnings

INIT_TIMEOUT_S = 60


def start(*positional: str) -> argparse.Namespace:
    """Parses `positional` arguments plus the process-group ones; starts JAX."""
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="orbax.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="orbax.*")
    parser = argparse.ArgumentParser()
    for name in positional:
        parser.add_argument(name)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    import jax

    if args.processes > 1:
        address = f"127.0.0.1:{args.port}"
        jax.distributed.initialize(
            address,
            num_processes=args.processes,
            process_id=args.process_id,
            # Without it the coordinator listens on every interface.
            coordinator_bind_address=address,
            initialization_timeout=INIT_TIMEOUT_S,
        )
    print(
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local devices, {jax.device_count()} in all",
        flush=True,
    )
    return args

"""The package as committed at a git revision, imported beside this checkout's,
for in-process A/B figures (`save_ab.py`, `numpy_leaves.py`, `inspect_speed.py`
and `restore_speed.py`, each with `--base REV`).

The revision's `orbax_eqx/` is extracted with `git archive` and imported under
another name (`orbax_eqx_base`). Its top level is not run: that registers the
handler's type name with Orbax, which this checkout's registered already; so
does its handler module, and that one registration is skipped (its handler is
always given to Orbax itself).
"""

import importlib
import io
import pathlib
import subprocess
import sys
import tarfile
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = "orbax_eqx_base"


def import_base(rev: str, into: pathlib.Path, module: str) -> types.ModuleType:
    """Module `module` (`"_orbax.api"`, say) of the package as committed at
    `rev`, extracted into `into` (once per process)."""
    if BASE not in sys.modules:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "orbax_eqx"],
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
        (into / "orbax_eqx").rename(into / BASE)
        package = types.ModuleType(BASE)
        package.__path__ = [str(into / BASE)]
        sys.modules[BASE] = package
    import orbax.checkpoint as ocp

    register = ocp.args.register_with_handler

    def lenient(*args, **kwargs):
        decorate = register(*args, **kwargs)

        def decorator(cls):
            try:
                return decorate(cls)
            except ValueError:  # the type name taken by this checkout's handler
                return cls

        return decorator

    ocp.args.register_with_handler = lenient
    try:
        return importlib.import_module(f"{BASE}.{module}")
    finally:
        ocp.args.register_with_handler = register


def checkout_head() -> str:
    """This checkout's commit, short, as the figures name it."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()

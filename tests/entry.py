"""The `orbax-eqx` command as users get it: the console script's entry point.

Tests call `main(argv)` (it returns the exit status) instead of importing the
CLI's module, so that they exercise what `pyproject.toml` publishes: were the
entry point renamed or moved, they would fail. The package is installed
(editable) in the test environments, so its entry points resolve; with
`PYTHONPATH` set to a checkout, the module they name is imported from there.
"""

import sys
import types
from importlib.metadata import entry_points


def _console_script():
    found = entry_points(group="console_scripts", name="orbax-eqx")
    if len(found) != 1:
        raise LookupError(
            f"{len(found)} `orbax-eqx` console scripts installed, expected 1: "
            "install the package (`pip install -e .`)"
        )
    (point,) = found
    return point.load()


main = _console_script()


def skeleton_spec(skeleton) -> str:
    """A `module:function` that gives `skeleton`, for `--skeleton`: a module of
    this process (`import --skeleton` imports it, finding it imported)."""
    module = types.ModuleType("_skeleton_of_this_test")
    module.skeleton = lambda: skeleton
    sys.modules[module.__name__] = module
    return f"{module.__name__}:skeleton"

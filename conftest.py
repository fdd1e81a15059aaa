"""pytest set-up for the whole repository: the tests use every core by default.

pytest-xdist (in the `test` extra) runs the tests in `-n auto` worker
processes, each test module in one worker (`--dist loadscope`), so a module's
expensive fixtures (a sharded save in a subprocess) are made once. Passing
`-n` chooses otherwise: `-n 0` runs everything in this one process, as does
`-p no:xdist`. (`addopts = "-n auto"` in pyproject.toml would break
`-p no:xdist`: pytest then rejects `-n` as an unknown argument.)
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if (
        config.pluginmanager.hasplugin("xdist")
        and config.option.numprocesses is None
        # xdist's workers read the same conftest; they must not spawn workers.
        and not hasattr(config, "workerinput")
    ):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadscope"

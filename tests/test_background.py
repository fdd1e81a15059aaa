"""Which save a background write error names (`_save.futures.target`).

Internal modules imported here (`_save.futures`) are the units these tests
pin, or the only way to cause or observe the condition under test; everything
else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import pytest
from etils import epath

from orbax_eqx._save.futures import target


@pytest.mark.parametrize(
    "directory, expected",
    [
        (
            "/ckpts/3.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",
            "step `3` (/ckpts/3/default)",
        ),
        (
            "/ckpts/ckpt_12.orbax-checkpoint-tmp-1712/model.orbax-checkpoint-tmp-5",
            "step `ckpt_12` (/ckpts/ckpt_12/model)",
        ),
        ("/ckpts/model.orbax-checkpoint-tmp-1712", "/ckpts/model"),  # standalone
        ("/ckpts/7/default", "/ckpts/7/default"),  # finalized in place
    ],
    ids=["manager", "prefixed-step-composite", "standalone", "final"],
)
def test_target_names_the_step(directory, expected):
    assert target(epath.Path(directory)) == expected

"""The error every process of a multi-process restore raises when one failed.

The exchange itself needs several processes (`integration_tests/test_share.py`);
here, what each outcome turns into, and that one process runs the restore as
it is.

Internal modules imported here (`_restore.together`) are the units these tests
pin, or the only way to cause or observe the condition under test; everything
else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import pytest

import orbax_eqx as oeqx
from orbax_eqx._restore.together import RestoreFailedElsewhereError, _error, together

NOTE = r"\(Process 1 of 4 found this; every process of the restore stops with it\.\)"


def test_one_process_restores_as_it_is():
    assert together("/ckpt", lambda: 3) == 3
    with pytest.raises(KeyError):
        together("/ckpt", lambda: {}["x"])


@pytest.mark.parametrize(
    "outcome, kind, match",
    [
        (
            "CheckpointDamagedError\nThe shard pack x.bin is damaged.",
            oeqx.CheckpointDamagedError,
            rf"^The shard pack x\.bin is damaged\. {NOTE}$",
        ),
        (
            "ValueError\nbad index",
            RestoreFailedElsewhereError,
            rf"^Process 1 of 4 could not restore /ckpt: ValueError: bad index {NOTE}$",
        ),
        (
            # Made of other arguments than a message: the generic error.
            "ShardingRuleError\nno rule fits",
            RestoreFailedElsewhereError,
            rf"^Process 1 of 4 could not restore /ckpt: ShardingRuleError: no rule "
            rf"fits {NOTE}$",
        ),
        (
            None,
            RestoreFailedElsewhereError,
            r"^Process 1 of 4 did not finish its part of the restore of /ckpt within "
            r"300 s \(Orbax's coordination timeout\): it crashed, was killed, or is "
            r"still reading\. Look at that process's log; every process stops the "
            r"restore\.$",
        ),
    ],
    ids=["ours", "builtin", "other-constructor", "silent"],
)
def test_what_every_process_raises(outcome, kind, match):
    error = _error("/ckpt", 1, 4, outcome, 300)
    assert type(error) is kind and isinstance(error, oeqx.OrbaxEqxError)
    with pytest.raises(kind, match=match):
        raise error

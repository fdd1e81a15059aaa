"""Every failure of the command line is one line on stderr and exit status 2,
even one nothing foresaw; `--debug` shows its traceback instead. (Errors from
damaged sidecars: tests/test_hostile_records.py.)"""

import re

import equinox as eqx
import jax.numpy as jnp
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx

# The user's code: a skeleton JAX cannot flatten (dict keys of mixed types).
SKELETONS_PY = """
import jax, jax.numpy as jnp

def mixed_keys():
    return {1: jax.ShapeDtypeStruct((2,), jnp.float32), "a": 2}
"""


def test_anything_unforeseen_is_one_line_naming_the_command(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"a": jnp.ones(2)})
    (tmp_path / "skeletons.py").write_text(SKELETONS_PY)
    argv = ["diff", str(tmp_path / "ckpt"), f"{tmp_path / 'skeletons.py'}:mixed_keys"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        r"orbax_eqx: error: diff failed: ValueError: .+ \(--debug shows the "
        r"traceback\)\n",
        captured.err,
    ), captured.err
    with pytest.raises(ValueError):
        main([*argv, "--debug"])


class Box(eqx.Module):
    inner: object


@pytest.mark.slow
def test_inspect_of_a_module_nested_1000_deep(tmp_path, capsys):
    # The sidecar of `Box(Box(...Box(x)))`, 1,000 deep, as a save writes it
    # (building the model itself needs a raised recursion limit).
    path = tmp_path / "ckpt"
    oeqx.save(path, Box(jnp.ones(2)))
    content = sidecars.read(path)
    record = content["leaves"].pop("inner")
    depth = 1000
    content["leaves"][".".join(["inner"] * depth)] = {
        **record,
        "path": ".inner" * depth,
    }
    module = content["modules"][""]
    for i in range(1, depth):
        content["modules"][".".join(["inner"] * i)] = {**module, "path": ".inner" * i}
    root = content["nodes"][""]
    content["nodes"] = {
        ".".join(["inner"] * i): {
            **root,
            "path": ".inner" * i or "<root>",
            "children": [".".join(["inner"] * (i + 1))],
        }
        for i in range(depth)
    }
    sidecars.write(path, content)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith("inner")]
    assert len(rows) == depth
    leaf = rows[-1].lstrip()
    assert re.match(r"inner +float32 +\(2,\) +8 B", leaf), leaf
    assert len(rows[-1]) - len(leaf) >= 2 * depth  # indented by its depth
    assert "Total: 1 leaves, 1 arrays, 8 B." in out
    assert "Without a skeleton: restore with `allow=['test_cli_errors']`" in out

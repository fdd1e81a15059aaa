"""`inspect` and `verify` of safetensors (a file, a directory, an index set),
and `inspect --skeleton`, the dry run of an import: files written with the
`safetensors` package's numpy API."""

import json
import re
import sys

import numpy as np
import pytest
import xxhash
from entry import main
from safetensors.numpy import save_file

# The metadata entry of checksums an export writes (docs/guides/cli.md).
CHECKSUMS = "orbax_eqx.xxh3"

SKELETONS_PY = """
import jax, jax.numpy as jnp

def mlp(width=4, dtype=jnp.float32):
    layer = {"weight": jax.ShapeDtypeStruct((width, width), dtype)}
    return {"layers": [layer] * 3}

def wide():
    return mlp(8)

def half():
    return mlp(dtype=jnp.bfloat16)
"""


def _layers(n=3, width=4):
    return {
        f"layers.{i}.weight": np.full((width, width), i, np.float32) for i in range(n)
    }


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "st_skeletons.py").write_text(SKELETONS_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "st_skeletons", raising=False)
    yield tmp_path
    sys.modules.pop("st_skeletons", None)


def test_inspect_a_file_folds_alike_layers(work, capsys):
    tensors = {
        f"model.layers.{i}.self_attn.q_proj.weight": np.zeros((8, 8), np.float16)
        for i in range(32)
    }
    tensors["lm_head.weight"] = np.zeros((2, 8), np.float32)
    tensors |= {f"odd.{i}.w": np.zeros(i + 1, np.float32) for i in range(3)}
    save_file(tensors, "m.safetensors", metadata={"format": "pt"})
    assert main(["inspect", "m.safetensors"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"Safetensors at {work / 'm.safetensors'}: 1 file, 36 tensors, 4.1 KiB\n"
        "  file           tensors    bytes  __metadata__\n"
        "  m.safetensors       36  "
    )
    rows = out.split("\n\n")[1].splitlines()
    assert rows[0].split() == ["name", "shape", "dtype", "bytes"]
    assert [r.split()[0] for r in rows[1:6]] == [
        "lm_head.weight",
        "model.layers.{0..31}.self_attn.q_proj.weight",
        "odd.0.w",  # alike but for their shapes: one a row
        "odd.1.w",
        "odd.2.w",
    ]
    assert re.fullmatch(
        r"  model\.layers\.\{0\.\.31\}\.self_attn\.q_proj\.weight  \(8, 8\)  float16 "
        r"+4\.0 KiB",
        rows[2],
    )
    assert rows[6] == (
        "A name with {...} is a row of tensors alike but for those indices (36 "
        "tensors in 5 rows; --flat lists each)."
    )
    assert main(["inspect", "--flat", "m.safetensors"]) == 0
    flat = capsys.readouterr().out
    assert "  model.layers.10.self_attn.q_proj.weight  (8, 8)" in flat
    assert "{" not in flat.split("\n\n")[1]


def _sharded(work):
    save_file(_layers(2), str(work / "hf" / "model-00001-of-00002.safetensors"))
    save_file(
        {"layers.2.weight": np.ones((4, 4), np.float32)},
        str(work / "hf" / "model-00002-of-00002.safetensors"),
    )
    index = {"metadata": {}, "weight_map": {
        "layers.0.weight": "model-00001-of-00002.safetensors",
        "layers.1.weight": "model-00001-of-00002.safetensors",
        "layers.2.weight": "model-00002-of-00002.safetensors",
    }}  # fmt: skip
    (work / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "path", ["hf", "hf/model.safetensors.index.json"], ids=["dir", "index"]
)
def test_inspect_a_sharded_set(work, capsys, path):
    (work / "hf").mkdir()
    _sharded(work)
    assert main(["inspect", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "safetensors" and doc["totals"] == {
        "files": 2,
        "tensors": 3,
        "nbytes": 192,
    }
    assert [f["tensors"] for f in doc["files"]] == [2, 1]
    assert not any(f["checksums"] for f in doc["files"])
    assert doc["tensors"]["layers.2.weight"] == {
        "shape": [4, 4],
        "dtype": "float32",
        "nbytes": 64,
        "file": str(work / "hf" / "model-00002-of-00002.safetensors"),
    }
    (folded,) = doc["folded"]
    assert folded == {
        "name": "layers.{0..2}.weight",
        "shape": [4, 4],
        "dtype": "float32",
        "nbytes": 192,
        "tensors": 3,
    }
    assert main(["inspect", path]) == 0
    assert "  layers.{0..2}.weight  (4, 4)  float32  192 B\n" in capsys.readouterr().out


def test_inspect_a_directory_without_an_index(work, capsys):
    (work / "hf").mkdir()
    save_file(_layers(), str(work / "hf" / "a.safetensors"))
    assert main(["inspect", "hf"]) == 0
    assert capsys.readouterr().out.startswith(
        f"Safetensors at {work / 'hf'}: 1 file, 3 tensors, 192 B\n"
    )


def test_dry_run_that_fits(work, capsys):
    save_file(_layers(), "m.safetensors")
    assert main(["inspect", "m.safetensors", "--skeleton", "st_skeletons:mlp"]) == 0
    assert capsys.readouterr().out == (
        f"Safetensors at {work / 'm.safetensors'}, lined up with st_skeletons:mlp by "
        "name (no tensor read):\n"
        "  leaf             shape   dtype    from tensors\n"
        "  layers.0.weight  (4, 4)  float32  layers.0.weight (4, 4)\n"
        "  layers.1.weight  (4, 4)  float32  layers.1.weight (4, 4)\n"
        "  layers.2.weight  (4, 4)  float32  layers.2.weight (4, 4)\n"
        "\n"
        "They fit: 3 leaves from 3 tensors (192 B).\n"
    )
    argv = ["inspect", "m.safetensors", "--skeleton", "st_skeletons:half", "--cast"]
    assert main(argv) == 0
    assert "layers.0.weight (4, 4) (cast from float32)\n" in capsys.readouterr().out


def test_dry_run_lists_every_problem_and_exits_1(work, capsys):
    save_file(_layers() | {"extra": np.ones(2, np.float32)}, "m.safetensors")
    argv = ["inspect", "m.safetensors", "--skeleton", "st_skeletons:half"]
    assert main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"Safetensors at {work / 'm.safetensors'}, lined up with st_skeletons:half "
        "by name (no tensor read): they do not fit."
    )
    # The problems are the import's, as it words them, one a line.
    assert re.fullmatch(r"The .* not fit .*\(\d+ problems\):", out[1]), out[1]
    problems = [x for x in out if x.startswith("  - ")]
    assert any("`extra`" in x for x in problems)
    assert any("bfloat16" in x and "float32" in x for x in problems)
    assert "--allow-unused" in "\n".join(out) and "--cast" in "\n".join(out)
    assert "allow_unused=True" not in "\n".join(out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["inspect", "m.safetensors", "--mapping", "m.json"],
            r"--mapping lines the tensors up with a skeleton: give --skeleton "
            r"MODULE:FUNCTION too\.",
        ),
        (
            ["inspect", "ckpt", "--skeleton", "st_skeletons:mlp"],
            r"--skeleton and --mapping line safetensors up with a skeleton, and "
            r"\S+/ckpt holds no safetensors file\. Give a \.safetensors file, a "
            r"directory of them or an index; `diff` compares a checkpoint with a "
            r"skeleton\.",
        ),
    ],
    ids=["mapping-without-skeleton", "skeleton-on-a-checkpoint"],
)
def test_dry_run_usage_errors(work, capsys, argv, message):
    import orbax_eqx as oeqx

    save_file(_layers(), "m.safetensors")
    oeqx.save(work / "ckpt", {"w": np.ones(2)})
    assert main(argv) == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", capsys.readouterr().err)


def _with_sums(path, tensors, change=lambda sums: None):
    sums = {  # each tensor one block
        n: [max(x.nbytes, 1), [xxhash.xxh3_64_hexdigest(x.tobytes())]]
        for n, x in tensors.items()
    }
    change(sums)
    save_file(tensors, str(path), metadata={CHECKSUMS: json.dumps(sums)})


def test_verify_says_which_files_carry_checksums(work, capsys):
    (work / "hf").mkdir()
    _with_sums(work / "hf" / "a.safetensors", _layers())
    save_file({"b": np.ones(3, np.float32)}, str(work / "hf" / "b.safetensors"))
    assert main(["verify", "hf"]) == 0
    assert capsys.readouterr().out == (
        "a.safetensors: 3 of 3 tensors (192 B) match their checksums.\n"
        "b.safetensors: no checksums (1 tensor): written by something other than "
        "orbax_eqx's export; its header is sound, its values cannot be checked.\n"
        f"2 files of {work / 'hf'}: 1 with orbax_eqx's checksums, 1 with none.\n"
    )
    assert main(["verify", "hf", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and [f["checksums"] for f in doc["files"]] == [True, False]
    assert doc["files"][1]["unchecked"] == ["b"]


def test_verify_without_any_checksums(work, capsys):
    save_file(_layers(), "m.safetensors")
    assert main(["verify", "m.safetensors"]) == 0
    assert capsys.readouterr().out.endswith(
        f"1 file of {work / 'm.safetensors'}: 0 with orbax_eqx's checksums, 1 with "
        "none.\n"
    )


def test_verify_finds_a_damaged_tensor(work, capsys):
    tensors = _layers()
    _with_sums(work / "m.safetensors", tensors, lambda sums: sums.update(gone=[1, []]))
    data = bytearray((work / "m.safetensors").read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    (work / "m.safetensors").write_bytes(bytes(data))
    assert main(["verify", "m.safetensors"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == "DAMAGED m.safetensors `gone`: has a checksum, but is no tensor of the file"
    )
    assert re.fullmatch(
        r"DAMAGED m\.safetensors `layers\.2\.weight`: data does not match its "
        r"sums: tensor `layers\.2\.weight`, bytes 0-64: XXH3-64 recorded at export "
        r"0x[0-9a-f]{16}, computed from the data now 0x[0-9a-f]{16}",
        out[1],
    )
    assert out[2] == (
        f"Damaged: 1 file of {work / 'm.safetensors'}: 1 with orbax_eqx's checksums, "
        "0 with none. Re-download or re-export the damaged files."
    )


def test_verify_refuses_a_malformed_checksum_entry(work, capsys):
    save_file(
        _layers(), "m.safetensors", metadata={CHECKSUMS: '{"layers.0.weight": 7}'}
    )
    assert main(["verify", "m.safetensors"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        "DAMAGED m.safetensors `orbax_eqx.xxh3`: the __metadata__ entry is no JSON "
        "object of `[block, [16-digit hexadecimal sums]]` per tensor"
    )


def test_verify_checks_the_block_sums_an_export_records(work, capsys):
    import orbax_eqx as oeqx

    tree = {"w": np.arange(64 * 256, dtype=np.float32).reshape(64, 256)}
    oeqx.export_safetensors(tree, work / "hf")
    assert main(["verify", "hf"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "model.safetensors: 1 of 1 tensors (64.0 KiB) match their checksums."
    )
    path = work / "hf" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10000] ^= 1
    path.write_bytes(bytes(data))
    assert main(["verify", "hf"]) == 1
    assert (
        capsys.readouterr()
        .out.splitlines()[0]
        .startswith(
            "DAMAGED model.safetensors `w`: data does not match its sums: tensor `w`, "
            "bytes 53248-57344: XXH3-64 recorded at export 0x"
        )
    )

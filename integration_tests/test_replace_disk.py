"""A full disk during `save(..., overwrite=True)` or `import --overwrite`: the
save fails, the old checkpoint restores bit for bit, nothing is left beside it.

Mounts a small tmpfs (`test_disk.mount`), which needs root (as on CI);
elsewhere these are skipped.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import orbax_eqx as oeqx
from orbax_eqx.__main__ import main

from .test_disk import mount  # noqa: F401  (the fixture)

OLD = {
    "w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),
    "b": jnp.linspace(0.0, 1.0, 100, dtype=jnp.bfloat16),
    "step": 1,
}
# 4 MiB of random floats does not fit beside it on a 2 MiB disk.
BIG = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)


def _assert_old(path) -> None:
    flat = oeqx.restore(path)
    assert flat["step"] == 1 and set(flat) == {"w", "b", "step"}
    for name in ("w", "b"):
        got, want = np.asarray(flat[name]), np.asarray(OLD[name])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax-store"])
def test_overwrite_on_a_full_disk_keeps_the_old_checkpoint(mount, pack):  # noqa: F811
    fs = mount("size=2m")
    path = fs / "ckpt"
    oeqx.save(path, OLD)
    new = {"w": jnp.zeros((64, 64)), "big": jnp.asarray(BIG), "step": 2}
    with pytest.raises(
        Exception,
        match=r"No space left on device[\s\S]*orbax_eqx: this save did not change "
        rf"{path}; its temporary files were removed\.",
    ):
        oeqx.save(path, new, overwrite=True, pack=pack)
    _assert_old(path)
    assert os.listdir(fs) == ["ckpt"]
    # With room again, the same overwrite goes through.
    oeqx.save(path, {**new, "big": jnp.ones(4)}, overwrite=True, pack=pack)
    assert oeqx.restore(path)["step"] == 2
    assert os.listdir(fs) == ["ckpt"]


def test_import_overwrite_on_a_full_disk_keeps_the_old_checkpoint(
    mount,  # noqa: F811
    tmp_path,
):
    fs = mount("size=2m")
    out = fs / "ckpt"
    oeqx.save(out, OLD)
    save_file({"w": BIG}, tmp_path / "big.safetensors")
    (tmp_path / "big_model.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def skeleton():\n"
        f"    return {{'w': jax.ShapeDtypeStruct({BIG.shape}, jnp.float32)}}\n"
    )
    skeleton = f"{tmp_path / 'big_model.py'}:skeleton"
    argv = ["import", str(tmp_path / "big.safetensors"), str(out), "--overwrite"]
    with pytest.raises(OSError, match="No space left on device"):
        main([*argv, "--skeleton", skeleton, "--debug"])
    _assert_old(out)
    assert os.listdir(fs) == ["ckpt"]

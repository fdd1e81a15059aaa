"""Worker: on 8 fake devices, a restore with `missing="keep"` puts the kept
skeleton arrays where `shardings=` says, like the restored ones.

    python _partial_worker.py keep DIR
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_eqx as oeqx


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    oeqx.save(f"{directory}/ckpt", {"old": jnp.arange(16.0)})
    sharded = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    fresh = jnp.ones(8)  # on one device, as a freshly built layer is
    skeleton = {"old": jax.ShapeDtypeStruct((16,), jnp.float32), "new": fresh}
    tree, report = oeqx.restore(
        f"{directory}/ckpt", skeleton, shardings=sharded, missing="keep", report=True
    )
    assert report.kept == ("new",), report
    for name in ("old", "new"):
        assert tree[name].sharding.is_equivalent_to(sharded, 1), tree[name].sharding
    np.testing.assert_array_equal(tree["old"], np.arange(16.0))
    np.testing.assert_array_equal(tree["new"], np.ones(8))
    print("kept arrays follow shardings: ok")


if __name__ == "__main__":
    main(sys.argv[2])

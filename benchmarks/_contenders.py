"""The contenders: one way each to save a model to a path and restore it.

- `orbax_eqx`: `oeqx.save` / `oeqx.restore` (an `ocp.Checkpointer` around
  `EqxHandler`, the standalone API), into a `filter_eval_shape` skeleton.
- `orbax`: plain Orbax as its docs suggest for Equinox: `StandardCheckpointer`
  on `eqx.filter(item, eqx.is_array)`, restored into the abstract arrays of
  the same skeleton (with an explicit sharding) and `eqx.combine`d back.
- `eqx`: `eqx.tree_serialise_leaves` (plus an fsync, which it lacks, so that it
  pays for the disk like the others) / `eqx.tree_deserialise_leaves`.
- `raw`: the disk itself: the model's bytes written with `pwritev` and fsync'd,
  read back with `preadv` in 64 MiB pieces into one buffer.

Not run by default (`--contenders` adds them), for the compression decision:
`orbax_eqx_perleaf` (`pack=False`: every array through Orbax, one stored
array per leaf, as orbax_eqx did before packs, uncompressed) and `orbax_eqx_zstd` (the
same with zstd, 0.1's default).

`arrays` is no contender but a floor for the peak-RSS probes: the arrays of
the skeleton made from filled host buffers, nothing read (`ArraysAlone`).

With `BENCHMARK_STAGING=copy` (`run.py --staging copy`), orbax_eqx's restores
pass the default window as `max_staged_bytes` (it imports the private
`orbax_eqx._storage.transfer.staging.default_max_bytes`), which CPU devices
then copy through as an accelerator's do.

Async contenders (`manager`) go through `ocp.CheckpointManager` with async
checkpointing on, as training loops do.
"""

import os

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

import orbax_eqx as oeqx
from orbax_eqx._storage.transfer.staging import default_max_bytes

STAGED = os.environ.get("BENCHMARK_STAGING", "") == "copy"
WINDOW = default_max_bytes() if STAGED else None  # `max_staged_bytes`

_PIECE = 64 << 20
_IOV_MAX = 512


def _device():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _is_struct(x):
    return isinstance(x, jax.ShapeDtypeStruct)


def fsync_tree(path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def evict(path) -> bool:
    """Drops `path`'s files from the page cache, so that a restore reads the disk.

    `posix_fadvise(DONTNEED)` needs no privileges (unlike `drop_caches`); it
    drops clean pages, and every contender's files were fsync'd.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


class OrbaxEqx:
    name = "orbax_eqx"

    def __init__(self, **options):
        self.options = options

    def save(self, path, item):
        oeqx.save(path, item, **self.options)

    def restore(self, path, skeleton):
        return oeqx.restore(path, skeleton, max_staged_bytes=WINDOW)

    def manager(self, root):
        mngr = ocp.CheckpointManager(
            root, item_handlers=oeqx.EqxHandler(**self.options)
        )
        return mngr, oeqx.EqxSave


class OrbaxEqxPerLeaf(OrbaxEqx):
    name = "orbax_eqx_perleaf"

    def __init__(self):
        super().__init__(pack=False, use_compression=False)


class OrbaxEqxNoChecksums(OrbaxEqx):
    """orbax_eqx without checksums: saved without them, restored unchecked."""

    name = "orbax_eqx_nosum"

    def __init__(self):
        super().__init__(checksums=False)

    def restore(self, path, skeleton):
        return oeqx.restore(path, skeleton, verify=False, max_staged_bytes=WINDOW)


class OrbaxEqxZstd(OrbaxEqx):
    name = "orbax_eqx_zstd"

    def __init__(self):
        super().__init__(pack=False, use_compression=True)


class Orbax:
    name = "orbax"

    def __init__(self):
        self._ckptr = ocp.StandardCheckpointer()

    def save(self, path, item):
        self._ckptr.save(path, eqx.filter(item, eqx.is_array))
        self._ckptr.wait_until_finished()

    def restore(self, path, skeleton):
        abstract, static = eqx.partition(skeleton, _is_struct)
        device = _device()
        abstract = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
            abstract,
        )
        return eqx.combine(self._ckptr.restore(path, abstract), static)

    def manager(self, root):
        mngr = ocp.CheckpointManager(root)

        def args(item):
            return ocp.args.StandardSave(eqx.filter(item, eqx.is_array))

        return mngr, args


class EqxSerialise:
    name = "eqx"

    def save(self, path, item):
        os.makedirs(path)
        file = os.path.join(path, "model.eqx")
        eqx.tree_serialise_leaves(file, item)
        fsync_tree(path)

    def restore(self, path, skeleton):
        return eqx.tree_deserialise_leaves(os.path.join(path, "model.eqx"), skeleton)


class Raw:
    """The disk: the same bytes, one file, no format."""

    name = "raw"

    def save(self, path, item):
        os.makedirs(path)
        views = [
            memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
            for x in host_views(item)
        ]
        fd = os.open(os.path.join(path, "raw"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = 0
            for i in range(0, len(views), _IOV_MAX):
                batch = views[i : i + _IOV_MAX]
                offset += _pwritev_all(fd, batch, offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def restore(self, path, skeleton):
        file = os.path.join(path, "raw")
        size = os.path.getsize(file)
        buf = aligned_empty(size)
        fd = os.open(file, os.O_RDONLY)
        try:
            view = memoryview(buf)
            for start in range(0, size, _PIECE):
                os.preadv(fd, [view[start : start + _PIECE]], start)
        finally:
            os.close(fd)
        return buf


def _pwritev_all(fd, views, offset) -> int:
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = os.pwritev(fd, views, offset + done)
        done += n
        # Drop what was written (rare: short writes happen on signals).
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]
    return total


def host_views(tree) -> list[np.ndarray]:
    """The model's arrays as host numpy arrays (no copy on CPU)."""
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        if eqx.is_array(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            out.append(np.asarray(x))
    return out


def aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start : start + nbytes]


class ArraysAlone:
    """Not a restore: the least host memory any restore ends up holding. Every
    array of the skeleton is made, on its target sharding, from host buffers
    of its shards' sizes, filled, nothing read from disk: on CPU, aligned
    buffers that the devices keep as they are (with `BENCHMARK_STAGING=copy`,
    buffers off alignment, which the devices copy, each let go once put). For
    the peak-RSS probes only (`arrays`)."""

    name = "arrays"

    def save(self, path, item):
        raise NotImplementedError("`arrays` only restores (a floor for the probes)")

    def restore(self, path, skeleton):
        copy = STAGED

        def buffer(shape, dtype):
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            raw = aligned_empty(nbytes + 16)
            host = raw[16 if copy else 0 :][:nbytes]
            host.fill(1)  # touched, as read bytes are
            return host.view(dtype).reshape(shape)

        def make(x):
            if not _is_struct(x):
                return x
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                raise ValueError("`arrays` does not make typed PRNG keys")
            sharding = x.sharding if x.sharding is not None else _device()
            return jax.make_array_from_callback(
                x.shape,
                sharding,
                lambda index: buffer(
                    tuple(
                        len(range(*s.indices(n)))
                        for s, n in zip(index, x.shape, strict=True)
                    ),
                    x.dtype,
                ),
            )

        return jax.tree_util.tree_map(make, skeleton)


CONTENDERS = {
    "orbax_eqx": OrbaxEqx,
    "orbax": Orbax,
    "eqx": EqxSerialise,
    "raw": Raw,
}
EXTRA = {
    "orbax_eqx_perleaf": OrbaxEqxPerLeaf,
    "orbax_eqx_zstd": OrbaxEqxZstd,
    "orbax_eqx_nosum": OrbaxEqxNoChecksums,
    "arrays": ArraysAlone,
}


def disk_bytes(path) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )

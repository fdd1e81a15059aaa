"""What an export reads: the array leaves of a checkpoint (through
`_restore.read.LeafReader`, a batch at a time) or of a tree in memory (one
process's), and everything else for the files' `__metadata__`."""

import math
import os
from typing import Any

import jax
import numpy as np

from .._errors import BridgeError, inline_list
from .._format.locate import find_item
from .._format.sidecar import FORMAT_VERSION, package_versions
from .._format.sidecar_read import read
from .._mapping.plan import LeafSpec, data_of, leaf_specs
from .._restore.read import LeafReader, read_cost, release_memory
from .._tree.names import label
from .._tree.values import encode
from .._tree.walk import ARRAY, SHARED, is_key_dtype, parse_dtype, walk


def _spec(record) -> LeafSpec:
    """The spec of an array leaf a checkpoint's sidecar records."""
    shape, dtype = data_of(parse_dtype(record.dtype), tuple(record.shape or ()))
    return LeafSpec(record.name, label(record.name, record.path), shape, dtype)


class ExportError(BridgeError):
    """A checkpoint or tree cannot be exported as asked."""


class CheckpointSource:
    """The array leaves of the checkpoint at `path` (an item or a step)."""

    def __init__(self, path: str | os.PathLike):
        self.directory = find_item(path)
        self.saved = read(self.directory)
        self._records = {
            name: r for name, r in self.saved.leaves.items() if r.kind == ARRAY
        }
        self.specs: list[LeafSpec] = [_spec(r) for r in self._records.values()]
        self.modules = len(self.saved.modules)
        self.in_metadata = len(self.saved.leaves) - len(self._records)
        self._reader: LeafReader | None = None

    def cost(self, name: str) -> int:
        return read_cost(self._records[name])

    def read(self, names: list[str]) -> dict[str, np.ndarray]:
        if self._reader is None:
            self._reader = LeafReader(self.directory, self.saved)
        return self._reader.read(names)

    def metadata(self) -> dict[str, Any]:
        saved = self.saved
        return {
            "format_version": saved.format_version,
            "source": saved.directory,
            "versions": saved.versions,
            "modules": _modules(saved.modules),
            "leaves": {
                name: {"path": r.path, "kind": r.kind, "value": r.value}
                for name, r in saved.leaves.items()
                if r.kind != ARRAY
            },
        }

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        release_memory()


class TreeSource:
    """The array leaves of a tree in memory (jax or numpy arrays)."""

    def __init__(self, tree: Any):
        self.tree = tree
        self.walked = walk(tree)
        arrays = [leaf for leaf in self.walked.leaves if leaf.kind == ARRAY]
        partial = [
            leaf.label
            for leaf in arrays
            if isinstance(leaf.value, jax.Array) and not leaf.value.is_fully_addressable
        ]
        if partial:
            raise ExportError(
                f"{len(partial)} array leaf(s) are on devices of several "
                f"processes: {inline_list(partial)}. An export writes its files "
                "from one process. Save the tree "
                "with `oeqx.save(path, tree)` (from every process), then export "
                "the checkpoint from one process: `oeqx.export_safetensors(path, "
                "out)` reads it a batch at a time."
            )
        abstract = [
            leaf.label
            for leaf in arrays
            if isinstance(leaf.value, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise ExportError(
                f"{len(abstract)} leaf(s) are shapes without values "
                f"(jax.ShapeDtypeStruct): {inline_list(abstract)}. Export a tree "
                "of arrays, or a checkpoint's path."
            )
        self._values = {leaf.name: leaf.value for leaf in arrays}
        self.specs: list[LeafSpec] = leaf_specs(self.walked)
        self._specs = {spec.name: spec for spec in self.specs}
        self.modules = len(self.walked.modules)
        self.in_metadata = len(self.walked.leaves) - len(arrays)

    def cost(self, name: str) -> int:
        spec = self._specs[name]
        return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize

    def read(self, names: list[str]) -> dict[str, np.ndarray]:
        values = []
        for name in names:
            x = self._values[name]
            values.append(jax.random.key_data(x) if is_key_dtype(x.dtype) else x)
        hosts = jax.device_get(values)  # one transfer for the batch
        return {name: np.asarray(h) for name, h in zip(names, hosts, strict=True)}

    def metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "source": "(a tree in memory)",
            "versions": package_versions(),
            "modules": _modules(self.walked.modules),
            "leaves": {
                leaf.name: {
                    "path": leaf.path_str,
                    "kind": leaf.kind,
                    "value": None if leaf.kind == SHARED else encode(leaf.value),
                }
                for leaf in self.walked.leaves
                if leaf.kind != ARRAY
            },
        }

    def close(self) -> None:
        pass


def _modules(modules: dict) -> dict[str, Any]:
    """Each module's path, class and static fields, for `__metadata__`."""
    return {
        name: {"path": m.path, "class": m.cls, "static": m.static}
        for name, m in modules.items()
    }


def open_source(checkpoint_or_tree: Any) -> CheckpointSource | TreeSource:
    if isinstance(checkpoint_or_tree, (str, os.PathLike)):
        return CheckpointSource(checkpoint_or_tree)
    return TreeSource(checkpoint_or_tree)

"""Checkpoint Equinox modules through Orbax, leaf by leaf, with nothing lost.

The whole public surface is `__all__`. Errors are an `OrbaxEqxError` of one
of a few kinds, each also the built-in it matches (`ValueError`,
`FileNotFoundError`, `OSError`, ...); warnings an `OrbaxEqxWarning`.
"""

from ._bridge.export import export_safetensors
from ._bridge.load import load_safetensors
from ._bridge.memory import from_state_dict, to_state_dict
from ._errors import (
    BridgeError,
    CheckpointDamagedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ObjectStoreError,
    OrbaxEqxError,
    OrbaxEqxWarning,
    RebuildError,
    UnsupportedLeafError,
)
from ._format.sidecar import Metadata
from ._mapping.mapping import StateDictMapping
from ._orbax.api import metadata, restore, save
from ._orbax.handler import EqxHandler, EqxRestore, EqxSave
from ._orbax.type_handler import PackedArrayHandler, type_handler_registry
from ._orbax.v1 import EqxCheckpointableHandler
from ._orbax.verify import verify
from ._restore.check import StaticMismatchWarning
from ._restore.fallback import restore_latest
from ._restore.restore import RecordedLeaf
from ._restore.rules import shardings_from_rules
from ._storage.shared import copy_step
from ._version import __version__

__all__ = [
    # Saving and restoring.
    "save",
    "restore",
    "restore_latest",
    "metadata",
    "verify",
    "shardings_from_rules",
    "copy_step",
    # Through Orbax.
    "EqxHandler",
    "EqxSave",
    "EqxRestore",
    "EqxCheckpointableHandler",
    "type_handler_registry",
    "PackedArrayHandler",
    # PyTorch and Hugging Face layouts.
    "to_state_dict",
    "from_state_dict",
    "load_safetensors",
    "export_safetensors",
    "StateDictMapping",
    # What a checkpoint records.
    "Metadata",
    "RecordedLeaf",
    # Errors, by what to do about them; warnings.
    "OrbaxEqxError",
    "CheckpointNotFoundError",
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "RebuildError",
    "UnsupportedLeafError",
    "ObjectStoreError",
    "BridgeError",
    "OrbaxEqxWarning",
    "StaticMismatchWarning",
    "__version__",
]

# Tracebacks name the public errors and warnings where users import them.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) and issubclass(_value, (OrbaxEqxError, Warning)):
        _value.__module__ = __name__
del _name, _value
